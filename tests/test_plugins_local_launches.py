"""Real ft_launcher runs set up by the plugins through ``run.run`` on the LocalExecutor (three at once).

* ``script``: ``examples/argparse_trainer.py`` (our stand-alone script that takes argparse flags only, not
  our trainer) on 2 ranks under the installed ft_launcher (0.4.1), configured through
  ``script_args_converter_fn=megatron_lm_args``: it receives the FT settings (its rank monitor's section
  timeouts are the plugin's) and the preemption signal (SIGTERM to ft_launcher: both ranks get it, rank 0
  saves, every rank exits 0);
* ``storage`` and ``cycles``: ft_launcher 0.7.0 from ``.venv-newest`` (first on PYTHONPATH; the console
  script imports whichever nvidia-resiliency-ext comes first): a storage path that does not exist stops it
  before rendezvous, naming the path, and the trainer never starts; with per-cycle logs and cycle info, a
  trainer that fails its first cycle on purpose leaves one log per cycle and ft_launcher's cycle records.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from nvrx_releases import ensure
from resilience_support.processes import ft_launcher_among

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "argparse_trainer.py")

DRIVER = textwrap.dedent("""
    import json, sys
    from megatron_resilience.upstream import import_nemo_run
    run = import_nemo_run()
    from nemo_run.config import set_nemorun_home
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, megatron_lm_args

    if __name__ == "__main__":
        home, example, name, ranks, ft_kwargs, script_args = sys.argv[1:7]
        set_nemorun_home(home)
        task = run.Script(path=example, entrypoint="python", args=json.loads(script_args))
        plugins = [FaultTolerancePlugin(script_args_converter_fn=megatron_lm_args, **json.loads(ft_kwargs)),
                   PreemptionPlugin(script_args_converter_fn=megatron_lm_args)]
        run.run(task, executor=run.LocalExecutor(ntasks_per_node=int(ranks), launcher="ft"), name=name,
                plugins=plugins)
""")


class Driver:
    def __init__(self, tmp_path, name: str, ranks: int, ft_kwargs: dict, script_args: list[str], release: str):
        tmp_path.mkdir(exist_ok=True)
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        if ensure(release):
            env["PYTHONPATH"] = os.pathsep.join(ensure(release))
        self.name, self.home = name, tmp_path / "home"
        self.out = open(tmp_path / f"{name}.driver.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(driver), str(self.home), EXAMPLE, name, str(ranks), json.dumps(ft_kwargs),
             json.dumps(script_args)], env=env, stdout=self.out, stderr=subprocess.STDOUT, cwd=tmp_path,
            start_new_session=True)

    def job_dir(self) -> str:
        return glob.glob(str(self.home / "experiments" / self.name / "*" / self.name))[0]

    def log(self) -> str:
        paths = glob.glob(os.path.join(self.job_dir(), "**", "*.log"), recursive=True)
        return "".join(open(p, errors="replace").read() for p in sorted(paths))

    def ft_launcher(self) -> psutil.Process | None:
        return ft_launcher_among(psutil.Process(self.proc.pid).children(recursive=True))

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"{self.name}: not done in {timeout} s:\n{self.log()[-4000:]}") from None


def signal_after_first_checkpoint(driver: Driver, tracker: str, sent: dict) -> None:
    """Background: once rank 0 has saved its first checkpoint, SIGTERM ft_launcher (as a scheduler would)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not os.path.exists(tracker):
        time.sleep(0.2)
    launcher = driver.ft_launcher()
    if launcher is None:
        sent["error"] = "no ft_launcher process (or no checkpoint in 600 s)"
        return
    launcher.send_signal(signal.SIGTERM)
    sent["at"] = time.time()


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("launches")
    runs = root / "runs"
    runs.mkdir()
    missing = str(root / "no_such_mount" / "data")
    ft_timeouts = {"setup_timeout": 611.0, "step_timeout": 181.0, "checkpointing_timeout": 421.0,
                   "out_of_section_timeout": 301.0}
    drivers = {
        "script": Driver(root / "script_home", "script", 2, ft_timeouts,
                         ["--train-iters", "100000", "--step-time", "0.2", "--save-interval", "5",
                          "--save", str(runs / "script_ckpt"), "--report", str(runs / "script.jsonl")], "0.4.1"),
        # enable_ft_package=False: these trainers need not import nvidia-resiliency-ext (and torch)
        "storage": Driver(root / "storage_home", "storage", 1,
                          {"nvrx_version": "0.7", "enable_ft_package": False, "storage_health_check": True,
                           "storage_health_check_paths": [missing]},
                          ["--train-iters", "3", "--save", str(runs / "storage_ckpt"),
                           "--report", str(runs / "storage.jsonl")], "0.7.0"),
        "cycles": Driver(root / "cycles_home", "cycles", 1,
                         {"nvrx_version": "0.7", "enable_ft_package": False, "per_cycle_logs": True,
                          "cycle_info": True},
                         ["--train-iters", "3", "--save", str(runs / "cycles_ckpt"), "--report",
                          str(runs / "cycles.jsonl"), "--fail-first-cycle"], "0.7.0"),
    }
    sent: dict = {}
    thread = threading.Thread(target=signal_after_first_checkpoint, daemon=True,
                              args=(drivers["script"], str(runs / "script_ckpt" / "latest_checkpointed_iteration.txt"),
                                    sent))
    thread.start()
    codes = {name: d.wait(900) for name, d in drivers.items()}
    thread.join(timeout=5)
    return {"drivers": drivers, "codes": codes, "runs": runs, "missing": missing, "sent": sent}


def reports(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_stand_alone_script_gets_the_ft_settings_and_the_preemption_signal(launches):
    driver, runs = launches["drivers"]["script"], launches["runs"]
    assert "at" in launches["sent"], launches["sent"].get("error", "") + driver.log()[-3000:]
    (report,) = reports(runs / "script.jsonl")
    assert report["argv"][-3:] == ["--enable-ft-package", "--calc-ft-timeouts", "--exit-signal-handler"]
    assert report["ft"] == {"connected": True, "rank_section_timeouts": {"setup": 611.0, "step": 181.0,
                                                                          "checkpointing": 421.0},
                            "rank_out_of_section_timeout": 301.0, "initial_rank_heartbeat_timeout": None,
                            "rank_heartbeat_timeout": None}
    assert report["stopped"] == "signal" and report["signal"]["signal"] == "SIGTERM"
    assert report["signal"]["wall_time"] >= launches["sent"]["at"] - 1.0  # received after it was sent
    log = driver.log()
    assert "rank 1: SIGTERM received" in log and f"rank 0: SIGTERM received: saved at step {report['finished_step']}" \
        in log
    with open(runs / "script_ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == report["finished_step"]


def test_missing_storage_path_stops_ft_launcher_0_7_before_rendezvous(launches):
    driver, missing = launches["drivers"]["storage"], launches["missing"]
    log = driver.log()
    assert f"StoragePathHealthCheck probe subprocess failed (rc=1): storage probe issues: missing:{missing}" in log, \
        log[-4000:]
    assert "UnhealthyNodeException" in log
    assert "has joined the rendezvous" not in log and "worker_start_started" not in log
    assert not os.path.exists(launches["runs"] / "storage.jsonl")  # the trainer never started


def test_ft_launcher_0_7_writes_per_cycle_logs_and_cycle_info(launches):
    job_dir = launches["drivers"]["cycles"].job_dir()
    cycle_logs = sorted(glob.glob(os.path.join(job_dir, "ft_cycle_logs", "*")))
    assert [os.path.basename(p) for p in cycle_logs] == ["cycle_cycle0.log", "cycle_cycle1.log"], cycle_logs
    assert "failing the first cycle on purpose" in open(cycle_logs[0]).read()
    assert "training finished at step 3" in open(cycle_logs[1]).read()
    info_dir = os.path.join(job_dir, "ft_cycle_info")
    records = sorted(f for f in os.listdir(info_dir) if not f.endswith(".current"))
    assert len(records) == 2, records  # one per cycle (job id empty: no Slurm here)
    with open(os.path.join(info_dir, records[1])) as f:
        info = json.load(f)
    assert info["cycle_number"] == 1 and info["cycle_log_file"] == cycle_logs[1]
    assert [r["finished_step"] for r in reports(launches["runs"] / "cycles.jsonl")] == [3]
