"""``nemo megatron_resilience pretrain``: entry-point discovery, factories, exact overrides, clear errors.

Most commands run NeMo-Run's real CLI (``create_cli``) in this process to save
interpreter start-ups; one test runs the installed ``nemo`` console script.
"""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from megatron_resilience.config import ConfigError
from megatron_resilience.recipes import apply_overrides, gpt_tiny, to_config

NEMO = os.path.join(os.path.dirname(sys.executable), "nemo")


def nemo(*args: str) -> tuple[int, str, str]:
    """``nemo megatron_resilience pretrain ARGS`` through NeMo-Run's CLI: (exit code, stdout, stderr)."""
    from nemo_run.cli.api import create_cli

    argv = ["nemo", "megatron_resilience", "pretrain", *args]
    saved, sys.argv = sys.argv, argv
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = create_cli()(args=argv[1:], standalone_mode=False)
    finally:
        sys.argv = saved
    return code or 0, out.getvalue(), err.getvalue()


def config_lines(stdout: str) -> dict[str, str]:
    """The ``key=value`` lines of a dry run's final config."""
    lines = stdout.split("final config", 1)[1].splitlines()[1:]
    out = {}
    for line in lines:
        if line.startswith("#"):
            break
        key, _, value = line.partition("=")
        out[key] = value
    return out


def test_dryrun_overrides_change_exactly_the_named_fields(tmp_path):
    code, base_out, err = nemo("--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun")
    assert code == 0, err
    code, out, err = nemo("--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun",
                          "train.max_steps=100", "ft.calc_ft_timeouts=false", "checkpoint.save_interval=null",
                          "optim.lr=1e-3", f"run_dir={tmp_path}/other")
    assert code == 0, err
    base, new = config_lines(base_out), config_lines(out)
    assert base.keys() == new.keys() and len(base) > 50
    changed = {k: (base[k], new[k]) for k in base if base[k] != new[k]}
    assert changed == {
        "train.max_steps": ("40", "100"),
        "ft.calc_ft_timeouts": ("true", "false"),
        "checkpoint.save_interval": ("10", "null"),
        "optim.lr": ("0.003", "0.001"),
        "run_dir": (f"{tmp_path}/gpt_tiny", f"{tmp_path}/other"),
    }
    assert "# pretrain: final config (no executor, world size 1)" in out


def test_executor_factories_set_world_size_and_launcher(tmp_path):
    code, out, err = nemo("--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun", "run.executor=local_ft",
                          "run.executor.ntasks_per_node=2")
    assert code == 0, err
    assert "# pretrain: final config (LocalExecutor, world size 2)" in out
    import fiddle as fdl
    import nemo_run as run

    from megatron_resilience.recipes.cli import local, local_ft, slurm

    ft = fdl.build(local_ft())
    assert (ft.launcher, ft.ntasks_per_node) == ("ft", 2)  # FaultTolerancePlugin fills in every ft_launcher field
    assert "# the executor uses ft_launcher: added FaultTolerancePlugin() to run.plugins" in out
    assert fdl.build(local()).launcher == "torchrun" and fdl.build(local()).ntasks_per_node == 2
    ex = fdl.build(slurm(account="acct", partition="batch", nodes=2, time="01:00:00"))
    assert (ex.account, ex.partition, ex.nodes, ex.time, ex.ntasks_per_node, ex.gpus_per_node) == \
        ("acct", "batch", 2, "01:00:00", 8, 8)
    assert isinstance(ex.tunnel, run.LocalTunnel) and type(ex.packager) is run.Packager
    ssh = fdl.build(slurm(account="acct", host="login.example.com", user="me", job_dir="/lustre/me/jobs"))
    assert isinstance(ssh.tunnel, run.SSHTunnel)
    assert (ssh.tunnel.host, ssh.tunnel.user, ssh.tunnel.job_dir) == ("login.example.com", "me", "/lustre/me/jobs")


@pytest.mark.parametrize("args, message", [
    (["train.max_stepz=3"],
     "Error: train.max_stepz: unknown key; did you mean train.max_steps? valid keys in train: train.max_steps, "
     "train.micro_batch_size, "),
    (["trian.max_steps=3"], "Error: trian.max_steps: unknown key; did you mean train.max_steps? sections: run_dir, "
                            "model, parallel, "),
    (["train.max_steps=abc"], "Error: train.max_steps: must be an integer, got 'abc'\n"),
    (["ft.enabled=maybe"], "Error: ft.enabled: must be true or false, got 'maybe'\n"),
    (["model.precision=fp8"], "Error: model.precision: must be one of ['fp32', 'bf16', 'fp16'], got 'fp8'\n"),
    (["optim.lr_warmup_steps=50"], "Error: optim.lr_warmup_steps: must be <= train.max_steps=40, got 50\n"),
    (["parallel.tensor_model_parallel_size=2", "run.executor=local", "run.executor.ntasks_per_node=3"],
     "Error: parallel: tensor_model_parallel_size * pipeline_model_parallel_size = 2 must divide the world "
     "size 3, got 2\n"),
    (["train.max_steps"], "Error: 'train.max_steps': expected key=value, e.g. train.max_steps=100\n"),
    (["train.max_steps=3", "train.max_steps=2"],
     "Error: train.max_steps: given twice on the command line ('3', then '2'); give it once\n"),
    (["run.executor=local", "run.executor=slurm"],
     "Error: run.executor: given twice on the command line ('local', then 'slurm'); give it once\n"),
])
def test_bad_overrides_fail_with_a_clear_message(args, message, tmp_path):
    code, out, err = nemo("--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun", *args)
    assert code == 1
    assert err.startswith(message) and err.count("\n") == 1, err  # one line
    assert "final config" not in out


def test_an_unknown_section_lists_the_sections_and_where_every_key_is():
    code, _, err = nemo("--factory", "gpt_tiny", "--dryrun", "foo=1")
    assert code == 1
    assert err == ("Error: foo: unknown key; sections: run_dir, model, parallel, data, optim, train, checkpoint, ft, "
                   "straggler, rerun, logger, inprocess (every key: python -m megatron_resilience --help)\n")


def test_without_a_factory_run_dir_is_required_and_sections_default(tmp_path):
    code, _, err = nemo("--dryrun", "train.max_steps=5")
    assert code == 1 and err.startswith("Error: run_dir: required")
    code, out, err = nemo("--dryrun", f"run_dir={tmp_path}", "train.max_steps=5", "model.num_layers=4")
    assert code == 0, err
    lines = config_lines(out)
    assert (lines["run_dir"], lines["train.max_steps"], lines["model.num_layers"], lines["ft.enabled"]) == \
        (str(tmp_path), "5", "4", "false")


def test_apply_overrides_leaves_the_recipe_untouched(tmp_path):
    recipe = gpt_tiny(dir=str(tmp_path))
    edited = apply_overrides(recipe, ["train.max_steps=7", "straggler.stop_if_detected=true"])
    assert (recipe.train.max_steps, recipe.straggler.stop_if_detected) == (40, False)
    assert (to_config(edited).train.max_steps, to_config(edited).straggler.stop_if_detected) == (7, True)
    with pytest.raises(ConfigError, match=r"^rerun.mode: unknown key; did you mean rerun.rerun_mode or ft.mode\? "
                                          r"valid keys in rerun: rerun.rerun_mode, "):
        apply_overrides(recipe, ["rerun.mode=validate_results"])


def test_installed_nemo_script_finds_the_namespace_through_the_entry_point(tmp_path):
    proc = subprocess.run(
        [NEMO, "megatron_resilience", "pretrain", "--factory", f"gpt_126m(dir={tmp_path},num_nodes=2)", "--dryrun",
         "run.executor=local", "run.executor.ntasks_per_node=16", "train.max_steps=1000",
         "optim.lr_warmup_steps=10"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = config_lines(proc.stdout)
    assert "# pretrain: final config (LocalExecutor, world size 16)" in proc.stdout
    assert (lines["model.num_layers"], lines["model.hidden_size"], lines["train.max_steps"],
            lines["train.global_batch_size"], lines["run_dir"]) == ("12", "768", "1000", "256", f"{tmp_path}/gpt_126m")


SLURM = ["--factory", "gpt_126m(dir=/lustre/me/runs,num_nodes=2)", "--dryrun", "run.executor=slurm",
         "run.executor.account=acct", "run.executor.partition=batch", "run.executor.nodes=2",
         "train.max_steps=1000", "optim.lr_warmup_steps=10"]


def test_slurm_dryrun_prints_the_sbatch_script_with_the_plugins_applied():
    code, out, err = nemo(*SLURM, "run.plugins=[ft,preemption]", "run.plugins[1].preempt_time=90",
                          "run.plugins.num_in_job_restarts=5")
    assert code == 0, err
    config, script = out.split("# sbatch script\n", 1)
    assert "# pretrain: final config (SlurmExecutor, world size 16)" in config
    assert config_lines(config)["run_dir"] == "/lustre/me/runs/gpt_126m"
    for line in ("#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --signal=SIGTERM@90",
                 "#SBATCH --time=04:00:00", "rank_section_timeouts:", "export TORCHX_MAX_RETRIES=3"):
        # TORCHX_MAX_RETRIES=3: 2 retries, 1 + 2 attempts
        assert line in script, line
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert " ft_launcher " in srun and " --max-restarts 5 " in srun and " --nproc-per-node 8 " in srun
    assert "-m nemo_run.core.runners.fdl_runner -n pretrain" in srun


@pytest.mark.parametrize("args, message", [
    (["run.executor=slurm", "run.executor.acount=x"],
     "Error: executor.acount: unknown key; did you mean executor.account? valid keys: executor.packager, "),
    (["run.executor=slurmx"], "Error: run.executor=slurmx: unknown executor; ours: local, local_ft, slurm\n"),
    (["run.executor=slurm", "run.executor.account=a", "run.plugins=ft", "run.plugins.step_timeout=-1"],
     "Error: FaultTolerancePlugin.step_timeout: must be a number > 0, got -1.0\n"),
    (["run.executor=slurm", "run.plugins=ft", "run.plugins.preempt_time=10"],
     "Error: plugins.preempt_time: unknown key; valid keys: plugins.attribution_endpoint, "
     "plugins.attribution_stop_action,"),
    (["run.executor=slurm"], "Error: executor.account: must be a Slurm account name, got ''\n"),
])
def test_bad_executor_and_plugin_overrides_fail_with_a_clear_message(args, message):
    code, out, err = nemo("--factory", "gpt_126m", "--dryrun", *args)
    assert code == 1
    assert err.startswith(message) and err.count("\n") == 1, err


def test_python_dash_m_runs_the_same_command_without_the_nemo_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_resilience.recipes.cli", "pretrain", "--factory",
                           f"gpt_tiny(dir={tmp_path})", "train.max_steps=3", "--dryrun"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert config_lines(proc.stdout)["train.max_steps"] == "3"


def test_no_ranks_per_node_is_named_first_and_worded_as_in_python(tmp_path):
    """``executor.ntasks_per_node=0``: the CLI leads with that key (not with gpus_per_node), in the Python API's
    words."""
    from megatron_resilience.plugins import preview
    from megatron_resilience.recipes import gpt_tiny
    from megatron_resilience.upstream import import_nemo_run

    run = import_nemo_run()
    code, _, err = nemo("--factory", f"gpt_tiny(dir={tmp_path})", "--dryrun", "run.executor=slurm",
                        "run.executor.account=a", "run.executor.ntasks_per_node=0")
    executor = run.SlurmExecutor(account="a", partition="p", nodes=1, ntasks_per_node=0,
                                 tunnel=run.LocalTunnel(job_dir=str(tmp_path)))
    with pytest.raises(Exception) as raised:
        preview(gpt_tiny(dir=str(tmp_path)), executor=executor)
    assert code == 1 and err == f"Error: {raised.value}\n" == "Error: executor.ntasks_per_node: must be an integer " \
                                                              ">= 1, got 0\n"
