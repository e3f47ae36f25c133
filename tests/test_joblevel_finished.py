"""Finished runs of trainers that never touch the finished flag (Megatron-LM, Megatron-Bridge) are not requeued.

Unit level: ``jobs/finished.py``'s rules, bucket by bucket. Script level: the whole rendered sbatch script of
a Megatron-LM and a Megatron-Bridge ``run.Script`` task (the plugins read ``--save``/``--train-iters``,
``checkpoint.save``/``train.train_iters`` and ``--save_dir``/``--max_steps`` into the job-level config), run by
bash attempt after attempt as Slurm would, its EXIT trap the real ``batch_exit``; ``srun`` is a stub that does
what a trainer leaves behind (Megatron's ``latest_checkpointed_iteration.txt``, its end-of-training line, its exit
code) and ``scontrol`` records requeues. Before issue 22 every finished attempt under ft_launcher was requeued
("exit 0 without the finished flag"). The real-Slurm proof is ``tests/slurm/test_script_tasks_on_slurm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_resilience.jobs import finished
from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402

ITERS = 10
LINE = "[after training is done] datetime: 2026-11-25 07:53:07 "


# --- the rules --------------------------------------------------------------------------------------------------


def _tracker(folder, step) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, finished.TRACKER_FILE), "w") as f:
        f.write(f"{step}\n")
    return str(folder)


@pytest.mark.parametrize("step, exit_code, lines, expected", [
    (10, 0, [], ("checkpoint", 10)),            # the final checkpoint: finished
    (12, 1, [], ("checkpoint", 12)),            # crashed after the final checkpoint: nothing is left to train
    (5, 0, [LINE], ("log", 5)),                 # the loop reached its end, the final save not yet in the tracker
    (5, 0, ["1: " + LINE], ("log", 5)),         # a launcher's rank prefix
    (None, 0, ["`Trainer.fit` stopped: `max_steps=10` reached."], ("log", None)),  # Lightning (NeMo 2.0)
    (5, 0, [], None),                           # exit 0 without either: saved and stopped on a signal
    (5, 1, [LINE], None),                       # the end line, then a failure (the final save failed)
    (9, 1, [], None),                           # a crash before the end
    ("release", 0, [], None),                   # Megatron's 'release' tracker is no iteration
])
def test_finished_rules(tmp_path, step, exit_code, lines, expected):
    ckpt = _tracker(tmp_path / "ckpt", step) if step is not None else None
    found = finished.detect(checkpoint_dir=ckpt, train_iters=ITERS, exit_code=exit_code, log_lines=lines)
    assert (None if found is None else (found.source, found.step)) == expected


def test_unknown_train_iters_needs_the_end_of_training_line(tmp_path):
    ckpt = _tracker(tmp_path / "ckpt", 1000)
    assert finished.detect(checkpoint_dir=ckpt, train_iters=None, exit_code=0, log_lines=[]) is None
    found = finished.detect(checkpoint_dir=ckpt, train_iters=None, exit_code=0, log_lines=["x", LINE, "y"])
    assert (found.source, found.evidence) == ("log", LINE.strip())


# --- the rendered batch script, attempt after attempt --------------------------------------------------------------

SRUN = r"""#!/bin/bash
case "$*" in *hostname*) echo 127.0.0.1; exit 0;; esac
out=""; prev=""
for a in "$@"; do [ "$prev" = "--output" ] && out="$a"; prev="$a"; done
out="${out//%j/$SLURM_JOB_ID}"
action=$(echo "$PLAN" | cut -d' ' -f$(( ${SLURM_RESTART_COUNT:-0} + 1 )))
tracker() { mkdir -p "$CKPT"; echo "$1" > "$CKPT/latest_checkpointed_iteration.txt"; }
case "$action" in
  finish) tracker 10; echo "[after training is done] datetime: 2026-11-25 07:53:07 " >> "$out"; exit 0;;
  saved_final_crash) tracker 10; exit 1;;
  crash) tracker 5; echo "rank 0: failing" >> "$out"; exit 1;;
  signal) tracker 5; echo "exiting program after receiving SIGTERM." >> "$out"; exit 0;;
  line) echo "[after training is done] datetime: 2026-11-25 07:53:07 " >> "$out"; exit 0;;
esac
echo "no plan for attempt ${SLURM_RESTART_COUNT:-0}" >&2; exit 99
"""
SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") echo localhost; exit 0;;
  "-o show"|"show job") echo "JobId=$SLURM_JOB_ID JobName=gpt JobState=RUNNING Partition=batch"; exit 0;;
esac
echo "$@" >> "$CALLS"
"""


def _task(kind: str, ckpt: str):
    if kind == "megatron_lm":
        return run.Script(path="/opt/megatron-lm/pretrain_gpt.py", entrypoint="python",
                          args=["--micro-batch-size", "4", "--train-iters", str(ITERS), "--save", ckpt])
    if kind == "bridge_run_recipe":  # Bridge hands what is not its flag to Hydra
        return run.Script(path="scripts/training/run_recipe.py", entrypoint="python",
                          args=["--recipe", "llama32_1b_pretrain_config", f"train.train_iters={ITERS}",
                                f"checkpoint.save={ckpt}"])
    if kind == "bridge_performance":  # Bridge's performance script has flags of its own for both
        return run.Script(path="scripts/performance/run_script.py", entrypoint="python",
                          args=["-m", "llama", "-mr", "llama3_8b", "-ng", "2", "-ms", str(ITERS), "--save_dir", ckpt])
    return run.Script(path="/opt/Megatron-Bridge/examples/recipes/llama/pretrain_llama3_8b.py", entrypoint="python",
                      args=["--config-file", "/conf/llama.yaml"])  # train_iters and the save dir are in the YAML


def run_job(tmp_path, kind: str, plan: str, *, ft: bool = True):
    """[(batch script exit code, requeued)] per attempt, and the ledger's attempt records."""
    cluster, ckpt = tmp_path / "cluster", tmp_path / "ckpt"
    executor = run.SlurmExecutor(account="acct", partition="batch", nodes=1, ntasks_per_node=2, time="04:00:00",
                                 launcher=None if ft else "torchrun", retries=0 if ft else 2,
                                 tunnel=run.LocalTunnel(job_dir=str(cluster)))
    plugins = ([FaultTolerancePlugin(num_job_retries_on_failure=2)] if ft else []) + [PreemptionPlugin()]
    script = preview(_task(kind, str(ckpt)), executor, plugins, name="gpt").replace("<random>", "1234")
    job_dir = cluster / "gpt" / "gpt_preview" / "gpt"
    job_dir.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sinfo", "#!/bin/bash\necho 'localhost|idle'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    attempts = []
    for restart in range(len(plan.split())):
        calls = tmp_path / f"calls_{restart}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "PLAN": plan, "CALLS": str(calls),
               "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_PARTITION": "batch", "CKPT": str(ckpt),
               "MEGATRON_RESILIENCE_PYTHON": sys.executable,
               **({"SLURM_RESTART_COUNT": str(restart)} if restart else {})}
        proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 99, proc.stderr[-2000:]
        requeued = calls.exists() and "requeue 42" in calls.read_text().splitlines()
        attempts.append((proc.returncode, requeued))
        if not requeued:
            break
    with open(job_dir / "job_ledger.jsonl") as f:
        records = [json.loads(line) for line in f if '"kind":"attempt"' in line.replace(" ", "")]
    return attempts, records, job_dir


def _why(records) -> list[tuple[str, str, str]]:
    return [(r["classification"]["error_type"], r["classification"]["source"], r["decision"]["action"])
            for r in records]


def test_finished_megatron_lm_run_is_not_requeued(tmp_path):
    attempts, records, job_dir = run_job(tmp_path, "megatron_lm", "finish")
    assert attempts == [(0, False)]
    assert _why(records) == [("finished", "checkpoint", "stop")]
    assert records[0]["classification"]["reason"].startswith("checkpoint at iteration 10 of train_iters=10")
    assert os.path.exists(job_dir / "gpt_finished_flag")  # touched for the trainer: every later reader agrees


def test_crashed_megatron_lm_run_is_requeued_then_finishes(tmp_path):
    attempts, records, _ = run_job(tmp_path, "megatron_lm", "crash finish")
    assert attempts == [(1, True), (0, False)]
    assert _why(records) == [("unknown", "exit_code", "requeue"), ("finished", "checkpoint", "stop")]


def test_megatron_lm_run_stopped_on_a_signal_is_requeued_then_finishes(tmp_path):
    attempts, records, _ = run_job(tmp_path, "megatron_lm", "signal finish")
    assert attempts == [(0, True), (0, False)]
    assert _why(records) == [("finished", "exit_code", "requeue"), ("finished", "checkpoint", "stop")]


def test_a_crash_after_the_final_checkpoint_is_finished(tmp_path):
    attempts, records, _ = run_job(tmp_path, "megatron_lm", "saved_final_crash")
    assert attempts == [(0, False)]
    assert _why(records) == [("finished", "checkpoint", "stop")]


@pytest.mark.parametrize("kind", ["bridge_run_recipe", "bridge_performance"])
def test_bridge_run_reads_train_iters_and_the_checkpoint_dir(tmp_path, kind):
    """run_recipe.py's Hydra overrides (train.train_iters, checkpoint.save); the performance script's -ms/--save_dir."""
    attempts, records, _ = run_job(tmp_path, kind, "finish")
    assert attempts == [(0, False)] and _why(records) == [("finished", "checkpoint", "stop")]
    assert records[0]["classification"]["reason"].startswith("checkpoint at iteration 10 of train_iters=10")


def test_bridge_config_file_run_is_finished_by_its_end_of_training_line(tmp_path):
    attempts, records, _ = run_job(tmp_path, "bridge_config_file", "signal line")
    assert attempts == [(0, True), (0, False)]
    assert _why(records) == [("finished", "exit_code", "requeue"), ("finished", "log", "stop")]


def test_without_ft_a_finished_run_stops_and_a_crash_is_requeued(tmp_path):
    attempts, records, _ = run_job(tmp_path, "megatron_lm", "crash finish", ft=False)
    assert attempts == [(1, True), (0, False)]
    assert _why(records)[1] == ("finished", "checkpoint", "stop")
