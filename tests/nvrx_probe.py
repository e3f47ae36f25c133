"""Run inside one nvidia-resiliency-ext release (PYTHONPATH set by tests/nvrx_releases.py): ask its own code.

Reads a JSON request on stdin, prints one JSON answer:

* ``{"table": true}`` -> that release's ft_launcher options (option strings, dest, default, whether an
  environment variable can give it, choices) and its FaultToleranceConfig fields;
* ``{"parse": [{"argv": [...], "env": {...}}, ...]}`` -> for each command: the parsed arguments and the
  FT config ft_launcher would run with (its ``FaultToleranceConfig.from_args``: the YAML named by
  ``--ft-cfg-path``/``PET_FT_CFG_PATH``, then the command-line values);
* ``{"cycle_info": {"dir": D, "prefix": P, "job": J, "attempt": A, "nodes": N, "cycles": [[start, end], ...]}}``
  -> that release's own ``CycleInfoWriter`` writes the cycles' records into D; answers the per-cycle log
  file name ft_launcher gives each cycle (``cycle_log_file(P, n)``), in ``cycle_logs`` (0.7 and newer).

The environment is set before the parser is built: torch-elastic's ``env`` action reads ``PET_<DEST>`` then.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import json
import os
import sys
import warnings


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def main() -> None:
    warnings.simplefilter("ignore")
    request = json.load(sys.stdin)
    from nvidia_resiliency_ext.fault_tolerance import launcher
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig

    answer = {"version": importlib.metadata.version("nvidia-resiliency-ext"), "module": launcher.__file__}
    if request.get("table"):
        answer["options"] = [
            {"option_strings": a.option_strings, "dest": a.dest, "default": _plain(a.default),
             "env": type(a).__name__ == "env", "choices": _plain(list(a.choices)) if a.choices else None}
            for a in launcher.get_args_parser()._actions if a.option_strings]
        answer["config_fields"] = [f.name for f in dataclasses.fields(FaultToleranceConfig)]
    results = []
    for command in request.get("parse", []):
        saved = dict(os.environ)
        os.environ.update(command["env"])
        try:
            args = launcher.get_args_parser().parse_args(command["argv"])
            config = FaultToleranceConfig.from_args(args)
            config_fields = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
            results.append({"args": {k: _plain(v) for k, v in vars(args).items()}, "config": config_fields})
        except SystemExit as err:  # argparse rejected the command
            results.append({"error": f"argparse exit {err.code}"})
        finally:
            os.environ.clear()
            os.environ.update(saved)
    answer["parsed"] = results
    if request.get("cycle_info"):
        from nvidia_resiliency_ext.fault_tolerance import cycle_info_writer as w

        ci = request["cycle_info"]
        writer = w.CycleInfoWriter(ci["dir"])
        answer["cycle_logs"] = []
        for cycle, (start, end) in enumerate(ci["cycles"]):
            path = w.cycle_log_file(ci["prefix"], cycle)
            answer["cycle_logs"].append(path)
            writer.write_cycle_start(ci["job"], ci["attempt"], cycle, start, path, ci["nodes"])
            writer.update_cycle_end(ci["job"], ci["attempt"], cycle, end)
        writer.shutdown()
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
