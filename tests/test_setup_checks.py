"""The late failures of old (a checkpoint folder under /proc, a run_dir that is a file, a missing data prefix)
now end the trainer before torch loads: one line naming the key, exit 1, no traceback.

Each case is a fresh ``python`` process, as a launcher would start it: the module form
(``python -m megatron_resilience``, for run.Script tasks) and the function a ``run.Partial`` runs
(``megatron_resilience.entry.pretrain``, what nemo_run's runner calls on the compute node).
"""

import os
import subprocess
import sys
import textwrap

import pytest

# Runs the trainer's entry the way a launcher does and reports, at exit, whether torch was ever imported.
RUNNER = textwrap.dedent("""
    import atexit, runpy, sys
    atexit.register(lambda: print("torch imported:", "torch" in sys.modules))
    form, args = sys.argv[1], sys.argv[2:]
    if form == "module":
        sys.argv = ["megatron_resilience", *args]
        runpy.run_module("megatron_resilience", run_name="__main__")
    else:
        from megatron_resilience.entry import pretrain
        from megatron_resilience.config import CheckpointConfig, DataConfig
        kwargs = dict(a.split("=", 1) for a in args)
        pretrain(run_dir=kwargs["run_dir"], checkpoint=CheckpointConfig(save=kwargs.get("checkpoint.save")),
                 data=DataConfig(data_path=[kwargs["data.data_path"]] if "data.data_path" in kwargs else []))
""")


@pytest.fixture
def afile(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a folder")
    return str(path)


CASES = [
    (["checkpoint.save=/proc/ckpt"],
     "checkpoint.save: must be a writable directory, got '/proc/ckpt' "
     "(cannot create directories in '/proc': No such file or directory)"),
    (["run_dir={afile}"], "run_dir: must be a directory, got '{afile}' (a file)"),
    (["checkpoint.save={afile}/ckpt"],
     "checkpoint.save: must be a directory we can create, got '{afile}/ckpt' ('{afile}' is a file)"),
    (["data.data_path={tmp}/tokens"],
     "data.data_path: must name indexed datasets (PREFIX.bin and PREFIX.idx), got '{tmp}/tokens' "
     "({tmp}/tokens.bin, {tmp}/tokens.idx not found)"),
]


@pytest.mark.parametrize("form", ["module", "partial"])
@pytest.mark.parametrize("overrides, message", CASES, ids=[c[0][0].split("=")[0] for c in CASES])
def test_late_failures_now_end_the_trainer_before_torch_loads(form, overrides, message, tmp_path, afile):
    fill = {"afile": afile, "tmp": str(tmp_path)}
    args = [f"run_dir={tmp_path}/run", *(o.format(**fill) for o in overrides)]
    proc = subprocess.run([sys.executable, "-c", RUNNER, form, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"})
    assert proc.returncode == 1
    assert proc.stderr == f"megatron_resilience: {message.format(**fill)}\n"  # one line: no traceback, no warnings
    assert proc.stdout == "torch imported: False\n"
    assert not os.path.exists(f"{tmp_path}/run")  # nothing created before the check
