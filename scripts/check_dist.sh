#!/usr/bin/env bash
# Installs the built sdist and wheel into one fresh venv and checks that they work: the
# wheel must be pure Python (py3-none-any, no compiled file in it), and each install must
# clip like torch (check_install.py).
# The venv borrows torch from TORCH_PYTHON's environment (the project's .venv, with the
# pinned torch) through a .pth line after its own site-packages, instead of a second copy
# of a 5 GB CUDA build: clipopt and its metadata come from the venv, which
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
wheel=$(ls "$dist"/clipopt-*-py3-none-any.whl) || { echo "check_dist: no py3-none-any wheel in $dist"; ls "$dist"; exit 1; }
compiled=$("$python" -c "import sys, zipfile; print([n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(('.so', '.pyd', '.c', '.h', '.pyi'))])" "$wheel")
[ "$compiled" = "[]" ] || { echo "check_dist: the wheel carries $compiled"; exit 1; }
"$python" -m venv "$venv"
pip="$venv/bin/python -m pip install --quiet --disable-pip-version-check"
platlib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])"; }
platlib "$torch_python" >"$(platlib "$venv/bin/python")/clipopt-check-borrowed-torch.pth"
"$venv/bin/python" -c "import torch" || { echo "check_dist: no torch in $torch_python"; exit 1; }
# The venv has no numpy, which torch mentions at import.
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
check="$venv/bin/python $here/check_install.py --license"
echo "check_dist: the sdist"
$pip --no-deps --no-cache-dir "$sdist"
(cd "$venv" && $check)
echo "check_dist: the wheel"
$pip --no-deps --force-reinstall "$wheel"
(cd "$venv" && $check)
