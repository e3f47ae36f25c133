"""Run Megatron-LM's own training loop (``megatron.training`` of the megatron-core 0.19 wheel) on this CPU-only machine.

Why it lives in ``tests/`` and not in the package: it exists only so that the test lane can run the *real*
Megatron-LM trainer here, where there is no GPU. No user needs it: on a cluster Megatron-LM runs on its GPUs
untouched, and a package that patched a foreign trainer's ``torch.cuda`` at run time would be a hazard. The
package's own CPU mapping (``megatron_resilience/runtime/cpu_compat.py``: tensors asked for on CUDA made on the CPU,
streams and events inert, the tensor-parallel RNG tracker swapping real generator states) is reused by import; what
Megatron-LM's training loop needs beyond it is here:

* ``typing.override``: megatron.training uses it (Python 3.12); this machine's Python is 3.11, so it is filled with
  an identity decorator *before* megatron.training is imported;
* ``torch.cuda.device_count() -> 1``: with 0 devices ``_initialize_distributed`` never builds the model-parallel
  groups (``if device_count > 0``), and every later ``mpu`` call fails;
* ``initialize_megatron(allow_no_cuda=True)``: ``pretrain`` calls it without, and it asserts
  ``torch.cuda.is_available()``;
* the dataset helpers' ``make`` step (``megatron.core.datasets.utils.compile_helpers``) is a no-op: the wheel ships
  ``helpers_cpp`` compiled, without the Makefile, so ``make`` fails and rank 0 exits;
* the "CUDA" RNG is a generator of its own (``torch.cuda.get_rng_state``/``set_rng_state``/``manual_seed``), not
  cpu_compat's alias of the CPU default generator: Megatron-LM's checkpoints carry both ``torch_rng_state`` and
  ``cuda_rng_state`` and restore the CUDA one *after* the CPU one, so with an alias the CPU state a resumed run
  continues from is the CUDA one, and anything drawing from the CPU generator after a resume (dropout outside the
  tracker, the data path) differs from an uninterrupted run. The tensor-parallel tracker still swaps the CPU default
  generator (cpu_compat), which is what CPU dropout draws from inside its ``fork()``, and restores it afterwards.

Call :func:`install` first thing in the entry script, before anything imports ``megatron.training``
(``pretrain_gpt.py`` here does). Command lines must carry the CPU flags in :data:`CPU_FLAGS` and the environment
:data:`CPU_ENV` (``TORCH_COMPILE_DISABLE=1``: torch.compile'd fused kernels need a compiler toolchain per shape and
take minutes on two cores).
"""

from __future__ import annotations

import os
import sys
import typing

# What Megatron-LM's command line needs to run on CPU with gloo (FACTS.md "Megatron-LM's real training loop on CPU").
CPU_FLAGS = ("--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
             "--no-gradient-accumulation-fusion", "--no-persist-layer-norm")
CPU_ENV = {"TORCH_COMPILE_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}

_installed = False


def _fill_typing_override() -> None:
    if not hasattr(typing, "override"):  # Python < 3.12
        def override(method):  # the decorator only marks the method (PEP 698); nothing checks it at run time
            return method

        typing.override = override


def _separate_cuda_generator() -> None:
    import torch

    generator = torch.Generator()  # a CPU generator standing for the device's: same state format, its own stream
    cuda = torch.cuda
    cuda.get_rng_state = lambda device="cuda": generator.get_state()
    cuda.set_rng_state = lambda new_state, device="cuda": generator.set_state(new_state)
    cuda.get_rng_state_all = lambda: [generator.get_state()]
    cuda.set_rng_state_all = lambda states: generator.set_state(states[0])
    cuda.manual_seed = lambda seed: generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: generator.manual_seed(int(seed))


def _allow_no_cuda() -> None:
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron  # pretrain calls the name it imported


def install() -> None:
    """Apply every patch above in this process (idempotent). Must run before ``megatron.training`` is imported."""
    global _installed
    if _installed:
        return
    if "megatron.training" in sys.modules:
        raise RuntimeError("cpu_layer.install() must run before megatron.training is imported (typing.override)")
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    _fill_typing_override()
    import torch

    from megatron_resilience.runtime import cpu_compat

    cpu_compat.install()
    torch.cuda.device_count = lambda: 1
    _separate_cuda_generator()
    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None  # helpers_cpp ships compiled in the wheel
    _allow_no_cuda()
    _installed = True


__all__ = ["CPU_ENV", "CPU_FLAGS", "install"]
