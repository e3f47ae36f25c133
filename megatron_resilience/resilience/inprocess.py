"""In-process restart: the trainer's training function under nvidia-resiliency-ext's ``inprocess.Wrapper``.

The recovery ladder (each rung hands over to the next; none loops forever):

1. **In-process restart** - an exception on any rank (a NaN the rerun state machine's check rejects, with
   ``rerun.rerun_mode=disabled``, is one), a rank that stops making progress (no step, save or eval finished
   within ``inprocess.soft_timeout``): every rank aborts its
   process groups, runs :class:`FinalizeTraining` and calls the training function again in the same process,
   which restores the newest checkpoint (memory, local, persistent) and continues: no new interpreter, no
   imports. Up to ``inprocess.max_iterations`` calls per process.
2. **Process restart by ft_launcher** - a dead process (killed, lost with its node, or terminated by the
   wrapper after ``inprocess.hard_timeout``), an exhausted in-process budget, and the rerun state machine's
   exit 16 (the suspicious step must be re-run on other hardware): the training function is not
   called again; the survivors exit with code 1 (log line "falling through to a process restart") and
   ft_launcher restarts the worker group (``--max-restarts``), which resumes from the local or persistent tier.
3. **Job level** - ft_launcher's budget exhausted: the launcher exits non-zero and the batch script's decision
   (requeue or stop) applies, as for any failed attempt. Every (re)start, in-process ones included, writes a
   ``start`` record (``attempt.inprocess_restart``), which the job-level ledger counts as a cycle.

What the wrapper needs here on CPU/gloo (the peers assume CUDA): a finalize that needs no CUDA; process
groups whose timeout frees a survivor blocked in gloo before its own hard timeout
(``InProcessConfig.group_timeout_seconds``); 0.7's NVML health checks only where NVML exists
(``upstream/nvrx_inprocess.py``); stores on the job's own ports (``config/ports.py``), hosted by rank 0's
main process and never, as upstream's store does when its port is taken, silently joined as a client.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import time
from typing import Callable

import torch

from megatron_resilience.config import PretrainConfig
from megatron_resilience.config.ports import JOB_PORT_ENV, PROCESS_GROUP, JobPorts, job_ports
from megatron_resilience.runtime.job_store import INPROCESS_RESTART_ENV, bind_or_explain, job_key
from megatron_resilience.upstream import nvrx_inprocess
from megatron_resilience.upstream.pytorch import abort_gloo_connections

log = logging.getLogger("megatron_resilience.inprocess")
_inprocess = nvrx_inprocess.import_inprocess()  # this module is imported only when in-process restart is on

FALL_THROUGH_EXIT_CODE = 1


class _Fault:
    """Rank-local view of the faults that ended in-process iterations (for the ``inprocess_restart`` record)."""

    raised: float | None = None  # when this rank's training function raised in the current iteration
    detected: float | None = None  # when this rank's wrapper began its abort (the fault known here)
    own: BaseException | None = None  # the exception this rank raised in the current iteration, if it did
    previous: tuple[float | None, float | None, BaseException | None] = (None, None, None)  # the previous iteration's
    store_kwargs: dict | None = None  # how to reach the wrapper's store (set by run_restartable)
    store = None


def note_own_exception(err: BaseException) -> None:
    """Called by the trainer when its training function raises on this rank. An exception after this rank's
    wrapper began to abort is the wrapper's own interrupt (its monitor thread aborts, then raises into the
    main thread), not a fault."""
    if _Fault.detected is not None:
        return
    _Fault.own = err
    _Fault.raised = _earliest(_Fault.raised, time.time())


def _noted_detection() -> None:
    _Fault.detected = _earliest(_Fault.detected, time.time())


def _earliest(current: float | None, now: float) -> float:
    return now if current is None else min(current, now)


def _begin_iteration(iteration: int) -> None:
    os.environ[INPROCESS_RESTART_ENV] = str(iteration)
    _Fault.previous = (_Fault.raised, _Fault.detected, _Fault.own) if iteration > 0 else (None, None, None)
    _Fault.raised, _Fault.detected, _Fault.own = None, None, None


def current_iteration() -> int:
    return int(os.environ.get(INPROCESS_RESTART_ENV, "0") or 0)


def _earliest_on_any_rank(*times: float | None) -> list[float | None]:
    """Collective (the restarted iteration's process groups): the minimum of each time over the ranks."""
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    values = torch.tensor([float("inf") if t is None else t for t in times], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN)
    return [None if v == float("inf") else v for v in values.tolist()]


def _cause_store():
    """A client connection of our own to the wrapper's store: the wrapper's connection is busy in its monitor
    thread's waits (up to a monitor interval per call), ours answers at once."""
    if _Fault.store is None:
        _Fault.store = _store_class()(**{**_Fault.store_kwargs, "host_pid": -1})
    return _Fault.store


def restart_record() -> dict:
    """The ``inprocess_restart`` record's fields: why the previous iteration ended and when. Collective.

    ``fault_time``: the first rank's exception (None when no rank raised: a stall, whose fault is the last sign
    of progress); ``detected_time``: the first rank's wrapper began to abort (after the wrapper's
    ``last_call_wait``, so that one restart handles every rank's fault). Detected -> the restarted function
    began is the in-process restart's own downtime (abort, finalize, the wrapper's barriers)."""
    iteration = current_iteration()
    raised, detected, own = _Fault.previous
    fault_time, detected_time = _earliest_on_any_rank(raised, detected)
    cause = nvrx_inprocess.interruptions_of(_cause_store(), iteration - 1) if _Fault.store_kwargs else None
    if cause is None and own is not None:
        cause = f"{type(own).__name__} on this rank"
    return {"iteration": iteration, "fault_time": fault_time, "detected_time": detected_time,
            "cause": cause or "unknown"}


def _store_class():
    import torch.distributed
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    class JobStore(torch.distributed.PrefixStore, StoreMixin):
        """The wrapper's store: a TCP store on the job's in-process port, under the job's key prefix. Hosted by
        rank 0's main process (``host_pid``; -1 on the other ranks), a client everywhere else, including rank 0's
        monitor process (forked before the store exists)."""

        def __init__(self, *, host_name: str, port: int, world_size: int, timeout: datetime.timedelta,
                     host_pid: int) -> None:
            is_host = os.getpid() == host_pid

            def tcp():
                return torch.distributed.TCPStore(host_name, port, world_size, is_host, timeout=timeout,
                                                  wait_for_workers=False)

            self.tcp = bind_or_explain(tcp, port, "in-process restart store") if is_host else tcp()
            super().__init__(f"{job_key()}/inprocess", self.tcp)

        @property
        def critical_ranks(self):
            return (0,)

    return JobStore


class FinalizeTraining(_inprocess.finalize.Finalize):
    """After an abort, before the next call: Megatron-Core's global state, our process groups, cached memory.
    A plain ``Finalize`` (upstream's ``ThreadedFinalize`` insists on CUDA)."""

    def __init__(self, empty_cuda_cache: bool) -> None:
        self.empty_cuda_cache = empty_cuda_cache

    def __call__(self, state):
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        from megatron_resilience.runtime.distributed import destroy_distributed

        destroy_rerun_state_machine()
        destroy_distributed()
        gc.collect()
        if self.empty_cuda_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return state


def node_name(env=None) -> str:
    """What a node is for ``inprocess.granularity=node``: Slurm's node name where Slurm started the rank (several
    Slurm nodes may share a host: the multi-node test cluster, or slurmd's multiple-slurmd mode; a rank keyed by the
    host's name would then see its peers on "its" node as surplus and be reserved), else the host's name."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def _on_cpu(config: PretrainConfig) -> bool:
    return config.train.device == "cpu" or (config.train.device == "auto" and not torch.cuda.is_available())


def _ports(world_size: int) -> JobPorts:
    ports = job_ports(os.environ)
    if ports is not None:
        return ports
    if world_size == 1:  # a single process started by hand: a block nobody else needs to find
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1] - PROCESS_GROUP
        os.environ[JOB_PORT_ENV] = str(base)  # the process-group store takes the same block
        return JobPorts(base, "a free port (single process)")
    raise RuntimeError("inprocess.enabled: the ranks need a common store port: start them under ft_launcher or "
                       "torchrun, under Slurm, or set MEGATRON_RESILIENCE_JOB_PORT")


def run_restartable(config: PretrainConfig, train_once: Callable[[object], int | None], *, rank: int,
                    world_size: int) -> int | None:
    """Call ``train_once(call_wrapper)`` under the wrapper; returns its exit code (None: 0), or the fall-through
    exit code when in-process restart cannot continue."""
    inprocess = nvrx_inprocess.import_inprocess()
    ip = config.inprocess
    ports = _ports(world_size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    seconds = datetime.timedelta

    class Iteration(inprocess.initialize.Initialize):
        def __call__(self, state):
            _begin_iteration(state.iteration)
            return state

    class RecordDetection(inprocess.abort.Abort):  # runs in the monitor thread the moment a fault is known
        def __call__(self, state):
            _noted_detection()
            return state

    class AbortGloo(inprocess.abort.Abort):  # frees ranks blocked in gloo collectives (upstream/pytorch.py)
        def __call__(self, state):
            closed = abort_gloo_connections({ports.process_group, ports.inprocess})
            log.info("rank %d: in-process restart: shut down %d gloo connection(s)", rank, closed)
            return state

    layers = [inprocess.rank_assignment.Layer(min_ranks=world_size, max_ranks=world_size,
                                              flag=inprocess.rank_assignment.LayerFlag.RESERVE)]
    if ip.granularity == "node":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
        node = node_name()
        layers.append(inprocess.rank_assignment.Layer(min_ranks=per_node, max_ranks=per_node,
                                                      key_or_fn=lambda _: node,
                                                      flag=inprocess.rank_assignment.LayerFlag.RESERVE))
    nested = inprocess.nested_restarter
    hardware = nvrx_inprocess.nvml_available()
    _Fault.store_kwargs = {"host_name": os.environ["MASTER_ADDR"], "port": ports.inprocess, "world_size": world_size,
                           "timeout": seconds(seconds=ip.barrier_timeout)}
    wrapper = nvrx_inprocess.make_wrapper(
        hardware_health_checks=hardware,
        store_factory=_store_class(),
        store_kwargs={**_Fault.store_kwargs, "host_pid": os.getpid() if rank == 0 else -1},
        initialize=inprocess.Compose(
            inprocess.initialize.RetryController(max_iterations=ip.max_iterations, min_world_size=world_size),
            Iteration(), nested.NestedRestarterHandlingCompleted()),
        abort=inprocess.Compose(  # composed right to left: record, free gloo, abort NCCL and destroy the groups
            nested.NestedRestarterHandlingStarting(), inprocess.abort.AbortTorchDistributed(),
            *([AbortGloo()] if _on_cpu(config) else []), RecordDetection()),
        finalize=FinalizeTraining(ip.empty_cuda_cache),
        health_check=(inprocess.health_check.CudaHealthCheck(timeout=seconds(seconds=10))
                      if torch.cuda.is_available() else None),
        rank_assignment=inprocess.rank_assignment.Tree(layers=layers),
        completion=nested.NestedRestarterFinalized(),
        terminate=nested.NestedRestarterAborted(),
        monitor_thread_interval=seconds(seconds=ip.monitor_thread_interval),
        monitor_process_interval=seconds(seconds=ip.monitor_process_interval),
        progress_watchdog_interval=seconds(seconds=ip.progress_watchdog_interval),
        heartbeat_interval=seconds(seconds=ip.heartbeat_interval),
        soft_timeout=seconds(seconds=ip.soft_timeout),
        hard_timeout=seconds(seconds=ip.hard_timeout),
        heartbeat_timeout=seconds(seconds=ip.heartbeat_timeout),
        barrier_timeout=seconds(seconds=ip.barrier_timeout),
        completion_timeout=seconds(seconds=ip.completion_timeout),
        last_call_wait=seconds(seconds=ip.last_call_wait),
        termination_grace_time=seconds(seconds=ip.termination_grace_time),
    )
    if rank == 0:
        log.info("in-process restart: up to %d calls per process (soft timeout %gs, hard %gs); stores on %s; "
                 "hardware health checks %s", ip.max_iterations, ip.soft_timeout, ip.hard_timeout, ports.describe(),
                 "on (NVML)" if hardware else "off (no NVML)")

    def train(call_wrapper=None):
        return train_once(call_wrapper)

    train.__annotations__ = {"call_wrapper": inprocess.CallWrapper}  # the wrapper passes itself to this parameter
    try:
        return wrapper(train)()
    except (inprocess.exception.RestartAbort, inprocess.exception.RestartError) as err:
        log.error("rank %d: %s: falling through to a process restart (exit code %d)", rank,
                  nvrx_inprocess.why_restarts_ended(err), FALL_THROUGH_EXIT_CODE)
        return FALL_THROUGH_EXIT_CODE
