"""What a cleanly finished run's ``stop_reason.json`` says, compared in one place by every test that ends a run."""

from __future__ import annotations

FINISH_KEYS = ("reason", "step", "exit_code", "finished", "checkpoint_step", "lost_steps")


def finish_record(stop: dict) -> dict:
    """The keys of a stop record that say how a run ended (absent keys read as None)."""
    return {key: stop.get(key) for key in FINISH_KEYS}


def finished_at(step: int) -> dict:
    """A run that trained to ``step``, saved it, and lost nothing."""
    return {"reason": "finished", "step": step, "exit_code": 0, "finished": True, "checkpoint_step": step,
            "lost_steps": 0}
