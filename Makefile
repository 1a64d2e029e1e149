# Every target does its own set-up: a fresh clone needs only Python 3.11 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help demo test figures lint docs clean

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)  ## reproduce the GatherLayer bug and its fix, print the verdict, write the figure
	$(PY) -m gatherlab.train -m experiment=bug_demo

test: $(STAMP)  ## run the test suite (real gloo process groups on the CPU), in 2 test processes
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

figures: $(STAMP)  ## re-run every README figure's experiment and write figures/ (PNG, PDF, tables)
	for script in experiments/bug_demo.py experiments/loss_matrix.py experiments/gather_audit.py \
	    experiments/gather_scaling.py \
	    experiments/optimizer_matrix.py experiments/downstream.py \
	    experiments/simclr_digits.py; do $(PY) $$script || exit 1; done

lint: $(STAMP)  ## ruff (lint and format) and the import layers of docs/design.md §4 (import-linter)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

# The modules are those gatherlab's __all__ names; -W error makes any pdoc warning fail the target.
docs: $(STAMP)  ## build the API reference of the public Python API into build/docs (pdoc)
	rm -rf build/docs
	$(PY) -W error -m pdoc --docformat google --output-directory build/docs gatherlab

clean:  ## remove the virtual environment and all run outputs
	rm -rf $(VENV) outputs multirun
