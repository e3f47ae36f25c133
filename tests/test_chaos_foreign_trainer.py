"""The chaos stream paces itself on a run whose trainer writes no ``metrics.jsonl`` (Megatron-LM's own ``pretrain``):
given the job folder, it reads the newest trainer log's tail as records (``records/megatron_log``), so the training
clock runs while that trainer trains and a hang waits until the restarted ranks are past their setup.
The log lines are Megatron-LM 0.19.2's, composed field by field in ``test_megatron_log.py``."""

from __future__ import annotations

import os

import pytest
from test_megatron_log import T0, setup, sigterm_then_resume

from megatron_resilience.chaos.runner import last_record_time, last_train_time, past_setup


def _write(path, lines: list[str], mtime: float) -> None:
    path.write_text("\n".join(lines) + "\n")
    os.utime(path, (mtime, mtime))


def test_the_newest_logs_last_step_and_start_are_the_clocks_marks(tmp_path):
    lines = sigterm_then_resume()  # process 2 starts its loop at T0 + 63 and logs steps 7..12, the last at T0 + 69.2
    _write(tmp_path / "log-mlm_41_0.out", lines[:len(lines) // 3], T0)
    _write(tmp_path / "log-mlm_41_1.out", lines, T0 + 100)
    (tmp_path / "sbatch_mlm_41.out").write_text("not a trainer's log\n")
    assert last_train_time(str(tmp_path)) == pytest.approx(T0 + 69.2)
    assert last_record_time(str(tmp_path), "start") == pytest.approx(T0 + 63.0)
    assert past_setup(str(tmp_path))


def test_a_restarted_trainer_still_in_its_setup_is_not_past_it(tmp_path):
    lines = sigterm_then_resume()
    restarted = lines[:lines.index(setup(T0 + 60.0, load=6, ckpt="/ckpt", load_ms=250.0)[-1]) + 1]
    _write(tmp_path / "log-mlm_41_0.out", restarted, T0 + 100)
    assert last_record_time(str(tmp_path), "start") == pytest.approx(T0 + 63.0)
    assert last_train_time(str(tmp_path)) < T0 + 63.0  # process 1's step 6
    assert not past_setup(str(tmp_path))


def test_a_folder_without_metrics_or_a_trainer_log_has_no_marks(tmp_path):
    (tmp_path / "sbatch_mlm_41.out").write_text("not a trainer's log\n")
    assert last_train_time(str(tmp_path)) is None and not past_setup(str(tmp_path))
