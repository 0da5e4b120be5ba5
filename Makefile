# The lab's commands. `make lab` and `make test` create .venv on first use (and update it when
# a requirement file changes), and set git's notebook filter.
PY := .venv/bin/python
KIT ?= dist/iteragpu-lab-v1.zip
# Extra JupyterLab flags, e.g. make lab LAB_ARGS="--no-browser --port 8888"
LAB_ARGS ?=
# Rented GPU machines often log you in as root, where JupyterLab refuses to start without this.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-gpu sync sync-check kit verify-kit venv-lab venv-test git-filter

venv-lab: git-filter
	bash .ci/venv.sh lab

venv-test: git-filter
	bash .ci/venv.sh test

# Git stores notebooks without outputs (see .gitattributes): a run notebook keeps its outputs in
# the working copy only. Set in this checkout's own git config, and only when this folder is the
# top of a git checkout (an unpacked copy inside another repository is left alone). `required`: a
# notebook the filter cannot clean (not JSON, a NaN, a lone surrogate) is refused by `git add`, never
# stored with its outputs or as a file no JSON reader accepts. A required filter needs both directions:
# without a smudge command git fails every checkout, merge or pull that writes a notebook; `cat`
# writes the stored form as it is.
git-filter:
	@if [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$$(pwd -P)" ]; then \
	  git config filter.notebook-strip.clean "python3 -m lab_helpers.notebook_strip"; \
	  git config filter.notebook-strip.smudge cat; \
	  git config filter.notebook-strip.required true; fi

# PYTHONSAFEPATH=1 (Python 3.11+, inherited by every kernel): no notebook's Python puts its working
# folder first on sys.path, so a json.py or torch.py lying beside a notebook is never imported.
lab: venv-lab
	PYTHONSAFEPATH=1 $(PY) -m jupyterlab --notebook-dir=notebooks $(ROOT_FLAG) $(LAB_ARGS)

# Two workers (pytest-xdist), each file on one worker: a notebook's cells share one kernel.
test: venv-test
	$(PY) -m pytest -n 2 --dist loadfile

# On a CUDA machine: the GPU tests, then every notebook with its cells run.
test-gpu: venv-test
	$(PY) -m pytest -m gpu tests
	$(PY) -m pytest --nbval-lax notebooks

# The generated files: the standalone files, the notebooks' generated cells, docs/cli.md.
sync: venv-lab
	$(PY) -m lab_helpers.build.sync

sync-check: venv-lab
	$(PY) -m lab_helpers.build.sync --check

kit: sync-check
	$(PY) -m lab_helpers.kit build

verify-kit: venv-lab
	$(PY) -m lab_helpers.kit verify $(KIT)
