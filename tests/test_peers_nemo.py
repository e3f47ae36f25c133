"""NeMo 2.0 users' ``run.Partial(llm.pretrain, trainer=run.Config(Trainer, callbacks=[...]), ...)`` tasks.

NeMo's plugins (``nemo/lightning/run/plugins.py``) add ``PreemptionCallback(sig=...)`` and nvidia-resiliency-ext's
``FaultToleranceCallback(autoresume=True, calculate_timeouts=True, exp_dir=<log dir>)`` to ``trainer.callbacks``;
ours do the same, accept NeMo's ``PreemptionPlugin(callbacks=[...], sig=...)``, and run ft_launcher in heartbeats mode,
because that callback sends heartbeats only.

NeMo's modules cannot import here (Lightning): the tasks use the stand-ins of ``tests/peer_standins.py``, whose
signatures are checked against the nemo_toolkit wheel's sources and the installed nvidia-resiliency-ext's
``FaultToleranceCallback``; what NeMo's plugins add is read from the wheel's ``plugins.py``, and its own
``_merge_callbacks`` (compiled from that file) merges callbacks next to ours, case by case. The heartbeats
argument is proven with the real ft_launcher: a worker that sends heartbeats only, as that callback does
(``RankMonitorClient.send_heartbeat``), is killed under the section timeouts a non-NeMo task gets and runs to the
end under the heartbeat timeouts the plugin renders for a NeMo task.
"""

from __future__ import annotations

import ast
import copy
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap

import fiddle as fdl
import peer_standins as ps
import peers
import pytest
from golden_cases import nemo_pretrain_task

from megatron_resilience.config import ConfigError
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402

NVRX_CALLBACK = os.path.join(list(__import__("nvidia_resiliency_ext").__path__)[0], "ptl_resiliency",
                             "fault_tolerance_callback.py")  # the installed release's (a namespace package)


def slurm():
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return executor


def configured(plugins, task=None, **standins):
    with ps.installed(**standins):
        task = task or nemo_pretrain_task()
        executor = slurm()
        for plugin in plugins:
            plugin.setup(task, executor)
        return task, executor


def built_callbacks(task) -> list:
    with ps.installed():  # the compute node: the callback classes import there
        return fdl.build(task).keywords["trainer"].callbacks


def test_standins_match_nemos_and_nvrx_sources():
    peers.ensure()
    preemption = peers.init_parameters(peers.NEMO / "nemo/lightning/pytorch/callbacks/preemption.py",
                                       "PreemptionCallback")
    assert preemption == {"sig": None}
    assert list(peers.init_parameters(peers.NEMO / "nemo/collections/llm/api.py", None, "pretrain")) == [
        "model", "data", "trainer", "log", "resume", "optim"]
    from pathlib import Path

    ft = peers.init_parameters(Path(NVRX_CALLBACK), "FaultToleranceCallback")
    assert list(ft) == ["autoresume", "calculate_timeouts", "simulated_fault_params", "exp_dir", "logger_name"]


def test_nemos_plugins_add_the_callbacks_ours_add():
    """What NeMo's PreemptionPlugin / FaultTolerancePlugin put into trainer.callbacks, read from its source."""
    peers.ensure()
    tree = ast.parse((peers.NEMO / "nemo/lightning/run/plugins.py").read_text())
    configs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "run.Config" and node.args:
            configs[ast.unparse(node.args[0])] = {k.arg: ast.unparse(k.value) for k in node.keywords}
    assert configs["PreemptionCallback"] == {"sig": "self.sig"}
    assert configs["res_module.FaultToleranceCallback"] == {"autoresume": "True", "calculate_timeouts": "True",
                                                            "exp_dir": "task.log.log_dir"}


def test_nemo_task_gets_nemos_callbacks_and_heartbeats_mode(caplog):
    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    task, executor = configured([FaultTolerancePlugin(), PreemptionPlugin()])
    callbacks = built_callbacks(task)
    assert [type(c).__name__ for c in callbacks] == ["TimingCallback", "FaultToleranceCallback", "PreemptionCallback"]
    ft, preemption = callbacks[1], callbacks[2]
    assert (ft.autoresume, ft.calculate_timeouts, ft.exp_dir) == (True, True, "/lustre/runs/nemo")
    assert preemption.sig == signal.SIGTERM
    assert isinstance(executor.launcher, run.FaultTolerance) and executor.signal == "SIGTERM@60"
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("FaultTolerancePlugin: mode=heartbeats for a NeMo 2.0 task: NeMo's FaultToleranceCallback "
                            "sends heartbeats only") for m in logged)
    assert "PreemptionPlugin: task trainer.callbacks += ['PreemptionCallback']" in logged


def test_nemos_callbacks_field_is_accepted_and_merged():
    mine = run.Config(ps.PreemptionCallback, sig=int(signal.SIGINT))
    task, _ = configured([PreemptionPlugin(signal="SIGINT", callbacks=[mine])])
    callbacks = built_callbacks(task)
    assert [(type(c).__name__, getattr(c, "sig", None)) for c in callbacks] == [
        ("TimingCallback", None), ("PreemptionCallback", signal.SIGINT)]


# --- callbacks merged as NeMo's own _merge_callbacks merges them ------------------------------------------------


def nemos_merge_callbacks():
    """NeMo's ``_merge_callbacks``, its code as the wheel's ``nemo/lightning/run/plugins.py`` has it. That module
    imports Lightning, so the function is compiled from its source; only its annotations (Lightning's
    ``Callback``) are dropped."""
    peers.ensure()
    path = peers.NEMO / "nemo/lightning/run/plugins.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_merge_callbacks")
    for arg in fn.args.args:
        arg.annotation = None
    namespace = {"copy": copy, "run": run}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_merge_callbacks"]


def _preemption(sig):
    return run.Config(ps.PreemptionCallback, sig=int(sig))


TERM, USR1 = signal.SIGTERM, signal.SIGUSR1
MERGES = {  # case: (trainer.callbacks before, callbacks merged in, the result as (class, sig))
    "none there": (None, [_preemption(TERM)], [("PreemptionCallback", TERM)]),
    "empty, the same one given twice": ([], [_preemption(TERM), _preemption(TERM)],
                                        [("PreemptionCallback", TERM), ("PreemptionCallback", TERM)]),
    "another class there": ([run.Config(ps.TimingCallback)], [_preemption(TERM)],
                            [("TimingCallback", None), ("PreemptionCallback", TERM)]),
    "the same class with another signal there": ([_preemption(USR1)], [_preemption(TERM)],
                                                 [("PreemptionCallback", USR1), ("PreemptionCallback", TERM)]),
    "the same config there": ([_preemption(TERM)], [_preemption(TERM)], [("PreemptionCallback", TERM)]),
    "the same one given twice": ([run.Config(ps.TimingCallback)], [_preemption(TERM), _preemption(TERM)],
                                 [("TimingCallback", None), ("PreemptionCallback", TERM)]),
}


@pytest.mark.parametrize("case", list(MERGES))
def test_callbacks_are_merged_exactly_as_nemos_own_function_merges_them(case):
    from megatron_resilience.tasks import partial_trainers

    before, given, expected = MERGES[case]
    merge = nemos_merge_callbacks()
    with ps.installed():
        theirs, ours = nemo_pretrain_task(), nemo_pretrain_task()
        for task in (theirs, ours):
            task.trainer.callbacks = copy.deepcopy(before)
        merge(theirs, callbacks=copy.deepcopy(given))
        partial_trainers.merge_callbacks(ours.trainer, copy.deepcopy(given), "PreemptionPlugin")
    assert ours.trainer.callbacks == theirs.trainer.callbacks
    assert [(c.__fn_or_cls__.__name__, c.sig if "sig" in c.__arguments__ else None)
            for c in ours.trainer.callbacks] == expected


def test_a_preemption_callback_with_another_signal_does_not_stop_nemos_being_added():
    """Before: one of the same class already there was kept and NeMo's not added; NeMo adds it."""
    with ps.installed():
        task = nemo_pretrain_task()
        task.trainer.callbacks = [_preemption(USR1)]
    task, _ = configured([PreemptionPlugin()], task=task)
    assert [(type(c).__name__, c.sig) for c in built_callbacks(task)] == [
        ("PreemptionCallback", signal.SIGUSR1), ("PreemptionCallback", signal.SIGTERM)]


def test_the_same_callback_already_there_is_not_added_twice(caplog):
    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    with ps.installed():
        task = nemo_pretrain_task()
        task.trainer.callbacks = [run.Config(ps.PreemptionCallback, sig=signal.SIGTERM)]
    task, _ = configured([PreemptionPlugin()], task=task)
    assert [(type(c).__name__, c.sig) for c in built_callbacks(task)] == [("PreemptionCallback", signal.SIGTERM)]
    assert ("PreemptionPlugin: task trainer.callbacks already has PreemptionCallback with the same arguments: not "
            "added again") in [r.getMessage() for r in caplog.records]


# --- NeMo's spelling of the signal: PreemptionPlugin(sig=signal.SIGINT) --------------------------------------------


def test_nemos_sig_field_is_the_signal(caplog):
    """NeMo's ``PreemptionPlugin(sig=signal.SIGINT)`` raised a bare TypeError; it is the plugin's ``signal``."""
    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    plugin = PreemptionPlugin(sig=signal.SIGINT)
    assert (plugin.signal, plugin.sig) == ("SIGINT", None)
    assert "PreemptionPlugin: sig=SIGINT (NeMo 2.0's name) is signal='SIGINT'" in [
        r.getMessage() for r in caplog.records]
    task, executor = configured([plugin])
    assert executor.signal == "SIGINT@60"
    assert [(type(c).__name__, getattr(c, "sig", None)) for c in built_callbacks(task)] == [
        ("TimingCallback", None), ("PreemptionCallback", signal.SIGINT)]
    with ps.installed():
        script = preview(nemo_pretrain_task(), slurm(), [FaultTolerancePlugin(), PreemptionPlugin(sig=signal.SIGINT)],
                         name="gpt")
    assert "\n#SBATCH --signal=SIGINT@60\n" in script


@pytest.mark.parametrize("kwargs, expected", [
    ({"signal": signal.SIGINT}, "SIGINT"),  # a signal.Signals member, as NeMo users write signals
    ({"sig": 2}, "SIGINT"), ({"sig": "SIGUSR1"}, "SIGUSR1"), ({"sig": signal.SIGINT, "signal": "SIGINT"}, "SIGINT"),
])
def test_a_signal_is_taken_by_name_or_as_signals_member(kwargs, expected):
    assert PreemptionPlugin(**kwargs).signal == expected


SIGNALS = "['SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP', 'SIGQUIT', 'SIGALRM', 'SIGCONT']"


@pytest.mark.parametrize("kwargs, message", [
    ({"sig": signal.SIGINT, "signal": "SIGUSR1"},
     "PreemptionPlugin.sig: NeMo 2.0's name for PreemptionPlugin.signal; sig='SIGINT' and signal='SIGUSR1' ask for "
     "two signals: set one of them"),
    ({"sig": signal.SIGKILL}, f"PreemptionPlugin.sig: must be one of {SIGNALS}, got <Signals.SIGKILL: 9>"),
    ({"signal": signal.SIGKILL}, f"PreemptionPlugin.signal: must be one of {SIGNALS}, got <Signals.SIGKILL: 9>"),
    ({"sig": 99}, f"PreemptionPlugin.sig: must be one of {SIGNALS}, got 99"),
])
def test_a_signal_the_plugin_cannot_use_is_named(kwargs, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        PreemptionPlugin(**kwargs)


def test_callbacks_on_a_task_without_a_lightning_trainer_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"^PreemptionPlugin.callbacks: NeMo 2.0's field, merged into the "
                                          r"trainer.callbacks of a NeMo run.Partial"):
        configured([PreemptionPlugin(callbacks=[run.Config(ps.PreemptionCallback)])],
                   task=run.Script(path="train.py", entrypoint="python"))
    with pytest.raises(ConfigError, match=r"^PreemptionPlugin.callbacks: must be a list of run.Config callbacks"):
        PreemptionPlugin(callbacks=[ps.PreemptionCallback()])


def test_sections_mode_is_refused_for_nemo():
    with pytest.raises(ConfigError, match=r"^FaultTolerancePlugin.mode: 'sections' cannot monitor a NeMo 2.0 task"):
        configured([FaultTolerancePlugin(mode="sections")])


def test_without_lightning_where_you_submit_the_callbacks_are_built_on_the_compute_node(caplog):
    caplog.set_level(logging.INFO, "megatron_resilience.plugins")
    task, _ = configured([FaultTolerancePlugin(), PreemptionPlugin()], with_nemo_callbacks=False)
    from megatron_resilience.config.lazy_import import build

    lazy = [c for c in task.trainer.callbacks if c.__fn_or_cls__ is build]
    assert [c.target for c in lazy] == ["nvidia_resiliency_ext.ptl_resiliency.FaultToleranceCallback",
                                        "nemo.lightning.pytorch.callbacks.PreemptionCallback"]
    assert [type(c).__name__ for c in built_callbacks(task)] == [
        "TimingCallback", "FaultToleranceCallback", "PreemptionCallback"]
    assert any("does not import here" in r.getMessage() for r in caplog.records)


# --- the real ft_launcher: heartbeats only, as NeMo's callback sends them -----------------------------------------

WORKER = textwrap.dedent("""
    import time
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    client = RankMonitorClient()
    client.init_workload_monitoring()
    for _ in range(40):  # 8 s of training, a heartbeat per step as FaultToleranceCallback sends them
        client.send_heartbeat()
        time.sleep(0.2)
    client.shutdown_workload_monitoring()
    print("worker finished", flush=True)
""")
FAST = dict(workload_check_interval=0.5, out_of_section_timeout=3.0, initial_rank_heartbeat_timeout=60.0,
            rank_heartbeat_timeout=5.0, num_in_job_restarts=0)


def _ft_yaml(task) -> str:
    with ps.installed():
        script = preview(task, run.SlurmExecutor(account="a", time="01:00:00"), [FaultTolerancePlugin(**FAST)],
                         name="gpt")
    return re.search(r"<<'MEGATRON_RESILIENCE_FT_CFG'\n(.*?)\nMEGATRON_RESILIENCE_FT_CFG", script, re.S).group(1)


@pytest.mark.slow
def test_heartbeat_only_worker_lives_under_nemos_mode_and_dies_under_sections(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    yamls = {"nemo": _ft_yaml(nemo_pretrain_task()), "other": _ft_yaml(run.Script(path="train.py"))}
    assert "rank_heartbeat_timeout: 5.0" in yamls["nemo"] and "rank_out_of_section_timeout: 3.0" in yamls["other"]
    launcher = os.path.join(os.path.dirname(sys.executable), "ft_launcher")
    procs = {}
    for name, text in yamls.items():
        (tmp_path / f"{name}.yml").write_text(text + "\n")
        procs[name] = subprocess.Popen([launcher, "--ft-cfg-path", str(tmp_path / f"{name}.yml"), "--standalone",
                                        "--nproc-per-node", "1", "--max-restarts", "0", str(tmp_path / "worker.py")],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    out = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    assert procs["nemo"].returncode == 0 and "worker finished" in out["nemo"], out["nemo"][-3000:]
    assert procs["other"].returncode != 0 and "worker finished" not in out["other"], out["other"][-3000:]
    assert re.search(r"Was out of section for [\d.]+ seconds\. Timeout is 3\.00 seconds\.", out["other"])
