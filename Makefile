# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# No GPU: the CPU build of torch (it lies on local disk on these machines; an unpinned torch is the multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: env demo lint test test-newest peers clean

env: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The Slurm tests (tests/slurm/) mostly wait on the scheduler: they run in a second pytest next to the rest
# (their output follows when both are done). The cluster is started once first, so the two never race on it.
# The rest runs in TEST_WORKERS pytest-xdist workers, a whole module per worker (module fixtures launch their
# process groups together): most of a test's time is spent waiting on launchers, timeouts and restarts.
TEST_WORKERS ?= 3
test: lint
	@scripts/slurm/start.sh >/dev/null 2>&1 || echo "scripts/slurm/start.sh failed; the Slurm tests will say why"
	@$(PY) -m pytest tests/slurm $(PYTEST_ARGS) > .pytest-slurm.log 2>&1 & slurm=$$!; \
	$(PY) -m pytest --ignore=tests/slurm -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rest=$$?; \
	wait $$slurm; slurm_rc=$$?; \
	echo "=== tests/slurm (run alongside) ==="; cat .pytest-slurm.log; \
	echo "pytest exit codes: tests/slurm=$$slurm_rc, the rest=$$rest"; \
	test $$rest = 0 && test $$slurm_rc = 0

# The second lane: the newest megatron-core / nvidia-resiliency-ext (scripts/newest/pins.txt) first on PYTHONPATH,
# for the tests that touch them: trainer (DP/TP/PP), checkpoints and exact resume, preemption and async saves,
# FT sections and restarts, stragglers, the rerun state machine, ft_launcher flags parsed by the newer launcher's
# own parser, and the preemption/FT jobs on the Slurm cluster (the jobs inherit PYTHONPATH from sbatch).
# .ci/run runs it after `make test`.
NEWEST := .venv-newest
NEWEST_TESTS ?= tests/test_checkpoint.py tests/test_checkpoint_results_queue.py tests/test_checkpoint_resume.py \
	tests/test_checkpoint_preemption.py tests/test_preemption_units.py tests/test_rerun_resume.py \
	tests/test_resilience_units.py tests/test_resilience_faults.py tests/test_runtime_parallel.py tests/test_runtime_units.py \
	tests/test_plugins_golden.py tests/slurm/test_preemption_on_slurm.py

test-newest: $(STAMP)
	scripts/newest/install.sh $(NEWEST)
	PYTHONPATH=$(CURDIR)/$(NEWEST) $(PY) -m pytest $(NEWEST_TESTS) $(PYTEST_ARGS)

# The peers' own code for the compatibility tests (tests/peers.py runs it too when .venv-peers is missing).
peers: $(STAMP)
	scripts/peers/install.sh

clean:
	rm -rf $(VENV) $(NEWEST) .venv-peers build *.egg-info .pytest_cache
