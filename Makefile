# Every target does its own set-up: a fresh clone needs only Python 3.11 and make. Two stamps, one
# per lock: make demo installs the base lock alone (requirements.txt: torch, Lightning, Hydra and
# what they need, 1.2 GB), every other target the full lock on top of it (requirements-dev.txt: the
# tests, wandb, Jupyter, Hugging Face, lint; 1 GB more), so the demo does not wait for what it never
# imports, and make demo after make test installs nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: help demo test test-fast soak mutants notebook figures examples lint docs install-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(DEV_STAMP)

demo: $(STAMP)  ## reproduce the GatherLayer bug and its fix, print the verdict, write the figure
	$(PY) -m gatherlab.train -m experiment=bug_demo

# pytest keeps each test module with its asserts rewritten in __pycache__, unless
# PYTHONDONTWRITEBYTECODE is set: then each test process rewrites every module again (~3 s of CPU).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

test: $(DEV_STAMP)  ## run the test suite (real gloo process groups on the CPU), in 2 test processes
	$(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-fast: $(DEV_STAMP)  ## the tests not marked slow (no fresh interpreters, no sweeps): the inner loop
	$(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder -m 'not slow and not soak' --durations=10

soak: $(DEV_STAMP)  ## the soak tests, many fresh launches each (~2 min here; not in make test)
	$(PY) -m pytest -m soak tests/journeys/test_teardown.py

# Mutation testing, a habit and not CI (docs/testing.md, "Mutation testing"): mutmut (its config in
# pyproject.toml) changes one operator, constant or name at a time in the functions that decide
# what a user is told, and runs the tests of [tool.mutmut] that call that function; a mutant they
# pass survives. MUTANTS names the functions (module.x_function, globs); a fresh copy each time
# (mutants/). One torch thread: a mutant runs in a process forked from the one that ran the tests,
# where a second thread pool would hang. Survivors: $(VENV)/bin/mutmut show NAME prints the change.
MUTANTS ?= gatherlab.core.terms.* gatherlab.check.hypotheses.* gatherlab.core.gradients.* \
    gatherlab.check.judge.* \
    gatherlab.check.table.x_verdict* gatherlab.check.table.x_trains_like_one_device* \
    gatherlab.check.table.x_failed_row* gatherlab.check.table.x_frame* \
    gatherlab.check.diagnosis.x_diagnosis* gatherlab.check.diagnosis.x_explain__* \
    gatherlab.analysis.report.x_one_device_whole_batch* gatherlab.analysis.report.x__held_against* \
    gatherlab.analysis.report.x__not_comparable* gatherlab.analysis.report.x_max_abs_weight_* \
    gatherlab.analysis.report.x_common_tolerance* gatherlab.analysis.report.x_loss_matrix* \
    gatherlab.analysis.report.x__matrix_cell*
mutants: $(DEV_STAMP)  ## mutation testing of the code of the verdicts (~2 min here; MUTANTS= to choose)
	rm -rf mutants && mkdir -p build
	(OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS); echo $$? > \
	    build/mutants.status) | tee build/mutants.log; exit "$$(cat build/mutants.status)"
	@echo "per module: 🎉 killed, ⏰ timeout (killed), 🙁 survived, 🫥 no test calls it"
	@tr '\r' '\n' < build/mutants.log | awk '/^[^ ]+ gatherlab\./ { module = $$2; \
	    sub(/\.x[_ǁ].*/, "", module); count[module " " $$1]++ } \
	    END { for (key in count) print "  " key, count[key] }' | sort

# The notebook server runs in this environment, so its default kernel (python3) is the project's;
# the notebook finds the newest sweep under multirun/ by itself. NOTEBOOK_ARGS=--no-browser on a
# machine without a browser. Jupyter refuses root unless told (containers and CI machines run as root).
NOTEBOOK_ARGS ?=
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
notebook: $(DEV_STAMP)  ## start Jupyter on notebooks/analysis.ipynb (the newest sweep under multirun/)
	$(PY) -m jupyter notebook $(AS_ROOT) $(NOTEBOOK_ARGS) notebooks/analysis.ipynb

figures: $(DEV_STAMP)  ## RE-RUN every experiment (~95 min here) and overwrite figures/ (PNG, PDF, tables)
	for script in experiments/bug_demo.py experiments/loss_matrix.py experiments/gather_audit.py \
	    experiments/gather_scaling.py \
	    experiments/optimizer_matrix.py experiments/downstream.py experiments/lr_sweep.py \
	    experiments/simclr_digits.py experiments/accumulation.py experiments/precision.py \
	    experiments/sharded.py experiments/sharded_sweep.py experiments/tp_sweep.py; do \
	    $(PY) $$script || exit 1; done
	$(PY) -m gatherlab.bench size --out figures/size_cost

# docs/examples.py: each block between <!-- example: NAME --> and <!-- /example --> is rewritten with
# what its command prints today; python docs/examples.py --check [NAME ...] only compares.
examples: $(DEV_STAMP)  ## re-run the commands whose output README.md and docs/usage.md print; rewrite it
	$(PY) docs/examples.py

lint: $(DEV_STAMP)  ## ruff, the import layers of docs/design.md §4, undeclared imports (deptry)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports
	$(PY) -m deptry src

# The modules are those gatherlab's __all__ names; -W error makes any pdoc warning fail the target.
docs: $(DEV_STAMP)  ## build the API reference of the public Python API into build/docs (pdoc)
	rm -rf build/docs
	$(PY) -W error -m pdoc --docformat google --output-directory build/docs gatherlab

# What a user of the package gets: the wheel installed into an empty environment with dependency
# resolution (every dependency downloaded, constrained by the lock), then the check, the testing
# assertion and a 2-job sweep from a directory outside the repository. The suite does the same
# offline (tests/journeys/test_install.py), and runs INSTALL_CHECK_TESTING below as it is written here.
CHECK_DIR := build/install-check
install-check: $(STAMP)  ## install the built wheel into an empty venv and use it from outside the repo
	rm -rf dist $(CHECK_DIR) && mkdir -p $(CHECK_DIR)/elsewhere
	$(PY) -m pip wheel -q --no-deps -w dist .
	$(PYTHON) -m venv $(CHECK_DIR)/venv
	$(CHECK_DIR)/venv/bin/pip install -q dist/gatherlab-*.whl -c requirements.txt
	$(CHECK_DIR)/venv/bin/pip check
	cd $(CHECK_DIR)/elsewhere && ../venv/bin/python -m gatherlab.check --gather fixed \
	    --world-sizes 2 --out check && ../venv/bin/python -c "$$INSTALL_CHECK_TESTING" && \
	    ../venv/bin/python -m gatherlab.train -m experiment=bug_demo layout=cpu1,cpu2 \
	    gather=fixed steps=5 hydra.sweep.dir=sweep

define INSTALL_CHECK_TESTING
from gatherlab.losses import NTXentLoss
from gatherlab.testing import assert_layout_invariant

assert_layout_invariant(NTXentLoss, world_sizes=(2,), gather="fixed", temperature=0.5)
print("gatherlab.testing: NTXentLoss with the fixed gather is layout-invariant on 2 ranks")

import tempfile, torch, gatherlab.record
from gatherlab.testing import assert_runs_match

def recorded(out, rows):  # one device, no process group: the same updates in 1 or 2 micro-batches
    torch.manual_seed(0)
    model, criterion = torch.nn.Linear(4, 2).double(), torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(24, 4, dtype=torch.float64), torch.randn(24, 2, dtype=torch.float64)
    with gatherlab.record(model, optimizer, out, loss=criterion, seed=0):
        for update in range(3):
            optimizer.zero_grad()
            for start in range(8 * update, 8 * update + 8, rows):
                batch = slice(start, start + rows)
                (criterion(model(x[batch]), y[batch]) * rows / 8).backward()
            optimizer.step()

with tempfile.TemporaryDirectory() as runs:
    recorded(f"{runs}/a", 8), recorded(f"{runs}/b", 4)
    assert_runs_match(f"{runs}/a", f"{runs}/b")
print("gatherlab.record and assert_runs_match: two recordings of a job match")
endef
export INSTALL_CHECK_TESTING

clean:  ## remove the virtual environment and all run outputs
	rm -rf $(VENV) outputs multirun build dist mutants
