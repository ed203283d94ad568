#!/usr/bin/env bash
# The suite on each torch release: one venv per release under .cache/ (made once, reused
# while constraints.txt is unchanged), clipopt installed into it, then the tests run.
# Prints a table of release x passed/failed/skipped, and exits non-zero if any release
# fails to import clipopt or fails a test.
#
#   scripts/torch_matrix.sh                  every supported release, the compat subset
#   scripts/torch_matrix.sh 2.6.0 2.14.1     only those
#   MATRIX_SELECT="" scripts/torch_matrix.sh the whole suite (tests/), not only compat
#
# Each venv takes the registry's default torch build for Linux (a CUDA build, 3-5 GB with
# its NVIDIA libraries; it runs on a CPU-only machine) and the test extras at the versions
# constraints.txt pins; the pinned torch itself comes from the Makefile's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

SUPPORTED=(2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1)
PYTHON=${PYTHON:-python3}
CACHE=${MATRIX_CACHE:-.cache}
SELECT=${MATRIX_SELECT-compat}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("${SUPPORTED[@]}")

mkdir -p "$CACHE"
constraints="$CACHE/constraints-without-torch.txt"
grep -v -e '^torch==' -e '^#' constraints.txt >"$constraints"
# A venv is remade when what it installs changes: the test dependencies' pins, or
# clipopt's declared dependencies; clipopt itself is reinstalled (editable) every run.
stamp=$( (cat "$constraints"; grep -E '^(dependencies|test) = ' pyproject.toml) | sha256sum | cut -c1-16)

venv_for() {  # make (or reuse) the venv of release $1 and print its python
    local venv="$CACHE/torch-$1"
    if [ ! -f "$venv/.installed-$stamp" ]; then
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --no-cache-dir --constraint "$constraints" \
            "torch==$1" -e '.[test]' 2>&1 | grep -v "^WARNING: Location" >&2 || true
        if ! "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$1'"; then
            rm -rf "$venv"  # a half-made venv (a full disk, say) must not be reused
            return 1
        fi
        touch "$venv/.installed-$stamp"
    else
        "$venv/bin/python" -m pip install --quiet --no-deps -e . 2>&1 | grep -v "^WARNING: Location" >&2 || true
    fi
    echo "$venv/bin/python"
}

summary() {  # "passed failed skipped" from pytest's closing line in file $1
    local line
    line=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s' "$1" | tail -1 || true)
    count() { echo "$line" | { grep -oE "[0-9]+ ($1)" || true; } | awk '{s += $1} END {print s + 0}'; }
    echo "$(count passed) $(count 'failed|errors?') $(count skipped)"
}

run_suite() {  # python, log: run the selected tests, print the summary
    local python=$1 log=$2
    local marker=()
    [ -z "$SELECT" ] || marker=(-m "$SELECT")
    "$python" -m pytest tests -q -p no:cacheprovider "${marker[@]}" >"$log" 2>&1 || true
    summary "$log"
}

status=0
rows=()
logs="$CACHE/matrix-logs"
mkdir -p "$logs"
for version in "${versions[@]}"; do
    echo "== torch $version" >&2
    start=$SECONDS
    if ! python=$(venv_for "$version"); then
        rows+=("| $version | install failed | - | $((SECONDS - start)) s |")
        status=1
        continue
    fi
    if "$python" -c "import clipopt" 2>"$logs/$version-import.log"; then
        imported=yes
    else
        imported=no
        status=1
    fi
    read -r p1 f1 s1 <<<"$(run_suite "$python" "$logs/$version.log")"
    if [ "$f1" != 0 ] || [ "$p1" = 0 ]; then status=1; fi
    rows+=("| $version | $imported | $p1 / $f1 / $s1 | $((SECONDS - start)) s |")
done

echo
echo "torch matrix, $(date -u +%Y-%m-%d), tests: ${SELECT:-all} (passed / failed / skipped)"
echo
echo "| torch | import | passed / failed / skipped | time |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
[ "$status" = 0 ] || echo "FAILED: see $logs/" >&2
exit "$status"
