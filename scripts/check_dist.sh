#!/usr/bin/env bash
# Installs the built sdist and wheel into one fresh venv and checks that they work:
#   1. the sdist with CC=/bin/false, i.e. no working C compiler: the install must
#      succeed without clipopt._kernels._native, and clipopt must clip like torch through the
#      torch-ops path;
#   2. the wheel (built with the compiler), which must carry the C kernel and use it.
# The venv borrows torch from TORCH_PYTHON's environment (the project's .venv, with the
# pinned torch) through a .pth line after its own site-packages, instead of a second copy
# of a 5 GB CUDA build: clipopt, its metadata and its C kernel come from the venv, which
# check_install.py asserts.
# Usage: scripts/check_dist.sh PYTHON DIST_DIR TORCH_PYTHON
set -euo pipefail
python=$1
dist=$(cd "$2" && pwd)
torch_python=$3
here=$(cd "$(dirname "$0")" && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
sdist=$(ls "$dist"/clipopt-*.tar.gz)
wheel=$(ls "$dist"/clipopt-*.whl)
"$python" -m venv "$venv"
pip="$venv/bin/python -m pip install --quiet --disable-pip-version-check"
platlib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])"; }
platlib "$torch_python" >"$(platlib "$venv/bin/python")/clipopt-check-borrowed-torch.pth"
"$venv/bin/python" -c "import torch" || { echo "check_dist: no torch in $torch_python"; exit 1; }
# The venv has no numpy, which torch mentions at import.
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
check="$venv/bin/python $here/check_install.py --license"
echo "check_dist: the sdist, with CC=/bin/false"
log="$venv/sdist-install.log"
if ! CC=/bin/false "$venv/bin/python" -m pip install --verbose --disable-pip-version-check \
    --no-cache-dir --no-deps "$sdist" >"$log" 2>&1; then
    cat "$log"
    exit 1
fi
grep -o "WARNING: clipopt: the C kernel (clipopt._kernels._native) could not be built" "$log" || { echo "check_dist: no warning of the skipped build"; exit 1; }
(cd "$venv" && $check --expect-native no)
echo "check_dist: the wheel"
$pip --no-deps --force-reinstall "$wheel"
(cd "$venv" && $check --expect-native yes)
