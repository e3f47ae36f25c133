"""Straggler detection with nvidia-resiliency-ext's ``Detector`` around the train step.

Each step runs inside ``Detector.detection_section("train_step")``; CUDA kernels
launched in it are timed by the Detector's CUPTI extension. Every
``report_time_interval`` seconds (the Detector turns it into a step count, agreed
by all ranks) all ranks build a report; rank 0 logs the worst and best ranks with
node names and scores, and names the ranks whose GPU scores fall below
``gpu_relative_perf_threshold`` (vs the fastest rank) or
``gpu_individual_perf_threshold`` (vs the rank's own best). With
``stop_if_detected`` the trainer then checkpoints and exits 0 so the job can come
back on healthy nodes (the stop is agreed through ``ResilienceHooks.after_step``).

Section scores (step wall time) are logged too but never stop training: in data
parallel training every rank waits for the slowest in the gradient all-reduce, so
wall times are equal and only per-rank kernel time tells who is slow.

Without CUDA/CUPTI: the Detector cannot load its CUPTI extension, so detection
is switched off with one warning (nothing to measure on a CPU-only machine).

``simulated_straggler_rank`` / ``simulated_straggler_delay`` make one rank spend extra
time in every step, to check the reporting and stopping path: computing (``simulated_straggler_mode=compute``,
a slow device: its share of the step holds however busy the host is) or sleeping (``wait``: a long step that
costs no CPU, for timing windows on a shared machine).
"""

from __future__ import annotations

import math
import socket
import time
from typing import Any, Callable

from megatron_resilience import upstream
from megatron_resilience.config.resilience import StragglerConfig
from megatron_resilience.resilience.log import get_logger, named_logger

SECTION = "train_step"


class StragglerDetection:
    def __init__(self, cfg: StragglerConfig, *, rank: int, world_size: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.log = get_logger("straggler", rank)
        self.report_log = named_logger(cfg.logger_name, rank)
        self.detector = None
        self.profile_cuda = False
        self._records: list[tuple[str, dict]] = []  # straggler reports for metrics.jsonl (rank 0)

    @property
    def active(self) -> bool:
        return self.detector is not None

    def start(self) -> None:
        """After torch.distributed is initialised (the Detector gathers rank->node names)."""
        if not self.cfg.enabled:
            return
        scores = []
        if self.cfg.calc_relative_gpu_perf:
            scores.append("relative_perf_scores")
        if self.cfg.calc_individual_gpu_perf:
            scores.append("individual_perf_scores")
        if not scores:
            self.log.warning("straggler.enabled=true but calc_relative_gpu_perf and calc_individual_gpu_perf are "
                             "both false: nothing to compute, straggler detection is off")
            return
        import torch

        straggler = upstream.import_straggler()
        if getattr(straggler.Detector, "initialized", False):  # an in-process restart: the last call never shut it
            straggler.Detector.shutdown()
        try:
            straggler.Detector.initialize(
                scores_to_compute=scores, gather_on_rank0=True, profiling_interval=self.cfg.profiling_interval,
                report_time_interval=self.cfg.report_time_interval, node_name=socket.gethostname())
        except Exception as err:  # noqa: BLE001 - ImportError (no libcupti), OSError, RuntimeError
            self.log.warning(
                "straggler detection is OFF: nvidia-resiliency-ext's Detector needs its CUPTI extension "
                f"(CUDA + libcupti) to time GPU kernels, and it could not be loaded here: {err}")
            return
        self.detector = straggler.Detector
        self.profile_cuda = True
        if not torch.cuda.is_available() and self.rank == 0:
            self.log.warning("straggler: CUDA is not available; GPU performance scores come from whatever the "
                             "loaded CUPTI extension reports")
        if self.rank == 0:
            self.log.info(f"straggler detection on: scores={scores}, report every ~{self.cfg.report_time_interval}s, "
                          f"thresholds relative={self.cfg.gpu_relative_perf_threshold} "
                          f"individual={self.cfg.gpu_individual_perf_threshold}, "
                          f"stop_if_detected={self.cfg.stop_if_detected}")

    def wrap(self, train_step: Callable[[], Any]) -> Callable[[], Any]:
        slow = self.cfg.simulated_straggler_rank == self.rank and self.cfg.simulated_straggler_delay > 0
        if not self.active and not slow:
            return train_step
        detector, delay, profile_cuda = self.detector, self.cfg.simulated_straggler_delay, self.profile_cuda
        spend = time.sleep if self.cfg.simulated_straggler_mode == "wait" else _busy

        def step() -> Any:
            if detector is None:
                spend(delay)
                return train_step()
            with detector.detection_section(SECTION, profile_cuda=profile_cuda):
                if slow:
                    spend(delay)
                return train_step()

        return step

    def after_step(self, step: int) -> bool:
        """Every rank, every step (collective when a report is due). True on rank 0 when it wants to stop."""
        if not self.active:
            return False
        report = self.detector.generate_report_if_interval_elapsed()
        if report is None:  # not due, or not rank 0
            return False
        cfg = self.cfg
        stragglers = report.identify_stragglers(
            gpu_rel_threshold=cfg.gpu_relative_perf_threshold, gpu_indiv_threshold=cfg.gpu_individual_perf_threshold,
            section_rel_threshold=cfg.gpu_relative_perf_threshold,
            section_indiv_threshold=cfg.gpu_individual_perf_threshold)
        slow = sorted({s for key in ("straggler_gpus_relative", "straggler_gpus_individual")
                       for s in stragglers[key]}, key=lambda s: s.rank)
        self._records.append(("straggler", report_record(report, step=step, stragglers=[s.rank for s in slow])))
        if cfg.enable_logging:
            for line in format_report(report, step=step, top=cfg.num_gpu_perf_scores_to_print):
                self.report_log.info(line)
        if slow:
            names = ", ".join(f"rank {s.rank} ({s.node})" for s in slow)
            self.report_log.warning(f"STRAGGLER DETECTED at step {step}: {names} below the GPU performance "
                                    f"thresholds (relative {cfg.gpu_relative_perf_threshold}, "
                                    f"individual {cfg.gpu_individual_perf_threshold})")
        elif cfg.enable_logging:
            self.report_log.info(f"no stragglers detected at step {step}")
        return bool(slow) and cfg.stop_if_detected

    def take_records(self) -> list[tuple[str, dict]]:
        records, self._records = self._records, []
        return records

    def shutdown(self) -> None:
        if self.active:
            self.detector.shutdown()
            self.detector = None


def report_record(report: Any, *, step: int, stragglers: list[int]) -> dict:
    """A report as a ``straggler`` record of metrics.jsonl: every rank's scores (NaN left out)."""
    scores = {"gpu-relative-perf": report.gpu_relative_perf_scores,
              "gpu-individual-perf": report.gpu_individual_perf_scores}
    scores.update({f"section-{name}-relative-perf": v for name, v in report.section_relative_perf_scores.items()})
    return {"step": step, "stragglers": stragglers,
            "scores": {name: {str(rank): float(score) for rank, score in by_rank.items() if not math.isnan(score)}
                       for name, by_rank in scores.items() if by_rank}}


def format_report(report: Any, *, step: int, top: int) -> list[str]:
    """Readable lines: for each score kind, the ``top`` worst and best ranks with node and score."""
    lines = [f"straggler report at step {step}:"]
    kinds = [("GPU relative perf", report.gpu_relative_perf_scores),
             ("GPU individual perf", report.gpu_individual_perf_scores)]
    kinds += [(f"section '{name}' relative perf", scores)
              for name, scores in sorted(report.section_relative_perf_scores.items())]
    kinds += [(f"section '{name}' individual perf", scores)
              for name, scores in sorted(report.section_individual_perf_scores.items())]
    for title, scores in kinds:
        valid = sorted(((score, rank) for rank, score in scores.items() if not math.isnan(score)))
        if not valid or top == 0:
            continue
        node = report.rank_to_node

        def fmt(items: list[tuple[float, int]]) -> str:
            return ", ".join(f"rank {rank} ({node.get(rank, '?')})={score:.2f}" for score, rank in items)

        lines.append(f"  {title}: worst: {fmt(valid[:top])}; best: {fmt(valid[::-1][:top])}")
    return lines


def _busy(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (not wall time): a slow device needs more compute for the same
    work, however busy the machine is."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1
