"""Help that helps: ``--help`` works for every command, the key listing is exact (golden), and on a login node
``--help``, ``--dryrun`` and ``preview()`` never import torch.

Regenerate the golden listings after adding a config key (and its one-line meaning in ``config/keys.py``)::

    .venv/bin/python -c "from tests.test_help import write_golden; write_golden()"
"""

import contextlib
import io
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_resilience import __main__ as trainer_cli
from megatron_resilience.config.keys import MEANING, key_listing
from megatron_resilience.config.overrides import valid_keys
from megatron_resilience.recipes import gpt_126m, to_config
from megatron_resilience.upstream.nemorun import run_cli

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_help")


def _recipe_listing() -> str:
    return key_listing(to_config(gpt_126m(dir="/lustre/runs", num_nodes=2)), "gpt_126m")


def write_golden() -> None:
    for name, text in (("keys.txt", key_listing()), ("keys_gpt_126m.txt", _recipe_listing())):
        with open(os.path.join(GOLDEN, name), "w") as f:
            f.write(text)


def _golden(name: str) -> str:
    with open(os.path.join(GOLDEN, name)) as f:
        return f.read()


def test_every_key_has_a_meaning():
    assert sorted(MEANING) == sorted(valid_keys())


def test_key_listing_golden():
    assert key_listing() == _golden("keys.txt")
    assert _recipe_listing() == _golden("keys_gpt_126m.txt")
    # one row per key, in the order the overrides name them; a recipe's changes are marked
    rows = _golden("keys_gpt_126m.txt").splitlines()[1:]
    assert [r.split()[0] for r in rows] == valid_keys()
    assert rows[valid_keys().index("model.num_layers")].split()[:4] == ["model.num_layers", "int", "2", "12"]
    assert "/lustre/runs/gpt_126m" in rows[0]


def _capture(fn, *args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = fn(*args, **kwargs) or 0
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def test_trainer_help_prints_usage_and_every_key():
    code, out, _ = _capture(trainer_cli.main, ["--help"])
    assert code == 0
    usage, listing = out.split("\n\n", 1)[0], out.split("\n\n")[-1]
    assert usage.startswith("The trainer's command line")
    assert out.endswith(key_listing()) and listing.splitlines()[0].startswith("key ")
    code, out, _ = _capture(trainer_cli.main, ["--help", "gpt_126m"])
    header = next(line for line in out.splitlines() if line.startswith("key "))
    assert code == 0 and header.split() == ["key", "type", "default", "gpt_126m", "meaning"]
    assert "12 *" in out
    code, _, err = _capture(trainer_cli.main, ["--help", "gpt_9"])
    assert (code, err) == ("megatron_resilience: --help gpt_9: unknown recipe; recipes: gpt_tiny, gpt_126m, gpt_350m, "
                           "gpt_1_3b, gpt_7b", "")


@pytest.mark.parametrize("argv", [
    ["megatron_resilience", "--help"],
    ["megatron_resilience", "pretrain", "--help"],
    ["megatron_resilience", "pretrain", "--factory", "gpt_126m", "--help"],
    ["megatron_resilience", "pretrain", "--factory", "gpt_126m(num_nodes=2,dir=/lustre/runs)", "--help"],
])
def test_nemo_help_works_for_every_command(argv):
    code, out, err = _capture(run_cli, argv, standalone_mode=False)
    assert code == 0, err
    assert "Traceback" not in out + err and "Error" not in err
    if "pretrain" in argv:
        assert "Overrides: section.field=value" in out
        assert key_listing().splitlines()[1].split()[0] in out  # run_dir row
    if "--factory" in argv:
        assert "gpt_126m" in out.split("meaning")[0].splitlines()[-1]  # the recipe's column
        assert "model.num_layers" in out and " 12 *" in out
    if argv[-4:-1] == ["pretrain", "--factory", "gpt_126m(num_nodes=2,dir=/lustre/runs)"]:
        assert "/lustre/runs/gpt_126m" in out


LOGIN_NODE = textwrap.dedent("""
    import contextlib, io, sys
    from megatron_resilience.upstream.nemorun import import_nemo_run, run_cli
    run = import_nemo_run()
    from megatron_resilience import __main__ as trainer_cli
    from megatron_resilience.entry import pretrain
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview
    from megatron_resilience.recipes import gpt_126m
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        for argv in (["megatron_resilience", "--help"], ["megatron_resilience", "pretrain", "--help"],
                     ["megatron_resilience", "pretrain", "--factory", "gpt_126m", "--help"],
                     ["megatron_resilience", "pretrain", "--factory", "gpt_126m(dir=/lustre/runs)", "--dryrun",
                      "run.executor=slurm", "run.executor.account=acct", "run.plugins=resilience"]):
            assert run_cli(argv, standalone_mode=False) in (0, None), argv
        trainer_cli.main(["--help"])
        executor = run.SlurmExecutor(account="acct", time="01:00:00", tunnel=run.LocalTunnel(job_dir="/x"))
        preview(gpt_126m(dir="/lustre/runs"), executor, [FaultTolerancePlugin(), PreemptionPlugin()])
        preview(run.Partial(pretrain, run_dir="/lustre/runs/x"), executor, [])
    assert "#SBATCH --signal=SIGTERM@60" in sink.getvalue()
    print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "megatron."))))
""")


def test_help_dryrun_and_preview_never_import_torch(tmp_path):
    """One fresh interpreter (torch is installed here): help, the CLI dry run of a Slurm job, preview()."""
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", LOGIN_NODE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
