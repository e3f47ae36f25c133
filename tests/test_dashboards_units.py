"""The dashboards without a launch: records -> chart points (incl. the in-process restart records of issue 24's
contract and straggler reports, built here as the trainer writes them), the run history a start record carries,
the real TensorBoard writer read back by TensorBoard's loader, and the message when a dashboard's package is
missing. The launched proof (in-job restart + requeue) is tests/test_dashboards_launched.py.
"""

from __future__ import annotations

import builtins
import importlib.util
import json

import pytest
from dashboards_support import read_tensorboard

from megatron_resilience import dashboards
from megatron_resilience.config import ConfigError, LoggerConfig, ModelConfig, PretrainConfig
from megatron_resilience.dashboards.flops import flops_per_token
from megatron_resilience.dashboards.series import Point, Series
from megatron_resilience.dashboards.tensorboard import EventWriter
from megatron_resilience.dashboards.wandb_run import WandbRun
from megatron_resilience.runtime.metrics import MetricsLogger, last_logged_step
from megatron_resilience.runtime.run_history import history_fields

ZERO = {"in_job_restarts": 0, "inprocess_restarts": 0, "requeues": 0, "recomputed_steps": 0, "preemption_stops": 0,
        "rerun_exits": 0}


def attempt(slurm=0, in_job=0, job="7", inprocess=None):
    out = {"slurm_restart": slurm, "in_job_restart": in_job, "job_id": job}
    return out if inprocess is None else {**out, "inprocess_restart": inprocess}


def train(logger, steps, loss=1.0):
    for s in steps:
        logger.train(step=s, loss=loss + s, lr=0.1, grad_norm=0.5, step_time_s=0.1, tokens_per_s=10.0,
                     consumed_samples=4 * s)


def test_start_records_carry_the_highest_step_and_running_totals(tmp_path):
    """Attempt 0 logs 1-28 and is preempted; a restart from 20 dies at 24; another from 20; a requeue ends 17."""
    m = MetricsLogger(str(tmp_path), enabled=True, max_steps=40)
    m.event("start", step=0, attempt=attempt())
    train(m, range(1, 29))
    m.event("signal", step=28)
    m.event("start", step=20, attempt=attempt(in_job=1))
    train(m, range(21, 25))
    assert last_logged_step(str(tmp_path)) == 28  # the highest, not the last logged (24)
    m.event("start", step=20, attempt=attempt(in_job=2))
    train(m, range(21, 31))
    m.event("end", step=30, reason="rerun:17", exit_code=17)
    m.event("start", step=30, attempt=attempt(slurm=1, job="7"))
    m.event("start", step=30, attempt=attempt(slurm=1, job="7", inprocess=1))
    m.close()
    starts = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"start"' in line]
    assert [(s["restart"], s["last_logged_step"]) for s in starts] == [
        ("first", None), ("in_job_restart", 28), ("in_job_restart", 28), ("requeue", 30), ("inprocess_restart", 30)]
    assert starts[-1]["totals"] == {"in_job_restarts": 2, "inprocess_restarts": 1, "requeues": 1,
                                    "recomputed_steps": 8 + 8, "preemption_stops": 1, "rerun_exits": 1}


def test_requeue_cause_comes_from_the_job_level_ledger(tmp_path):
    (tmp_path / "job_ledger.jsonl").write_text(json.dumps({"kind": "attempt", "classification": {
        "error_type": "node_fail", "source": "slurm", "reason": "NODE_FAIL"}}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "start", "step": 0, "attempt": attempt(),
                                                        "totals": ZERO}) + "\n")
    fields = history_fields(str(tmp_path / "metrics.jsonl"), step=0, attempt=attempt(slurm=1), ledger_dir=str(tmp_path))
    assert fields["cause"] == "node_fail (slurm): NODE_FAIL" and fields["restart"] == "requeue"


def test_series_leaves_recomputed_steps_out_and_marks_restarts_at_the_first_new_step():
    s = Series()
    pts = []
    feed = [{"kind": "start", "step": 0, "restart": "first", "totals": ZERO}]
    feed += [{"kind": "train", "step": k, "loss": float(k), "lr": 0.1, "grad_norm": None, "step_time_s": 0.5,
              "tokens_per_s": 2.0, "consumed_samples": k} for k in (1, 2, 3)]
    feed += [{"kind": "checkpoint", "step": 2, "blocking_s": 0.25}]
    feed += [{"kind": "inprocess_restart", "iteration": 1, "fault_time": 5.0, "cause": "RuntimeError: boom",
              "restored_from": {"tier": "local", "step": 2}},
             {"kind": "start", "step": 2, "resumed": True, "resumed_from": 2, "restart": "inprocess_restart",
              "last_logged_step": 3, "attempt": attempt(inprocess=1),
              "totals": {**ZERO, "inprocess_restarts": 1, "recomputed_steps": 1},
              "setup": {"marks": {"data": 10.0, "checkpoint_load": 10.75}}}]
    feed += [{"kind": "train", "step": k, "loss": 10.0 + k, "lr": 0.1, "grad_norm": 1.0, "step_time_s": 0.5,
              "tokens_per_s": 2.0, "consumed_samples": k} for k in (3, 4)]
    feed += [{"kind": "eval", "step": 4, "eval_loss": 3.5},
             {"kind": "straggler", "step": 4, "stragglers": [1],
              "scores": {"gpu-relative-perf": {"0": 1.0, "1": 0.5}}}]
    for record in feed:
        pts += s.points(record)
    by_tag: dict[str, list[tuple[int, object]]] = {}
    for p in pts:
        by_tag.setdefault(p.tag, []).append((p.step, p.value))
    assert by_tag["lm loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0)]  # the re-run of step 3 is left out
    assert "grad-norm" in by_tag and by_tag["grad-norm"] == [(4, 1.0)]  # None is no point
    assert by_tag["resilience/inprocess-restarts"] == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0)]
    assert by_tag["resilience/recomputed-steps"] == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0)]
    assert by_tag["resilience/restart-resumed-from"] == [(4, 2.0)]
    assert by_tag["checkpoint/load-seconds"] == [(4, 0.75)]
    assert by_tag["checkpoint/save-seconds"] == [(2, 0.25)]
    assert by_tag["resilience/events/inprocess"] == [
        (4, "in-process restart 1: cause: RuntimeError: boom; restored from the local checkpoint of step 2")]
    assert by_tag["resilience/events"] == [(4, "in-process restart (slurm restart 0, in-job restart 0, job 7): "
                                               "resumed from checkpoint step 2; step 3 recomputed")]
    assert by_tag["lm loss validation"] == [(4, 3.5)]
    assert by_tag["straggler/gpu-relative-perf/rank-1"] == [(4, 0.5)]
    assert by_tag["straggler/gpu-relative-perf/min"] == [(4, 0.5)] and by_tag["straggler/stragglers"] == [(4, 1.0)]


def test_flops_per_token_is_megatron_lms_count_for_our_shapes():
    """l (12 h f + 12 h (h + h g/n) + 6 h s) + 6 h v. The two figures were also computed with the
    num_floating_point_operations that megatron-core 0.19.2 ships (megatron/training/training.py, BSHD, no
    SwiGLU/MoE), which gave the same numbers: it is not imported here (it needs Megatron-LM's args and torch)."""
    tiny = ModelConfig()  # gpt_tiny: 2 layers, hidden 64, 4 heads, FFN 256, seq 64, vocab 1024
    assert flops_per_token(tiny) == 2 * (12 * 64 * 256 + 12 * 64 * (64 + 64) + 6 * 64 * 64) + 6 * 64 * 1024 == 1032192
    gqa = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=11008, seq_length=4096, vocab_size=32000)
    assert flops_per_token(gqa) == 29374808064  # key/value width 4096 / 32 x 8 = 1024


def test_series_writes_megatron_lms_throughput_in_tflops_per_gpu_at_the_attempts_world_size():
    s, pts = Series(flops_per_token=1032192.0), []
    feed = [{"kind": "start", "step": 0, "restart": "first", "totals": ZERO, "world_size": 2},
            {"kind": "train", "step": 1, "loss": 1.0, "step_time_s": 0.5, "tokens_per_s": 1e6},
            {"kind": "start", "step": 1, "resumed": True, "restart": "requeue", "last_logged_step": 1, "totals": ZERO,
             "world_size": 1},  # an elastic attempt on fewer ranks: per GPU is per its own ranks
            {"kind": "train", "step": 2, "loss": 1.0, "step_time_s": 0.5, "tokens_per_s": 1e6},
            {"kind": "train", "step": 3, "loss": 1.0, "step_time_s": 0.0, "tokens_per_s": float("inf")}]
    for record in feed:
        pts += s.points(record)
    assert [(p.step, p.value) for p in pts if p.tag == "throughput"] == [(1, 0.516096), (2, 1.032192)]
    assert [p.tag for p in pts if p.step == 1][:3] == ["lm loss", "iteration-time", "throughput/tokens-per-sec"]
    # no model shape (a sink built without it) or no world size (a start record from before it was recorded)
    for series, start in ((Series(), feed[0]), (Series(flops_per_token=1.0), {**feed[0], "world_size": None})):
        assert "throughput" not in {p.tag for r in (start, feed[1]) for p in series.points(r)}


def test_the_trainers_sink_knows_the_models_flops(tmp_path):
    config = PretrainConfig(run_dir=str(tmp_path), model=ModelConfig(num_layers=3))
    sink = dashboards.open_sink(config)
    try:
        assert sink.series.flops_per_token == flops_per_token(config.model) == 1032192 + 319488
    finally:
        sink.close()


def test_tensorboard_writer_is_read_back_by_tensorboards_loader(tmp_path):
    writer = EventWriter(str(tmp_path))
    writer.write([Point("lm loss", 2.5, 1), Point("resilience/events", "requeue: resumed from step 0", 1),
                  Point("lm loss", 2.25, 2)])
    writer.close()
    assert read_tensorboard(str(tmp_path)) == {"lm loss": [(1, 2.5), (2, 2.25)],
                                               "resilience/events": [(1, "requeue: resumed from step 0")]}


def test_wandb_offline_run_takes_its_id_from_next_to_the_checkpoints_and_never_logs_a_step_backwards(tmp_path,
                                                                                                     monkeypatch):
    """One real offline W&B run (the launched test proves the id is kept across three (re)starts)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from dashboards_support import read_wandb_offline

    (tmp_path / "wandb_run_id").write_text("kept1234\n")  # as an earlier attempt left it
    run = WandbRun(project="p", entity=None, name="n", save_dir=str(tmp_path / "wb"), id_folder=str(tmp_path),
                   config={"a": 1})
    run.write([Point("lm loss", 1.5, 3), Point("checkpoint/save-seconds", 0.5, 1)])
    run.write([Point("lm loss", 2.5, 4)])
    run.close()
    [offline] = read_wandb_offline(str(tmp_path / "wb"), rows=2)
    assert (offline["id"], offline["project"], offline["name"]) == ("kept1234", "p", "n")
    rows = [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"} for row in offline["rows"]]
    # the save reported for step 1 lands in the current row: W&B would drop a step below its current one
    assert rows == [{"lm loss": 1.5, "checkpoint/save-seconds": 0.5, "_step": 3}, {"lm loss": 2.5, "_step": 4}]


def _without(monkeypatch, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    real_import = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_asking_for_a_dashboard_whose_package_is_missing_says_what_to_install(tmp_path, monkeypatch):
    """The trainer's command line, before torch loads (uninstalled packages simulated: both are installed here)."""
    from megatron_resilience import __main__ as trainer_cli
    from megatron_resilience import trainer

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "build_hooks", lambda *a, **k: (_ for _ in ()).throw(AssertionError("past checks")))
    _without(monkeypatch, "wandb")
    with pytest.raises(SystemExit) as exit_:
        trainer_cli.main([f"run_dir={tmp_path}", "logger.wandb_project=p"])
    assert str(exit_.value.code) == (
        "megatron_resilience: logger.wandb_project: W&B logging needs the wandb package, which is not installed: "
        "pip install 'megatron-resilience[wandb]' (or pip install wandb); or set logger.wandb_project=null, got 'p'")
    _without(monkeypatch, "tensorboard")
    with pytest.raises(SystemExit) as exit_:
        trainer_cli.main([f"run_dir={tmp_path}", "logger.tensorboard_dir=/tmp/tb"])
    assert str(exit_.value.code) == (
        "megatron_resilience: logger.tensorboard_dir: TensorBoard event files need the tensorboard package, which is "
        "not installed: pip install 'megatron-resilience[tensorboard]' (or pip install tensorboard); or set "
        "logger.tensorboard_dir=null, got '/tmp/tb'")
    # the default folder without the package: a note, not an error (event files are an optional extra)
    assert dashboards.check_installed(PretrainConfig(run_dir=str(tmp_path))) == [
        "no TensorBoard event files: the tensorboard package is not installed (pip install "
        "'megatron-resilience[tensorboard]' (or pip install tensorboard)); logger.tensorboard_dir=null silences "
        "this note"]
    with pytest.raises(ImportError, match=r"pip install 'megatron-resilience\[wandb\]'"):
        WandbRun(project="p", entity=None, name="n", save_dir=str(tmp_path), id_folder=str(tmp_path), config={})


def test_logger_keys_are_checked():
    with pytest.raises(ConfigError, match=r"^logger.wandb_project: must be set when logger.wandb_entity is set, "
                                          r"got None$"):
        LoggerConfig(wandb_entity="team")
    with pytest.raises(ConfigError, match=r"^logger.tensorboard_dir: must be a non-empty string or null, got ''$"):
        LoggerConfig(tensorboard_dir="")
    assert LoggerConfig().tensorboard_path("/r") == "/r/tensorboard"
    assert LoggerConfig(tensorboard_dir="/abs/tb").tensorboard_path("/r") == "/abs/tb"
    assert LoggerConfig(tensorboard_dir=None).tensorboard_path("/r") is None


def test_a_restart_waits_while_the_previous_processs_wandb_service_still_holds_the_run(monkeypatch, caplog):
    """After an in-job restart the killed worker's wandb-core service can hold the run for seconds (seen under CI
    load: "run ID ... is in use"); init is retried while it says so, any other error is raised at once. The W&B
    module is a stand-in here: the race needs a dying service, which the launched dashboards test provides."""
    from megatron_resilience.dashboards import wandb_run

    calls = []

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            calls.append(kwargs["id"])
            if len(calls) < 3:
                raise RuntimeError("run ID abc123 is in use")
            return "run"

    monkeypatch.setattr(wandb_run.time, "sleep", lambda s: None)
    retries: list = []
    with caplog.at_level("WARNING", "megatron_resilience.dashboards.wandb_run"):
        assert wandb_run._init_when_free(FakeWandb, retries, id="abc123") == "run"
    assert calls == ["abc123"] * 3
    # each try made again is on record (the trainer writes them to metrics.jsonl as ``retry`` records)
    assert [(r["what"], r["why"]) for r in retries] == [("wandb.init", "run ID abc123 is in use")] * 2
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "wandb: run abc123 is still held by the previous process's W&B service"] * 2

    class Broken:
        @staticmethod
        def init(**kwargs):
            raise RuntimeError("permission denied")

    with pytest.raises(RuntimeError, match="permission denied"):
        wandb_run._init_when_free(Broken, [], id="abc123")

