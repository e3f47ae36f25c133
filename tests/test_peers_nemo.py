"""NeMo 2.0 users' ``run.Partial(llm.pretrain, trainer=run.Config(Trainer, callbacks=[...]), ...)`` tasks.

NeMo's plugins (``nemo/lightning/run/plugins.py``) add ``PreemptionCallback(sig=...)`` and nvidia-resiliency-ext's
``FaultToleranceCallback(autoresume=True, calculate_timeouts=True, exp_dir=<log dir>)`` to ``trainer.callbacks``;
ours do the same, accept NeMo's ``PreemptionPlugin(callbacks=[...])``, and run ft_launcher in heartbeats mode,
because that callback sends heartbeats only.

NeMo's modules cannot import here (Lightning): the tasks use the stand-ins of ``tests/peer_standins.py``, whose
signatures are checked against the nemo_toolkit wheel's sources and the installed nvidia-resiliency-ext's
``FaultToleranceCallback``; what NeMo's plugins add is read from the wheel's ``plugins.py``. The heartbeats
argument is proven with the real ft_launcher: a worker that sends heartbeats only, as that callback does
(``RankMonitorClient.send_heartbeat``), is killed under the section timeouts a non-NeMo task gets and runs to the
end under the heartbeat timeouts the plugin renders for a NeMo task.
"""

from __future__ import annotations

import ast
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


def test_a_callback_already_there_is_kept_not_added_twice():
    with ps.installed():
        task = nemo_pretrain_task()
        task.trainer.callbacks = [run.Config(ps.PreemptionCallback, sig=int(signal.SIGUSR1))]
    task, _ = configured([PreemptionPlugin()], task=task)
    assert [(type(c).__name__, c.sig) for c in built_callbacks(task)] == [("PreemptionCallback", signal.SIGUSR1)]


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
