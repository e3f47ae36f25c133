"""The smallest faithful stand-ins for Megatron-Bridge's and NeMo 2.0's task objects, where theirs cannot import here.

Why stand-ins (measured on this machine, Python 3.11, no GPU):

* ``megatron.bridge.training.config`` (``ConfigContainer``, ``FaultToleranceConfig``, ...) of megatron-bridge
  0.6.2 imports every model bridge of the package, and through them Transformer Engine (CUDA only),
  ``transformers``, ``datasets``/``pandas``/``pyarrow`` and ``megatron.energon``, and Megatron-Core 0.19's
  ``megatron.training`` which needs Python 3.12 (``typing.override``);
* NeMo 2.0's ``llm.pretrain``, ``nemo.lightning.Trainer``, its ``PreemptionCallback`` and
  nvidia-resiliency-ext's ``ptl_resiliency.FaultToleranceCallback`` all import Lightning.

So: the classes below carry exactly the field names, defaults and call signatures that the plugins touch,
and ``tests/test_peers_bridge.py`` / ``tests/test_peers_nemo.py`` check them against the real sources (the
megatron-bridge and nemo_toolkit wheels, read with ``ast``; nvidia-resiliency-ext's installed source). Their
module names are the real ones, so NeMo-Run serializes a task that uses them exactly as it would the real
task; :func:`installed` registers them in ``sys.modules`` only for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import types
from typing import Any, Iterator, Literal, Optional

BRIDGE_CONFIG = "megatron.bridge.training.config"


# --- Megatron-Bridge (megatron/bridge/training/config.py; TrainingConfig's and CheckpointConfig's fields come
#     from Megatron-Core's megatron/training/config/training_config.py, their base classes) ------------------------


@dataclasses.dataclass
class FaultToleranceConfig:
    enable_ft_package: bool = False
    calc_ft_timeouts: bool = False
    simulate_fault: bool = False
    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    simulated_fault_rank: Optional[int] = None
    simulated_fault_base_delay: int = 0


@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    train_iters: Optional[int] = None
    exit_signal_handler: bool = False
    exit_signal: signal.Signals = signal.SIGTERM
    exit_signal_handler_for_dataloader: bool = False


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory"]] = None
    non_persistent_local_ckpt_dir: Optional[str] = None
    replication: bool = False
    replication_jump: Optional[int] = None
    replication_factor: int = 2


@dataclasses.dataclass
class InProcessRestartConfig:  # the fields the plugin sets and the tests read (the wheel's are checked)
    enabled: bool = False
    max_iterations: Optional[int] = None
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    granularity: Literal["node", "rank"] = "node"


@dataclasses.dataclass(kw_only=True)
class ConfigContainer:
    train: TrainingConfig
    checkpoint: CheckpointConfig
    ft: Optional[FaultToleranceConfig] = None
    inprocess_restart: Optional[InProcessRestartConfig] = None


def bridge_pretrain(config: ConfigContainer, forward_step_func: Any) -> None:
    """megatron.bridge.training.pretrain.pretrain(config, forward_step_func)."""


def bridge_forward_step(state: Any, data_iterator: Any, model: Any) -> Any:
    """megatron.bridge.training.gpt_step.forward_step."""


# --- NeMo 2.0 (nemo/collections/llm/api.py, nemo/lightning, nemo/lightning/pytorch/callbacks/preemption.py) and
#     nvidia-resiliency-ext (ptl_resiliency/fault_tolerance_callback.py) -----------------------------------------


def nemo_pretrain(model: Any, data: Any, trainer: Any, log: Any = None, resume: Any = None, optim: Any = None) -> Any:
    """nemo.collections.llm.api.pretrain."""


class Trainer:
    """nemo.lightning.Trainer (Lightning's Trainer): the arguments the plugins read or change."""

    def __init__(self, *, max_steps: int = -1, devices: Any = "auto", num_nodes: int = 1,
                 callbacks: Optional[list] = None, strategy: Any = None):
        self.max_steps, self.devices, self.num_nodes, self.callbacks = max_steps, devices, num_nodes, callbacks


class NeMoLogger:
    def __init__(self, *, log_dir: Optional[str] = None, name: str = "default"):
        self.log_dir, self.name = log_dir, name


class PreemptionCallback:
    def __init__(self, sig: Optional[int] = None):
        self.sig = sig if sig is not None else signal.SIGTERM


class TimingCallback:
    """nemo.utils.exp_manager.TimingCallback: a callback users already have in their trainer."""

    def __init__(self, reduction: str = "mean"):
        self.reduction = reduction


class FaultToleranceCallback:
    def __init__(self, autoresume: bool, calculate_timeouts: bool, simulated_fault_params: Any = None,
                 exp_dir: Any = None, logger_name: Optional[str] = "nemo_logger.FaultToleranceCallback"):
        self.autoresume, self.calculate_timeouts, self.exp_dir = autoresume, calculate_timeouts, exp_dir


# Where each stand-in lives in the real project (so serialization and the plugins see the real names).
_HOMES = {
    BRIDGE_CONFIG: (FaultToleranceConfig, TrainingConfig, CheckpointConfig, ConfigContainer, InProcessRestartConfig),
    "megatron.bridge.training.pretrain": (bridge_pretrain,),
    "megatron.bridge.training.gpt_step": (bridge_forward_step,),
    "nemo.collections.llm": (nemo_pretrain,), "nemo.lightning": (Trainer, NeMoLogger),
    "nemo.utils.exp_manager": (TimingCallback,), "nemo.lightning.pytorch.callbacks": (PreemptionCallback,),
    "nvidia_resiliency_ext.ptl_resiliency": (FaultToleranceCallback,),
}
for _home, _members in _HOMES.items():
    for _member in _members:
        _member.__module__ = _home
for _fn, _name in ((bridge_pretrain, "pretrain"), (bridge_forward_step, "forward_step"), (nemo_pretrain, "pretrain")):
    _fn.__qualname__ = _fn.__name__ = _name


def _module(name: str, **members: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules resolve
    for key, value in members.items():
        setattr(module, key, value)
    return module


def _modules(with_nemo_callbacks: bool) -> dict[str, types.ModuleType]:
    modules = {
        "megatron.bridge": _module("megatron.bridge"),
        "megatron.bridge.training": _module("megatron.bridge.training"),
        BRIDGE_CONFIG: _module(BRIDGE_CONFIG, FaultToleranceConfig=FaultToleranceConfig,
                               TrainingConfig=TrainingConfig, CheckpointConfig=CheckpointConfig,
                               ConfigContainer=ConfigContainer, InProcessRestartConfig=InProcessRestartConfig),
        "megatron.bridge.training.pretrain": _module("megatron.bridge.training.pretrain", pretrain=bridge_pretrain),
        "megatron.bridge.training.gpt_step": _module("megatron.bridge.training.gpt_step",
                                                     forward_step=bridge_forward_step),
        "nemo": _module("nemo"),
        "nemo.collections": _module("nemo.collections"),
        "nemo.collections.llm": _module("nemo.collections.llm", pretrain=nemo_pretrain),
        "nemo.lightning": _module("nemo.lightning", Trainer=Trainer, NeMoLogger=NeMoLogger),
        "nemo.utils": _module("nemo.utils"),
        "nemo.utils.exp_manager": _module("nemo.utils.exp_manager", TimingCallback=TimingCallback),
    }
    if with_nemo_callbacks:
        modules["nemo.lightning.pytorch"] = _module("nemo.lightning.pytorch")
        modules["nemo.lightning.pytorch.callbacks"] = _module("nemo.lightning.pytorch.callbacks",
                                                              PreemptionCallback=PreemptionCallback)
        modules["nvidia_resiliency_ext.ptl_resiliency"] = _module("nvidia_resiliency_ext.ptl_resiliency",
                                                                  FaultToleranceCallback=FaultToleranceCallback)
    return modules


@contextlib.contextmanager
def installed(*, with_nemo_callbacks: bool = True) -> Iterator[None]:
    """The stand-in modules in ``sys.modules`` for the block (previous entries restored after).

    ``with_nemo_callbacks=False``: the callback classes do not import (a login node without Lightning)."""
    modules = _modules(with_nemo_callbacks)
    hidden = ["nemo.lightning.pytorch", "nemo.lightning.pytorch.callbacks", "nvidia_resiliency_ext.ptl_resiliency"]
    saved = {name: sys.modules.get(name) for name in list(modules) + hidden}
    for name in hidden:
        if not with_nemo_callbacks:
            sys.modules[name] = None  # import fails with ImportError, as where Lightning is missing
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def bridge_container(**train: Any) -> ConfigContainer:
    """A Bridge recipe's ConfigContainer as recipes return it: ft None, train and checkpoint set."""
    return ConfigContainer(train=TrainingConfig(**{"train_iters": 1000, "global_batch_size": 32,
                                                   "micro_batch_size": 1, **train}),
                           checkpoint=CheckpointConfig(save="/lustre/runs/llama/ckpt", save_interval=100,
                                                       load="/lustre/runs/llama/ckpt"))


def bridge_partial(*, as_config: bool) -> Any:
    """A Bridge user's ``run.Partial(pretrain, config=..., forward_step_func=...)``, its config either what a recipe
    returns (:func:`bridge_container`) or, ``as_config``, a ``run.Config`` of a ``ConfigContainer``; call it inside
    :func:`installed`.

    Why here: tests/test_peers_bridge.py (FT and preemption) and tests/test_peers_inprocess.py (in-process restart)
    configure these same two task forms with our plugins."""
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    config = run.Config(ConfigContainer, train=run.Config(TrainingConfig, train_iters=7),
                        checkpoint=run.Config(CheckpointConfig, save="/ck")) if as_config else bridge_container()
    return run.Partial(bridge_pretrain, config=config, forward_step_func=bridge_forward_step)
