"""What the plugins add to a Megatron-LM command line so that its restarts resume and its learned timeouts are
bounded (plugins/megatron_lm_flags.py): exact argv in, exact argv, FT config line and log line out.

Why each matters was measured with Megatron-LM's real trainer (megatron-core 0.19.2 under ft_launcher 0.7.0,
FACTS.md): with ``--save`` alone a restarted group trained again from step 0; learned timeouts came out at 0.72 s
per step with nvidia-resiliency-ext's safety factor 5. The lane ``make test-megatron-lm`` runs the trainer with
what these tests pin.
"""

from __future__ import annotations

import logging

import pytest

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402

LOGGER = "megatron_resilience.plugins"
SCRIPT = "/opt/megatron-lm/pretrain_gpt.py"
OWN = ["--micro-batch-size", "4", "--train-iters", "1000", "--save", "/lustre/ckpt", "--save-interval", "100"]
LOAD_LINE = ("{plugin}: task args += ['--load', '/lustre/ckpt']: Megatron-LM resumes only from --load; with --save "
             "alone every in-job restart and requeue would train again from step 0")
FACTOR_LINE = ("FaultTolerancePlugin: FT config safety_factor=20.0 (nvidia-resiliency-ext's default 5.0): with "
               "--calc-ft-timeouts Megatron-LM sets each section timeout to safety_factor x the longest interval it "
               "saw, with no minimum (0.72 s per step measured with 5.0); the factor is the one bound ft_launcher "
               "passes to the ranks")


def slurm():
    executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/cluster/exp"))
    executor.assign("job_1", "/cluster/exp/job_1", task_id="job", task_dir="job")
    return executor


def configured(args, *plugins, caplog, path=SCRIPT):
    caplog.set_level(logging.INFO, LOGGER)
    task, executor = run.Script(path=path, entrypoint="python", args=list(args)), slurm()
    for plugin in plugins:
        plugin.setup(task, executor)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return [str(a) for a in task.args], executor, messages


def ft_yaml(executor) -> list[str]:
    """The lines of the sbatch script's block that writes ft_launcher's FT config (``executor.setup_lines``)."""
    return [line.strip() for line in (executor.setup_lines or "").splitlines() if ": " in line]


def test_save_only_gets_load_from_both_plugins_once(caplog):
    args, executor, messages = configured(OWN, FaultTolerancePlugin(), PreemptionPlugin(), caplog=caplog)
    assert args == [*OWN, "--enable-ft-package", "--calc-ft-timeouts", "--load", "/lustre/ckpt",
                    "--exit-signal-handler"]
    assert LOAD_LINE.format(plugin="FaultTolerancePlugin") in messages
    assert not any(m.startswith("PreemptionPlugin: task args += ['--load'") for m in messages)  # already there
    assert "safety_factor: 20.0" in ft_yaml(executor) and FACTOR_LINE in messages


def test_preemption_alone_adds_load_for_the_requeue(caplog):
    args, _, messages = configured(OWN, PreemptionPlugin(), caplog=caplog)
    assert args == [*OWN, "--exit-signal-handler", "--load", "/lustre/ckpt"]
    assert LOAD_LINE.format(plugin="PreemptionPlugin") in messages


@pytest.mark.parametrize("given", [["--load", "/lustre/other"], ["--load=/lustre/other"]])
def test_a_load_of_the_users_own_is_kept(caplog, given):
    args, _, messages = configured([*OWN, *given], FaultTolerancePlugin(), caplog=caplog)
    assert args == [*OWN, *given, "--enable-ft-package", "--calc-ft-timeouts"]
    assert not any("--load" in m and "task args +=" in m for m in messages)


def test_save_given_with_equals_sign(caplog):
    own = ["--train-iters", "1000", "--save=/lustre/ckpt"]
    args, _, _ = configured(own, FaultTolerancePlugin(), caplog=caplog)
    assert args == [*own, "--enable-ft-package", "--calc-ft-timeouts", "--load", "/lustre/ckpt"]


def test_no_save_no_load(caplog):
    own = ["--train-iters", "1000", "--micro-batch-size", "4"]
    args, _, _ = configured(own, PreemptionPlugin(), caplog=caplog)
    assert args == [*own, "--exit-signal-handler"]


def test_timeouts_not_learned_keep_nvrx_factor(caplog):
    args, executor, messages = configured(OWN, FaultTolerancePlugin(calc_ft_timeouts=False), caplog=caplog)
    assert args == [*OWN, "--enable-ft-package", "--load", "/lustre/ckpt"]
    assert not any(line.startswith("safety_factor") for line in ft_yaml(executor))
    assert FACTOR_LINE not in messages


def test_users_own_calc_ft_timeouts_gets_the_factor(caplog):
    own = [*OWN, "--calc-ft-timeouts"]
    _, executor, messages = configured(own, FaultTolerancePlugin(calc_ft_timeouts=False), caplog=caplog)
    assert "safety_factor: 20.0" in ft_yaml(executor) and FACTOR_LINE in messages


def test_a_bridge_script_is_not_touched(caplog):
    own = ["--recipe", "llama32_1b_pretrain_config", "checkpoint.save=/lustre/ckpt"]
    args, executor, messages = configured(own, FaultTolerancePlugin(), PreemptionPlugin(), caplog=caplog,
                                          path="scripts/training/run_recipe.py")
    assert "--load" not in args and not any(line.startswith("safety_factor") for line in ft_yaml(executor))


SIGNAL_SAVE_WARNING = (
    "PreemptionPlugin: Megatron-LM saves in --ckpt-format {fmt}: seen with megatron-core 0.19.2 under ft_launcher "
    "0.7.0, the save at the signal fails (BrokenPipeError): megatron-core returns each torch_dist save's write results "
    "through a helper process it spawns on the first save, in the rank's process group, and the launcher forwards the "
    "signal to that group; the checkpoint stays at the previous save. --ckpt-format torch saved and exited 0 there "
    "(tests/megatron_lm/)")


@pytest.mark.parametrize("given, fmt", [([], "torch_dist (its default)"), (["--ckpt-format", "torch_dist"],
                                                                           "torch_dist"),
                                        (["--ckpt-format", "torch"], None)])
def test_preemption_warns_of_the_torch_dist_save_at_the_signal(caplog, given, fmt):
    _, _, messages = configured([*OWN, *given], PreemptionPlugin(), caplog=caplog)
    warned = [m for m in messages if "save at the signal fails" in m]
    assert warned == ([SIGNAL_SAVE_WARNING.format(fmt=fmt)] if fmt else [])


def test_with_a_converter_of_the_users_only_its_arguments_are_added(caplog):
    """examples/argparse_trainer.py takes Megatron-LM's flags but not --load; its tests give the converter."""
    from megatron_resilience.plugins import megatron_lm_args

    args, executor, messages = configured(OWN, FaultTolerancePlugin(script_args_converter_fn=megatron_lm_args),
                                          PreemptionPlugin(script_args_converter_fn=megatron_lm_args), caplog=caplog)
    assert args == [*OWN, "--enable-ft-package", "--calc-ft-timeouts", "--exit-signal-handler"]
    assert not any(line.startswith("safety_factor") for line in ft_yaml(executor))
    assert not any("save at the signal fails" in m or "safety_factor" in m for m in messages)


FSDP = {  # Megatron-LM's own flags for its two sharded data-parallel paths, with the format each path saves in
    "megatron_fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                      "--ckpt-format", "fsdp_dtensor"],
    "torch_fsdp2": ["--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--untie-embeddings-and-output-weights"],
}


@pytest.mark.parametrize("path", sorted(FSDP))
def test_an_fsdp_run_passes_through_untouched_and_its_progress_is_read_from_its_tracker(caplog, tmp_path, path):
    """issue 33: the plugins add what they add to any Megatron-LM run and leave its FSDP flags alone; the job-level
    room knows an FSDP run's progress and end from Megatron-LM's tracker file, which megatron-core 0.19.2's
    ``megatron/training/checkpointing.py`` writes after every global save whatever ``--ckpt-format`` (torch_dist,
    fsdp_dtensor, torch_dcp; only the node-local tier has none): the same file as for DDP."""
    from megatron_resilience.jobs.finished import detect
    from megatron_resilience.plugins.task_settings import finished_evidence

    own = [*OWN[:4], "--save", str(tmp_path), *OWN[6:], *FSDP[path]]
    args, executor, _ = configured(own, FaultTolerancePlugin(), PreemptionPlugin(), caplog=caplog)
    assert args == [*own, "--enable-ft-package", "--calc-ft-timeouts", "--load", str(tmp_path),
                    "--exit-signal-handler"]
    evidence = finished_evidence(executor)
    assert evidence == {"checkpoint_dir": str(tmp_path), "train_iters": 1000}
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("900")
    assert detect(**evidence, exit_code=1, log_lines=[]) is None  # a crash at 900 of 1000: not finished
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1000")
    done = detect(**evidence, exit_code=1, log_lines=[])
    assert (done.source, done.step) == ("checkpoint", 1000)


LOCAL_LINE = ("FaultTolerancePlugin: task args -= ['--calc-ft-timeouts'] (with --non-persistent-ckpt-type local): "
              "Megatron-LM learns its checkpointing section timeout from every save, local ones included, so a "
              "persistent save after fast local saves is ended as hung (measured: 0.67 s learned from ~30 ms local "
              "saves killed a persistent save, and the restarted group met the same kill again); the FT config's "
              "section timeouts apply instead")


@pytest.mark.parametrize("own_calc", [False, True])
def test_node_local_saves_drop_learned_timeouts(caplog, own_calc):
    """Node-local checkpoints through the plugin's flags (or the user's own ``--calc-ft-timeouts``): Megatron-LM would
    learn the checkpointing timeout from the local saves; the flag goes, the warning says why, the FT config keeps
    nvidia-resiliency-ext's factor and the plugin's section timeouts."""
    own = [*OWN, "--calc-ft-timeouts"] if own_calc else OWN
    args, executor, messages = configured(own, FaultTolerancePlugin(local_checkpoint_dir="/local/ckpt",
                                                                    local_checkpoint_interval=3), caplog=caplog)
    assert "--calc-ft-timeouts" not in args
    assert args[-6:] == ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/local/ckpt",
                         "--non-persistent-save-interval", "3"], args
    assert LOCAL_LINE in messages and FACTOR_LINE not in messages
    assert not any(line.startswith("safety_factor") for line in ft_yaml(executor))
