"""Run Megatron-Core's hard-coded CUDA paths on CPU: the ONE compatibility module.

Megatron-Core is written for GPUs: about 25 call sites create tensors with
``device="cuda"`` or ``device=torch.cuda.current_device()``, call ``.cuda()``,
synchronize streams, seed and swap the CUDA RNG state, and check
``param.type() == "torch.cuda.FloatTensor"`` (FACTS.md). Patching
``torch.cuda.is_available()`` does not help, so instead, when (and only when)
the run's device is CPU, :func:`install` makes those calls mean "the CPU":

- a ``torch.overrides.TorchFunctionMode`` rewrites every ``device`` that names
  CUDA (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, or a bare device
  index) to ``cpu``, drops ``pin_memory`` (needs a CUDA driver), makes
  ``Tensor.cuda()`` return the tensor itself, maps ``Tensor.to("cuda")`` to a
  no-op device move, and makes ``Tensor.type()`` report CPU float tensors as
  ``torch.cuda.*Tensor`` (the optimizer and ``clip_grads`` assert that name);
- ``torch.cuda`` functions used by Megatron-Core get CPU meanings:
  ``current_device`` -> 0, ``synchronize``/``empty_cache`` -> no-ops, streams
  and events -> inert objects, and the "CUDA RNG" *is* the CPU default
  generator (``get_rng_state``/``set_rng_state``/``manual_seed``), so the tensor
  parallel RNG tracker and the rerun state machine save and restore real state;
- ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` /
  ``_set_cuda_rng_state`` are replaced: upstream reaches into
  ``torch.cuda.default_generators`` and defers through ``torch.cuda._lazy_call``,
  which never runs on a CPU-only build (the state would silently not change).

The GPU path never calls :func:`install`. Installing is idempotent and
process-wide (the function mode is pushed once for the main thread; the
autograd engine runs CPU backward passes on the calling thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_installed = False
_mode: TorchFunctionMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _cuda_type_name(tensor: torch.Tensor) -> str:
    name = torch.Tensor.type(tensor)
    return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch function call (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot path (~1300 calls per tiny-GPT step): no allocation unless something must change.
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            return _cuda_type_name(args[0])
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if kwargs:
            device = kwargs.get("device")
            if (device is not None and _is_cuda(device)) or kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                if device is not None and _is_cuda(device):
                    kwargs["device"] = _CPU
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
            return func(*args, **kwargs)
        return func(*args)


_TENSOR_CUDA, _TENSOR_TYPE, _TENSOR_TO = torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to


class _InertStream:
    """Stands in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:  # Event.wait (Megatron-FSDP's grad-reduce pipeline)
        pass

    def record_event(self, *args: Any) -> "_InertStream":
        return _InertStream()

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all itself (infinite recursion).
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.Stream = _InertStream
    cuda.Event = _InertStream
    cuda.current_stream = lambda device=None: _InertStream()
    cuda.default_stream = lambda device=None: _InertStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _cpu_get_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_rng_state


def install() -> None:
    """Make Megatron-Core's CUDA-only code run on CPU in this process. Idempotent; CPU runs only."""
    global _installed, _mode
    if _installed:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("cpu_compat.install() must run on the main thread (the function mode is per thread)")
    _patch_torch_cuda()
    _patch_megatron()
    _mode = CudaToCpuMode()
    _mode.__enter__()
    _installed = True
    log.info("cpu_compat: Megatron-Core CUDA calls mapped to CPU (device=cpu)")


def is_installed() -> bool:
    return _installed


def device_mode() -> contextlib.AbstractContextManager:
    """The function mode for another thread (e.g. an async checkpoint worker); a no-op when not installed."""
    return CudaToCpuMode() if _installed else contextlib.nullcontext()


# --- RNG state for checkpoints -------------------------------------------------------------------------------


def get_rng_tracker_states() -> dict[str, torch.Tensor]:
    """The tensor-parallel RNG tracker's states (name -> ByteTensor), on CPU and GPU alike.

    On CPU each state is a CPU generator state (see module docstring); on GPU a
    CUDA generator state. Checkpointing saves this dict with the other RNG states.
    """
    from megatron.core import tensor_parallel

    return {name: state.clone() for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


def set_rng_tracker_states(states: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`get_rng_tracker_states` returned (after the model is built)."""
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states({name: state.clone() for name, state in states.items()})


def get_device_rng_state() -> torch.Tensor:
    """The accelerator RNG state: CUDA's on GPU, the CPU generator's on CPU (same call on both)."""
    return torch.cuda.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    torch.cuda.set_rng_state(state)
