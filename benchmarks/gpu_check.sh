#!/usr/bin/env bash
# The GPU check (`make gpu-check`): on a CUDA machine, run every CUDA test, the host-sync
# tests, the compiled and CUDA-graph-captured clipped step, and the benchmark with
# --device cuda; write logs, JSON and Markdown to $OUT
# (else benchmarks/results/). Installs nothing: the GPU machine has no network.
#
#   bash benchmarks/gpu_check.sh            # or: make gpu-check
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# The interpreter is $PYTHON if set, else the first of .venv/bin/python and python3
# whose torch sees a GPU. Every step runs under `timeout`, sized so the whole check ends
# within 8 minutes (DEADLINE_S, 470 s by default). Exit status: 0 all passed and every
# target held; 1 a step failed or timed out; 2 no CUDA (nothing run); 3 every step
# passed but a benchmark target was missed. docs/benchmarks.md, "GPU check", says more.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEADLINE_S=${DEADLINE_S:-470}
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu-check-summary.txt"
: >"$SUMMARY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
failed=0

say() { echo "$*" | tee -a "$SUMMARY"; }

# ------------------------------------------------------------------ the interpreter

probe='import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'
candidates=()
if [[ -n "${PYTHON:-}" ]]; then candidates+=("$PYTHON"); fi
candidates+=(.venv/bin/python python3)
PY=""
for candidate in "${candidates[@]}"; do
    if ! command -v "$candidate" >/dev/null 2>&1; then
        echo "gpu-check: $candidate: not found"
        continue
    fi
    if ! found=$(timeout 120 "$candidate" -c "$probe" 2>/dev/null); then
        echo "gpu-check: $candidate: cannot import torch"
        continue
    fi
    echo "gpu-check: $candidate: torch, CUDA runtime, CUDA available = $found"
    if [[ "$found" == *True ]]; then
        PY=$candidate
        break
    fi
done
if [[ -z "$PY" ]]; then
    say "gpu-check: no interpreter here has a torch that sees a CUDA GPU" \
        "(tried: ${candidates[*]}). This check needs one; nothing was run."
    exit 2
fi
echo "+ $PY -c <device info>"
timeout 60 "$PY" - <<'EOF' | tee -a "$SUMMARY"
import platform, torch
print(f"python {platform.python_version()} ({__import__('sys').executable})")
print(f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
print(f"device: {torch.cuda.get_device_name()}, {torch.cuda.device_count()} visible, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
for module in pytest hypothesis numpy; do
    if ! "$PY" -c "import $module" 2>/dev/null; then
        say "gpu-check: warning: $PY cannot import $module; the tests that need it fail"
    fi
done

if ! "$PY" -c "import clipopt" 2>/dev/null; then
    say "gpu-check: $PY cannot import clipopt from this tree"
    exit 1
fi

# ------------------------------------------------------------------ the steps

# step NAME CAP_S RESERVE_S COMMAND...: run COMMAND under a timeout of CAP_S seconds,
# or less so that RESERVE_S seconds stay for the steps after it; log to $OUT_DIR/NAME.log.
step() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    local left=$((DEADLINE_S - SECONDS - reserve))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        say "FAILED  $name: not started, ${left}s left of the ${DEADLINE_S}s budget"
        failed=1
        return 0
    fi
    echo
    echo "+ timeout ${limit}s $*"
    local start=$SECONDS rc
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    local took=$((SECONDS - start))
    if ((rc == 0)); then
        say "ok      $name (${took}s)"
    elif ((rc == 124 || rc == 137)); then
        say "FAILED  $name: timed out after ${limit}s"
        failed=1
    else
        say "FAILED  $name: exit status $rc (${took}s, log: $OUT_DIR/$name.log)"
        failed=1
    fi
}

# Every test module with a CUDA skip, found by grep; the sync tests run on their own.
mapfile -t cuda_modules < <(
    grep -l -E 'torch\.cuda\.is_available\(\)|needs CUDA' tests/test_*.py |
        grep -v -x 'tests/test_cuda_sync.py' | sort
)
say "CUDA test modules: ${cuda_modules[*]}"

step pytest-cuda 160 300 "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest-cuda.xml" "${cuda_modules[@]}"
step pytest-sync 60 240 "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest-sync.xml" tests/test_cuda_sync.py
# The clipped step compiled with inductor on CUDA, captured whole by torch.cuda.graph
# (capturable AdamW, static grads) and compiled with mode="reduce-overhead": each against
# the eager step, last_norm on every replay (benchmarks/gpu_compile.py).
step compile-cuda 90 150 "$PY" -m benchmarks.gpu_compile --device cuda \
    --json "$OUT_DIR/compile-cuda.json"
# A CUDA test that skips for want of CUDA here means the check did not check it.
if grep -h "needs CUDA" "$OUT_DIR/pytest-cuda.log" "$OUT_DIR/pytest-sync.log" 2>/dev/null; then
    say "FAILED  CUDA tests were skipped for want of CUDA (lines above)"
    failed=1
fi

step bench-cuda 150 0 "$PY" -m benchmarks.run --device cuda --json "$OUT_DIR/bench-cuda.json"

# ------------------------------------------------------------------ results

missed=0
if [[ -s "$OUT_DIR/bench-cuda.json" ]]; then
    echo "+ $PY -m benchmarks.markdown $OUT_DIR/bench-cuda.json > $OUT_DIR/bench-cuda.md"
    "$PY" -m benchmarks.markdown "$OUT_DIR/bench-cuda.json" >"$OUT_DIR/bench-cuda.md"
    missed=$("$PY" - "$OUT_DIR/bench-cuda.json" <<'EOF'
import json, sys
targets = json.load(open(sys.argv[1]))["targets"]
print(sum(not t["held"] for t in targets))
EOF
    )
    say "benchmark targets missed: $missed (table: $OUT_DIR/bench-cuda.md)"
else
    say "FAILED  no benchmark results ($OUT_DIR/bench-cuda.json missing)"
    failed=1
fi
say "total: ${SECONDS}s of the ${DEADLINE_S}s budget; summary: $SUMMARY"
if ((failed)); then exit 1; fi
if ((missed > 0)); then exit 3; fi
exit 0
