"""The job-level report and watcher where a newcomer meets them: ``python -m megatron_resilience.report`` and
``nemo megatron_resilience report|watch`` (NeMo-Run's real CLI, in this process). Run folders are written by the
real ``MetricsLogger`` and ``Ledger``; the batch log is appended to by two attempts as ``--open-mode=append`` does.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import sys
import time

import pytest
from dashboards_support import read_tensorboard

from megatron_resilience.dashboards import DashboardSink
from megatron_resilience.dashboards.tensorboard import EventWriter
from megatron_resilience.records.ledger import Ledger
from megatron_resilience.report.cli import main as report_main
from megatron_resilience.report.cli import skipped
from megatron_resilience.runtime.metrics import MetricsLogger
from megatron_resilience.upstream.nemorun import run_cli


def _capture(fn, *args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = fn(*args, **kwargs)
        except SystemExit as exc:
            code = exc.code
    return code or 0, out.getvalue(), err.getvalue()


def nemo(*argv):
    return _capture(run_cli, ["megatron_resilience", *argv], standalone_mode=False)


def local_run(run_dir, steps=6):
    sink = DashboardSink({"tensorboard": EventWriter(str(run_dir / "tensorboard"))})
    m = MetricsLogger(str(run_dir), enabled=True, max_steps=steps, sinks=[sink])
    m.event("start", step=0, attempt={"slurm_restart": 0, "in_job_restart": 0, "job_id": None},
            dashboards={"tensorboard": str(run_dir / "tensorboard")})
    for s in range(1, steps + 1):
        m.train(step=s, loss=7.0 - s / 10, lr=0.1, grad_norm=1.0, step_time_s=0.25, tokens_per_s=100.0,
                consumed_samples=4 * s)
    m.event("end", step=steps, reason="finished", exit_code=0)
    m.close()
    return run_dir


@pytest.fixture
def runs(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "nested").mkdir(parents=True)
    local_run(tmp_path / "runs" / "a")
    local_run(tmp_path / "runs" / "b" / "nested")
    return tmp_path / "runs"


def test_a_folder_that_is_not_a_run_is_an_error_listing_the_runs_it_can_see(runs):
    message = (f"megatron_resilience report: {str(runs)!r} is not a run folder (it has no metrics.jsonl or "
               f"job_ledger.jsonl); run folders under it: {runs}/a, {runs}/b/nested\n")
    assert _capture(report_main, [str(runs)]) == (2, "", message)
    assert nemo("report", str(runs)) == (2, "", message)
    assert not list(runs.glob("*.png"))  # nothing written there
    empty = runs / "a" / "ckpt"
    empty.mkdir()
    code, _, err = _capture(report_main, [str(empty)])
    assert code == 2 and err.endswith("; no run folder under it either\n")


def test_goodput_and_badput_land_in_the_runs_tensorboard_once_however_often_the_report_runs(runs):
    run = runs / "a"
    for _ in range(2):
        code, out, _ = _capture(report_main, [str(run), "--json", "--png", "none"])
        assert code == 0
    accounting = json.loads(out)["accounting"]
    tb = read_tensorboard(str(run / "tensorboard"))
    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    assert tb["goodput/goodput-percent"] == [(6, f32(100 * accounting["goodput"]))]  # at the last step, once
    # The report's own figure (its accounting, bucket by bucket, is proven in test_goodput_accounting.py); here
    # the records were written milliseconds apart, so productive time is what fits in that wall time, not 6 x 0.25 s.
    assert tb["goodput/productive-seconds"] == [(6, f32(accounting["productive"]))] and accounting["productive"] > 0
    assert tb["goodput/allocated-seconds"] == [(6, f32(accounting["allocated"]))]
    assert {t: v for t, v in tb.items() if t.startswith("badput/")} == {
        f"badput/{name.replace('_', '-')}-seconds": [(6, f32(value))] for name, value in accounting["badput"].items()}
    assert len(list((run / "tensorboard").glob("*.goodput-report"))) == 1
    assert tb["lm loss"][-1] == (6, f32(6.4))  # the trainer's own points are untouched beside them
    code, out, _ = _capture(report_main, [str(run), "--png", "none", "--no-tensorboard"])
    assert code == 0 and "tensorboard:" not in out


def test_a_login_node_without_matplotlib_or_tensorboard_gets_the_report_and_one_line_per_skipped_part(
        runs, monkeypatch):
    """Neither package is a required dependency. Both are blocked in this process (every loaded module of theirs
    too: a loaded submodule would otherwise still import), as on a login node that lacks them."""
    run = runs / "a"
    for name in [m for m in sys.modules if m.split(".")[0] in ("matplotlib", "tensorboard")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    before = sorted(p.name for p in (run / "tensorboard").iterdir())
    code, out, err = _capture(report_main, [str(run)])
    assert code == 0
    assert out.startswith(f"megatron_resilience report: {run}\n") and "\ngoodput: " in out
    assert "timeline:" not in out and "tensorboard:" not in out
    assert err.splitlines() == [
        "megatron_resilience report: timeline skipped: matplotlib is not installed (pip install matplotlib; "
        "--png none leaves it out)",
        "megatron_resilience report: goodput/badput TensorBoard scalars skipped: tensorboard is not installed "
        "(pip install 'megatron-resilience[tensorboard]'; --no-tensorboard leaves them out)"]
    assert not list(run.glob("*.png")) and sorted(p.name for p in (run / "tensorboard").iterdir()) == before
    code, out, err = _capture(report_main, [str(run), "--json"])  # stdout stays JSON; the lines go to stderr
    assert code == 0 and json.loads(out)["accounting"] and len(err.splitlines()) == 2
    assert _capture(report_main, [str(run), "--png", "none", "--no-tensorboard"])[2] == ""
    # a package that is there but does not import says why instead
    assert skipped("timeline", ImportError("numpy.core.multiarray failed to import", name="numpy")) == (
        "megatron_resilience report: timeline skipped: matplotlib did not import (ImportError: "
        "numpy.core.multiarray failed to import; --png none leaves it out)")


def test_logs_prints_each_attempts_own_part_of_the_appended_batch_log(tmp_path):
    run, jobdir = tmp_path / "run", tmp_path / "job"
    jobdir.mkdir()
    batch = jobdir / "sbatch_train_31337.out"
    ledger = Ledger.in_run_dir(str(run))
    t = time.time() - 100
    parts = ["attempt zero starts\nNCCL watchdog timeout on rank 3\n", "attempt one starts\ntraining finished\n"]
    for restart, text in enumerate(parts):
        offset = batch.stat().st_size if batch.exists() else 0
        ledger.append({"kind": "attempt_start", "job_id": "31337", "slurm_restart": restart,
                       "time": t + 10 * restart, "batch_log_offset": offset})
        with open(batch, "a") as f:
            f.write(text)
        ledger.append({"kind": "attempt", "job_id": "31337", "slurm_restart": restart, "start": t + 10 * restart,
                       "end": t + 10 * restart + 5, "log_files": [str(batch)], "cycles": [{"cycle": 0}],
                       "classification": {"error_type": ["nccl_timeout", "finished"][restart], "source": "log"},
                       "decision": {"action": ["requeue", "stop"][restart]}})
    code, out, _ = _capture(report_main, [str(run), "--logs", "--png", "none"])
    assert code == 0
    logs = out[out.index("==> attempt 0"):].split("\ntimeline")[0].splitlines()
    size0 = len(parts[0].encode())
    assert logs == [
        f"==> attempt 0 (job 31337, restart 0): {batch} bytes 0-{size0} [last 2 of 2 lines] <==",
        "attempt zero starts", "NCCL watchdog timeout on rank 3",
        f"==> attempt 1 (job 31337, restart 1): {batch} bytes {size0}-end [last 2 of 2 lines] <==",
        "attempt one starts", "training finished"]


def test_nemo_report_takes_key_value_and_flag_forms_and_names_bad_options(runs):
    run = str(runs / "a")
    flags = nemo("report", run, "--png", "none", "--logs", "--no-tensorboard")
    keys = nemo("report", run, "png=none", "logs=true", "tensorboard=false")
    assert flags[0] == keys[0] == 0 and flags[1] == keys[1] and "goodput: " in flags[1]
    code, out, _ = nemo("report", run, "pgn=x")
    assert code == 1 and " ".join(out.split()) == (
        "Error: report: unknown option 'pgn'; did you mean png? options: png=VALUE, logs=true|false, "
        "json=true|false, tensorboard=true|false")
    assert "<function" not in out
    code, out, _ = nemo("report", run, "logs=maybe")
    assert code == 1 and "report: logs must be true or false, got 'maybe'" in " ".join(out.split())
    code, out, _ = nemo("report", run, str(runs / "b"))
    assert code == 1 and "give exactly one run directory or experiment id" in " ".join(out.split())


def test_nemo_watch_takes_interval_and_once_in_both_forms(runs, monkeypatch):
    """What reaches the watcher: the argv ``watch_argv`` hands to ``python -m megatron_resilience.watch``'s main,
    and the interval and once that main's own parser then gives the watcher's wait loop (the job is pending:
    no job-level config yet; the loop is replaced, so no Slurm is asked)."""
    from megatron_resilience.watch import cli as watch_cli

    run, seen = str(runs / "a"), []
    real_main = watch_cli.main
    monkeypatch.setattr(watch_cli, "main", lambda argv: seen.append(("argv", argv)) or real_main(argv))
    monkeypatch.setattr(watch_cli, "wait_for_first_attempt", lambda run_dir, job_id, *, interval, once, **_: (
        seen.append(("wait", run_dir, job_id, interval, once)) or (None, 0)))
    for argv in (["--interval", "5", "--once", "--job-id", "42"], ["interval=5", "once=true", "job_id=42"],
                 ["--interval=5", "--job-id=42", "--once"]):
        seen.clear()
        assert nemo("watch", run, *argv)[0] == 0, argv
        assert seen == [("argv", [run, "--interval", "5.0", "--job-id", "42", "--once"]),
                        ("wait", run, "42", 5.0, True)], argv
    seen.clear()
    code, out, err = nemo("watch", run, "interval=0.5")  # no job id: watch says what is missing
    assert code == 2 and "megatron_resilience watch: no job-level config found" in err, (out, err)
    assert seen == [("argv", [run, "--interval", "0.5"])]
    seen.clear()
    nemo("watch", run, "job_id=7", "once=true")  # the default interval, 30 s, as python -m's
    assert seen == [("argv", [run, "--interval", "30.0", "--job-id", "7", "--once"]), ("wait", run, "7", 30.0, True)]
    code, out, _ = nemo("watch", run, "--interval", "0")
    assert code == 1 and "watch: interval must be a number of seconds > 0, got '0'" in " ".join(out.split())
    code, out, _ = nemo("watch", run, "interval=soon")
    assert code == 1 and "watch: interval must be a number of seconds, got 'soon'" in " ".join(out.split())


def test_nemo_report_and_watch_help_document_the_key_value_forms():
    for command, listed in (("report", "png=PATH|none logs=true json=true tensorboard=false"),
                            ("watch", "interval=SECONDS once=true job_id=ID config=PATH")):
        code, out, _ = nemo(command, "--help")
        assert code == 0 and listed in " ".join(out.split()), out


def test_nemo_report_of_an_experiment_id_reports_its_jobs_run_dir(runs, tmp_path):
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    from megatron_resilience.entry import pretrain
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    saved = get_nemorun_home()
    set_nemorun_home(str(tmp_path / "home"))
    try:
        with run.Experiment("report_by_id", executor=run.LocalExecutor()) as exp:
            exp.add(run.Partial(pretrain, run_dir=str(runs / "a")), name="train")
            exp.dryrun(delete_exp_dir=False)
        code, out, err = nemo("report", exp._id, "png=none", "tensorboard=false")
    finally:
        set_nemorun_home(saved)
    assert code == 0, out + err
    assert f"megatron_resilience report: {runs / 'a'}\n" in out and "\ngoodput: " in out
