"""What a newcomer tripped over (issue 27), each in the interface where they meet it. The bad-input table
(``validation_cases.py``) carries the one-key cases through the CLI, Python and the trainer's command line
(``checkpoint.load``, ``model.vocab_size``, ``train.gpu_memory_gib``); the rest is here:

- a missing resume is a hard error in the trainer too (a folder the login node could not check), and an
  optional one starts from step 0 and says so (the real trainer, one process);
- the memory estimate warns near the budget;
- one rank per GPU: the same message in the CLI, ``preview``, ``run.run`` with and without plugins, and the fix
  it suggests passes every check;
- ``run.run`` without plugins checks our tasks (a LocalExecutor job is never started), also in a fresh
  interpreter that imported only nemo_run and ``megatron_resilience.entry``, in either order;
- Python misuse of plugins and tasks: one line each;
- the docs' ``run.LocalTunnel(...)`` constructions and the CLI's ``-y``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from test_validation_interfaces import cli_slurm, python_task

from megatron_resilience.config import ConfigError, ModelConfig, PretrainConfig, TrainingConfig
from megatron_resilience.config.memory import check_memory
from megatron_resilience.entry import pretrain
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview
from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.nemorun import run_cli

run = import_nemo_run()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def home(tmp_path):
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    saved = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "home"))
    yield tmp_path / "home"
    set_nemorun_home(saved)


def slurm(home, **changes):
    fields = dict(account="acct", partition="batch", nodes=1, ntasks_per_node=2, gpus_per_node=None,
                  time="04:00:00", tunnel=run.LocalTunnel(job_dir=str(home / "experiments")))
    return run.SlurmExecutor(**{**fields, **changes})


def files(home):
    return sorted(str(p) for p in home.rglob("*")) if home.exists() else []


# --- checkpoint.load in the trainer ------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_refuses_a_load_folder_without_a_complete_checkpoint_and_an_optional_one_says_it_starts_at_0(
        tmp_path):
    """The login node saw a folder with an ``iter_`` directory in it, but no save there ever finished."""
    (tmp_path / "ckpt" / "iter_0000010").mkdir(parents=True)
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    common = [sys.executable, "-m", "megatron_resilience", "train.max_steps=2", "train.device=cpu",
              f"checkpoint.load={tmp_path / 'ckpt'}"]
    procs = [subprocess.Popen(common + [f"run_dir={tmp_path / name}", *extra], env={**env, "MASTER_PORT": port},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, extra, port in (("required", [], "29741"),
                                       ("optional", ["checkpoint.load_optional=true"], "29742"))]
    (required, _), (optional, _) = [p.communicate(timeout=600) for p in procs]
    assert procs[0].returncode == 1
    assert required.rstrip().splitlines()[-1] == (
        f"megatron_resilience: checkpoint.load: no complete checkpoint under '{tmp_path / 'ckpt'}' to resume from; "
        "checkpoint.load_optional=true starts from step 0 when it holds none")
    assert "step 1/2" not in required
    assert procs[1].returncode == 0, optional[-3000:]
    assert (f"checkpoint: no complete checkpoint under {tmp_path / 'ckpt'}; starting from step 0 "
            "(checkpoint.load_optional=true)") in optional
    assert "setup: starting at step 0" in optional and "step 2/2" in optional


@pytest.mark.slow
def test_a_restart_resumes_from_the_runs_own_save_folder_not_from_load(tmp_path):
    """``checkpoint.load`` is where a run starts (another run's checkpoints); once the run saved into its own
    ``checkpoint.save``, a restart (in-job, requeue) resumes there: going back to ``load`` would lose every step
    since the start."""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
               MASTER_PORT="29743")
    common = [sys.executable, "-m", "megatron_resilience", "train.device=cpu", "checkpoint.save_interval=2"]

    def train(name: str, *extra: str) -> str:
        proc = subprocess.run(common + [f"run_dir={tmp_path / name}", *extra], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    start, own = tmp_path / "start", tmp_path / "run" / "ckpt"
    first = train("run", "train.max_steps=4", f"checkpoint.load={start}", "checkpoint.load_optional=true",
                  f"checkpoint.save={own}")
    assert "setup: starting at step 0" in first and "resuming from there" not in first
    shutil.copytree(own / "iter_0000002", start / "iter_0000002")  # the starting point now holds step 2
    again = train("run", "train.max_steps=6", f"checkpoint.load={start}", f"checkpoint.save={own}")
    assert (f"checkpoint: {own} holds this run's own checkpoints: resuming from there, not from "
            f"checkpoint.load={start}") in again
    assert "setup: resumed at step 4" in again and "step 5/6" in again and "step 3/6" not in again


# --- memory ------------------------------------------------------------------------------------------------------


def test_memory_estimate_warns_near_the_budget_and_states_estimate_and_budget(caplog):
    config = PretrainConfig(run_dir="/r", model=ModelConfig(vocab_size=50304, hidden_size=1024, num_layers=24,
                                                            num_attention_heads=16, seq_length=2048),
                            train=TrainingConfig(gpu_memory_gib=9.0, micro_batch_size=1))
    with caplog.at_level(logging.WARNING, "megatron_resilience.config"):
        config.validate_world_size(1)
    assert [r.getMessage() for r in caplog.records] == [
        "memory: near the limit: about 8.49 GiB per rank (3.56e+08 parameters on the first pipeline stage x 16 bytes "
        "for fp32 weights and gradients and Adam state = 5.3 GiB, + activations of at least 3.19 GiB), 94% of "
        "train.gpu_memory_gib=9; a larger micro-batch or sequence may not fit"]
    # sharding the optimizer over 8 data-parallel ranks: 4 + 12/8 bytes of bf16 state per parameter
    config = PretrainConfig(run_dir="/r", model=ModelConfig(precision="bf16"))
    config.parallel.use_distributed_optimizer = True
    assert check_memory(config, 8).bytes_per_param == 2 + 4 + 12 / 8
    # the published shapes fit an 80 GiB GPU as the recipes lay them out
    from megatron_resilience.recipes import gpt_7b, to_config
    assert check_memory(to_config(gpt_7b(dir="/r")), 8).total < 80 * 2**30


# --- one rank per GPU ------------------------------------------------------------------------------------------

SHAPES = [
    # (ranks per node, GPUs per node, overrides, message, the fix as executor fields)
    (8, 3, [], "executor.gpus_per_node: must equal the ranks per node (executor.ntasks_per_node=8; one rank per "
               "GPU), got 3; set executor.ntasks_per_node=3", {"ntasks_per_node": 3}),
    (2, 3, ["parallel.tensor_model_parallel_size=2"],
     "executor.gpus_per_node: must equal the ranks per node (executor.ntasks_per_node=2; one rank per GPU), got 3; "
     "1 node(s) x 3 GPUs do not fit this job (parallel: tensor_model_parallel_size * pipeline_model_parallel_size = "
     "2 must divide the world size 3, got 2): set executor.gpus_per_node=2 and executor.ntasks_per_node=2",
     {"gpus_per_node": 2, "ntasks_per_node": 2}),
    (16, 8, [], "executor.gpus_per_node: must equal the ranks per node (executor.ntasks_per_node=16; one rank per "
                "GPU), got 8; set executor.ntasks_per_node=8", {"ntasks_per_node": 8}),
]


@pytest.mark.parametrize("ranks, gpus, overrides, message, fix", SHAPES, ids=["8_on_3", "tp2_on_3", "16_on_8"])
def test_ranks_per_node_must_match_gpus_in_every_interface_with_a_fix_that_passes(ranks, gpus, overrides, message,
                                                                                  fix, tmp_path, home):
    code, out, err = cli_slurm(tmp_path, f"run.executor.ntasks_per_node={ranks}", f"run.executor.gpus_per_node={gpus}",
                               *overrides, plugins="preemption")
    assert (code, err) == (1, f"Error: {message}\n")
    task = python_task(tmp_path, overrides)
    for plugins in ([], [FaultTolerancePlugin(), PreemptionPlugin()]):
        with pytest.raises(ConfigError) as err_:
            preview(task, slurm(home, ntasks_per_node=ranks, gpus_per_node=gpus), plugins)
        assert str(err_.value) == message
        with pytest.raises(ConfigError) as err_:
            run.run(task, executor=slurm(home, ntasks_per_node=ranks, gpus_per_node=gpus), plugins=plugins,
                    dryrun=True)
        assert str(err_.value) == message
    fixed = {"ntasks_per_node": ranks, "gpus_per_node": gpus, **fix}
    script = preview(task, slurm(home, **fixed), [FaultTolerancePlugin(), PreemptionPlugin()])
    assert f"--nproc-per-node {fixed['ntasks_per_node']} " in script  # the fix passes every other check


# --- run.run without plugins ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor_model_parallel_size=4"], "parallel: tensor_model_parallel_size * pipeline_model_parallel_size "
                                                "= 4 must divide the world size 2, got 4"),
    (["train.max_steps=-5"], "train.max_steps: must be an integer >= 1, got -5"),
])
def test_run_run_without_plugins_checks_our_task_and_starts_nothing(overrides, message, tmp_path, home):
    task = python_task(tmp_path, overrides)
    for plugins in (None, []):
        with pytest.raises(ConfigError) as err:
            run.run(task, executor=run.LocalExecutor(ntasks_per_node=2), plugins=plugins)  # not a dry run
        assert str(err.value) == message
    assert files(home) == [] and not (tmp_path / "run").exists()  # no experiment folder, no job started


IMPORTS = {"nemo_run first": "import nemo_run as run\nfrom megatron_resilience.entry import pretrain",
           "entry first": "from megatron_resilience.entry import pretrain\nimport nemo_run as run"}


@pytest.mark.parametrize("order", sorted(IMPORTS))
def test_run_run_checks_in_an_interpreter_that_imported_only_nemo_run_and_the_entry_point(order, tmp_path):
    """Either import order (entry first: the meta-path hook fires after ``import nemo_run``, then is gone and
    nemo_run keeps its own loader); a dry run is refused too, and the plugins load only at the submission."""
    code = IMPORTS[order] + "\n" + textwrap.dedent(f"""
        import sys
        from nemo_run.config import set_nemorun_home
        from megatron_resilience.config import ParallelConfig
        print("HOOKS", [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_AfterImport"],
              type(run.__loader__).__name__ == type(run.__spec__.loader).__name__ == "SourceFileLoader",
              "megatron_resilience.plugins" in sys.modules)
        set_nemorun_home({str(tmp_path / 'home')!r})
        task = run.Partial(pretrain, run_dir={str(tmp_path / 'run')!r},
                           parallel=run.Config(ParallelConfig, tensor_model_parallel_size=4))
        for dryrun in (True, False):
            try:
                run.run(task, executor=run.LocalExecutor(ntasks_per_node=2), dryrun=dryrun)
            except Exception as err:
                print("REFUSED", dryrun, type(err).__name__, err)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    refused = ("ConfigError parallel: tensor_model_parallel_size * pipeline_model_parallel_size = 4 must divide the "
               "world size 2, got 4")
    lines = [line for line in out.stdout.splitlines() if line.startswith(("HOOKS", "REFUSED"))]
    assert lines == ["HOOKS [] True False", f"REFUSED True {refused}", f"REFUSED False {refused}"], \
        out.stdout + out.stderr
    assert not (tmp_path / "run").exists()


# --- Python misuse ------------------------------------------------------------------------------------------------

EXAMPLE = "e.g. plugins=[FaultTolerancePlugin(), PreemptionPlugin()]"
MISUSE = [
    ("plugins='ft'", lambda t: (t, "ft"),
     f"plugins: expected run.Plugin objects ({EXAMPLE}), got 'ft', a string (plugin names like 'ft' are for the "
     "CLI's run.plugins=...)"),
    ("a plugin class", lambda t: (t, [FaultTolerancePlugin]),
     f"plugins: expected plugin objects, got the class FaultTolerancePlugin; write FaultTolerancePlugin() "
     f"({EXAMPLE})"),
    ("run.Partial(print)", lambda t: (run.Partial(print), [FaultTolerancePlugin()]),
     "task: run.Partial needs a function importable by name (defined at module level), got print (a built-in); "
     "for this package: run.Partial(megatron_resilience.entry.pretrain, run_dir=...) or a recipe such as "
     "megatron_resilience.recipes.gpt_tiny(...)"),
    ("a lambda", lambda t: (run.Partial(lambda: None), []),
     "task: run.Partial needs a function importable by name (defined at module level), got "
     "<lambda>.<locals>.<lambda> (a lambda or a function defined inside another); for this package: "
     "run.Partial(megatron_resilience.entry.pretrain, run_dir=...) or a recipe such as "
     "megatron_resilience.recipes.gpt_tiny(...)"),
]


def test_python_misuse_gets_one_line_saying_what_was_expected(tmp_path, home, caplog):
    base = run.Partial(pretrain, run_dir=str(tmp_path / "run"))
    for name, make, message in MISUSE:
        task, plugins = make(base)
        caplog.clear()
        for submit in (lambda: preview(task, slurm(home), plugins),
                       lambda: run.run(task, executor=slurm(home), plugins=plugins, dryrun=True)):
            with pytest.raises(ConfigError) as err:
                with caplog.at_level(logging.INFO):
                    submit()
            assert str(err.value) == message, name
        assert not [r for r in caplog.records if r.name.startswith("megatron_resilience.plugins")], name
    # plugins=None means no plugins, as in run.run
    assert "#SBATCH" in preview(base, slurm(home), None)


# --- the docs' snippets --------------------------------------------------------------------------------------------


def test_every_local_tunnel_the_docs_show_constructs_and_previews(home):
    pages = ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs"))) if n.endswith(".md")]
    calls = {(page, m) for page in pages  # executors the pages build: tunnel=run.LocalTunnel(...)
             for m in re.findall(r"(?<=tunnel=)run\.LocalTunnel\([^()]*\)", open(os.path.join(ROOT, page)).read())}
    assert any(page == "README.md" for page, _ in calls) and any(page == "docs/testing.md" for page, _ in calls)
    for page, call in sorted(calls):
        tunnel = eval(call, {"run": run})  # noqa: S307 - the docs' own expression
        executor = slurm(home, tunnel=tunnel)
        assert "#SBATCH --account=acct" in preview(run.Partial(pretrain, run_dir=str(home / "r")), executor, []), \
            (page, call)


def test_dash_y_is_yes_and_launches_without_a_prompt_as_the_cli_page_says(tmp_path, monkeypatch):
    """nemo binds ``-y`` twice (``--yaml`` and ``--yes``); click keeps the last. nemo_run's own parser builds the
    run context of the real command line; its execution is replaced by recording the context, so no job runs."""
    import nemo_run.cli.api as nemo_cli_api
    import typer

    from megatron_resilience.recipes.cli import PretrainRunContext

    text = open(os.path.join(ROOT, "examples", "cli.md")).read()
    assert "`--yes` or `-y` (no\n  prompt: the job is launched at once; `-y` is not `--yaml`" in text
    contexts = []
    monkeypatch.setattr(PretrainRunContext, "cli_execute", lambda self, fn, args, *rest: contexts.append(self))
    for flag in ("-y", "--yes", None):
        run_cli(["megatron_resilience", "pretrain", "--factory", "gpt_tiny", f"run_dir={tmp_path}/r",
                 *([flag] if flag else []), "run.executor=local"], standalone_mode=False)
    assert [(c.skip_confirmation, c.yaml) for c in contexts] == [(True, None), (True, None), (False, None)]
    # what skip_confirmation does: without it nemo_run asks (answered "no" here); with it, it goes on unasked
    prompts = []
    monkeypatch.setattr(typer, "confirm", lambda text, *a, **k: prompts.append(text) or False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # nemo_run never asks under torchrun
    monkeypatch.setattr(nemo_cli_api, "NEMORUN_SKIP_CONFIRMATION", None)  # its answer of an earlier prompt
    assert contexts[2]._should_continue(contexts[2].skip_confirmation) is False and prompts == ["Continue?"]
    monkeypatch.setattr(nemo_cli_api, "NEMORUN_SKIP_CONFIRMATION", None)
    assert contexts[0]._should_continue(contexts[0].skip_confirmation) is True and prompts == ["Continue?"]
