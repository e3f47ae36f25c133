"""The jobs whose sbatch scripts are frozen in tests/golden/, and the one command that rewrites them.

Comparing and regenerating are separate on purpose: ``tests/test_plugins_golden.py`` only compares
(it fails when ``UPDATE_GOLDEN`` is set, so a regeneration can never pass as a comparison); after an
intended change, regenerate, read every diff, then run the test::

    .venv/bin/python tests/golden_cases.py            # rewrites tests/golden/*.sh, lists what changed
    git diff tests/golden/

The only random part of a script (torchrun's --rdzv-id) is masked by ``preview``; the experiment id is
fixed (``<name>_preview``); paths come from the executor's LocalTunnel(job_dir=...) and do not depend on
this machine. ``NVRX`` says which nvidia-resiliency-ext release each FT case renders for (its parser
judges the rendered command).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_resilience.upstream import import_nemo_run  # noqa: E402

run = import_nemo_run()

import peer_standins  # noqa: E402

from megatron_resilience.config import CheckpointConfig, RerunConfig, TrainingConfig  # noqa: E402
from megatron_resilience.entry import pretrain  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin, preview  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
JOB_DIR = "/cluster/experiments"
INSTALLED = "0.4.1"  # the nvidia-resiliency-ext that installs on these machines (Python 3.11)


def partial_task(**sections):
    return run.Partial(
        pretrain, run_dir="/lustre/runs/gpt",
        train=run.Config(TrainingConfig, max_steps=1000),
        checkpoint=run.Config(CheckpointConfig, save="/lustre/runs/gpt/ckpt", save_interval=100), **sections,
    )


def script_task():
    return run.Script(path="megatron_resilience", m=True, entrypoint="python",
                      args=["run_dir=/lustre/runs/gpt", "train.max_steps=1000", "checkpoint.save=/lustre/runs/gpt/ckpt",
                            "checkpoint.save_interval=100"])


def inline_task(extra: str = ""):
    return run.Script(inline="export OMP_NUM_THREADS=1\n"
                             f"python -m megatron_resilience run_dir=/lustre/runs/gpt train.max_steps=1000{extra} \\\n"
                             "    checkpoint.save=/lustre/runs/gpt/ckpt checkpoint.save_interval=100\n")


def bridge_task():
    """A Megatron-Bridge recipe script as its documentation runs it: Hydra-style overrides."""
    return run.Script(path="/opt/Megatron-Bridge/examples/recipes/llama/pretrain_llama3_8b.py", entrypoint="python",
                      args=["train.train_iters=1000", "checkpoint.save=/lustre/runs/llama/ckpt",
                            "checkpoint.save_interval=100"])


def megatron_lm_task():
    """Megatron-LM's pretrain_gpt.py with its own flags."""
    return run.Script(path="/opt/megatron-lm/pretrain_gpt.py", entrypoint="python",
                      args=["--tensor-model-parallel-size", "2", "--micro-batch-size", "4", "--train-iters", "1000",
                            "--save", "/lustre/runs/gpt/ckpt", "--load", "/lustre/runs/gpt/ckpt",
                            "--save-interval", "100", "--data-path", "/lustre/data/web_text_document"])


# Issue 22: each launch shape a user migrating from Megatron-Bridge, NeMo 2.0 or Megatron-LM documents.
def bridge_config_file_task():
    """Bridge's example recipe script as its NeMo-Run launcher runs it: a YAML config file, no overrides."""
    return run.Script(path="/opt/Megatron-Bridge/examples/recipes/llama/pretrain_llama3_8b.py", entrypoint="python",
                      args=["--config-file", "/lustre/conf/llama3_8b.yaml"])


def bridge_run_recipe_task():
    """Bridge's current launch flow: scripts/training/run_recipe.py --recipe NAME (a relative path, as in its docs).

    Its own flags are --recipe --dataset --step_func --peft_scheme --packed_sequence --seq_length --hf_path; the
    rest goes to Hydra, so the run's length and checkpoint directory are overrides (--max_steps / --save_dir are
    flags of Bridge's scripts/performance/ scripts only)."""
    return run.Script(path="scripts/training/run_recipe.py", entrypoint="python",
                      args=["--recipe", "llama32_1b_pretrain_config", "train.train_iters=1000",
                            "checkpoint.save=/lustre/runs/llama/ckpt"])


def bridge_old_pretrain_gpt_task():
    """Bridge's older scripts/training/pretrain_gpt.py --recipe NAME: named like Megatron-LM's script."""
    return run.Script(path="/workspace/scripts/training/pretrain_gpt.py", entrypoint="python",
                      args=["--recipe", "llama3_8b_pretrain_config"])


def bridge_partial_task():
    """Bridge's run.Partial(pretrain, config=ConfigContainer(...)) (stand-in classes: tests/peer_standins.py)."""
    return run.Partial(peer_standins.bridge_pretrain, config=peer_standins.bridge_container(),
                       forward_step_func=peer_standins.bridge_forward_step)


def nemo_pretrain_task():
    """NeMo 2.0's llm.pretrain Partial with a trainer that already has a callback (stand-ins: peer_standins)."""
    return run.Partial(peer_standins.nemo_pretrain, model=None, data=None,
                       trainer=run.Config(peer_standins.Trainer, max_steps=1000, devices=2,
                                          callbacks=[run.Config(peer_standins.TimingCallback)]),
                       log=run.Config(peer_standins.NeMoLogger, log_dir="/lustre/runs/nemo"))


def megatron_lm_own_flags_task():
    """Megatron-LM's pretrain_gpt.py whose command line already asks for FT and the exit handler itself."""
    task = megatron_lm_task()
    task.args = [*task.args, "--enable-ft-package", "--exit-signal-handler"]
    return task


def slurm(nodes=1, gpus=2, launcher=None, **kw):
    return run.SlurmExecutor(account="acct", partition="batch", nodes=nodes, ntasks_per_node=gpus, gpus_per_node=gpus,
                             time="04:00:00", launcher=launcher, tunnel=run.LocalTunnel(job_dir=JOB_DIR), **kw)


def ft(**kwargs) -> FaultTolerancePlugin:
    """FaultTolerancePlugin rendered for the release installed here (0.4.1), named explicitly: a golden file must
    not change with whatever nvidia-resiliency-ext the test process happens to import (the newest lane)."""
    return FaultTolerancePlugin(**{"nvrx_version": INSTALLED, **kwargs})


def every_feature(version: str) -> FaultTolerancePlugin:
    """FaultTolerancePlugin with every ft_launcher safety feature that release ``version`` has switched on."""
    if version == "0.4.1":
        return FaultTolerancePlugin(nvrx_version=version, restart_policy="min-healthy")
    return FaultTolerancePlugin(
        nvrx_version=version, restart_policy="any-failed", use_infra_group_rank=True,
        node_health_check_endpoint="unix:///var/run/nvhcd.sock", enable_dist_storage_healthcheck=True,
        storage_health_check=True, gpu_memory_reclaim_timeout=120.0, gpu_memory_tolerance_mb=256.0,
        gpu_memory_poll_interval=1.0, gpus_per_numa=4, numa_bind_strict=False, attribution_endpoint="localhost",
        attribution_stop_action="log", per_cycle_logs=True, cycle_info=True, max_no_progress_cycles=3,
        min_progress_iterations=10, no_restart_exit_code=94)


def _rerun():
    return run.Config(RerunConfig, rerun_mode="validate_results")


CASES = {
    "ft_partial": lambda: (partial_task(), slurm(), [ft()]),
    "preemption_partial": lambda: (partial_task(), slurm(launcher="torchrun"), [PreemptionPlugin()]),
    "ft_preemption_partial": lambda: (partial_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_nsys_partial": lambda: (
        partial_task(), slurm(launcher=run.Torchrun(nsys_profile=True)), [ft(), PreemptionPlugin()]),
    "ft_preemption_2x8_partial": lambda: (
        partial_task(), slurm(nodes=2, gpus=8), [ft(), PreemptionPlugin(preempt_time=120)]),
    "ft_preemption_4x8_partial": lambda: (
        partial_task(), slurm(nodes=4, gpus=8), [ft(rdzv_join_timeout=300), PreemptionPlugin(preempt_time=120)]),
    "ft_preemption_script": lambda: (script_task(), slurm(), [ft(), PreemptionPlugin()]),
    "preemption_script": lambda: (script_task(), slurm(launcher="torchrun"), [PreemptionPlugin()]),
    "ft_heartbeats_preemption_inline": lambda: (
        inline_task(" ft.mode=heartbeats"), slurm(),
        [FaultTolerancePlugin(nvrx_version="0.7"), PreemptionPlugin(signal="SIGINT")]),
    "preemption_inline": lambda: (inline_task(), slurm(), [PreemptionPlugin(signal="SIGUSR1", preempt_time=300)]),
    # Issue 13: other trainers' scripts, configured through converters (detected from their command lines).
    "ft_preemption_bridge_script": lambda: (bridge_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_megatron_lm_script": lambda: (
        megatron_lm_task(), slurm(), [ft(), PreemptionPlugin(preempt_time=120)]),
    # Issue 22: migrating users' launches (Bridge's launchers and Partials, NeMo 2.0, Megatron-LM's own flags).
    "ft_preemption_bridge_config_file_script": lambda: (bridge_config_file_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_bridge_run_recipe_script": lambda: (bridge_run_recipe_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_bridge_pretrain_gpt_recipe_script": lambda: (
        bridge_old_pretrain_gpt_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_bridge_partial": lambda: (
        bridge_partial_task(), slurm(signal="TERM@60"), [ft(), PreemptionPlugin()]),
    "ft_preemption_nemo_partial": lambda: (nemo_pretrain_task(), slurm(), [ft(), PreemptionPlugin()]),
    "ft_preemption_megatron_lm_own_flags_script": lambda: (
        megatron_lm_own_flags_task(), slurm(), [ft(), PreemptionPlugin()]),
    # Issue 15: every ft_launcher safety feature of the oldest and the newest supported release; 0.6's progress
    # settings go on the command line (its command-line defaults override the config file).
    "ft_every_feature_nvrx_0_4": lambda: (partial_task(rerun=_rerun()), slurm(),
                                          [every_feature("0.4.1"), PreemptionPlugin()]),
    "ft_every_feature_nvrx_0_7": lambda: (partial_task(rerun=_rerun()), slurm(),
                                          [every_feature("0.7"), PreemptionPlugin()]),
    "ft_progress_flags_nvrx_0_6": lambda: (partial_task(), slurm(), [FaultTolerancePlugin(
        nvrx_version="0.6", max_no_progress_cycles=4, min_progress_iterations=20, cycle_info=True)]),
    # Issue 25: a node range (min_nodes): elastic where the release's rendezvous is (0.4), hot spares from 0.6.
    "ft_min_nodes_2x8_partial": lambda: (partial_task(), slurm(nodes=2, gpus=8), [
        ft(min_nodes=1), PreemptionPlugin(preempt_time=120), RestartPolicyPlugin(policy="megatron_transient")]),
    "ft_min_nodes_2x8_nvrx_0_7": lambda: (partial_task(), slurm(nodes=2, gpus=8), [
        FaultTolerancePlugin(nvrx_version="0.7", min_nodes=1)]),
    # Issue 24: in-process restart and node-local checkpoints through the plugin, on two 8-GPU nodes: srun keeps the
    # survivors (--kill-on-bad-exit=0 after nemo_run's =1), the wrapper's environment, the restart policy per release,
    # the job's port block; our trainer gets its keys, Megatron-LM and Bridge scripts their flags/overrides.
    "ft_inprocess_local_2x8_nvrx_0_4": lambda: (partial_task(), slurm(nodes=2, gpus=8), [ft(
        inprocess_restart=True, local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10, replication_factor=2),
        PreemptionPlugin()]),
    "ft_inprocess_local_2x8_nvrx_0_7": lambda: (partial_task(), slurm(nodes=2, gpus=8), [FaultTolerancePlugin(
        nvrx_version="0.7", inprocess_restart=True, local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10,
        replication_factor=2)]),
    # Megatron-LM's in-process restart is refused with its FT package (any release) and from megatron-core 0.18
    # (plugins/megatron_lm_flags.py); the cluster's release is named, as nvidia-resiliency-ext's is by ft(): the
    # newest lane has 0.19.2 installed.
    "ft_inprocess_megatron_lm_script_2x8": lambda: (megatron_lm_task(), slurm(nodes=2, gpus=8), [ft(
        inprocess_restart=True, local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10,
        replication_factor=2, enable_ft_package=False, megatron_core_version="0.17.0")]),
    "ft_inprocess_bridge_script_2x8": lambda: (bridge_task(), slurm(nodes=2, gpus=8), [ft(
        inprocess_restart=True, local_checkpoint_dir="/local/ckpt", local_checkpoint_interval=10,
        replication_factor=2)]),
    # Issue 10: the job-level decision with a restart policy and its monitors.
    "ft_preemption_policy_partial": lambda: (partial_task(), slurm(), [
        ft(), PreemptionPlugin(), RestartPolicyPlugin(policy="megatron_transient", monitors="megatron_production")]),
}


def nvrx_release(case: str) -> str:
    """The nvidia-resiliency-ext release a case's ft_launcher command is rendered for."""
    _, _, plugins = CASES[case]()
    return next((p.nvrx_version for p in plugins if isinstance(p, FaultTolerancePlugin) and p.nvrx_version),
                INSTALLED)


def render(case: str) -> str:
    with peer_standins.installed():  # Bridge's and NeMo's modules, for the cases that use their tasks
        task, executor, plugins = CASES[case]()
        return preview(task, executor, plugins, name="gpt", with_scripts=True)


def golden_path(case: str) -> str:
    return os.path.join(GOLDEN, f"{case}.sh")


def main() -> None:
    os.makedirs(GOLDEN, exist_ok=True)
    changed = []
    for case in sorted(CASES):
        script = render(case)
        path = golden_path(case)
        old = open(path).read() if os.path.exists(path) else None
        if old != script:
            with open(path, "w") as f:
                f.write(script)
            changed.append(f"{'changed' if old is not None else 'new'}: {os.path.relpath(path, REPO)}")
    stale = sorted(set(os.listdir(GOLDEN)) - {f"{c}.sh" for c in CASES})
    print("\n".join(changed) or "no golden file changed")
    if stale:
        print(f"not a case any more (delete after review): {stale}")


if __name__ == "__main__":
    main()
