"""``pretrain_gpt.py`` (beside this file) with ``--inprocess-restart`` runnable on CPU, and an exception at one step.

``RAISE_AT_STEP=8 RAISE_RANK=1``: rank 1 raises ``RuntimeError('injected at step 8')`` from its forward step, once
per process (a restart iteration in the same process passes that step untouched), inside Megatron-LM's training
loop, which nvidia-resiliency-ext's in-process wrapper around ``pretrain`` catches. Megatron-LM's own fault
injector cannot do this: it is armed again in every ``pretrain`` call, so every restart iteration would raise again.

The stand-ins for what a GPU node has and this machine has not (nothing of Megatron-LM's own changes):

* nvidia-resiliency-ext's ``ThreadedFinalize`` (Megatron-LM's finalize, ``destroy_state``) raises "CUDA is not
  available" before it calls anything: here it calls its function in the calling thread, the same call without
  the CUDA device set in a thread (FACTS.md "in-process restart ... on CPU");
* nvidia-resiliency-ext 0.7.0's wrapper adds NVML-based GPU, NVLink and NIC health checks whenever ``LOCAL_RANK``
  is set (ft_launcher sets it), which fail without NVML: only the health check Megatron-LM gives runs;
* ``GLOO_TIMEOUT_S``: the process groups' timeout (Megatron-LM's ``--distributed-timeout-minutes`` takes whole
  minutes). On GPUs the wrapper's abort ends a survivor's NCCL collective at once; gloo cannot abort an operation
  in flight, so without a short timeout the survivor waits in its gradient all-reduce until the wrapper's hard
  timeout kills it (seen: 90 s, and with it the rank that hosts the wrapper's store, so the job);
* ``--inprocess-granularity rank`` on the command line: with the default ``node`` Megatron-LM reserves
  ``torch.cuda.device_count()`` ranks per host, which the CPU layer sets to 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrain_gpt  # noqa: E402  (installs the CPU layer before megatron.training is imported)
from megatron.training import get_args  # noqa: E402
from nvidia_resiliency_ext import inprocess  # noqa: E402


def _finalize_in_this_thread(self, state):
    self.fn(*self.args, **self.kwargs)
    return state


_construct_health_check = inprocess.Wrapper._construct_restart_health_check


def _given_health_check_only(self):
    _construct_health_check(self)
    self.restart_health_check = self.health_check


inprocess.finalize.ThreadedFinalize.__call__ = _finalize_in_this_thread
inprocess.Wrapper._construct_restart_health_check = _given_health_check_only

_parse = pretrain_gpt.parse_and_validate_args


def parse_and_validate_args(*args, **kwargs):
    parsed = _parse(*args, **kwargs)
    parsed.distributed_timeout_minutes = float(os.environ.get("GLOO_TIMEOUT_S", "10")) / 60
    return parsed


_forward_step = pretrain_gpt.forward_step
_raised = []


def forward_step(data_iterator, model, return_schedule_plan=False):
    step = get_args().curr_iteration + 1  # Megatron-LM sets curr_iteration to the steps done before this one
    if not _raised and os.environ.get("RANK") == os.environ.get("RAISE_RANK", "1") \
            and step == int(os.environ["RAISE_AT_STEP"]):
        _raised.append(step)
        raise RuntimeError(f"injected at step {step}")
    return _forward_step(data_iterator, model, return_schedule_plan)


pretrain_gpt.parse_and_validate_args = parse_and_validate_args  # main() looks both up when it runs
pretrain_gpt.forward_step = forward_step

if __name__ == "__main__":
    pretrain_gpt.main()
