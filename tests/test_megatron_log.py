"""A foreign trainer's log read as this package's records (``records/megatron_log*.py``), and the report from it.

The lines are composed here with the format specs of the trainers' own print calls (megatron-core 0.19.2's
``megatron/training/training.py`` ``training_log`` / ``print_datetime`` / ``checkpointing.py``,
``megatron/core/timers.py``; megatron-bridge 0.6.2's ``training/utils/train_utils.py``, ``checkpointing.py``,
``train.py``), so that each parse is asserted exactly. The real trainer's own log, captured from a run, is read
in ``tests/megatron_lm/test_megatron_lm_report.py`` (the ``make test-megatron-lm`` lane).
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest

from megatron_resilience.jobs import evidence as ev
from megatron_resilience.records.megatron_log import records_from_lines, records_from_logs
from megatron_resilience.records.megatron_log_lines import read_line, read_lines
from megatron_resilience.report import run_report
from megatron_resilience.report.cli import main as report_main

T0 = time.mktime(time.strptime("2026-11-29 01:20:00", "%Y-%m-%d %H:%M:%S"))


def stamp(t: float, micro: bool = True) -> str:
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return text + (f".{round((t % 1) * 1e6):06d}" if micro else "")


def iteration(t: float, step: int, iters: int, ms: float, loss: float, *, micro: bool = True) -> str:
    """Megatron-LM's (and Bridge's) iteration line, field by field as ``training_log`` prints it."""
    line = f" [{stamp(t, micro)}]"
    line += " iteration {:8d}/{:8d} |".format(step, iters)
    line += " consumed samples: {:12d} |".format(4 * step)
    line += " elapsed time per iteration (ms): {:.1f} |".format(ms)
    line += f" learning rate: {1e-3:.6E} |"
    line += f" global batch size: {4:5d} |"
    line += " {}: {:.6E} |".format("lm loss", loss)
    line += f" loss scale: {1.0:.1f} |"
    line += f" grad norm: {1.5:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(0)
    line += " number of nan iterations: {:3d} |".format(0)
    return line


def mark(name: str, t: float, micro: bool = True) -> str:
    return f"[{name}] datetime: {stamp(t, micro)} "


def timer(name: str, lo_ms: float, hi_ms: float) -> list[str]:
    return ["INFO:megatron.core.timers:(min, max) time across ranks (ms):",
            "    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), lo_ms, hi_ms)]


def argument(name: str, value: object) -> str:
    return "  {} {} {}".format(name, "." * (48 - len(name)), value)


def saving(t: float, step: int, ckpt: str) -> str:
    return f"[{stamp(t)}] saving checkpoint at iteration {step:7d} to {ckpt} in torch_dist format"


def saved(t: float, step: int, ckpt: str) -> str:
    return f"  [{stamp(t)}] successfully saved checkpoint from iteration {step:7d} to {ckpt} " \
           "[ t 1/1, gtp_remat 1/1, p 1/1 ]"


def setup(t: float, *, load: int | None, ckpt: str, load_ms: float = 2.0) -> list[str]:
    """A Megatron-LM process's setup from its arguments to its training loop's start at ``t + 3``."""
    lines = ["using world size: 2, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel "
             "sizes: None, tensor-model-parallel size: 1, pipeline-model-parallel size: 1",
             "------------------------ arguments ------------------------",
             argument("global_batch_size", 4), argument("save", ckpt), argument("save_interval", 4),
             argument("seq_length", 32), argument("train_iters", 12), argument("world_size", 2),
             "-------------------- end of arguments ---------------------",
             "time to initialize megatron (seconds): {:.3f}".format(1.5),
             mark("after megatron is initialized", t)]
    if load is not None:
        lines.append(f"  successfully loaded checkpoint from {ckpt} [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration "
                     f"{load}")
    lines += timer("load-checkpoint", load_ms - 0.5, load_ms)
    lines += [mark("after model, optimizer, and learning rate scheduler are built", t + 1.0),
              mark("after dataloaders are built", t + 2.5), mark("before the start of training step", t + 3.0)]
    return lines


CKPT = "/ckpt"


def sigterm_then_resume() -> list[str]:
    """Process 1: steps 1-6 (saves at 4), SIGTERM -> save at 6 -> exit; process 2: resumes at 6, trains 7-12,
    saves at 8 and 12, finishes."""
    lines = setup(T0, load=None, ckpt=CKPT)
    t = T0 + 3.0
    ms = {1: 800.0, 2: 600.0}  # the second line: the mean of steps 1 and 2 (a 400 ms step 2)
    for step in range(1, 7):
        t += 1.0
        lines.append(iteration(t, step, 12, ms.get(step, 500.0), 7.0 - step / 10))
        if step == 4:
            lines += [saving(t + 0.01, 4, CKPT), saved(t + 2.01, 4, CKPT), *timer("save-checkpoint", 1990.0, 2000.0)]
            t += 2.0
    lines += [saving(t + 0.01, 6, CKPT), saved(t + 0.31, 6, CKPT), *timer("save-checkpoint", 290.0, 300.0),
              mark("exiting program after receiving SIGTERM.", t + 0.4)]
    t2 = T0 + 60.0
    lines += setup(t2, load=6, ckpt=CKPT, load_ms=250.0)
    t = t2 + 3.0
    for step in range(7, 13):
        t += 1.0
        lines.append(iteration(t, step, 12, {7: 700.0, 8: 550.0}.get(step, 500.0), 7.0 - step / 10))
        if step in (8, 12):
            lines += [saving(t + 0.01, step, CKPT), saved(t + 0.21, step, CKPT),
                      *timer("save-checkpoint", 190.0, 200.0)]
            t += 0.2
    lines.append(mark("after training is done", t + 0.1))
    return lines


def test_iteration_line_of_megatron_lm_0_19_is_read_field_by_field_through_a_launcher_prefix_and_a_glued_print():
    line = "[default1]:" + iteration(T0 + 0.873669, 12, 30, 101.7, 6.818871) + "[Rank 0] (after 12 iterations)"
    (e,) = read_line(line)
    assert (e.kind, e.step, e.value) == ("iteration", 12, 30)
    assert e.time == pytest.approx(T0 + 0.873669, abs=1e-6)
    assert e.fields["elapsed time per iteration (ms)"] == "101.7"
    assert e.fields["lm loss"] == "6.818871E+00"
    assert e.fields["global batch size"] == "4"
    assert e.fields["consumed samples"] == "48"
    # "validation loss at iteration N", "(after N iterations)" and the save lines are no iteration lines
    validation = " validation loss at iteration 14 on validation set | lm loss value: 6.8E+00 |"
    assert [x.kind for x in read_line(validation)] == []
    assert [x.kind for x in read_line(saving(T0, 12, CKPT))] == ["saving"]


def test_save_load_timer_and_exit_lines_are_read_exactly():
    events = read_lines([saving(T0 + 1.5, 4, CKPT), saved(T0 + 9.25, 4, CKPT), *timer("save-checkpoint", 7677.99,
                                                                                         7684.96),
                         "  successfully loaded checkpoint from /ckpt [ t 1/1, gtp_remat 1/1, p 1/1 ] at iteration 8",
                         "max time across ranks (ms):",
                         "    {}: {:.2f}".format("load-checkpoint ".ljust(48, "."), 125.42),
                         argument("save_interval", 4), mark("exiting program at iteration 14", T0 + 20.5),
                         f"  [{stamp(T0)}] successfully saved local checkpoint from iteration {5:7d}"])
    assert [(e.kind, e.step, e.name, e.value) for e in events] == [
        ("saving", 4, "", CKPT), ("saved", 4, "global", CKPT), ("timer", None, "save-checkpoint", 7.68496),
        ("loaded", 8, "", CKPT), ("timer", None, "load-checkpoint", 0.12542), ("argument", None, "save_interval", "4"),
        ("mark", None, "exiting program at iteration 14", None), ("saved", 5, "local", None)]
    assert events[0].time == pytest.approx(T0 + 1.5) and events[1].time == pytest.approx(T0 + 9.25)


def test_a_sigterm_and_a_resume_become_the_records_the_accounting_reads():
    recs = records_from_lines(sigterm_then_resume())
    starts = [r for r in recs if r["kind"] == "start"]
    assert [(r["resumed_from"], r["world_size"], r["dp"], r["trainer"]) for r in starts] == \
        [(0, 2, 2, "megatron_lm"), (6, 2, 2, "megatron_lm")]
    assert starts[0]["time"] == pytest.approx(T0 + 3.0)
    assert starts[0]["setup"]["process_start"] == pytest.approx(T0 - 1.5)  # initialized less the init time
    marks = starts[1]["setup"]["marks"]  # the load's 250 ms end where the model was built
    assert (marks["model"], marks["checkpoint_load"], marks["data"]) == \
        pytest.approx((T0 + 61.0 - 0.25, T0 + 61.0, T0 + 62.5))
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    # the second line after each start averages the process's first two steps: its own step is the rest
    times = {r["step"]: round(r["step_time_s"], 6) for r in train}
    assert (times[1], times[2], times[3], times[7], times[8]) == (0.8, 0.4, 0.5, 0.7, 0.4)
    assert train[0]["tokens_per_s"] == pytest.approx(4 * 32 / 0.8)
    saves = [(r["step"], r["reason"], round(r["blocking_s"], 6)) for r in recs if r["kind"] == "checkpoint"]
    assert saves == [(4, "interval", 2.0), (6, "signal", 0.3), (8, "interval", 0.2), (12, "interval", 0.2)]
    ends = [(r["kind"], r.get("reason"), r.get("exit_code"), r["step"]) for r in recs if r["kind"] in ("signal", "end")]
    assert ends == [("signal", None, None, 6), ("end", "signal", 0, 6), ("end", "finished", 0, 12)]
    # the ledger's progress reads them like this package's trainer's
    progress = ev.progress(recs, recs, None)
    assert (progress["last_step"], progress["resumed_from"], progress["checkpoint_step"]) == (12, 0, 12)
    assert [(c["resumed_from"], c["last_step"], c["recomputed_steps"]) for c in progress["cycles"]] == \
        [(0, 6, 0), (6, 12, 0)]


def test_megatron_bridge_lines_reset_their_timer_every_line_and_print_saves_without_a_stamp():
    lines = ["time to initialize megatron (seconds): 2.000", mark("after megatron is initialized", T0, False),
             "  successfully loaded checkpoint from /b [ t 0/1, p 0/1 ] at iteration 10",
             mark("after model, optimizer, and learning rate scheduler are built", T0 + 1, False),
             mark("after dataloaders are built", T0 + 2, False), "Starting training loop at iteration 10",
             iteration(T0 + 3, 11, 20, 900.0, 6.0, micro=False), iteration(T0 + 4, 12, 20, 600.0, 5.9, micro=False),
             "  successfully saved checkpoint from iteration      12 to /b [ t 1/1, p 1/1 ]",
             *timer("save-checkpoint", 400.0, 500.0), mark("exiting program after receiving SIGTERM.", T0 + 5, False)]
    recs = records_from_lines(lines)
    assert [(r["kind"], r["step"]) for r in recs] == [("start", 10), ("train", 11), ("train", 12),
                                                      ("checkpoint", 12), ("signal", 12), ("end", 12)]
    assert recs[0]["trainer"] == "megatron_bridge" and recs[0]["time"] == T0 + 2
    assert [round(r["step_time_s"], 6) for r in recs if r["kind"] == "train"] == [0.9, 0.6]  # no correction
    # no stamp on the line: the save began after the step that asked for it, for as long as its timer says
    assert (recs[3]["start_time"], recs[3]["time"], recs[3]["blocking_s"], recs[3]["reason"]) == \
        (T0 + 4, T0 + 4.5, 0.5, "signal")


def test_the_report_of_a_megatron_lm_log_folder_and_of_the_log_file(tmp_path):
    log = tmp_path / "log-megatron_0.out"
    log.write_text("\n".join(sigterm_then_resume()) + "\n")
    (tmp_path / "unrelated.txt").write_text("not a trainer's log\n")
    report = run_report.build(str(tmp_path), slurm_lookup=False)
    assert [(r.cycle, r.steps, r.resumed_from, r.recomputed, r.ended) for r in report.rows] == \
        [(0, "1-6", 0, 0, "in-job restart (worker group restarted)"), (1, "7-12", 6, 0, "finished")]
    acc = report.accounting
    assert sum(acc.badput.values()) + acc.productive == pytest.approx(acc.allocated)
    assert acc.productive == pytest.approx(0.8 + 0.4 + 0.5 * 4 + 0.7 + 0.4 + 0.5 * 4)
    assert acc.badput["checkpoint_save"] == pytest.approx(2.0 + 0.3 + 0.2 + 0.2)
    assert acc.badput["checkpoint_restore"] == pytest.approx(0.002 + 0.25)
    assert acc.badput["wasted_progress"] == 0.0  # the SIGTERM save kept every step
    assert [(i.kind, i.cause, i.fault_source) for i in acc.interruptions] == \
        [("process", "in_job_restart", "last sign of life")]
    assert report.optimum.c == pytest.approx(0.2)  # the median of the interval saves (2.0, 0.2, 0.2)
    text = run_report.format_report(report)
    assert "recommended: --save-interval=" in text and "interval_policy" not in text
    assert "final: trainer ended: finished at step 12" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert report_main([str(log), "--png", "none"]) == 0
    assert "recommended: --save-interval=" in out.getvalue()
    assert "7-12" in out.getvalue()
    assert len(records_from_logs([str(log), str(tmp_path / "unrelated.txt")])) == len(
        records_from_lines(sigterm_then_resume()))


def test_the_ledger_reads_the_chains_step_logs_when_the_trainer_writes_no_metrics(tmp_path):
    """The EXIT trap's progress for a Megatron-LM attempt: its step log and the earlier attempts' (ledger)."""
    from megatron_resilience.jobs.attempt_end import foreign_records
    from megatron_resilience.records.ledger import Ledger

    lines = sigterm_then_resume()
    cut = next(k for k, line in enumerate(lines) if "exiting program after receiving SIGTERM." in line) + 1
    first, second = tmp_path / "log-job_100_0.out", tmp_path / "log-job_100_1.out"
    first.write_text("\n".join(lines[:cut]) + "\n")
    second.write_text("\n".join(lines[cut:]) + "\n")
    (tmp_path / "sbatch_job_100.out").write_text("\n".join(lines) + "\n")  # the batch log is not read
    ledger = Ledger(str(tmp_path / "job_ledger.jsonl"))
    ledger.append({"kind": "attempt", "job_id": "100", "slurm_restart": 0, "log_files": [str(first)]})
    records = foreign_records(ledger, [str(second), str(tmp_path / "sbatch_job_100.out")])
    assert records == records_from_lines(lines)
    mine = ev.attempt_records(records, job_id="100", restart=1, since=T0 + 30, until=None)
    progress = ev.progress(records, mine, None)
    assert (progress["last_step"], progress["resumed_from"], progress["recomputed_steps"]) == (12, 6, 0)
    assert foreign_records(Ledger(str(tmp_path / "none.jsonl")), [str(tmp_path / "sbatch_job_100.out")]) == []


def test_the_lines_composed_here_are_the_ones_megatron_bridges_and_megatron_lms_sources_print():
    """The format fragments the lines above are built from, found in the trainers' own sources: Megatron-Bridge
    0.6.2's wheel (downloaded by ``tests/peers.py``, as the peer tests do) and megatron-core 0.19.2's
    ``megatron/training`` (the newest lane's). Megatron-Bridge's trainer does not run here (Transformer Engine is
    CUDA only): its lines are proven by these fragments and the parse above, not by a run."""
    import peers

    bridge = peers.ensure() / "bridge" / "megatron" / "bridge" / "training"
    newest = peers.ensure_newest() / "megatron" / "training"
    sources = {
        bridge / "utils" / "train_utils.py": [
            "log_string = f\" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]\"",  # no microseconds
            '" iteration {:8d}/{:8d} |"', '" consumed samples: {:12d} |"',
            '" elapsed time per iteration (ms): {:.1f} |"',
            'f" global batch size: {batch_size:5d} |"', '" {}: {:.6E} |".format(key, avg)'],
        bridge / "checkpointing.py": ['f"  successfully saved checkpoint from iteration {',
                                      'f"to {ckpt_cfg.save} [ t ',
                                      'f"  successfully loaded checkpoint from {load_dir} "', 'f"at iteration {'],
        bridge / "train.py": ['barrier_and_log("exiting program after receiving SIGTERM.")',
                              'print_rank_0(f"Starting training loop at iteration {start_iteration}")',
                              'timer_key = "save-checkpoint-non-persistent" if non_persistent_ckpt else '
                              '"save-checkpoint"'],
        bridge / "setup.py": ['barrier_and_log("after megatron is initialized")',
                              'barrier_and_log("after dataloaders are built")', 'timers("load-checkpoint"'],
        newest / "training.py": ["log_string = f\" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]\"",
                                 "' iteration {:8d}/{:8d} |'", "should_reset = not is_first_iteration",
                                 "print_datetime('before the start of training step')",
                                 "print_datetime('exiting program after receiving SIGTERM.')",
                                 "'time to initialize megatron (seconds): {:.3f}'"],
        newest / "checkpointing.py": ["saving checkpoint '",
                                      "f'at iteration {iteration:7d} to {save_dir} in {ckpt_format} format'",
                                      "successfully saved '",
                                      "f'checkpoint from iteration {int(iteration):7d} to {args.save} '",
                                      "f'  successfully loaded checkpoint from {load_dir} '"],
    }
    for path, fragments in sources.items():
        text = path.read_text()
        assert [f for f in fragments if f not in text] == [], path


def test_a_slurm_chain_of_a_megatron_lm_run_is_reported_from_its_attempts_step_logs(tmp_path):
    """Two Slurm attempts (the ledger's windows): the SIGTERM of a preemption, then the requeued attempt resumed."""
    from megatron_resilience.records.ledger import Ledger

    lines = sigterm_then_resume()
    cut = next(k for k, line in enumerate(lines) if "exiting program after receiving SIGTERM." in line) + 1
    logs = [tmp_path / "log-job_7_0.out", tmp_path / "log-job_7_1.out"]
    logs[0].write_text("\n".join(lines[:cut]) + "\n")
    logs[1].write_text("\n".join(lines[cut:]) + "\n")
    ledger = Ledger(str(tmp_path / "job_ledger.jsonl"))
    for restart, (begin, end, cls) in enumerate([(T0 - 5, T0 + 20, {"error_type": "preempted", "mode": None}),
                                                 (T0 + 50, T0 + 80, {"error_type": "finished", "mode": None})]):
        ledger.append({"kind": "attempt_start", "job_id": "7", "slurm_restart": restart, "time": begin})
        ledger.append({"kind": "attempt", "job_id": "7", "slurm_restart": restart, "start": begin, "end": end,
                       "classification": cls, "log_files": [str(logs[restart])], "nodes": ["n1"]})
    report = run_report.build(str(tmp_path), slurm_lookup=False)
    acc = report.accounting
    assert acc.allocated == pytest.approx(25 + 30) and acc.queue_wait == pytest.approx(30)
    assert acc.productive + sum(acc.badput.values()) == pytest.approx(acc.allocated)
    assert [(i.kind, i.cause, i.fault_source) for i in acc.interruptions] == [("preemption", "preempted", "signal")]
    assert acc.badput["checkpoint_save"] == pytest.approx(2.0 + 0.3 + 0.2 + 0.2)
    assert acc.productive == pytest.approx(0.8 + 0.4 + 0.5 * 4 + 0.7 + 0.4 + 0.5 * 4)
    assert [(r.restart, r.world_size) for r in report.rows] == [(0, 2), (1, 2)]
