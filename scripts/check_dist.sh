#!/usr/bin/env bash
# Installs the built sdist and wheel into one fresh venv and checks that they work:
#   1. the sdist with CC=/bin/false, i.e. no working C compiler: the install must
#      succeed without clipopt._native, and clipopt must clip like torch through the
#      torch-ops path;
#   2. the wheel (built with the compiler), which must carry the C kernel and use it.
# Usage: scripts/check_dist.sh PYTHON DIST_DIR
set -euo pipefail
python=$1
dist=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
sdist=$(ls "$dist"/clipopt-*.tar.gz)
wheel=$(ls "$dist"/clipopt-*.whl)
"$python" -m venv "$venv"
pip="$venv/bin/python -m pip install --quiet --disable-pip-version-check"
$pip --constraint "$here/../constraints.txt" torch
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
grep -o "WARNING: clipopt: the C kernel (clipopt._native) could not be built" "$log" || { echo "check_dist: no warning of the skipped build"; exit 1; }
(cd "$venv" && $check --expect-native no)
echo "check_dist: the wheel"
$pip --no-deps --force-reinstall "$wheel"
(cd "$venv" && $check --expect-native yes)
