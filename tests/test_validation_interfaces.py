"""One validation, three interfaces: every bad input is rejected before submission or training, with the same
message, through

- the CLI: ``nemo megatron_resilience pretrain ... run.executor=slurm run.plugins=resilience --dryrun``
  (NeMo-Run's real CLI, run in this process): exit 1, ``Error: <message>`` and nothing rendered;
- Python: ``preview(task, executor, plugins)`` and ``run.run(task, executor=..., plugins=..., dryrun=True)``
  on a ``run.Partial`` of ``megatron_resilience.entry.pretrain``: ``ConfigError(<message>)``, no file written;
- the trainer's command line: ``python -m megatron_resilience run_dir=... key=value`` (its ``main``, in this
  process, under ``WORLD_SIZE=2``): exit with ``megatron_resilience: <message>`` before the trainer builds
  anything (building the hooks, the first step of setup, fails the test).

Every interface starts from the config defaults with a job of 2 ranks (Slurm: 1 node x 2 tasks, through a
LocalTunnel, so paths are checked on this machine). Settings that only one side has (plugin fields, executor
fields, recipe arguments) go through the interfaces that have them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import typing

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from validation_cases import EXECUTOR_CASES, PLUGIN_CASES, RECIPE_CASES, TASK_CASES  # noqa: E402

from megatron_resilience import __main__ as trainer_cli  # noqa: E402
from megatron_resilience import trainer as runtime_pretrain  # noqa: E402
from megatron_resilience.config import SECTIONS, ConfigError, PretrainConfig  # noqa: E402
from megatron_resilience.config.overrides import parse_override, parse_value  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402
from megatron_resilience.recipes import RECIPES  # noqa: E402
from megatron_resilience.upstream.nemorun import run_cli  # noqa: E402

# --- the three interfaces ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A private NEMORUN_HOME (LocalTunnel job dir = its experiments folder, as nemo_run requires)."""
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    path = tmp_path_factory.mktemp("nemo_run_home")
    saved = get_nemorun_home()
    set_nemorun_home(str(path))
    yield path
    set_nemorun_home(saved)


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    return tmp_path


def fill(items, tmp):
    return [item.replace("{tmp}", str(tmp)) for item in items]


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_cli(["megatron_resilience", "pretrain", *args], standalone_mode=False)
    return code or 0, out.getvalue(), err.getvalue()


def cli_slurm(tmp, *args: str, plugins: str = "resilience") -> tuple[int, str, str]:
    """The CLI on a Slurm executor; a case's own ``key=value`` replaces the base's (a key given twice is an error)."""
    base = [f"run_dir={tmp}/run", "run.executor=slurm", "run.executor.account=acct", "run.executor.partition=batch",
            "run.executor.nodes=1", "run.executor.ntasks_per_node=2", "run.executor.gpus_per_node=null",
            f"run.plugins={plugins}"]
    given = {a.split("=", 1)[0] for a in args if "=" in a}
    return cli(*[a for a in base if a.split("=", 1)[0] not in given], "--dryrun", *args)


def assert_cli_rejects(result, message):
    code, out, err = result
    assert (code, err) == (1, f"Error: {message}\n")
    assert "# sbatch script" not in out and "final config" not in out  # nothing rendered, nothing submitted


def python_task(tmp, overrides):
    """A ``run.Partial`` of pretrain with every section at its defaults, then each override set as an attribute:
    the typed value, or the raw text where it does not parse (a string where a number belongs)."""
    task = run.Partial(pretrain, run_dir=f"{tmp}/run",
                       **{s: run.Config(typing.get_type_hints(PretrainConfig)[s]) for s in SECTIONS})
    for item in overrides:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        try:
            value = parse_override(item)[2]
        except ConfigError:
            value = raw
        setattr(getattr(task, section), name, value) if name else setattr(task, section, value)
    return task


def slurm_executor(home, **changes):
    fields = dict(account="acct", partition="batch", nodes=1, ntasks_per_node=2, gpus_per_node=None,
                  time="04:00:00", tunnel=run.LocalTunnel(job_dir=str(home / "experiments")))
    return run.SlurmExecutor(**{**fields, **changes})


def assert_python_rejects(home, task, executor_changes, plugins, message):
    with pytest.raises(ConfigError) as err:
        preview(task, slurm_executor(home, **executor_changes), plugins())
    assert str(err.value) == message
    before = sorted(str(p) for p in home.rglob("*"))
    # run.run checks the task before nemo_run's serializer round trip (plugins/submit_check.py), so a NaN (NaN !=
    # NaN fails that round trip) gets the same message as everywhere else
    with pytest.raises(ConfigError) as err:
        run.run(task, executor=slurm_executor(home, **executor_changes), plugins=plugins(), dryrun=True)
    assert str(err.value) == message
    assert sorted(str(p) for p in home.rglob("*")) == before  # nothing written: no sbatch file, no job folder


def both_plugins(**changes):
    return lambda: [FaultTolerancePlugin(**{k: v for k, v in changes.items() if k in FT_FIELDS}),
                    PreemptionPlugin(**{k: v for k, v in changes.items() if k not in FT_FIELDS})]


FT_FIELDS = {f.name for f in dataclasses.fields(FaultTolerancePlugin)}


def typed(cls, name, raw):
    return parse_value(name, raw, typing.get_type_hints(cls)[name])


@pytest.fixture
def trainer(monkeypatch):
    """``python -m megatron_resilience ARGS`` in this process, 2 ranks: returns its exit message."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def reached(*args, **kwargs):
        raise AssertionError("the trainer went past its checks into setup")

    monkeypatch.setattr(runtime_pretrain, "build_hooks", reached)

    def call(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            trainer_cli.main(list(args))
        return str(exit_.value.code)

    return call


# --- the table -----------------------------------------------------------------------------------------------


def _id(case):
    return case[0][-1][:40]


@pytest.mark.parametrize("overrides, message, where", TASK_CASES, ids=[_id(c) for c in TASK_CASES])
def test_task_input_rejected_alike_everywhere(overrides, message, where, tmp, home, trainer):
    overrides, message = fill(overrides, tmp), message.replace("{tmp}", str(tmp))
    if "c" in where:
        assert_cli_rejects(cli_slurm(tmp, *overrides), message)
    if "p" in where:
        assert_python_rejects(home, python_task(tmp, overrides), {}, both_plugins(), message)
    else:  # Fiddle refuses an unknown attribute on the task when it is set, naming the valid ones
        section, _, name = overrides[0].split("=")[0].partition(".")
        task = python_task(tmp, [])
        if section not in SECTIONS:
            with pytest.raises(AttributeError, match=f"No parameter named '{section}' exists"):
                setattr(task, section, 3)
        elif name and name not in typing.get_type_hints(typing.get_type_hints(PretrainConfig)[section]):
            with pytest.raises(AttributeError, match=f"No parameter named '{name}' exists"):
                setattr(getattr(task, section), name, 3)
    if "t" in where:
        assert trainer(f"run_dir={tmp}/run", *overrides) == f"megatron_resilience: {message}"


@pytest.mark.parametrize("index, name, raw, message", PLUGIN_CASES, ids=[f"{c[1]}={c[2]}" for c in PLUGIN_CASES])
def test_plugin_input_rejected_alike(index, name, raw, message, tmp, home):
    assert_cli_rejects(cli_slurm(tmp, f"run.plugins[{index}].{name}={raw}"), message)
    cls = (FaultTolerancePlugin, PreemptionPlugin)[index]
    assert_python_rejects(home, python_task(tmp, []), {}, both_plugins(**{name: typed(cls, name, raw)}), message)


@pytest.mark.parametrize("executor, plugin, message", EXECUTOR_CASES, ids=[str(c[0]) for c in EXECUTOR_CASES])
def test_executor_input_rejected_alike(executor, plugin, message, tmp, home):
    args = [f"run.executor.{k}={v}" for k, v in executor.items()]
    args += [f"run.plugins[1].{k}={v}" for k, v in plugin.items()]
    assert_cli_rejects(cli_slurm(tmp, *args), message)
    changes = {k: typed(run.SlurmExecutor, k, v) for k, v in executor.items()}
    assert_python_rejects(home, python_task(tmp, []), changes,
                          both_plugins(**{k: typed(PreemptionPlugin, k, v) for k, v in plugin.items()}), message)


@pytest.mark.parametrize("recipe, arguments, message", RECIPE_CASES, ids=[f"{c[0]}{c[1]}" for c in RECIPE_CASES])
def test_recipe_arguments_rejected_alike(recipe, arguments, message, tmp):
    spec = f"{recipe}({','.join(f'{k}={v}' for k, v in arguments.items())})"
    code, out, err = cli("--factory", spec, "--dryrun")
    assert_cli_rejects((code, out, err), message)
    fn = RECIPES[recipe]
    hints = typing.get_type_hints(fn)
    kwargs = {}
    for key, raw in arguments.items():
        try:
            kwargs[key] = parse_value(key, raw, hints[key])
        except ConfigError:
            kwargs[key] = raw  # as a Python user would pass it
    with pytest.raises(ConfigError) as err_:
        fn(dir=str(tmp), **kwargs)
    assert str(err_.value) == message


def test_the_table_has_at_least_60_bad_inputs():
    assert len(TASK_CASES) + len(PLUGIN_CASES) + len(EXECUTOR_CASES) + len(RECIPE_CASES) >= 60
    assert sum("p" in w for *_, w in TASK_CASES) >= 50  # all three interfaces


def test_cli_options_never_say_unexpected_error(tmp):
    cases = {
        ("run.plugins=[resilience,preemption]",):
            "run.plugins=[resilience,preemption]: PreemptionPlugin is given twice (resilience = ft + preemption); "
            "give each plugin once",
        ("run.plugins=fault",): "run.plugins=fault: unknown plugin 'fault'; plugins: ft, preemption, resilience",
        ("run.executor.nodes=two",): "executor.nodes: must be an integer, got 'two'",
        ("run.executor.acount=x",): "executor.acount: unknown key; did you mean executor.account? valid keys: ",
        ("run.plugin=ft",): "run.plugin: unknown run option; did you mean run.plugins? run options: run.executor, ",
        ("run.plugins.preempt_tim=10",):
            "plugins.preempt_tim: unknown key; did you mean plugins.preempt_time? valid keys: ",
    }
    for args, message in cases.items():
        code, out, err = cli_slurm(tmp, *args)
        assert code == 1 and err.startswith(f"Error: {message}") and err.count("\n") == 1, (args, err)
    code, _, err = cli("--factory", "gpt_999", "--dryrun")
    assert (code, err) == (1, "Error: --factory gpt_999: unknown recipe; recipes: gpt_tiny, gpt_126m, gpt_350m, "
                              "gpt_1_3b, gpt_7b\n")
    code, _, err = cli("--factory", "gpt_126m(num_node=2)", "--dryrun")
    assert (code, err) == (1, "Error: num_node: unknown argument of gpt_126m; did you mean num_nodes? "
                              "arguments: dir, name, num_nodes, num_gpus_per_node\n")


# --- accepted: what Slurm accepts passes -----------------------------------------------------------------------


@pytest.mark.parametrize("time", ["0", "UNLIMITED", "infinite", "-1", "2-", "1-12", "1-12:30", "1-12:30:15", "90",
                                  "01:30:00"])
def test_slurm_time_limits_slurm_accepts_pass(time, tmp, home):
    script = preview(python_task(tmp, []), slurm_executor(home, time=time), both_plugins()())
    assert f"#SBATCH --time={time}" in script


def test_minutes_seconds_limit_is_logged(tmp, home, caplog):
    with caplog.at_level("WARNING", logger="megatron_resilience.plugins"):
        preview(python_task(tmp, []), slurm_executor(home, time="01:30"), both_plugins()())
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "executor.time='01:30' is 1 min 30 s to Slurm (minutes:seconds); for 1 h 30 min write '01:30:00'"]


def test_shell_variables_in_an_inline_script_are_not_checked_at_submit_time(home):
    task = run.Script(inline="python -m megatron_resilience run_dir=$RUN_DIR train.max_steps=$STEPS optim.lr=0.1")
    script = preview(task, slurm_executor(home), [PreemptionPlugin()], with_scripts=True)
    assert "exec python -m megatron_resilience run_dir=$RUN_DIR train.max_steps=$STEPS" in script
    bad = run.Script(inline="python -m megatron_resilience run_dir=$RUN_DIR optim.lr=nan")
    with pytest.raises(ConfigError, match=r"^optim.lr: must be a finite number, got nan$"):
        preview(bad, slurm_executor(home), [PreemptionPlugin()])


def test_script_task_in_module_form_is_checked(home, tmp):
    task = run.Script(path="megatron_resilience", m=True, entrypoint="python",
                      args=[f"run_dir={tmp}/run", "checkpoint.save=/proc/ckpt"])
    with pytest.raises(ConfigError, match=r"^checkpoint.save: must be a writable directory, got '/proc/ckpt'"):
        preview(task, slurm_executor(home), [])


INPROCESS_WITHOUT_FT = (
    "inprocess.enabled: true on a SlurmExecutor needs FaultTolerancePlugin(inprocess_restart=True) among the job's "
    "plugins (without it srun keeps nemo_run's --kill-on-bad-exit=1, which kills the ranks the in-process wrapper "
    "keeps alive, and the wrapper's environment is not set), got plugins {}")


def test_inprocess_restart_on_slurm_needs_the_ft_plugin_in_every_interface(home, tmp):
    """``inprocess.enabled=true`` without FaultTolerancePlugin: preview(), run.run (plugins or not) and the CLI refuse
    it before anything is rendered; with the plugin, srun keeps the survivors (``--kill-on-bad-exit=0``)."""
    task = python_task(tmp, ["inprocess.enabled=true"])
    assert_python_rejects(home, task, {}, lambda: [PreemptionPlugin()],
                          INPROCESS_WITHOUT_FT.format(["PreemptionPlugin"]))
    with pytest.raises(ConfigError) as err:
        run.run(task, executor=slurm_executor(home), dryrun=True)
    assert str(err.value) == INPROCESS_WITHOUT_FT.format([])
    assert "--kill-on-bad-exit=0" in preview(task, slurm_executor(home), [PreemptionPlugin(), FaultTolerancePlugin()])
    assert_cli_rejects(cli_slurm(tmp, "inprocess.enabled=true", plugins="preemption"),
                       INPROCESS_WITHOUT_FT.format(["PreemptionPlugin"]))
    code, out, err = cli_slurm(tmp, "inprocess.enabled=true", plugins="resilience")
    assert code == 0 and "--kill-on-bad-exit=0" in out, err[-2000:]
