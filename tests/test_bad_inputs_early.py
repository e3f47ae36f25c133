"""The last bad inputs a newcomer met late (issue 35 §4), each failing early where the user meets it, naming the
key and what it must be: the logger's folders in the trainer (before torch loads), ``nvrx_version`` below the
package's floor or as a number, chaos on a run with no Slurm job (nothing appended, no wait), a chaos mix with a
YAML syntax error (one line), and ``report --png`` into a folder nobody can write (before the report prints).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_resilience.config import ConfigError
from megatron_resilience.plugins import FaultTolerancePlugin

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("override, key", [
    ("logger.tensorboard_dir=/proc/tb", "logger.tensorboard_dir"),
    ("logger.wandb_save_dir=/proc/wb", "logger.wandb_save_dir"),
])
def test_a_logger_folder_nobody_can_write_fails_before_torch_loads(tmp_path, override, key):
    extra = ["logger.wandb_project=p"] if "wandb" in key else []
    proc = _module(["megatron_resilience", f"run_dir={tmp_path}", "train.max_steps=2", override, *extra])
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert lines[-1].startswith(f"megatron_resilience: {key}: must be a writable directory, got '/proc/")
    assert "Traceback" not in proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "megatron.core" not in imported  # refused before the heavy imports


@pytest.mark.parametrize("value, why", [
    (0.4, "a number loses digits, quote it, got 0.4"),
    ("0.1", "older releases are not supported by FaultTolerancePlugin, got '0.1'"),
    ("0.3.9", "older releases are not supported by FaultTolerancePlugin, got '0.3.9'"),
])
def test_nvrx_version_below_the_floor_or_a_number_is_refused(value, why):
    with pytest.raises(ConfigError) as raised:
        FaultTolerancePlugin(nvrx_version=value)
    assert str(raised.value) == ("FaultTolerancePlugin.nvrx_version: must be a version string from '0.4' on, like "
                                 f"'0.7' or '0.4.1' (or None: the installed one); {why}")
    assert FaultTolerancePlugin(nvrx_version="0.4").nvrx_version == "0.4"


def test_chaos_on_a_run_with_no_slurm_job_fails_at_once_and_writes_nothing(tmp_path):
    proc = _module(["megatron_resilience.chaos", str(tmp_path), "--mtbf", "60"], timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith(
        f"megatron_resilience chaos: run_dir: must be the run directory of a Slurm job, got '{tmp_path}'")
    assert os.listdir(tmp_path) == []  # no chaos ledger started


def test_a_chaos_mix_with_a_yaml_syntax_error_is_one_line(tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text("name: x\ncauses: [a,\n  b: c\n")
    proc = _module(["megatron_resilience.chaos", str(tmp_path), "--mtbf", "60", "--mix", str(mix), "--plan"],
                   timeout=60)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith(f"megatron_resilience chaos: {mix}: not valid YAML: while parsing a flow sequence")


def test_report_png_into_a_folder_nobody_can_write_fails_before_the_report(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    proc = _module(["megatron_resilience.report", str(tmp_path), "--png", "/proc/x.png"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("megatron_resilience report: --png: must be a writable directory, got '/proc' ")
    assert errors[0].endswith("(the timeline PNG's folder; --png none leaves it out)")


def test_a_resume_with_another_model_shape_names_the_key_before_torch_loads(tmp_path):
    """Checkpoints saved at hidden 64, a resume asked at 128: one line naming the key, both values and the folder,
    from the trainer's first checks (no torch import, no traceback, the checkpoints called valid)."""
    ckpt = tmp_path / "ckpt"
    first = _module(["megatron_resilience", f"run_dir={tmp_path}", f"checkpoint.save={ckpt}", "train.max_steps=2",
                     "checkpoint.save_interval=2"], timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = ckpt / "iter_0000002"
    assert '"hidden_size": 64' in (saved / "model_shape.json").read_text()
    proc = _module(["megatron_resilience", f"run_dir={tmp_path}", f"checkpoint.save={ckpt}", "train.max_steps=4",
                    "model.hidden_size=128", "model.ffn_hidden_size=256"])
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1] == (f"megatron_resilience: model.hidden_size: must be 64 to resume from {saved} (the model it "
                         "holds), got 128. To train another shape, give it its own checkpoint.save folder; the "
                         "checkpoints there are valid, keep them")
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported
