"""``nemo megatron_resilience report|watch|chaos RUN``: the job-level commands.

``RUN`` is a run directory (it holds ``metrics.jsonl`` or ``job_ledger.jsonl``) or a NeMo-Run experiment id
(its job's ``run_dir`` is used). Options take either form, NeMo-Run's ``key=value`` or the flags of
``python -m megatron_resilience.report`` / ``.watch``:

    nemo megatron_resilience report RUN [png=PATH|none] [logs=true] [json=true] [tensorboard=false]
    nemo megatron_resilience report RUN [--png PATH] [--logs] [--json] [--no-tensorboard]
    nemo megatron_resilience watch RUN [interval=SECONDS] [once=true] [job_id=ID] [config=PATH] [policy=FILE]
                                       [monitors=FILE]
    nemo megatron_resilience watch RUN [--interval SECONDS] [--once] [--job-id ID] [--config PATH] [--policy FILE]
                                       [--monitors FILE]

Both run here, on the login node, at once (no executor, no confirmation). A value that does not parse
(``logs=maybe``) or an unknown option (``pgn=x``) is one ``Error:`` line naming the option and the valid
ones. nemo_run's executor-less entrypoints parse their arguments with Fiddle (positional values fill the
parameters in order, so ``--png x`` became ``png='--png'``); :class:`ToolEntrypoint` parses them here.
Registered by one import in ``recipes/cli.py``.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Callable

from megatron_resilience.upstream import import_nemo_run
from megatron_resilience.upstream.nemorun import cli_classes

_, RunContextError, Entrypoint = cli_classes()

NAMESPACE = "megatron_resilience"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# option -> (kind, the flag of the python -m command it becomes); "bool" options are flags there
REPORT_OPTIONS = {"png": ("str", "--png"), "logs": ("bool", "--logs"), "json": ("bool", "--json"),
                  "tensorboard": ("bool", None)}
WATCH_OPTIONS = {"interval": ("float", "--interval"), "once": ("bool", "--once"), "job_id": ("str", "--job-id"),
                 "config": ("str", "--config"), "policy": ("str", "--policy"), "monitors": ("str", "--monitors")}
# durations and counts stay text here: ``python -m megatron_resilience.chaos`` parses and names them
CHAOS_OPTIONS = {"mtbf": ("str", "--mtbf"), "mix": ("str", "--mix"), "seed": ("str", "--seed"),
                 "max_count": ("str", "--max-count"), "max_time": ("str", "--max-time"),
                 "repair": ("str", "--repair"), "job_id": ("str", "--job-id"), "rank": ("str", "--rank"),
                 "plan": ("bool", "--plan")}


def run_dir_of(run: str) -> str:
    """A run directory as given, or the ``run_dir`` of a NeMo-Run experiment's (first) job."""
    if os.path.isdir(run):
        return run
    from megatron_resilience.tasks.our_trainer import our_trainer_editor
    from megatron_resilience.upstream.nemorun import experiment_tasks

    try:
        tasks = experiment_tasks(run)
    except Exception as err:  # noqa: BLE001 - nemo_run raises several kinds for an unknown id
        raise RunContextError(f"{run!r} is neither a run directory nor a NeMo-Run experiment id ({err})") from None
    for task in tasks:
        editor = our_trainer_editor(task, "megatron_resilience")
        found = editor.run_dir() if editor is not None else None
        if found:
            return found
    raise RunContextError(f"experiment {run!r} has no job with a run_dir")


def _listing(options: dict[str, tuple[str, str | None]]) -> str:
    kinds = {"bool": "true|false", "float": "SECONDS", "str": "VALUE"}
    return ", ".join(f"{name}={kinds[kind]}" for name, (kind, _) in options.items())


def parse_tool_args(command: str, args: list[str], options: dict[str, tuple[str, str | None]]
                    ) -> tuple[str, dict[str, Any]]:
    """(RUN, {option: value}) from ``key=value`` and ``--key [value]`` forms; RunContextError names the option."""
    positional, values = [], {}
    items = list(args)
    while items:
        arg = items.pop(0)
        if arg.startswith("--"):
            key, has_value, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if key.startswith("no_") and options.get(key[3:], ("",))[0] == "bool" and not has_value:
                key, value, has_value = key[3:], "false", True
            kind = options.get(key, ("",))[0]
            if not has_value:
                if kind == "bool":
                    value = "true"
                elif items and kind:
                    value = items.pop(0)
                elif kind:
                    raise RunContextError(f"{command}: --{key.replace('_', '-')} needs a value")
        elif "=" in arg:
            key, _, value = arg.partition("=")
        else:
            positional.append(arg)
            continue
        if key not in options:
            close = difflib.get_close_matches(key, list(options), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise RunContextError(f"{command}: unknown option {key!r}; {hint}options: {_listing(options)}")
        kind = options[key][0]
        if kind == "bool":
            if value.lower() not in TRUE + FALSE:
                raise RunContextError(f"{command}: {key} must be true or false, got {value!r}")
            values[key] = value.lower() in TRUE
        elif kind == "float":
            try:
                values[key] = float(value)
            except ValueError:
                raise RunContextError(f"{command}: {key} must be a number of seconds, got {value!r}") from None
            if values[key] <= 0:
                raise RunContextError(f"{command}: {key} must be a number of seconds > 0, got {value!r}")
        else:
            values[key] = value
    if len(positional) != 1:
        raise RunContextError(f"{command}: give exactly one run directory or experiment id, got {positional}")
    return positional[0], values


def report_argv(run: str, values: dict[str, Any]) -> list[str]:
    argv = [run]
    if values.get("png"):
        argv += ["--png", values["png"]]
    argv += ["--logs"] * bool(values.get("logs")) + ["--json"] * bool(values.get("json"))
    return argv + (["--no-tensorboard"] if values.get("tensorboard") is False else [])


def watch_argv(run: str, values: dict[str, Any]) -> list[str]:
    argv = [run]
    for key in ("interval", "job_id", "config", "policy", "monitors"):
        if key in values:
            argv += [WATCH_OPTIONS[key][1], str(values[key])]
    return argv + ["--once"] * bool(values.get("once"))


class ToolEntrypoint(Entrypoint):
    """An executor-less entrypoint whose arguments are parsed by :func:`parse_tool_args`, not Fiddle."""

    def _execute_simple(self, args: list[str], console: Any) -> None:
        options = {"report": REPORT_OPTIONS, "watch": WATCH_OPTIONS, "chaos": CHAOS_OPTIONS}[self.fn.__name__]
        run, values = parse_tool_args(self.fn.__name__, args, options)
        code = self.fn(run_dir_of(run), **values)
        if code:
            raise SystemExit(code)


def report(run: str, png: str = "", logs: bool = False, json: bool = False, tensorboard: bool = True) -> int:
    """The run's chain of attempts, goodput and badput by cause, a PNG timeline (RUN_DIR/attempts_timeline.png)
    and goodput/badput as TensorBoard scalars in the run's TensorBoard folder."""
    from megatron_resilience.report.cli import main

    return main(report_argv(run, {"png": png, "logs": logs, "json": json, "tensorboard": tensorboard}))


def watch(run: str, interval: float = 30.0, once: bool = False, job_id: str = "", config: str = "", policy: str = "",
          monitors: str = "") -> int:
    """Watch the run's Slurm jobs for what they cannot see about themselves (node failure, lost batch host, ...);
    ``policy``/``monitors``: decide with these files (this package's schema or the log-monitoring tool's)."""
    from megatron_resilience.watch.cli import main

    given = {"job_id": job_id, "config": config, "policy": policy, "monitors": monitors}
    values = {"interval": interval, "once": once, **{k: v for k, v in given.items() if v}}
    return main(watch_argv(run, values))


def chaos(run: str, mtbf: str = "", mix: str = "llama3", seed: str = "0", max_count: str = "10",
          max_time: str = "1h", repair: str = "60s", job_id: str = "", rank: str = "", plan: bool = False) -> int:
    """Inject a seeded stream of realistic failures into the run's running Slurm job (chaos_ledger.jsonl)."""
    from megatron_resilience.chaos.cli import main

    if not mtbf:
        raise RunContextError("chaos: mtbf= is required (the mean time between faults, e.g. mtbf=120s)")
    values = {"mtbf": mtbf, "mix": mix, "seed": seed, "max_count": max_count, "max_time": max_time,
              "repair": repair, "job_id": job_id, "rank": rank}
    argv = [run] + [arg for key, value in values.items() if value for arg in (CHAOS_OPTIONS[key][1], str(value))]
    return main(argv + ["--plan"] * bool(plan))


def _register(fn: Callable[..., Any], help: str) -> None:
    import_nemo_run().cli.entrypoint(namespace=NAMESPACE, entrypoint_cls=ToolEntrypoint, enable_executor=False,
                                     skip_confirmation=True, help=help)(fn)


_register(report, "The run's chain of Slurm attempts: why each ended, decisions, goodput/badput (also as "
                  "TensorBoard scalars), PNG timeline. Options: png=PATH|none logs=true json=true tensorboard=false "
                  "(or --png PATH --logs --json --no-tensorboard).")
_register(watch, "Watch a run's Slurm jobs: node failures, lost batch hosts, finished-but-alive, stalls. Options: "
                 "interval=SECONDS once=true job_id=ID config=PATH policy=FILE monitors=FILE (or --interval SECONDS "
                 "--once --job-id ID --config PATH --policy FILE --monitors FILE).")
_register(chaos, "Inject a seeded stream of realistic failures (the Llama 3 mix) into a run's running Slurm job. "
                 "Options: mtbf=DURATION mix=NAME|FILE seed=N max_count=N max_time=DURATION repair=DURATION "
                 "job_id=ID rank=N plan=true (or --mtbf DURATION ... --plan).")
