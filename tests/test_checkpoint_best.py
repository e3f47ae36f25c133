"""Issue 25, section 4: ``checkpoint.keep_best=N`` keeps the N checkpoints with the lowest validation loss apart
from the ``keep_last_n`` rotation, written and listed atomically, resumable like any other checkpoint.

The ranking and the rotation are plain files (``checkpoint_layout``): checked on folders made here. Then the real
trainer (one process, tiny GPT, learning rate 0.3 so that the validation loss goes up and down) evaluates every 3
steps with ``keep_best=2, keep_last_n=1`` and no save interval: every evaluation that ranks among the two best is
saved then, the ones that drop out are rotated away, and what is left is exactly the two best plus the newest.
The expected best steps come from the run's own evaluation records, so the test holds whatever the curve is on
another megatron-core; it requires that a best checkpoint is older than the newest (true for this curve on 0.16.1
and 0.19.2), so the rotation really had to spare it. One best checkpoint is then resumed in a fresh folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, read_metrics

from megatron_resilience.config import CheckpointConfig, ConfigError, PretrainConfig, TrainingConfig
from megatron_resilience.records import checkpoint_layout as layout


def _dirs(root) -> list[int]:
    return [step for step, _ in layout.iter_dirs(str(root))]


def _make(root, *steps):
    for step in steps:
        os.makedirs(os.path.join(root, layout.iter_dir_name(step)))


def test_ranking_keeps_the_lowest_losses_and_rotation_spares_them(tmp_path):
    best = layout.BestCheckpoints(str(tmp_path), keep=2)
    evaluations = [(4, 5.0), (8, 4.0), (12, 4.5), (16, 6.0), (20, 3.0), (24, 4.2)]
    saved = []
    for step, loss in evaluations:
        if best.note(step, loss):
            _make(tmp_path, step)
            assert best.commit(step) == {"step": step, "validation_loss": loss}
            best.write()
            saved.append(step)
            layout.apply_retention(str(tmp_path), 1, just_saved=step, protected=best.steps())
    assert saved == [4, 8, 12, 20]  # 16 (6.0) and 24 (4.2 > 4.0, 3.0) never ranked among the two best
    assert best.best == [{"step": 20, "validation_loss": 3.0}, {"step": 8, "validation_loss": 4.0}]
    assert _dirs(tmp_path) == [8, 20]  # 4 and 12 dropped out of the best and were rotated away
    assert json.loads((tmp_path / layout.BEST_FILE).read_text()) == {
        "metric": "validation loss", "keep_best": 2,
        "best": [{"step": 20, "validation_loss": 3.0}, {"step": 8, "validation_loss": 4.0}]}
    _make(tmp_path, 28, 32)  # interval saves: the rotation keeps the newest one, and never a best one
    layout.apply_retention(str(tmp_path), 1, just_saved=32, protected=best.steps())
    assert _dirs(tmp_path) == [8, 20, 32]


def test_a_resumed_run_reads_the_list_back_without_checkpoints_that_are_gone(tmp_path):
    _make(tmp_path, 8, 20)
    (tmp_path / layout.BEST_FILE).write_text(json.dumps({"metric": "validation loss", "keep_best": 2, "best": [
        {"step": 20, "validation_loss": 3.0}, {"step": 8, "validation_loss": 4.0},
        {"step": 4, "validation_loss": 1.0}]}))  # iter_4 was removed by hand
    best = layout.BestCheckpoints(str(tmp_path), keep=2)
    assert best.steps() == {8, 20}
    assert not best.note(24, 4.5) and best.note(28, 3.5) and not best.note(32, float("nan"))


class _Crash(BaseException):
    """The process dies here (what a kill between two writes leaves on disk, without killing the test)."""


def test_a_crash_between_a_best_checkpoints_commit_and_its_listing_never_lets_the_rotation_take_it(tmp_path,
                                                                                                     monkeypatch,
                                                                                                     caplog):
    """The real ``CheckpointManager._commit`` (rank 0 of a 1-rank gloo group) publishes saves whose files are
    stand-ins (the commit only renames folders). Step 8 ranks first among the best; the process dies right after
    its rename and tracker, before ``best_checkpoints.json`` is written. The restarted run, saving every 4 steps with
    ``keep_last_n=1``, must keep iter_8: its loss went into the folder before the rename."""
    import time

    import torch.distributed as dist

    from megatron_resilience.checkpointing import manager as checkpoint
    from megatron_resilience.runtime.distributed import destroy_distributed

    root = tmp_path / "ckpt"
    config = CheckpointConfig(save=str(root), keep_best=2, keep_last_n=1)

    def save(manager, step):
        tmp = root / (layout.iter_dir_name(step) + layout.TMP_SUFFIX)
        tmp.mkdir(parents=True)
        (tmp / "metadata.json").write_text("{}")
        manager._commit(checkpoint._Save(step=step, reason="best", is_async=False, tmp=str(tmp),
                                         start_time=time.time(), start_perf=time.perf_counter(),
                                         first_in_process=False))

    def listed():
        return json.loads((root / layout.BEST_FILE).read_text())["best"]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = checkpoint.CheckpointManager(config, run_dir=str(tmp_path))
        assert first.note_validation(4, 5.0)
        save(first, 4)
        assert first.note_validation(8, 4.0)
        with monkeypatch.context() as patched:
            patched.setattr(layout.BestCheckpoints, "write", lambda self: (_ for _ in ()).throw(_Crash()))
            with pytest.raises(_Crash):
                save(first, 8)
        assert (_dirs(root), layout.read_tracker(str(root))) == ([4, 8], 8)
        assert listed() == [{"step": 4, "validation_loss": 5.0}]  # the crash window: iter_8 is not listed
        assert json.loads((root / layout.iter_dir_name(8) / layout.BEST_MARK).read_text()) == {
            "metric": "validation loss", "step": 8, "validation_loss": 4.0}

        caplog.set_level("WARNING", logger="megatron_resilience.checkpointing.manager")
        restarted = checkpoint.CheckpointManager(config, run_dir=str(tmp_path))
        assert restarted.best.steps() == {4, 8}
        assert listed() == [{"step": 8, "validation_loss": 4.0}, {"step": 4, "validation_loss": 5.0}]
        assert f"{root / layout.BEST_FILE} did not list iter_0000008 (a crash after the commit" in caplog.text
        for step in (12, 16):  # interval saves, no evaluation: the rotation keeps the newest and the best
            save(restarted, step)
        assert _dirs(root) == [4, 8, 16]
        assert restarted.note_validation(20, 3.0)
        save(restarted, 20)  # displaces step 4 (5.0), which the rotation now removes
        assert _dirs(root) == [8, 20]
        assert listed() == [{"step": 20, "validation_loss": 3.0}, {"step": 8, "validation_loss": 4.0}]
    finally:
        destroy_distributed()


def test_the_list_is_rebuilt_from_the_folders_marks_and_a_lower_keep_releases_the_rest(tmp_path):
    _make(tmp_path, 4, 8, 12, 16)
    for step, loss in ((4, 5.0), (8, 4.0), (12, 4.5)):  # 12 dropped out of the best earlier: its mark stays
        layout.write_best_mark(str(tmp_path / layout.iter_dir_name(step)), {"step": step, "validation_loss": loss})
    (tmp_path / layout.iter_dir_name(16) / layout.BEST_MARK).write_text('{"step": 15, "validation_loss": 1.0}')
    (tmp_path / layout.BEST_FILE).write_text(json.dumps({"best": [{"step": 4, "validation_loss": 5.0}]}))
    assert layout.read_best(str(tmp_path)) == [{"step": 8, "validation_loss": 4.0},
                                               {"step": 12, "validation_loss": 4.5},
                                               {"step": 4, "validation_loss": 5.0}]  # 16's mark names another step
    best = layout.BestCheckpoints(str(tmp_path), keep=2)
    assert (best.steps(), best.stale, best.unlisted) == ({8, 12}, True, [8, 12])
    best.write()
    assert (layout.BestCheckpoints(str(tmp_path), keep=2).stale, layout.BestCheckpoints(str(tmp_path), 1).steps()) \
        == (False, {8})


def test_keep_best_settings_are_checked_naming_the_keys():
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_best: must be an integer >= 1, got 0$"):
        CheckpointConfig(save="/c", keep_best=0)
    with pytest.raises(ConfigError, match=r"^checkpoint\.save: must be set when checkpoint\.keep_best is set"):
        CheckpointConfig(keep_best=2)
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_best: needs train\.eval_interval"):
        PretrainConfig(run_dir="/r", checkpoint=CheckpointConfig(save="/c", keep_best=2))
    PretrainConfig(run_dir="/r", checkpoint=CheckpointConfig(save="/c", keep_best=2),
                   train=TrainingConfig(eval_interval=10, eval_iters=1))


def _trainer(run_dir, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_resilience", f"run_dir={run_dir}", *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_trainer_keeps_the_best_checkpoints_apart_from_the_rotation_and_one_resumes(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    proc = _trainer(run_dir, "train.max_steps=24", "train.eval_interval=3", "train.eval_iters=1", "optim.lr=0.3",
                    "optim.lr_decay_style=constant", f"checkpoint.save={ckpt}", "checkpoint.keep_best=2",
                    "checkpoint.keep_last_n=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [(r["step"], r["eval_loss"]) for r in read_metrics(run_dir, None) if r.get("kind") == "eval"]
    assert [s for s, _ in evals] == list(range(3, 25, 3))
    top, expected_saves = [], []  # what keep_best=2 must have done, replayed from the evaluations
    for step, loss in evals:
        if len(top) < 2 or loss < top[-1][0]:
            top = sorted(top + [(loss, step)])[:2]
            expected_saves.append(step)
    best = sorted(step for _, step in top)
    assert min(best) < 24, f"this curve's best checkpoints are the newest ones; nothing to spare: {evals}"
    saves = [(r["step"], r["reason"]) for r in read_metrics(run_dir, None) if r.get("kind") == "checkpoint"]
    assert saves == [(s, "best") for s in expected_saves if s != 24] + [(24, "finished")], (saves, evals)
    assert _dirs(ckpt) == sorted(set(best) | {24})
    manifest = json.loads((ckpt / layout.BEST_FILE).read_text())
    assert manifest == {"metric": "validation loss", "keep_best": 2,
                        "best": [{"step": s, "validation_loss": loss} for loss, s in top]}
    from megatron_resilience.checkpointing.readable import why_incomplete

    assert all(why_incomplete(str(ckpt / layout.iter_dir_name(s)), s) is None for s in best)
    assert f"checkpoint: step {top[0][1]} is among the 2 best by validation loss" in proc.stderr

    resumed_dir, older = tmp_path / "resumed", min(best)
    os.makedirs(resumed_dir / "ckpt")
    shutil.copytree(ckpt / layout.iter_dir_name(older), resumed_dir / "ckpt" / layout.iter_dir_name(older))
    proc = _trainer(resumed_dir, f"train.max_steps={older + 1}", "optim.lr=0.3", "optim.lr_decay_style=constant",
                    f"checkpoint.save={resumed_dir / 'ckpt'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    [start] = [r for r in read_metrics(resumed_dir, None) if r.get("kind") == "start"]
    assert (start["step"], start["resumed"]) == (older, True)
    assert [r["step"] for r in read_metrics(resumed_dir)] == [older + 1]
