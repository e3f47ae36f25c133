"""``nemo megatron_resilience report|watch|chaos RUN``: the job-level commands.

``RUN`` is a run directory (it holds ``job_ledger.jsonl``) or a NeMo-Run experiment id (its job's
``run_dir`` is used). Options are ``key=value`` as elsewhere in NeMo-Run's CLI:
``report RUN png=/tmp/t.png logs=true``, ``watch RUN interval=10 once=true``. Both run here, on the
login node, at once (no executor, no confirmation). Registered by one import in ``recipes/cli.py``.
"""

import dataclasses
import os
from typing import Any, Callable, List, Literal

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()
from nemo_run.cli.api import RunContext, RunContextError  # noqa: E402

NAMESPACE = "megatron_resilience"
TRUE = ("1", "true", "yes", "on")


def run_dir_of(run: str) -> str:
    """A run directory as given, or the ``run_dir`` of a NeMo-Run experiment's (first) job."""
    if os.path.isdir(run):
        return run
    from megatron_resilience.plugins._task import task_editor

    try:
        exp = import_nemo_run().Experiment.from_id(run)
    except Exception as err:  # noqa: BLE001 - nemo_run raises several kinds for an unknown id
        raise RunContextError(f"{run!r} is neither a run directory nor a NeMo-Run experiment id ({err})") from None
    for job in exp.jobs:
        found = task_editor(job.task, "megatron_resilience").run_dir()
        if found:
            return found
    raise RunContextError(f"experiment {run!r} has no job with a run_dir")


@dataclasses.dataclass(kw_only=True)
class ToolRunContext(RunContext):
    """Calls the command with RUN and its key=value options; nothing is submitted."""

    def cli_execute(self, fn: Callable, args: List[str],
                    entrypoint_type: Literal["task", "experiment"] = "task") -> None:
        positional = [a for a in args if "=" not in a]
        options = dict(a.split("=", 1) for a in args if "=" in a)
        if len(positional) != 1:
            raise RunContextError(f"{fn.__name__}: give exactly one run directory or experiment id, got {positional}")
        code = fn(run_dir_of(positional[0]), **options)
        if code:
            raise SystemExit(code)


def report(run: str, png: str = "", logs: str = "false", json: str = "false") -> int:
    """The run's chain of attempts, goodput and badput by cause, and a PNG timeline (RUN_DIR/attempts_timeline.png)."""
    from megatron_resilience.jobs.report_cli import main

    argv = [run] + (["--png", png] if png else []) + (["--logs"] if logs.lower() in TRUE else []) + \
        (["--json"] if json.lower() in TRUE else [])
    return main(argv)


def watch(run: str, interval: str = "30", once: str = "false", job_id: str = "") -> int:
    """Watch the run's Slurm jobs for what they cannot see about themselves (node failure, lost batch host, ...)."""
    from megatron_resilience.jobs.watch_cli import main

    return main([run, "--interval", interval] + (["--once"] if once.lower() in TRUE else []) +
                (["--job-id", job_id] if job_id else []))


def chaos(run: str, mtbf: str = "", mix: str = "llama3", seed: str = "0", max_count: str = "10",
          max_time: str = "1h", repair: str = "60s", job_id: str = "", plan: str = "false") -> int:
    """Inject a seeded stream of realistic failures into the run's running Slurm job (chaos_ledger.jsonl)."""
    from megatron_resilience.chaos.cli import main

    if not mtbf:
        raise RunContextError("chaos: mtbf= is required (the mean time between faults, e.g. mtbf=120s)")
    argv = [run, "--mtbf", mtbf, "--mix", mix, "--seed", seed, "--max-count", max_count, "--max-time", max_time,
            "--repair", repair] + (["--job-id", job_id] if job_id else []) + (["--plan"] if plan.lower() in TRUE
                                                                             else [])
    return main(argv)


def _register(fn: Callable[..., Any], help: str) -> None:
    run.cli.entrypoint(namespace=NAMESPACE, run_ctx_cls=ToolRunContext, enable_executor=False,
                       skip_confirmation=True, help=help)(fn)


_register(report, "The run's chain of Slurm attempts: why each ended, decisions, goodput/badput, PNG timeline.")
_register(watch, "Watch a run's Slurm jobs: node failures, lost batch hosts, finished-but-alive, stalls.")
_register(chaos, "Inject a seeded stream of realistic failures (the Llama 3 mix) into a run's running Slurm job.")
