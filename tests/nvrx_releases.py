"""nvidia-resiliency-ext releases as judges: each release's own parser and config loader, in a subprocess.

Only 0.4.1 installs here; newer releases ship cp312 / glibc 2.39 wheels whose pure-Python parts (the launcher,
its parser, the FT config) load on Python 3.11 when unpacked:

| release | where                      | built by                                                      |
|---------|----------------------------|---------------------------------------------------------------|
| 0.4.1   | .venv (installed)          | make env                                                      |
| 0.6.0   | .venv-nvrx/0.6.0 (+ newest)| scripts/nvrx_releases/install.sh 0.6.0 (one 0.8 MB wheel)     |
| 0.7.0   | .venv-newest               | scripts/newest/install.sh (the newest lane)                   |

Both scripts are idempotent; :func:`ensure` runs them once when the folder is missing, so ``make test``
works on a fresh clone. :func:`probe` asks ``tests/nvrx_probe.py`` inside a release and checks that the
release answering is the one asked for (a stale PYTHONPATH cannot pass for another release).

Also here: :func:`job_step`, which runs a rendered sbatch script's job-step line through bash exactly as
the batch script would (our ``srun`` function included, ``srun`` itself a stub) and returns the
ft_launcher command, its environment and its FT config file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "nvrx_probe.py"
NEWEST = REPO / ".venv-newest"
RELEASES = ("0.4.1", "0.6.0", "0.7.0")


@functools.lru_cache(maxsize=None)
def ensure(release: str) -> tuple[str, ...]:
    """PYTHONPATH entries for ``release``, installing it here first when missing."""
    if release == "0.4.1":
        return ()
    if not (NEWEST / ".installed").exists():
        subprocess.run([str(REPO / "scripts/newest/install.sh")], cwd=REPO, check=True, capture_output=True)
    if release == "0.7.0":
        return (str(NEWEST),)
    folder = REPO / ".venv-nvrx" / release
    if not (folder / ".installed").exists():
        subprocess.run([str(REPO / "scripts/nvrx_releases/install.sh"), release], cwd=REPO, check=True,
                       capture_output=True)
    return (str(folder), str(NEWEST))


def probe(release: str, request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = ensure(release)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    proc = subprocess.run([sys.executable, str(PROBE)], input=json.dumps(request), capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout)
    assert answer["version"] == release, f"asked {release}, answered by {answer['version']} ({answer['module']})"
    return answer


@functools.lru_cache(maxsize=None)
def options(release: str) -> dict[str, dict]:
    """Every ft_launcher option string of ``release`` -> its action (dest, default, env, choices)."""
    answer = probe(release, {"table": True})
    table = {opt: action for action in answer["options"] for opt in action["option_strings"]}
    table["__config_fields__"] = answer["config_fields"]
    table["__module__"] = answer["module"]
    return table


_FLAGS_BLOCK = re.compile(r"# >>> megatron_resilience FaultTolerancePlugin ft_launcher flags >>>\n(.*?)"
                          r"# <<< megatron_resilience FaultTolerancePlugin ft_launcher flags <<<", re.S)
_YAML = re.compile(r"<<'MEGATRON_RESILIENCE_FT_CFG'\n(.*?)MEGATRON_RESILIENCE_FT_CFG\n", re.S)


def job_step(script: str, workdir: str) -> dict:
    """The ft_launcher command the job step of ``script`` runs, with the environment the script exports.

    The srun line and the plugins' flags block run in bash with a stub ``srun`` on PATH that prints its
    arguments; ``export`` lines give the environment; the FT YAML heredoc goes to a file in ``workdir``
    that PET_FT_CFG_PATH then points at.
    """
    srun_line = next(line for line in script.splitlines() if line.startswith("srun --output"))
    block = _FLAGS_BLOCK.search(script)
    stub_dir = tempfile.mkdtemp(dir=workdir)
    stub = os.path.join(stub_dir, "srun")
    with open(stub, "w") as f:
        f.write('#!/bin/bash\nprintf "%s\\0" "$@"\n')
    os.chmod(stub, 0o755)
    bash = f"head_node_ip=10.0.0.1\n{block.group(1) if block else ''}\n{srun_line.replace('<random>', '1234')}\n"
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", script, re.M)
    env = {"PATH": f"{stub_dir}:{os.environ['PATH']}", "SLURM_NODEID": "0",
           "SLURM_JOB_NUM_NODES": nodes.group(1) if nodes else "1"}  # what Slurm exports in the job
    out = subprocess.run(["bash", "-c", bash], capture_output=True, env=env, check=True).stdout.decode()
    argv = out.split("\0")[:-1]
    exports = {m.group(1): shlex.split(m.group(2), comments=True)[0]
               for m in re.finditer(r"^export (\w+)=(.*)$", script, re.M)}
    yaml = _YAML.search(script)
    if yaml:
        cfg = os.path.join(workdir, "ft_cfg.yml")
        with open(cfg, "w") as f:
            f.write(yaml.group(1))
        for key in ("PET_FT_CFG_PATH", "PET_FAULT_TOL_CFG_PATH"):
            if key in exports:
                exports[key] = cfg
    return {"argv": argv[argv.index("ft_launcher") + 1:], "env": exports, "srun": argv}


__all__ = ["RELEASES", "ensure", "job_step", "options", "probe"]
