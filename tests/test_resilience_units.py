"""Resilience pieces in one process: exit-code table, signal handler, FT outside ft_launcher, fault arming,
straggler report text. The multi-process proofs under the real ft_launcher are in test_resilience_faults.py."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from megatron_resilience.config import FaultToleranceConfig, PretrainConfig, StragglerConfig, TrainingConfig
from megatron_resilience.resilience import build_hooks, exit_codes
from megatron_resilience.resilience.fault_tolerance import FaultTolerance, floor_learned_timeouts
from megatron_resilience.resilience.preemption import DataloaderWorkerInit, DistributedSignalHandler
from megatron_resilience.resilience.simulated_fault import SimulatedFault
from megatron_resilience.resilience.straggler import StragglerDetection, format_report
from megatron_resilience.runtime.state import TrainState


def test_exit_code_table():
    assert [exit_codes.exit_code_for(r) for r in ("finished", "signal", "straggler", "duration", "rerun:16",
                                                  "rerun:17")] == [0, 0, 0, 0, 16, 17]
    assert [exit_codes.marks_finished(r) for r in ("finished", "signal", "straggler", "duration", "rerun:16",
                                                   "rerun:17")] == [True, False, False, False, False, True]
    assert exit_codes.stops_in_job_restarts("rerun:17") and exit_codes.stops_in_job_restarts("rerun:16")
    assert not any(exit_codes.stops_in_job_restarts(r) for r in ("finished", "signal", "straggler", "duration"))
    with pytest.raises(ValueError, match="unknown stop reason 'crashed'"):
        exit_codes.exit_code_for("crashed")
    from megatron.core import rerun_state_machine as rsm

    assert (exit_codes.RESUME_TO_DISAMBIGUATE, exit_codes.FAILED_ON_RESULT_VALIDATION) == (
        rsm.EXIT_CODE_RESUME_TO_DISAMBIGUATE, rsm.EXIT_CODE_FAILED_ON_RESULT_VALIDATION)


def test_signal_handler_records_and_restores_previous_handler():
    previous = []
    old = signal.signal(signal.SIGUSR1, lambda *a: previous.append(1))
    try:
        handler = DistributedSignalHandler("SIGUSR1", rank=0)
        handler.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received and previous == []  # recorded, process alive, old handler not called
        handler.restore()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert previous == [1]  # the previous handler is back
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_dataloader_workers_ignore_the_exit_signal():
    old = signal.getsignal(signal.SIGUSR2)
    try:
        seen = []
        DataloaderWorkerInit("SIGUSR2", chained=seen.append)(3)
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN and seen == [3]
    finally:
        signal.signal(signal.SIGUSR2, old)


class _SignalsItself:
    """A dataset whose worker receives the exit signal (as Slurm's signal to the whole process tree would)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGUSR2)
        return i


@pytest.mark.parametrize("for_dataloader", [True, False])
def test_dataloader_workers_survive_the_exit_signal_only_when_asked(tmp_path, for_dataloader):
    import torch

    config = PretrainConfig(run_dir=str(tmp_path), train=TrainingConfig(
        exit_signal_handler=True, exit_signal="SIGUSR2", exit_signal_handler_for_dataloader=for_dataloader))
    hooks = build_hooks(config, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(_SignalsItself(), batch_size=2, num_workers=1,
                                         worker_init_fn=hooks.dataloader_worker_init,
                                         multiprocessing_context="fork")
    if for_dataloader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    else:
        with pytest.raises(RuntimeError, match="DataLoader worker .* (killed|exited unexpectedly)"):
            list(loader)


def test_hooks_signal_stop_reason_single_process(tmp_path):
    config = PretrainConfig(run_dir=str(tmp_path), train=TrainingConfig(exit_signal_handler=True,
                                                                      exit_signal="SIGUSR1"))
    hooks = build_hooks(config, rank=0, world_size=1)
    state = TrainState(model=[], optimizer=None, scheduler=None, step=0)
    old = signal.getsignal(signal.SIGUSR1)
    with hooks.setup_section():
        pass
    hooks.after_setup(state)
    state.step = 1
    assert hooks.after_step(state) is None
    os.kill(os.getpid(), signal.SIGUSR1)
    state.step = 2
    assert hooks.after_step(state) == "signal"
    hooks.on_exit(state, "signal", checkpoint_step=2, checkpoint_at_stop="saved")
    assert signal.getsignal(signal.SIGUSR1) == old  # restored
    stop = json.loads((tmp_path / "stop_reason.json").read_text())
    assert stop == {"reason": "signal", "step": 2, "exit_code": 0, "finished": False, "checkpoint_step": 2,
                    "lost_steps": 0, "checkpoint_at_stop": "saved", "signal": stop["signal"]}
    assert {k: v for k, v in stop["signal"].items() if k != "received_time"} == {
        "signal": "SIGUSR1", "received_during": "setup", "count": 1}


def test_finished_flag_only_for_finished_and_17(tmp_path, monkeypatch):
    flag = tmp_path / "job" / "finished.flag"
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(flag))
    state = TrainState(model=[], optimizer=None, scheduler=None, step=5)
    for reason, touched in (("signal", False), ("rerun:16", False), ("finished", True), ("rerun:17", True)):
        if flag.exists():
            flag.unlink()
        build_hooks(PretrainConfig(run_dir=str(tmp_path)), rank=0, world_size=1).on_exit(state, reason)
        assert flag.exists() == touched, reason
    flag.unlink()
    build_hooks(PretrainConfig(run_dir=str(tmp_path)), rank=1, world_size=2).on_exit(state, "finished")
    assert not flag.exists()  # only rank 0 marks it


def test_ft_outside_ft_launcher_logs_once_and_is_a_no_op(monkeypatch, caplog):
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    ft = FaultTolerance(FaultToleranceConfig(enabled=True, calc_ft_timeouts=True), rank=0, save_dir=None,
                        load_dir=None, async_save=False)
    with caplog.at_level(logging.INFO, logger="megatron_resilience"):
        ft.start()
        ft.end_setup(loaded_checkpoint=False)
        with ft.step():
            pass
        with ft.checkpointing():
            pass
        ft.shutdown(update_timeouts=True)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("megatron_resilience")]
    assert lines == ["ft.enabled=true but this process was not started by ft_launcher "
                     "(FT_RANK_MONITOR_IPC_SOCKET is not set): hang detection is off for this run"]
    assert not ft.active


def test_ft_floor_raises_only_learned_timeouts():
    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts

    st = SectionTimeouts(section={"setup": 0.5, "step": 0.85, "checkpointing": 150.0}, out_of_section=2.0,
                         calculated_sections={"step", "checkpointing"}, is_out_of_section_calculated=True)
    floored, raised = floor_learned_timeouts(st, 60.0)
    assert floored == SectionTimeouts(section={"setup": 0.5, "step": 60.0, "checkpointing": 150.0},
                                      out_of_section=60.0, calculated_sections={"step", "checkpointing"},
                                      is_out_of_section_calculated=True)  # setup 0.5 is configured: kept
    assert raised == [("step", 0.85), ("out_of_section", 2.0)]
    assert st.section["step"] == 0.85  # the input is not modified
    hb, raised = floor_learned_timeouts(HeartbeatTimeouts(initial=90.0, subsequent=1.5, were_calculated=True), 60.0)
    assert hb == HeartbeatTimeouts(initial=90.0, subsequent=60.0, were_calculated=True)
    assert raised == [("heartbeat subsequent", 1.5)]
    configured = HeartbeatTimeouts(initial=1.0, subsequent=1.0, were_calculated=False)
    assert floor_learned_timeouts(configured, 60.0) == (configured, [])


def test_ft_min_learned_timeout_must_be_positive():
    with pytest.raises(ValueError, match="ft.min_learned_timeout"):
        FaultToleranceConfig(min_learned_timeout=0)


def test_ft_learned_timeouts_floored_before_the_monitor_and_ft_state_json_get_them(tmp_path, caplog):
    # Real RankMonitorClient, real TimeoutsCalc (5 x max observed, all-reduced over a real 1-rank gloo group);
    # only its IPC send to a rank monitor server is recorded here (tests/test_resilience_faults.py runs the real one).
    import torch.distributed as dist
    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionAction, SectionTimeouts
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient
    from nvidia_resiliency_ext.fault_tolerance.timeouts_calc import TimeoutsCalc

    client = RankMonitorClient()
    client.is_initialized, client.rank_monitor_socket = True, object()
    client.timeouts_calc = TimeoutsCalc(sections=["setup", "step", "checkpointing"], start_time=0.0, safety_factor=5.0)
    client.hb_timeouts = HeartbeatTimeouts(initial=None, subsequent=None, were_calculated=False)
    client.section_timeouts = SectionTimeouts(section={"setup": 180.0, "step": 60.0, "checkpointing": 120.0},
                                              out_of_section=300.0)
    sent = []

    def record(new_hb_timeouts, new_section_timeouts):
        sent.append(new_section_timeouts)
        client.section_timeouts = new_section_timeouts

    client._set_calculated_timeouts = record
    calc = client.timeouts_calc
    for name, start, end in (("step", 1.0, 1.17), ("checkpointing", 2.0, 32.0)):
        calc.update_on_section_event(name, SectionAction.OPEN, event_time=start)
        calc.update_on_section_event(name, SectionAction.CLOSE, event_time=end)
    ft = FaultTolerance(FaultToleranceConfig(enabled=True, calc_ft_timeouts=True, min_learned_timeout=60.0), rank=0,
                        save_dir=str(tmp_path), load_dir=None, async_save=False)
    ft.client, ft.sections = client, {"setup", "step", "checkpointing"}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.INFO, logger="megatron_resilience"):
            ft._calculate_and_set(heartbeats=False, selected_sections=["step", "checkpointing"],
                                  calc_out_of_section=False)
    finally:
        dist.destroy_process_group()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("megatron_resilience")]
    assert lines[0] == "FT: learned step timeout 0.85 s raised to the floor ft.min_learned_timeout=60 s"
    assert len(sent) == 1 and sent[0].section == {"setup": 180.0, "step": 60.0, "checkpointing": 150.0}
    assert sorted(sent[0].calculated_sections) == ["checkpointing", "step"]
    state = json.loads((tmp_path / "ft_state.json").read_text())["current_timeouts"]["section"]
    assert state["section"] == {"setup": 180.0, "step": 60.0, "checkpointing": 150.0}
    assert "section timeouts: checkpointing=150.00s setup=180.00s step=60.00s out_of_section=300.00s " \
           "(learned: checkpointing, step)" in lines[1]


def test_ft_floor_degrades_on_a_client_without_the_private_setter():
    # A stand-in for an nvidia-resiliency-ext whose client has only the public calculate-and-send call (the
    # installed one has the internals): the floor then reaches the client's copy, hence ft_state.json.
    from nvidia_resiliency_ext.fault_tolerance.data import SectionTimeouts

    from megatron_resilience import upstream

    class PublicOnlyClient:
        section_timeouts = SectionTimeouts(section={"step": 60.0}, out_of_section=90.0)

        def calculate_and_set_section_timeouts(self, *, selected_sections, calc_out_of_section, skip_if_not_ready):
            self.section_timeouts = SectionTimeouts(section={"step": 0.85}, out_of_section=90.0,
                                                    calculated_sections={"step"})
            return True

    client = PublicOnlyClient()
    result = upstream.ft_calculate_and_set_timeouts(
        client, heartbeats=False, selected_sections=["step"], adjust=lambda t: floor_learned_timeouts(t, 60.0)[0])
    assert result == (True, False)  # updated, but the monitor got the unraised value
    assert client.section_timeouts.section == {"step": 60.0}


def test_ft_state_json_loaded_values_below_the_floor_are_raised(tmp_path, caplog):
    # An ft_state.json written before the floor existed (values seen on a real cluster).
    (tmp_path / "ft_state.json").write_text(json.dumps({"current_timeouts": {"section": {
        "section": {"setup": 180.0, "step": 0.85, "checkpointing": 0.97}, "out_of_section": 300.0,
        "calculated_sections": ["checkpointing", "step"], "is_out_of_section_calculated": False}}}))
    ft = FaultTolerance(FaultToleranceConfig(enabled=True, calc_ft_timeouts=True, min_learned_timeout=30), rank=0,
                        save_dir=None, load_dir=str(tmp_path), async_save=False)
    with caplog.at_level(logging.INFO, logger="megatron_resilience"):
        state = ft._read_state()
    assert state["current_timeouts"]["section"]["section"] == {"setup": 180.0, "step": 30.0, "checkpointing": 30.0}
    assert state["current_timeouts"]["section"]["out_of_section"] == 300.0  # configured: kept
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("megatron_resilience")]
    assert lines[1:] == ["FT: loaded checkpointing timeout 0.97 s raised to the floor ft.min_learned_timeout=30 s",
                         "FT: loaded step timeout 0.85 s raised to the floor ft.min_learned_timeout=30 s"]


@pytest.mark.parametrize("env,start_step,armed", [
    ({}, 0, True),
    ({}, 6, True),  # resumed before the fault step: still the first attempt
    ({}, 7, False),  # resumed at/after the fault step
    ({"TORCHELASTIC_RESTART_COUNT": "1"}, 0, False),  # an in-job restart
    ({"SLURM_RESTART_COUNT": "1"}, 0, False),  # a requeued job
])
def test_simulated_fault_fires_only_on_the_first_attempt(monkeypatch, env, start_step, armed):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = FaultToleranceConfig(simulate_fault=True, simulated_fault_type="rank_killed", simulated_fault_rank=0,
                               simulated_fault_step=7)
    fault = SimulatedFault(cfg, rank=0, world_size=2)
    fault.arm(start_step)
    assert fault.armed is armed
    other = SimulatedFault(cfg, rank=1, world_size=2)
    other.arm(0)
    assert not other.armed  # only the chosen rank


def test_straggler_without_cupti_warns_and_is_off(caplog):
    # Real nvidia-resiliency-ext on a machine without CUDA: its CUPTI extension cannot load.
    det = StragglerDetection(StragglerConfig(enabled=True), rank=0, world_size=1)
    with caplog.at_level(logging.WARNING, logger="megatron_resilience"):
        det.start()
    assert not det.active
    assert any("straggler detection is OFF" in r.getMessage() and "CUPTI" in r.getMessage()
               for r in caplog.records)
    step = det.wrap(lambda: 42)
    assert step() == 42 and det.after_step(1) is False


def test_straggler_report_text_names_worst_and_best_ranks():
    from megatron_resilience import upstream

    report = upstream.import_straggler().Report(
        gpu_relative_perf_scores={0: 1.0, 1: 0.42, 2: 0.97}, section_relative_perf_scores={},
        gpu_individual_perf_scores={0: 0.99, 1: 0.98, 2: 1.0}, section_individual_perf_scores={},
        rank_to_node={0: "node-a", 1: "node-b", 2: "node-a"}, local_section_summaries={}, local_kernel_summaries={},
        generate_report_elapsed_time=0.0, gather_on_rank0=True, rank=0)
    assert format_report(report, step=30, top=1) == [
        "straggler report at step 30:",
        "  GPU relative perf: worst: rank 1 (node-b)=0.42; best: rank 0 (node-a)=1.00",
        "  GPU individual perf: worst: rank 1 (node-b)=0.98; best: rank 2 (node-a)=1.00",
    ]


@pytest.mark.parametrize("mode, burns_cpu", [("compute", True), ("wait", False)])
def test_simulated_straggler_spends_its_delay_computing_or_waiting(mode, burns_cpu):
    import time

    cfg = StragglerConfig(simulated_straggler_rank=1, simulated_straggler_delay=0.3, simulated_straggler_mode=mode)
    step = StragglerDetection(cfg, rank=1, world_size=2).wrap(lambda: 7)
    wall, cpu = time.monotonic(), time.thread_time()
    assert step() == 7
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert wall >= 0.3
    assert (cpu >= 0.3) is burns_cpu, (mode, cpu)  # "wait": a long step that costs no CPU
    healthy = StragglerDetection(cfg, rank=0, world_size=2).wrap(lambda: 8)
    wall = time.monotonic()
    assert healthy() == 8 and time.monotonic() - wall < 0.3  # only the chosen rank


def test_simulated_straggler_mode_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"straggler\.simulated_straggler_mode.*'compute', 'wait'"):
        StragglerConfig(simulated_straggler_mode="sleep")
