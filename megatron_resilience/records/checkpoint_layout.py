"""The checkpoint directory on disk: names, the tracker, completeness checks, retention.

Layout under ``checkpoint.save``::

    iter_0000010/                      complete checkpoints (dist_checkpointing format)
    iter_0000020/
    iter_0000030.tmp/                  a save in progress (or one cut off by a crash)
    latest_checkpointed_iteration.txt  "20": the newest committed step, written last
    best_checkpoints.json              with checkpoint.keep_best: the N best by validation loss
    iter_0000020/validation.json       with checkpoint.keep_best: the loss a best checkpoint was ranked by

A checkpoint is written under ``iter_N.tmp`` and renamed to ``iter_N`` only once
every rank has finished writing, so a directory named ``iter_N`` is complete by
construction. The tracker is a hint for humans and Megatron-LM tools, not the
source of truth: a crash between the rename and the tracker update, or a damaged
directory, must not lose or poison a resume, so :func:`complete_checkpoints`
scans the ``iter_*`` directories and checks their metadata itself
(``checkpointing.readable``: that check reads dist_checkpointing's metadata, so it lives on the compute node).

Everything here is plain filesystem work run by rank 0; no collectives.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile

from megatron_resilience.records.names import ITER_DIR, TRACKER_FILE, iter_dir_name  # noqa: F401 (read from here)

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
_ITER_RE = ITER_DIR
TMP_RE = re.compile(r"^iter_\d{7,}\.(tmp|old)(\..*)?$")


def fsync_dir(path: str) -> None:
    """Make a rename or file creation inside ``path`` durable (POSIX needs the directory fsynced too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new content, never a torn file.

    Writes a temporary file in the same directory, fsyncs it, ``os.replace``s it
    over ``path`` (atomic on POSIX within one filesystem) and fsyncs the directory.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def directory_bytes(path: str) -> int:
    """Total size of the files under ``path`` (what a checkpoint costs on disk)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # removed meanwhile (retention by another process): not part of it any more
                pass
    return total


def read_tracker(root: str | None) -> int | None:
    """The step named by the tracker file (Megatron's name: ours, Megatron-LM's and Megatron-Bridge's), or None when
    there is no folder, no tracker, an unreadable one or not a number."""
    if not root:
        return None
    try:
        with open(os.path.join(root, TRACKER_FILE), encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(root: str, step: int) -> None:
    atomic_write_text(os.path.join(root, TRACKER_FILE), f"{step}\n")


def iter_dirs(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every directory named ``iter_N`` (complete by name), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITER_RE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def remove_stale_tmp(root: str, *, keep: str | None = None) -> list[str]:
    """Delete ``iter_*.tmp`` / ``iter_*.old`` leftovers of saves cut off by a crash; returns what was removed."""
    removed = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if TMP_RE.match(name) and path != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("checkpoint: removed incomplete saves %s", ", ".join(removed))
    return removed


def apply_retention(root: str, keep_last_n: int, *, just_saved: int, protected: frozenset[int] = frozenset()
                    ) -> list[str]:
    """Keep the ``keep_last_n`` newest ``iter_N`` directories (never ``just_saved``); returns what was removed.

    ``protected`` steps (the best checkpoints, ``checkpoint.keep_best``) are never removed by the rotation.
    """
    dirs = iter_dirs(root)
    keep = {step for step, _ in dirs[-keep_last_n:]} | {just_saved} | set(protected)
    removed = []
    for step, path in dirs:
        if step not in keep:
            shutil.rmtree(path)
            removed.append(path)
    if removed:
        log.info("checkpoint: keep_last_n=%d removed %s", keep_last_n, ", ".join(removed))
    return removed


def commit(root: str, tmp_path: str, step: int, *, best: dict | None = None,
           shape: dict | None = None) -> str:
    """Make the finished save in ``tmp_path`` visible as ``iter_N`` and point the tracker at it.

    Order matters for crash safety: [best mark] -> rename (atomic) -> fsync -> tracker. When
    ``iter_N`` already exists (a second save of the same step), it is moved
    aside first; a crash in between leaves ``iter_N.old``, which
    :func:`remove_stale_tmp` cleans, and the previous checkpoint is used.
    ``best`` (``checkpoint.keep_best``: the entry :meth:`BestCheckpoints.commit` returned) is written into the
    folder before the rename, so the checkpoint and its rank among the best become visible in one atomic step.
    ``shape``: the model's shape (``runtime/model_shape.py``), written inside it the same way.
    """
    if best is not None:
        write_best_mark(tmp_path, best)
    if shape is not None:
        atomic_write_text(os.path.join(tmp_path, "model_shape.json"), json.dumps(shape, sort_keys=True) + "\n")
    final = os.path.join(root, iter_dir_name(step))
    aside = None
    if os.path.exists(final):
        aside = final + ".old"
        if os.path.exists(aside):
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp_path, final)
    fsync_dir(root)
    write_tracker(root, step)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


# --- the best checkpoints by validation loss (checkpoint.keep_best) ---------------------------------------------

BEST_FILE = "best_checkpoints.json"
BEST_MARK = "validation.json"  # inside iter_N: the validation loss it entered the best list with
BEST_METRIC = "validation loss"


def _rank_key(entry: dict) -> tuple[float, int]:
    return entry["validation_loss"], entry["step"]


class BestCheckpoints:
    """The ``keep`` checkpoints with the lowest validation loss, kept apart from the keep-last-N rotation.

    Every rank keeps the same list (the validation loss is reduced over the ranks, so every rank ranks the same
    way): whether a step's checkpoint is wanted must be decided identically, a save being collective.

    Where the list lives, and why there: a best checkpoint's loss is recorded *inside* its folder
    (``iter_N/validation.json``, written before the rename, :func:`commit`), so the rename that makes the
    checkpoint visible also makes its rank known, in one atomic step. At every start the list is rebuilt from
    the ``iter_*`` folders' marks (with ``best_checkpoints.json``'s entries for folders written before marks
    existed) and the best ``keep`` of them are protected. ``best_checkpoints.json`` (rank 0, atomically, after
    the rename and tracker) is the readable copy of that list; a crash before it is written (after the rename)
    leaves it stale, never the protection: the restarted run lists the checkpoint again (:attr:`stale`) before
    any rotation. The alternative, writing the list before the rename, is not atomic either way round: it names
    a checkpoint that may never appear and drops the entry it displaces before its replacement exists, so a
    crash in between would leave the displaced best checkpoint to the rotation.

    Ranking every marked folder again gives the list the saves built one by one (same key: loss, then step):
    a checkpoint that dropped out of the best had ``keep`` better ones, which stay protected until displaced by
    even better ones. A list shortened by a lower ``keep_best`` releases the extra ones to the rotation.
    """

    def __init__(self, root: str, keep: int) -> None:
        self.root, self.keep = root, keep
        listed = _read_listed(root)
        self.best: list[dict] = read_best(root)[:keep]  # lowest loss first
        # The file lags behind the folders (a crash after a best checkpoint's rename) or holds what is gone:
        # rank 0 rewrites it (CheckpointManager); the steps below were protected by their marks alone.
        self.stale = listed != self.best
        self.unlisted = sorted(self.steps() - {e["step"] for e in listed})
        self._losses: dict[int, float] = {}  # validation losses of this run, by step, not yet committed

    def note(self, step: int, loss: float) -> bool:
        """Record ``step``'s validation loss; True when a checkpoint of ``step`` would be among the best."""
        self._losses[step] = loss
        return self.wants(step)

    def wants(self, step: int) -> bool:
        loss = self._losses.get(step)
        if loss is None or loss != loss:  # no evaluation at this step, or NaN
            return False
        others = [b for b in self.best if b["step"] != step]
        return len(others) < self.keep or loss < others[self.keep - 1]["validation_loss"]

    def commit(self, step: int) -> dict | None:
        """``step``'s checkpoint is complete: rank it. Returns its entry when it is now among the best."""
        if not self.wants(step):
            return None
        entry = {"step": step, "validation_loss": self._losses[step]}
        ranked = sorted([b for b in self.best if b["step"] != step] + [entry], key=_rank_key)
        self.best = ranked[:self.keep]
        return entry

    def steps(self) -> frozenset[int]:
        return frozenset(b["step"] for b in self.best)

    def write(self) -> None:
        atomic_write_text(os.path.join(self.root, BEST_FILE), json.dumps(
            {"metric": BEST_METRIC, "keep_best": self.keep, "best": self.best}, indent=1) + "\n")
        self.stale, self.unlisted = False, []


def write_best_mark(folder: str, entry: dict) -> None:
    """Record ``entry`` (step, validation loss) inside a checkpoint folder (before its rename: see commit)."""
    atomic_write_text(os.path.join(folder, BEST_MARK), json.dumps(
        {"metric": BEST_METRIC, "step": entry["step"], "validation_loss": entry["validation_loss"]}) + "\n")


def _entry(raw: object, step: int | None = None) -> dict | None:
    """A well-formed ``{"step", "validation_loss"}`` (of ``step`` when given), else None."""
    if not isinstance(raw, dict):
        return None
    loss, at = raw.get("validation_loss"), raw.get("step")
    if isinstance(at, bool) or not isinstance(at, int) or (step is not None and at != step):
        return None
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or loss != loss:
        return None
    return {"step": at, "validation_loss": loss}


def _read_listed(root: str) -> list[dict]:
    """``best_checkpoints.json``'s entries whose ``iter_N`` still exists, lowest loss first ([] when none)."""
    try:
        with open(os.path.join(root, BEST_FILE), encoding="utf-8") as handle:
            raw = json.load(handle)["best"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    present = {step for step, _ in iter_dirs(root)}
    entries = [e for e in map(_entry, raw if isinstance(raw, list) else []) if e and e["step"] in present]
    return sorted(entries, key=_rank_key)


def read_best(root: str) -> list[dict]:
    """Every checkpoint under ``root`` with a validation loss, lowest first: the ``iter_N`` folders' marks, and
    ``best_checkpoints.json``'s entries for folders without one (written before marks existed; a mark wins)."""
    found = {e["step"]: e for e in _read_listed(root)}
    for step, path in iter_dirs(root):
        try:
            with open(os.path.join(path, BEST_MARK), encoding="utf-8") as handle:
                mark = _entry(json.load(handle), step)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            log.warning("checkpoint: ignoring %s: %s", os.path.join(path, BEST_MARK), err)
            continue
        if mark is not None:
            found[step] = mark
    return sorted(found.values(), key=_rank_key)
