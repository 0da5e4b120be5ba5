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
  echo "venv: first set-up of .venv ($purpose): torch, JupyterLab, pandas, matplotlib, transformers, peft, bitsandbytes$([ "$purpose" = test ] && echo ', pytest, nbval'),"
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
# --no-compile: pip would byte-compile every installed file (torch, JupyterLab: tens of thousands,
# a minute of CPU on 2 cores); Python compiles a module on its first import instead, and only those.
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q --no-compile)
constraints="$venv/constraints-in-use.txt"
# torch is satisfied by the first entry of this one pip call, so nothing here ever replaces it.
grep -v '^torch\b' requirements.txt > "$venv/requirements-without-torch.txt"
wanted=(-r "$venv/requirements-without-torch.txt")
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "venv: keeping torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  # this box's own torch build stays: the CPU pin would replace it
  grep -v '^torch\b' .ci/constraints.txt > "$constraints" || true
else
  echo "venv: torch (CPU build, pinned in .ci/constraints.txt)"
  cp .ci/constraints.txt "$constraints"
  wanted=(torch "${wanted[@]}")
fi
if [ "$purpose" = test ]; then
  wanted+=(-r .ci/requirements-test.txt)
fi
# One pip call for requirements.txt and the test tools: one resolution, one download pass.
echo "venv: installing requirements.txt$([ "$purpose" = test ] && echo ' and the test tools (.ci/requirements-test.txt)')"
"${pip[@]}" -c "$constraints" "${wanted[@]}"
# jsonschema's format-nongpl extra (JupyterLab's jupyter-events asks for it) brings rfc3987-syntax,
# whose import builds a lark grammar: 2-3 s of CPU in every Python that imports jsonschema (nbformat,
# the Jupyter server, each `make sync`, each notebook test). Without it jsonschema leaves the "iri"
# formats unchecked, which nothing in the lab or JupyterLab's notebooks relies on.
"$venv/bin/python" -m pip uninstall --disable-pip-version-check -y -q rfc3987-syntax 2>/dev/null || true
# Editable and without dependencies: `.venv/bin/python -m lab_helpers.X` and the iteragpu-*
# commands then work from any folder, and pip resolves nothing twice. The venv's own setuptools
# builds it when it is recent enough (no throwaway build environment to install).
echo "venv: installing this project (editable, no dependencies)"
isolation=()
if "$venv/bin/python" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' 2>/dev/null; then
  isolation=(--no-build-isolation)
fi
"${pip[@]}" --no-deps ${isolation[@]+"${isolation[@]}"} -e .
# --no-compile left the bytecode to Python's first imports, which never write it where
# PYTHONDONTWRITEBYTECODE is set: written once here for what the lab's answers import (about 15 s on
# 2 cores). The test session compiles into a folder of its own (tests/conftest.py), so test skips it.
if [ "$purpose" = lab ]; then
  echo "venv: writing the bytecode of what an answer imports (torch, transformers, the bundled families)"
  "$venv/bin/python" -m lab_helpers.build.bytecode
fi
echo "$want" > "$stamp"
echo "venv: ready ($purpose) in $((SECONDS - start)) s"
