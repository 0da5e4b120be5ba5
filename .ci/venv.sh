#!/usr/bin/env bash
# Creates .venv once with what the lab needs; "test" adds the test tools.
# On a GPU box whose python3 already imports torch, the venv sees the system
# packages and keeps that CUDA/ROCm build; elsewhere it installs the pinned CPU
# build from .ci/constraints.txt rather than a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
purpose=${1:-lab}
venv=.venv
stamp="$venv/.installed-$purpose"
[ -f "$stamp" ] && exit 0
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
if [ ! -x "$venv/bin/python" ]; then
  if python3 -c 'import torch' 2>/dev/null; then
    python3 -m venv --system-site-packages "$venv"
  else
    python3 -m venv "$venv"
  fi
fi
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "venv: keeping torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
else
  "${pip[@]}" -c .ci/constraints.txt torch
fi
# torch is satisfied by now, so this never replaces it.
grep -v '^torch' requirements.txt > "$venv/requirements-without-torch.txt"
"${pip[@]}" -r "$venv/requirements-without-torch.txt"
if [ "$purpose" = test ]; then
  "${pip[@]}" -r .ci/requirements-test.txt
fi
touch "$stamp"
