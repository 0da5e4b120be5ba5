#!/usr/bin/env bash
# Creates or updates .venv with what the lab needs; "test" adds the test tools.
# On a GPU box whose python3 already imports torch, the venv sees the system
# packages and keeps that CUDA/ROCm build; elsewhere it installs the pinned CPU
# build from .ci/constraints.txt rather than a multi-GB CUDA one.
# A stamp holds a hash of the requirement files: when one of them changes, the
# next `make lab` or `make test` installs again (pip keeps what is already there).
set -euo pipefail
cd "$(dirname "$0")/.."
purpose=${1:-lab}
case $purpose in lab|test) ;; *) echo "venv.sh: error: purpose must be lab or test, not '$purpose'" >&2; exit 2 ;; esac
venv=.venv
stamp="$venv/.installed-$purpose"
inputs=(requirements.txt .ci/constraints.txt pyproject.toml)
[ "$purpose" = test ] && inputs+=(.ci/requirements-test.txt)
want=$(python3 -c 'import hashlib, sys
h = hashlib.sha256()
for name in sys.argv[1:]:
    h.update(name.encode() + b"\0" + open(name, "rb").read() + b"\0")
print(h.hexdigest())' "${inputs[@]}")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  # Measured on a 2-core machine with a fast package index; a slow network adds to it.
  echo "venv: first set-up of .venv ($purpose): torch, JupyterLab, pandas, matplotlib, transformers$([ "$purpose" = test ] && echo ', pytest, nbval'),"
  echo "venv: then this project itself. Usually about 2 minutes on 2 cores; pip stays quiet meanwhile."
  if python3 -c 'import torch' 2>/dev/null; then
    python3 -m venv --system-site-packages "$venv"
  else
    python3 -m venv "$venv"
  fi
elif [ -f "$stamp" ]; then
  echo "venv: requirement files changed since .venv was set up ($purpose): updating it"
else
  echo "venv: adding what $purpose needs to .venv"
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
constraints="$venv/constraints-in-use.txt"
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "venv: keeping torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  # this box's own torch build stays: the CPU pin would replace it
  grep -v '^torch\b' .ci/constraints.txt > "$constraints" || true
else
  echo "venv: installing torch (CPU build, pinned in .ci/constraints.txt)"
  "${pip[@]}" -c .ci/constraints.txt torch
  cp .ci/constraints.txt "$constraints"
fi
# torch is satisfied by now, so this never replaces it.
grep -v '^torch\b' requirements.txt > "$venv/requirements-without-torch.txt"
echo "venv: installing requirements.txt"
"${pip[@]}" -c "$constraints" -r "$venv/requirements-without-torch.txt"
if [ "$purpose" = test ]; then
  echo "venv: installing the test tools (.ci/requirements-test.txt)"
  "${pip[@]}" -c "$constraints" -r .ci/requirements-test.txt
fi
# Editable and without dependencies: `.venv/bin/python -m lab_helpers.X` and the iteragpu-*
# commands then work from any folder, and pip resolves nothing twice.
echo "venv: installing this project (editable, no dependencies)"
"${pip[@]}" --no-deps -e .
echo "$want" > "$stamp"
echo "venv: ready ($purpose) in $((SECONDS - start)) s"
