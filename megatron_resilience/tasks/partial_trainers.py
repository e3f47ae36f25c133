"""``run.Partial`` tasks of Megatron-Bridge and NeMo 2.0: their settings, changed where those projects keep them.

* Megatron-Bridge: ``run.Partial(pretrain, config=ConfigContainer(...), forward_step_func=...)``
  (``megatron.bridge.training.pretrain.pretrain``, or any function taking Bridge's ``ConfigContainer`` as
  ``config``). As Bridge's plugin did for Partials: ``config.ft`` becomes a ``FaultToleranceConfig`` when
  None, with ``enable_ft_package`` and ``calc_ft_timeouts``; ``config.train.exit_signal_handler``,
  ``exit_signal_handler_for_dataloader`` and ``exit_signal``. nemo_run turns the dataclass instances
  into ``run.Config`` objects; both forms are handled.
* NeMo 2.0: ``run.Partial(llm.pretrain, model=..., data=..., trainer=run.Config(Trainer, callbacks=[...]),
  log=...)`` (a function of ``nemo.*`` or any Partial with a Lightning/NeMo ``trainer``): callbacks are
  merged into ``trainer.callbacks`` as NeMo's plugins merge them (an equal ``run.Config`` already there is not
  added again; one of the same class with other arguments is). The classes are imported when the plugin runs
  (the login node that built a NeMo task has NeMo); where one does not import there, the callback is a
  ``run.Config`` of ``megatron_resilience.config.lazy_import.build`` that imports it on the compute node (logged).

Every change is logged on ``megatron_resilience.plugins`` with the old and new value.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
from typing import Any

from megatron_resilience.upstream import import_nemo_run

log = logging.getLogger("megatron_resilience.plugins")

NEMO_PREEMPTION_CALLBACK = "nemo.lightning.pytorch.callbacks.PreemptionCallback"
NEMO_FT_CALLBACK = "nvidia_resiliency_ext.ptl_resiliency.FaultToleranceCallback"
_TRAINER_MODULES = ("nemo.", "lightning.", "pytorch_lightning.")


def _class_of(value: Any) -> type | None:
    fn = getattr(value, "__fn_or_cls__", None)
    if fn is not None:
        return fn if isinstance(fn, type) else None
    return type(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else None


def _name(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', getattr(cls, '__name__', ''))}"


def _arguments(task: Any) -> dict[str, Any]:
    arguments = getattr(task, "__arguments__", None)
    if isinstance(arguments, dict):
        return arguments
    return {k: getattr(task, k) for k in ("config", "trainer", "log") if hasattr(task, k)}  # a stand-in object


def _partial(task: Any) -> bool:
    run = import_nemo_run()
    return isinstance(task, run.Partial)


# --- Megatron-Bridge ---------------------------------------------------------------------------------------------


def bridge_config(task: Any) -> Any | None:
    """The task's Bridge ``ConfigContainer`` (a ``run.Config`` or an instance), or None for other tasks."""
    if not _partial(task):
        return None
    config = _arguments(task).get("config")
    cls = _class_of(config) if config is not None else None
    if cls is not None and cls.__name__ == "ConfigContainer" and cls.__module__.startswith("megatron.bridge"):
        return config
    return None


def _bridge_class(container: Any, name: str) -> type:
    module = importlib.import_module(_class_of(container).__module__)
    return getattr(module, name)


def _set(owner: Any, path: str, name: str, value: Any, plugin: str, why: str) -> None:
    old = getattr(owner, name, None)
    if old == value:
        return
    setattr(owner, name, value)
    log.info("%s: task %s.%s: %r -> %r (%s)", plugin, path, name, old, value, why)


def bridge_section(container: Any, section: str, class_name: str, plugin: str) -> Any:
    """``container.<section>``; created (a ``run.Config`` in a ``run.Config``, else an instance) when None."""
    current = getattr(container, section, None)
    if current is not None:
        return current
    cls = _bridge_class(container, class_name)
    run = import_nemo_run()
    created = run.Config(cls) if hasattr(container, "__fn_or_cls__") else cls()
    setattr(container, section, created)
    log.info("%s: task config.%s: None -> %s() (Megatron-Bridge's defaults; the fields below are set on it)",
             plugin, section, class_name)
    return created


def configure_bridge_ft(container: Any, *, enable_ft_package: bool, calc_ft_timeouts: bool, plugin: str) -> None:
    ft = bridge_section(container, "ft", "FaultToleranceConfig", plugin)
    _set(ft, "config.ft", "enable_ft_package", enable_ft_package, plugin, "enable_ft_package")
    _set(ft, "config.ft", "calc_ft_timeouts", calc_ft_timeouts, plugin, "calc_ft_timeouts")


def configure_bridge_inprocess(container: Any, *, enabled: bool, local_dir: str | None, local_interval: int,
                               replication_factor: int, replication_jump: int | None, plugin: str) -> None:
    """``config.inprocess_restart`` (created when None: every recipe) enabled; with ``local_dir``:
    ``config.checkpoint``'s ``non_persistent_ckpt_type='local'``, ``non_persistent_local_ckpt_dir``,
    ``non_persistent_save_interval`` and, for a factor above 1, ``replication``/``replication_jump``/
    ``replication_factor`` (the fields of Megatron-Core's CheckpointConfig that Bridge's extends)."""
    if enabled:
        inprocess = bridge_section(container, "inprocess_restart", "InProcessRestartConfig", plugin)
        _set(inprocess, "config.inprocess_restart", "enabled", True, plugin, "inprocess_restart")
    if not local_dir:
        return
    checkpoint = getattr(container, "checkpoint", None)
    if checkpoint is None:
        from megatron_resilience.config import ConfigError

        raise ConfigError(f"{plugin}: the Megatron-Bridge ConfigContainer has no checkpoint section (config.checkpoint "
                          "is None); local_checkpoint_dir needs one")
    for name, value, why in (("non_persistent_ckpt_type", "local", "local_checkpoint_dir"),
                             ("non_persistent_local_ckpt_dir", local_dir, "local_checkpoint_dir"),
                             ("non_persistent_save_interval", local_interval, "local_checkpoint_interval")):
        _set(checkpoint, "config.checkpoint", name, value, plugin, why)
    if replication_factor > 1:
        for name, value, why in (("replication", True, "replication_factor"),
                                 ("replication_jump", replication_jump, "replication_jump"),
                                 ("replication_factor", replication_factor, "replication_factor")):
            _set(checkpoint, "config.checkpoint", name, value, plugin, why)


def configure_bridge_exit_handler(container: Any, *, for_data_loader: bool, signal_name: str, plugin: str) -> None:
    import signal

    train = getattr(container, "train", None)
    if train is None:
        from megatron_resilience.config import ConfigError

        raise ConfigError(f"{plugin}: the Megatron-Bridge ConfigContainer has no train section (config.train is "
                          "None); Bridge requires one")
    _set(train, "config.train", "exit_signal_handler", True, plugin, "enable_exit_handler")
    _set(train, "config.train", "exit_signal_handler_for_dataloader", for_data_loader, plugin,
         "enable_exit_handler_for_data_loader")
    if signal_name != "SIGTERM" or getattr(train, "exit_signal", signal.SIGTERM) != signal.SIGTERM:
        _set(train, "config.train", "exit_signal", signal.Signals[signal_name], plugin, "signal")


def bridge_run_facts(container: Any) -> tuple[str | None, str | None, int | None]:
    """(checkpoint.save, checkpoint.load, train.train_iters) of a Bridge ConfigContainer (None: not set)."""
    checkpoint, train = getattr(container, "checkpoint", None), getattr(container, "train", None)
    iters = getattr(train, "train_iters", None)
    return (getattr(checkpoint, "save", None), getattr(checkpoint, "load", None),
            iters if isinstance(iters, int) and not isinstance(iters, bool) else None)


# --- NeMo 2.0 ----------------------------------------------------------------------------------------------------


def nemo_trainer(task: Any) -> Any | None:
    """The ``trainer`` argument of a NeMo 2.0 (Lightning) Partial, or None for other tasks."""
    if not _partial(task):
        return None
    trainer = _arguments(task).get("trainer")
    cls = getattr(trainer, "__fn_or_cls__", None) if trainer is not None else None
    fn = getattr(task, "__fn_or_cls__", None)
    if cls is not None and _name(cls).startswith(_TRAINER_MODULES):
        return trainer
    if trainer is not None and getattr(fn, "__module__", "").startswith("nemo."):
        return trainer
    return None


def callback_config(target: str, plugin: str, **kwargs: Any) -> Any:
    """``run.Config`` of the callback class ``target`` (module.Class) with ``kwargs``."""
    run = import_nemo_run()
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        from megatron_resilience.config.lazy_import import build

        log.info("%s: %s does not import here (%s): the callback is built on the compute node by "
                 "megatron_resilience.config.lazy_import.build, so the job's Python needs megatron_resilience",
                 plugin, target, err)
        return run.Config(build, target=target, **kwargs)
    return run.Config(cls, **kwargs)


def _callback_target(callback: Any) -> str:
    fn = getattr(callback, "__fn_or_cls__", None)
    arguments = getattr(callback, "__arguments__", {}) or {}
    if fn is not None and getattr(fn, "__name__", "") == "build" and "target" in arguments:
        return str(arguments["target"])
    cls = fn if fn is not None else type(callback)
    return _name(cls)


def _same_callback(a: Any, b: Any) -> bool:
    """NeMo's test (``callback not in trainer.callbacks``): equal ``run.Config`` objects, i.e. the same class and
    the same arguments. Our compute-node form (``lazy_import.build(target=<class>, ...)``, used where the class does
    not import) counts as the ``run.Config`` of the class it builds: it builds the same callback."""
    if a is b or a == b:
        return True
    if not (hasattr(a, "__fn_or_cls__") and hasattr(b, "__fn_or_cls__")):
        return False

    def arguments(callback: Any) -> dict[str, Any]:
        found = dict(getattr(callback, "__arguments__", {}) or {})
        if getattr(callback.__fn_or_cls__, "__name__", "") == "build":
            found.pop("target", None)
        return found

    return _callback_target(a) == _callback_target(b) and arguments(a) == arguments(b)


def merge_callbacks(trainer: Any, callbacks: list[Any], plugin: str) -> list[str]:
    """Merge ``callbacks`` into ``trainer.callbacks`` exactly as NeMo's plugins do (``_merge_callbacks`` in
    ``nemo/lightning/run/plugins.py``), so a NeMo user's task ends up with the callbacks NeMo would give it: when
    the trainer has callbacks, each given one is appended unless an equal one (same class and arguments) is
    already there (one of the same class with other arguments is appended too); when it has none,
    ``trainer.callbacks`` becomes a copy of ``callbacks``. Returns the targets added."""
    current = getattr(trainer, "callbacks", None)
    if not current:
        trainer.callbacks = copy.deepcopy(list(callbacks))
        added = [_callback_target(c) for c in callbacks]
    else:
        merged, added = list(current), []
        for callback in callbacks:
            if any(_same_callback(callback, c) for c in merged):
                log.info("%s: task trainer.callbacks already has %s with the same arguments: not added again",
                         plugin, _callback_target(callback).rsplit(".", 1)[-1])
                continue
            merged.append(callback)
            added.append(_callback_target(callback))
        trainer.callbacks = merged
    if added:
        log.info("%s: task trainer.callbacks += %s", plugin, [t.rsplit(".", 1)[-1] for t in added])
    return added


def nemo_log_dir(task: Any) -> str | None:
    log_cfg = _arguments(task).get("log")
    value = getattr(log_cfg, "log_dir", None) if log_cfg is not None else None
    return value if isinstance(value, str) else None


def nemo_max_steps(trainer: Any) -> int | None:
    value = getattr(trainer, "max_steps", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


__all__ = ["NEMO_FT_CALLBACK", "NEMO_PREEMPTION_CALLBACK", "bridge_config", "bridge_run_facts", "callback_config",
           "configure_bridge_exit_handler", "configure_bridge_ft", "configure_bridge_inprocess", "merge_callbacks",
           "nemo_log_dir", "nemo_max_steps", "nemo_trainer"]
