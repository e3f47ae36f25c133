"""Checks of the paths a config names, on the machine that can see them.

A checkpoint directory under ``/proc``, a ``run_dir`` that is a file or a data prefix
without its ``.bin``/``.idx`` used to pass every check and fail hours later (at the
first save) or after the model was built, with a traceback. These checks run on the
login node when it sees the job's filesystem (LocalExecutor, Slurm through a
LocalTunnel) and again in the trainer before torch loads.

Writability is probed by creating (and removing) a directory in the nearest
existing ancestor: permission bits do not tell (root may write anywhere but
``/proc``; read-only mounts). Nothing the user named is created here.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Iterable

from megatron_resilience.config.validate import ConfigError
from megatron_resilience.records.names import ITER_DIR, TRACKER_FILE

PROBE_PREFIX = ".megatron_resilience_probe_"


def _nearest_existing(path: str) -> str:
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _probe(directory: str) -> str | None:
    """None when a directory can be created in ``directory``, else why not."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=directory))
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def check_writable_dir(key: str, path: Any) -> None:
    """``path`` is a directory we can write, or one we can create (its nearest existing ancestor is writable)."""
    if not isinstance(path, str) or not path:
        return
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: must be a directory, got {path!r} (a file)")
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise ConfigError(f"{key}: must be a directory we can create, got {path!r} ({base!r} is a file)")
    why = _probe(base)
    if why:
        action = "write in" if base == os.path.abspath(path) else "create directories in"
        raise ConfigError(f"{key}: must be a writable directory, got {path!r} (cannot {action} {base!r}: {why})")


def check_existing_file(key: str, path: Any) -> None:
    if isinstance(path, str) and path and not os.path.isfile(path):
        raise ConfigError(f"{key}: must be an existing file, got {path!r} (not found)")


def check_holds_checkpoint(path: str) -> None:
    """``checkpoint.load`` names a folder with a checkpoint in it (an ``iter_NNNNNNN`` folder or the tracker file)."""
    if not os.path.isdir(path):
        why = "not found"
    elif os.path.exists(os.path.join(path, TRACKER_FILE)) or any(ITER_DIR.match(n) for n in os.listdir(path)):
        return
    else:
        why = f"no checkpoint in it: no iter_NNNNNNN folder, no {TRACKER_FILE}"
    raise ConfigError(f"checkpoint.load: must be a folder holding a checkpoint to resume from, got {path!r} ({why}); "
                      "checkpoint.load_optional=true starts from step 0 when it holds none")


def data_prefixes(data_path: list[str]) -> list[str]:
    """The dataset prefixes of a Megatron blend: ``["a"]`` or ``["0.7", "a", "0.3", "b"]`` -> ``["a", "b"]``."""
    def weight(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if len(data_path) > 1 and len(data_path) % 2 == 0 and all(weight(w) for w in data_path[::2]):
        return list(data_path[1::2])
    return list(data_path)


def check_paths(config: Any, *, skip: Iterable[str] = ()) -> None:
    """Every path of a ``PretrainConfig`` that must exist or be writable, checked on this machine.

    ``skip``: keys whose value is not known here (a shell variable the batch script expands).
    """
    skip = set(skip)

    def wanted(key: str) -> bool:
        return key not in skip

    if wanted("run_dir"):
        check_writable_dir("run_dir", config.run_dir)
    if wanted("checkpoint.save"):
        check_writable_dir("checkpoint.save", config.checkpoint.save)
    load = config.checkpoint.load
    if wanted("checkpoint.load") and load and os.path.lexists(load) and not os.path.isdir(load):
        raise ConfigError(f"checkpoint.load: must be a directory, got {load!r} (a file)")
    if wanted("checkpoint.load") and config.checkpoint.load_required:
        check_holds_checkpoint(load)
    for prefix in data_prefixes(config.data.data_path) if wanted("data.data_path") else []:
        missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(f"{prefix}{ext}")]
        if missing:
            raise ConfigError(f"data.data_path: must name indexed datasets (PREFIX.bin and PREFIX.idx), "
                              f"got {prefix!r} ({', '.join(missing)} not found)")
    for key in ("data.vocab_file", "data.merge_file"):
        if wanted(key):
            check_existing_file(key, getattr(config.data, key.split(".")[1]))
    if wanted("data.cache_dir"):
        check_writable_dir("data.cache_dir", config.data.cache_dir)
    if wanted("logger.tensorboard_dir") and config.logger.tensorboard_dir is not None and config.run_dir:
        check_writable_dir("logger.tensorboard_dir", config.logger.tensorboard_path(config.run_dir))
    wandb = config.logger.wandb_project and config.logger.wandb_save_dir
    if wanted("logger.wandb_save_dir") and wandb and config.run_dir:
        check_writable_dir("logger.wandb_save_dir", config.logger.wandb_path(config.run_dir))
    tracker = config.rerun.result_rejected_tracker_filename
    if tracker and wanted("rerun.result_rejected_tracker_filename"):
        check_writable_dir("rerun.result_rejected_tracker_filename", os.path.dirname(os.path.abspath(tracker)))
