"""``preview(task, executor, plugins)``: the sbatch script a job would run, without submitting it.

It takes the steps ``run.run`` / ``Experiment`` take for one job (clone and assign the executor,
clone the task, apply the plugins in order, package, let nemo_run's Slurm scheduler render the
script; the task and executor are checked as the plugins check them, ``plugins/task_check.py``)
with three differences that keep it side-effect free:

* everything nemo_run writes locally (configs, inline scripts, the sbatch file) goes to a temporary
  directory that is deleted afterwards: the user's NEMORUN_HOME is only read (for the default
  LocalTunnel job directory, as nemo_run would);
* nothing is packaged (no git checkout needed, no archive, no tunnel): the packager never changes
  the script's text;
* the experiment id is ``<name>_preview`` instead of ``<name>_<unix time>``, and torchrun's random
  ``--rdzv-id`` is shown as ``--rdzv-id <random>`` (the only random part of the script).
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from typing import Any, Iterable

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins.submit_check import check_callable, check_plugins
from megatron_resilience.plugins.task_check import check_task
from megatron_resilience.upstream import import_nemo_run

RDZV_ID = re.compile(r"--rdzv-id \d+")
RDZV_ID_MASK = "--rdzv-id <random>"


def mask_random_ids(script: str) -> str:
    return RDZV_ID.sub(RDZV_ID_MASK, script)


def default_name(task: Any) -> str:
    """The job name nemo_run's ``run.run`` would use."""
    run = import_nemo_run()
    from nemo_run.config import get_type_namespace

    return task.get_name() if isinstance(task, run.Script) else get_type_namespace(task.__fn_or_cls__)


def _prepared(task: Any, executor: Any, plugins: Iterable[Any], name: str, tmp: str) -> tuple[Any, Any]:
    """Clones of ``task`` and ``executor``, assigned to a job under ``tmp`` and set up by ``plugins`` in order
    (as ``Experiment.add`` does), then checked like the plugins check them."""
    run = import_nemo_run()
    check_callable(task)
    experiment_id = f"{name}_preview"
    exp_dir = os.path.join(tmp, "experiments", name, experiment_id)
    job_executor = executor.clone()
    job_executor.assign(experiment_id, exp_dir, task_id=name, task_dir=name)
    job_task = copy.deepcopy(task) if isinstance(task, run.Script) else task.clone()
    for plugin in plugins:
        plugin = copy.deepcopy(plugin)
        plugin.assign(experiment_id)
        plugin.setup(job_task, job_executor)
    check_task(job_task, job_executor, plugins=list(plugins))  # what run.run checks, also with no plugins
    return job_task, job_executor


def check_job(task: Any, executor: Any, plugins: Any | Iterable[Any] = (), *, name: str | None = None) -> None:
    """Every submit-time check of ``task`` on ``executor`` with ``plugins`` (any executor the plugins support),
    nothing rendered: what the CLI runs before it prints or submits anything."""
    plugins = check_plugins(plugins)
    with tempfile.TemporaryDirectory(prefix="megatron_resilience_check_") as tmp:
        _prepared(task, executor, plugins, name or default_name(task), tmp)


def preview(task: Any, executor: Any, plugins: Any | Iterable[Any] = (), *, name: str | None = None,
            with_scripts: bool = False) -> str:
    """The exact sbatch script for ``task`` on the SlurmExecutor ``executor`` after ``plugins`` ran.

    ``name`` is the job name (default: what ``run.run`` uses). ``with_scripts`` appends the files an
    inline ``run.Script`` becomes (``<job dir>/scripts/*.sh``, which the sbatch script runs), each
    after a ``# ==> <path> <==`` line.
    """
    run = import_nemo_run()
    from nemo_run.run.torchx_backend.packaging import package
    from nemo_run.run.torchx_backend.schedulers.slurm import SlurmTunnelScheduler

    if not isinstance(executor, run.SlurmExecutor):
        raise ConfigError(f"preview: needs a run.SlurmExecutor (the sbatch script), got {type(executor).__name__}")
    plugins = check_plugins(plugins)
    check_callable(task)
    name = name or default_name(task)

    with tempfile.TemporaryDirectory(prefix="megatron_resilience_preview_") as tmp:
        job_task, job_executor = _prepared(task, executor, plugins, name, tmp)
        job_executor.create_job_dir()
        app = package(name, job_task, executor=job_executor, serialize_to_file=True)
        # Packaging code never changes the script; skipping it avoids a shell-out and any git/tunnel access.
        job_executor.package = lambda packager, job_name: None
        scheduler = SlurmTunnelScheduler(session_name="megatron_resilience_preview")
        scheduler._submit_dryrun(app, job_executor)
        with open(os.path.join(job_executor.experiment_dir, f"{job_executor.job_name}_sbatch.sh")) as f:
            script = f.read()
        scripts_dir = os.path.join(job_executor.job_dir, "scripts")
        if with_scripts and os.path.isdir(scripts_dir):
            remote_dir = os.path.join(job_executor.tunnel.job_dir, os.path.basename(job_executor.job_dir), "scripts")
            for filename in sorted(os.listdir(scripts_dir)):
                with open(os.path.join(scripts_dir, filename)) as f:
                    script += f"\n\n# ==> {os.path.join(remote_dir, filename)} <==\n{f.read()}"
    return mask_random_ids(script)
