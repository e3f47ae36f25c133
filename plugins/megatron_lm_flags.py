"""What a Megatron-LM command line needs under the plugins beyond the flags they convert.

The converted flags (``script_args.megatron_lm_args``) switch Megatron-LM's own features on; restarting it needs
more, which its users forget because a single run never shows it (facts with their releases:
``megatron_resilience/upstream/megatron_lm.py``):

* ``--load`` when only ``--save`` is given (:func:`ensure_load`, both plugins): Megatron-LM resumes from ``--load``
  only, so an in-job restart or a requeue with ``--save`` alone trains again from step 0. The plugin adds
  ``--load <the --save folder>`` and says so in the log;
* a bound on learned FT timeouts (:func:`learned_timeout_settings`, FaultTolerancePlugin): with
  ``--calc-ft-timeouts`` Megatron-LM replaces the plugin's section timeouts by ``safety_factor`` x the longest
  interval seen, without a minimum; the factor in ft_launcher's FT config is the one bound a launcher can set,
  and for these tasks it is raised from nvidia-resiliency-ext's 5 to ``LEARNED_TIMEOUT_SAFETY_FACTOR`` (logged);
* no learned timeouts with node-local saves (:func:`no_learned_timeouts_with_local_saves`, FaultTolerancePlugin):
  Megatron-LM would learn its checkpointing timeout from the local saves and end the next persistent save as hung;
* a warning (:func:`warn_save_at_signal`, PreemptionPlugin) when it saves in ``torch_dist``, whose save at the
  signal failed under ft_launcher (megatron-core 0.19.2; the lane pins it);
* ``--inprocess-restart`` refused before submission (:func:`check_inprocess_restart`, FaultTolerancePlugin) where
  no in-process restart iteration of Megatron-LM can run: with ``--enable-ft-package`` (any release) or on a
  megatron-core from 0.18; warned on 0.17.1, where every iteration shares one restart store. The release is the
  one installed where the job is submitted, or the cluster's, named by
  ``FaultTolerancePlugin(megatron_core_version=...)``.

Only tasks the plugins recognise as Megatron-LM from their arguments (``trainer_detect``) and that give no
``script_args_converter_fn`` are touched; a Bridge or unknown script never is.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_resilience.config import ConfigError
from megatron_resilience.config.validate import fail
from megatron_resilience.tasks.trainer_detect import detect_script_trainer, flag_values
from megatron_resilience.upstream.megatron_lm import (
    INPROCESS_ARGS_DESTROYED_FROM,
    INPROCESS_STORE_UNPREFIXED_FROM,
    LEARNED_TIMEOUT_SAFETY_FACTOR,
    NVRX_DEFAULT_SAFETY_FACTOR,
)
from megatron_resilience.upstream.versions import package_version, parse_version

log = logging.getLogger("megatron_resilience.plugins")


def is_megatron_lm(target: Any) -> bool:
    """The target is a ``run.Script`` the plugins recognised as Megatron-LM themselves (from its arguments or place).

    With a ``script_args_converter_fn`` the user's function decides every argument the plugins add (Megatron-Bridge's
    contract), and the script may only look like Megatron-LM (``examples/argparse_trainer.py`` takes Megatron-LM's
    flags but not ``--load``): nothing here applies to it."""
    if target.converter is None or not target.why.startswith("detected"):
        return False
    found = detect_script_trainer(target.task)
    return found is not None and found[0] == "megatron_lm"


def _args(target: Any) -> list[str]:
    return [str(a) for a in target.task.args]


def ensure_load(target: Any, plugin: str) -> list[str]:
    """Append ``--load <save>`` to a Megatron-LM task that gives ``--save`` and no ``--load``; returns what was
    appended (logged)."""
    if not is_megatron_lm(target):
        return []
    args = _args(target)
    save, load = flag_values(args, "--save"), flag_values(args, "--load")
    if not save or load or "--load" in args:
        return []
    added = ["--load", save[-1]]
    target.task.args = args + added
    log.info("%s: task args += %s: Megatron-LM resumes only from --load; with --save alone every in-job restart and "
             "requeue would train again from step 0", plugin, added)
    return added


def learned_timeout_settings(target: Any, plugin: str) -> dict[str, float]:
    """FT config keys for a Megatron-LM task that learns its timeouts (``--calc-ft-timeouts`` in its arguments,
    the plugin's or the user's own); {} for any other task."""
    if not is_megatron_lm(target) or "--calc-ft-timeouts" not in _args(target):
        return {}
    log.info("%s: FT config safety_factor=%s (nvidia-resiliency-ext's default %s): with --calc-ft-timeouts "
             "Megatron-LM sets each section timeout to safety_factor x the longest interval it saw, with no minimum "
             "(0.72 s per step measured with %s); the factor is the one bound ft_launcher passes to the ranks", plugin,
             LEARNED_TIMEOUT_SAFETY_FACTOR, NVRX_DEFAULT_SAFETY_FACTOR, NVRX_DEFAULT_SAFETY_FACTOR)
    return {"safety_factor": LEARNED_TIMEOUT_SAFETY_FACTOR}


def no_learned_timeouts_with_local_saves(target: Any, plugin: str) -> bool:
    """Drop ``--calc-ft-timeouts`` from a Megatron-LM task that also saves node-local (non-persistent) checkpoints;
    returns whether it did (a warning says why).

    Megatron-LM opens its FT ``checkpointing`` section around every save, local ones included, and learns that
    section's timeout from all of them: with local saves every few steps and a persistent one seldom, the timeout
    comes from the local saves' milliseconds, and the next persistent save is ended as hung. Measured here
    (megatron-core 0.19.2, ft_launcher 0.7.0, ``tests/megatron_lm/test_megatron_lm_local_checkpoints.py``): a learned
    0.67 s killed the step-20 persistent save, the restarted group resumed from the local copy of step 18 and the
    kill came again, cycle after cycle. The section timeouts then stay the FT config's."""
    if not is_megatron_lm(target):
        return False
    args = _args(target)
    types = flag_values(args, "--non-persistent-ckpt-type")
    if "--calc-ft-timeouts" not in args or not types or types[-1] != "local":
        return False
    target.task.args = [a for a in args if a != "--calc-ft-timeouts"]
    log.warning("%s: task args -= ['--calc-ft-timeouts'] (with --non-persistent-ckpt-type local): Megatron-LM learns "
                "its checkpointing section timeout from every save, local ones included, so a persistent save after "
                "fast local saves is ended as hung (measured: 0.67 s learned from ~30 ms local saves killed a "
                "persistent save, and the restarted group met the same kill again); the FT config's section timeouts "
                "apply instead", plugin)
    return True


def warn_save_at_signal(target: Any, plugin: str) -> bool:
    """Warn a Megatron-LM task that saves in ``torch_dist`` (its default) that its save at the signal may fail under
    a launcher; returns whether it warned."""
    if not is_megatron_lm(target):
        return False
    formats = flag_values(_args(target), "--ckpt-format")
    if formats and formats[-1] != "torch_dist":
        return False
    log.warning("%s: Megatron-LM saves in --ckpt-format %s: seen with megatron-core 0.19.2 under ft_launcher 0.7.0, "
                "the save at the signal fails (BrokenPipeError): megatron-core returns each torch_dist save's write "
                "results through a helper process it spawns on the first save, in the rank's process group, and the "
                "launcher forwards the signal to that group; the checkpoint stays at the previous save. "
                "--ckpt-format torch saved and exited 0 there (tests/megatron_lm/)", plugin,
                formats[-1] if formats else "torch_dist (its default)")
    return True


def validate_megatron_core_version(key: str, value: object) -> None:
    """``FaultTolerancePlugin.megatron_core_version``: None (the installed one) or a version string."""
    if value is None:
        return
    allowed = "must be the cluster's megatron-core release as a string, like '0.19.2' or '0.17' (or None: the " \
              "one installed where the job is submitted)"
    if not isinstance(value, str):  # 0.10 as a number is 0.1
        fail(key, allowed + "; a number loses digits, quote it", value)
    try:
        parse_version(value)
    except ValueError:
        fail(key, allowed, value)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def check_inprocess_restart(target: Any, plugin: str, megatron_core_version: str | None, *,
                            by_plugin: bool = True) -> bool:
    """Refuse (ConfigError) a Megatron-LM task given ``--inprocess-restart`` where no restart iteration can run:
    with ``--enable-ft-package`` (any release), or on a megatron-core from 0.18; warn on 0.17.1, whose iterations
    share one restart store; returns whether it warned. ``by_plugin``: the plugin's ``inprocess_restart`` added the
    flag; else the user wrote it into the script's arguments (the plugin set nothing up for it).

    The release: ``megatron_core_version`` (the cluster's, as the user names it) or else the one installed where
    the job is submitted; with neither known, a warning says what to check (``upstream/megatron_lm.py`` has the
    facts, ``tests/megatron_lm/test_megatron_lm_inprocess_restart.py`` the runs that measured them)."""
    if not is_megatron_lm(target) or "--inprocess-restart" not in _args(target):
        return False
    key = f"{plugin}.megatron_core_version"
    if megatron_core_version is not None:
        version, source = parse_version(megatron_core_version), f"{key}={megatron_core_version!r}"
    else:
        version, source = package_version("megatron-core"), "installed where the job is submitted"
    field = f"{plugin}.inprocess_restart" if by_plugin else "task: --inprocess-restart in the run.Script's args"
    instead = (f"use ft_launcher's in-job restart instead: {plugin}(inprocess_restart=False) restarts" if by_plugin
               else "remove --inprocess-restart from the script's args: ft_launcher's in-job restart then restarts")
    reasons, ways = [], [f"{instead} the worker group, which resumes from --load (local_checkpoint_dir still adds "
                         f"node-local saves)"]
    if "--enable-ft-package" in _args(target):
        reasons.append("with --enable-ft-package (enable_ft_package=True) each one fails in Megatron-LM's "
                       "ft_integration.setup with 'AssertionError: rank monitor client is already initialized.': the "
                       "first iteration's client is shut down only by a pretrain that returns (every release with "
                       "--inprocess-restart, 0.13.0 to Megatron-LM's main, read; measured with 0.19.2)")
    if version is not None and version >= INPROCESS_ARGS_DESTROYED_FROM:
        reasons.append(f"with megatron-core {_dotted(version)} ({source}) each one fails with 'AssertionError: "
                       f"args is not initialized.': from {_dotted(INPROCESS_ARGS_DESTROYED_FROM)} (Megatron-LM PR "
                       f"#4225) pretrain_gpt.py parses its arguments before the in-process wrapper, whose finalize "
                       f"destroys them (measured with 0.19.2)")
        ways.append(f"if the cluster's container runs another megatron-core, name it: "
                    f"{plugin}(megatron_core_version='0.17.0')")
    elif reasons:
        ways.append(f"or {plugin}(enable_ft_package=False), leaving hangs to the in-process wrapper's timeouts")
    shared = version is not None and version >= INPROCESS_STORE_UNPREFIXED_FROM
    store = (f"from {_dotted(INPROCESS_STORE_UNPREFIXED_FROM)} (Megatron-LM PR #4420, backported by #4453) pretrain "
             f"annotates inprocess_call_wrapper as Optional[Any], so nvidia-resiliency-ext's wrapper never passes it "
             f"its CallWrapper and every restart iteration's process group meets the previous one's keys in one "
             f"restart store")
    if reasons:
        raise ConfigError(
            f"{field}: no in-process restart iteration of Megatron-LM can run here: "
            + "; and ".join(reasons) + " (a failed iteration is restarted forever: no release passes "
            "--inprocess-max-iterations to the wrapper)" + (f"; also, {store}" if shared else "") + "; "
            + "; ".join(ways))
    if version is None:
        log.warning("%s: Megatron-LM --inprocess-restart and no megatron-core installed here: from megatron-core "
                    "%s no in-process restart iteration can run (Megatron-LM PR #4225: 'AssertionError: args is not "
                    "initialized.'), from %s its iterations share one restart store (PR #4420/#4453); name the "
                    "cluster's release with %s(megatron_core_version=...) to have it checked", plugin,
                    _dotted(INPROCESS_ARGS_DESTROYED_FROM), _dotted(INPROCESS_STORE_UNPREFIXED_FROM), plugin)
        return True
    if shared:
        log.warning("%s: Megatron-LM --inprocess-restart with megatron-core %s (%s): %s (seen once by hand with "
                    "0.19.2: two restart iterations failed in the process-group rendezvous before a third resumed)",
                    plugin, _dotted(version), source, store)
        return True
    return False


__all__ = ["check_inprocess_restart", "ensure_load", "is_megatron_lm", "learned_timeout_settings",
           "no_learned_timeouts_with_local_saves", "validate_megatron_core_version", "warn_save_at_signal"]
