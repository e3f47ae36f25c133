# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# No GPU: the CPU build of torch (it lies on local disk on these machines; an unpinned torch is the multi-GB CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: env demo lint test test-newest test-megatron-lm peers clean

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

# The newest lane's environment (below) is built in the background from the start: test_plugins_golden.py asks
# newer nvidia-resiliency-ext releases' own parsers and waits for it (scripts/newest/install.sh takes a lock).
# The Slurm tests (tests/slurm/) mostly wait on the scheduler: they run next to the rest, in two pytest processes
# of their own, one per cluster instance: SLURM_MULTINODE_TESTS on the multi-node instance (nodes set DOWN, jobs
# across nodes), the others on the single-node cluster. The single-node cluster is started once first, so no two
# race on it. Their output follows when all are done. The rest runs in TEST_WORKERS pytest-xdist workers, a whole
# module per worker (module fixtures launch their process groups together): most of a test's time is spent
# waiting on launchers, timeouts and restarts.
TEST_WORKERS ?= 3
SLURM_MULTINODE_TESTS ?= tests/slurm/test_leftover_jobs_on_slurm.py tests/slurm/test_chaos_on_slurm.py \
	tests/slurm/test_multinode_on_slurm.py tests/slurm/test_node_down_on_slurm.py tests/slurm/test_elastic_on_slurm.py tests/slurm/test_inprocess_on_slurm.py \
	tests/slurm/test_sdc_on_slurm.py
test: lint
	@(scripts/newest/install.sh $(NEWEST) > .newest-install.log 2>&1 &)  # for the release-parser tests, meanwhile
	@scripts/slurm/start.sh >/dev/null 2>&1 || echo "scripts/slurm/start.sh failed; the Slurm tests will say why"
	@$(PY) -m pytest $(SLURM_MULTINODE_TESTS) --durations=8 $(PYTEST_ARGS) > .pytest-slurm-multinode.log 2>&1 & multi=$$!; \
	$(PY) -m pytest tests/slurm $(addprefix --ignore=,$(SLURM_MULTINODE_TESTS)) --durations=8 $(PYTEST_ARGS) \
		> .pytest-slurm.log 2>&1 & slurm=$$!; \
	$(PY) -m pytest --ignore=tests/slurm --ignore=tests/megatron_lm -n $(TEST_WORKERS) --dist loadfile --durations=12 \
		$(PYTEST_ARGS); rest=$$?; \
	wait $$slurm; slurm_rc=$$?; wait $$multi; multi_rc=$$?; \
	echo "=== tests/slurm, single-node cluster (run alongside) ==="; cat .pytest-slurm.log; \
	echo "=== tests/slurm, multi-node instance (run alongside) ==="; cat .pytest-slurm-multinode.log; \
	echo "pytest exit codes: tests/slurm=$$slurm_rc, tests/slurm multi-node=$$multi_rc, the rest=$$rest"; \
	test $$rest = 0 && test $$slurm_rc = 0 && test $$multi_rc = 0

# The second lane: the newest megatron-core / nvidia-resiliency-ext (scripts/newest/pins.txt) first on PYTHONPATH,
# for the tests that touch them: trainer (DP/TP/PP), checkpoints and exact resume, resharding, preemption and
# async saves, FT sections and restarts, stragglers, the rerun state machine, ft_launcher flags parsed by the
# newer launcher's own parser, and in-process restart with node-local checkpoints (the wrapper and the
# local-checkpoint adapters). Not here: what is the same on every version (Slurm's signals and requeues, cloud
# notices, the best-checkpoint rotation): the first lane proves it, and CI's time is better spent once.
# .ci/run runs it after `make test`.
NEWEST := .venv-newest
NEWEST_TESTS ?= tests/test_checkpoint.py tests/test_checkpoint_results_queue.py tests/test_checkpoint_resume.py \
	tests/test_checkpoint_preemption.py tests/test_preemption_units.py tests/test_rerun_resume.py \
	tests/test_resilience_units.py tests/test_resilience_faults.py tests/test_runtime_parallel.py tests/test_runtime_units.py \
	tests/test_plugins_golden.py tests/test_elastic_reshard.py tests/test_inprocess_units.py tests/test_local_checkpoint_units.py \
	tests/test_inprocess_restart.py tests/test_signal_during_async_save.py tests/test_rank0_killed_each_moment.py \
	tests/test_torch_fsdp2.py tests/test_data_parallel_strategy.py tests/test_megatron_fsdp.py tests/test_sdc_continues.py \
	tests/test_loss_checks.py tests/test_preemption_blocked_setup.py

test-newest: $(STAMP)
	scripts/newest/install.sh $(NEWEST)
	PYTHONPATH=$(CURDIR)/$(NEWEST) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=8 $(NEWEST_TESTS) $(PYTEST_ARGS)

# The third lane: Megatron-LM's own trainer (megatron-core 0.19.2's megatron.training, from the newest lane's
# environment) under the plugins, through run.Script on the LocalExecutor under ft_launcher 0.7.0: a killed rank,
# SIGTERM, a Python exception, node-local checkpoints, --inprocess-restart's real failure (why the plugins refuse
# it); and on the local Slurm cluster, a SIGTERM'd job requeued and completed once, a chaos run
# (tests/megatron_lm/). A few minutes, most of it imports and first saves; .ci/run runs it
# after the other two only when the time allows (CI_BUDGET_S there).
MEGATRON_LM_TESTS ?= tests/megatron_lm
test-megatron-lm: $(STAMP)
	scripts/newest/install.sh $(NEWEST)
	PYTHONPATH=$(CURDIR)/$(NEWEST) $(PY) -m pytest --durations=8 $(MEGATRON_LM_TESTS) $(PYTEST_ARGS)

# The peers' own code for the compatibility tests (tests/peers.py runs it too when .venv-peers is missing).
peers: $(STAMP)
	scripts/peers/install.sh

clean:
	rm -rf $(VENV) $(NEWEST) .venv-peers build *.egg-info .pytest_cache
