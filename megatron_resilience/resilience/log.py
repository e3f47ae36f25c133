"""Loggers for the resilience hooks: every line names its rank, so launcher logs of all ranks stay readable.

The trainer may configure logging for ``megatron_resilience``; if nobody did, we
add one stderr handler so INFO lines (loaded timeouts, stop reasons) are not lost.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "megatron_resilience.resilience"


_own_handler = False  # True when we installed the stderr handler (then lines need their own rank prefix)


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return (f"[rank {self.extra['rank']}] {msg}" if _own_handler else msg), kwargs


def get_logger(component: str, rank: int | None = None) -> logging.LoggerAdapter:
    _ensure_handler()
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return _RankAdapter(logging.getLogger(f"{ROOT}.{component}"), {"rank": rank})


def _ensure_handler() -> None:
    global _own_handler
    package = logging.getLogger("megatron_resilience")
    root = logging.getLogger(ROOT)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    if root.handlers or package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    _own_handler = True


def named_logger(name: str, rank: int) -> logging.LoggerAdapter:
    """A user-chosen logger (e.g. ``straggler.logger_name``) with the same rank prefix; INFO unless set."""
    _ensure_handler()
    logger = logging.getLogger(name)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not name.startswith(ROOT) and not logger.handlers and not logging.getLogger().handlers \
            and not (name.startswith("megatron_resilience") and logging.getLogger("megatron_resilience").handlers):
        logger.addHandler(logging.getLogger(ROOT).handlers[0] if logging.getLogger(ROOT).handlers
                          else logging.StreamHandler(sys.stderr))
    return _RankAdapter(logger, {"rank": rank})
