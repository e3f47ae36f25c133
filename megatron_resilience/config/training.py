"""The training loop: steps, batch sizes, seeds, logging, evaluation and graceful exit."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_resilience.config.validate import (
    check_int,
    check_positive,
    check_signal,
    check_types,
    fail,
)

# Instance metadata services that announce a spot/preemptible node's loss (resilience/cloud_notice.py).
PREEMPTION_NOTICE_PROVIDERS = ("aws", "azure", "gcp")


@dataclass(kw_only=True)
class TrainingConfig:
    max_steps: int = 50
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None -> micro_batch_size * data-parallel size
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int | None = None  # None -> no evaluation
    eval_iters: int = 0
    # Graceful exit: a distributed signal handler saves a checkpoint and exits 0 on `exit_signal`.
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"
    exit_signal_handler_for_dataloader: bool = False
    exit_duration_in_mins: float | None = None  # save and exit once this much wall time has passed
    # A cloud preemption notice on the instance metadata service acts as exit_signal (local rank 0 of each node
    # polls it): "aws", "gcp", "azure" or None. The URL replaces the provider's metadata host (None: its own).
    preemption_notice: str | None = None
    preemption_notice_interval: float = 5.0
    preemption_notice_url: str | None = None
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    # Memory of one rank's device in GiB: the submit-time size check (config/memory.py); None -> no check.
    gpu_memory_gib: float | None = 80.0

    def __post_init__(self) -> None:
        check_types(self, "train")
        check_int("train.max_steps", self.max_steps, minimum=1)
        check_int("train.micro_batch_size", self.micro_batch_size, minimum=1)
        check_int("train.global_batch_size", self.global_batch_size, minimum=1, allow_none=True)
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            fail("train.global_batch_size", f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
                 self.global_batch_size)
        check_int("train.seed", self.seed, minimum=0)
        check_positive("train.gpu_memory_gib", self.gpu_memory_gib, allow_none=True)
        check_int("train.log_interval", self.log_interval, minimum=1)
        check_int("train.eval_interval", self.eval_interval, minimum=1, allow_none=True)
        check_int("train.eval_iters", self.eval_iters, minimum=0)
        if self.eval_interval is not None and self.eval_iters == 0:
            fail("train.eval_iters", "must be >= 1 when train.eval_interval is set", self.eval_iters)
        check_signal("train.exit_signal", self.exit_signal)
        check_positive("train.exit_duration_in_mins", self.exit_duration_in_mins, allow_none=True)
        if self.preemption_notice is not None:
            if self.preemption_notice not in PREEMPTION_NOTICE_PROVIDERS:
                fail("train.preemption_notice", f"must be one of {list(PREEMPTION_NOTICE_PROVIDERS)} or None",
                     self.preemption_notice)
            if not self.exit_signal_handler:
                fail("train.exit_signal_handler", "must be true when train.preemption_notice is set (a notice acts "
                     "as train.exit_signal)", self.exit_signal_handler)
        check_positive("train.preemption_notice_interval", self.preemption_notice_interval)
        url = self.preemption_notice_url
        if url is not None and not re.fullmatch(r"https?://[A-Za-z0-9._\-\[\]:]+/?", url):
            fail("train.preemption_notice_url", "must be http(s)://HOST[:PORT] (the metadata service's address) "
                 "or None", url)
        if self.device not in ("auto", "cpu", "cuda"):
            fail("train.device", "must be one of ['auto', 'cpu', 'cuda']", self.device)

    def resolved_global_batch_size(self, data_parallel_size: int) -> int:
        gbs = self.global_batch_size or self.micro_batch_size * data_parallel_size
        if gbs % (self.micro_batch_size * data_parallel_size):
            fail("train.global_batch_size",
                 f"must be a multiple of train.micro_batch_size * data-parallel size = {self.micro_batch_size} * "
                 f"{data_parallel_size} = {self.micro_batch_size * data_parallel_size}", gbs)
        return gbs
