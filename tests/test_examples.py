"""The examples run as users would run them: the resilient demo, the Python script, the CLI walkthrough,
the notebook."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
from resilience_support.stop import finish_record, finished_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
# What `make demo` prints at its end; the README shows these lines (tests/test_docs.py checks it shows exactly these).
DEMO_SUMMARY = [
    "steps:        40/40 completed, last step 40 (finished)",
    "restarts:     1 (after step 24 -> resumed from checkpoint at step 20)",
    "checkpoints:  4 at steps [10, 20, 30, 40]",
    "lost steps:   0",
    "recomputed:   4 steps after the last checkpoint before the fault; losses bit-identical on re-run",
]


def _env(tmp_path) -> dict:
    """A private NeMo-Run home, so the test never touches the user's ~/.nemo_run."""
    return {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo_run_home"), "PYTHONUNBUFFERED": "1"}


def _run_in_own_group(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout kills the whole process group (ft_launcher and its ranks too)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_make_demo_survives_a_killed_rank_with_zero_lost_steps(tmp_path):
    """`make demo`: 2 CPU ranks under the real ft_launcher via run.Experiment; rank 1 SIGKILLed at step 25."""
    proc = _run_in_own_group(
        [sys.executable, os.path.join(EXAMPLES, "demo.py"), "--dir", str(tmp_path / "runs"),
         "--plot", str(tmp_path / "demo.png")], timeout=900, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "demo: job SUCCEEDED" in out
    summary_at = out.index(DEMO_SUMMARY[0])  # the summary, line by line, exactly as the README shows it
    assert out[summary_at:].splitlines()[:len(DEMO_SUMMARY)] == DEMO_SUMMARY
    assert "megatron_resilience report: " in out and "\ngoodput: " in out  # the demo ends with its own report

    (summary_path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "runs") for f in files
                       if f == "demo_summary.json"]
    summary = json.load(open(summary_path))
    assert (summary["lost_steps"], summary["restarts"], summary["resumed_from"], summary["checkpoints"]) == \
        (0, 1, [20], [10, 20, 30, 40])
    _assert_the_run_itself_matches_the_summary(os.path.dirname(summary_path), tmp_path)
    # The restart really went through ft_launcher: its log names the dead rank and the restart.
    launcher_log = "".join(open(os.path.join(d, f), errors="replace").read()
                           for d, _, files in os.walk(tmp_path / "nemo_run_home") for f in files
                           if f == "combined.log")
    assert "SIMULATED FAULT" in launcher_log and "rank_killed on rank 1" in launcher_log
    assert "will restart worker group" in launcher_log
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def _assert_the_run_itself_matches_the_summary(run_dir: str, scratch) -> None:
    """What the summary claims, read independently from the trainer's own records and the checkpoint files."""
    from conftest import read_checkpoint

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    starts = [(r["step"], r["resumed"]) for r in records if r["kind"] == "start"]
    assert starts == [(0, False), (20, True)]  # the restart loaded the step-20 checkpoint
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    # Attempt 1 trained steps 1-24 (rank 1 died at the start of 25); attempt 2 re-ran 21-24 and went on to 40.
    assert [step for step, _ in train] == list(range(1, 25)) + list(range(21, 41))
    first, second = dict(train[:24]), dict(train[24:])
    assert [first[s] for s in range(21, 25)] == [second[s] for s in range(21, 25)]  # bitwise re-run
    assert second[40] < first[1] - 1.0  # it learned
    ends = [(r["reason"], r["step"], r["exit_code"]) for r in records if r["kind"] == "end"]
    assert ends == [("finished", 40, 0)]  # the killed attempt never reached its end
    saves = [(i, r["step"]) for i, r in enumerate(records) if r["kind"] == "checkpoint"]
    restart = [i for i, r in enumerate(records) if r["kind"] == "start"][1]
    assert sorted({step for _, step in saves}) == [10, 20, 30, 40]
    assert all(step > 20 for i, step in saves if i > restart)  # the resumed run did not save step 20 again
    ckpt = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", "iter_0000030", "iter_0000040",
                                        "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "40"
    for step in (10, 20, 30, 40):
        common = read_checkpoint(os.path.join(ckpt, f"iter_{step:07d}"), scratch / f"scratch_{step}.pt")["common"]
        assert (common["step"], common["consumed_samples"]) == (step, step * 8)
    with open(os.path.join(run_dir, "stop_reason.json")) as f:
        stop = json.load(f)
    assert finish_record(stop) == finished_at(40)
    _assert_the_report_adds_up(run_dir, records)


def _assert_the_report_adds_up(run_dir: str, records: list[dict]) -> None:
    """The report the demo printed, bucket by bucket against the run's own records (issue 26)."""
    from megatron_resilience.report.run_report import build

    report = build(run_dir)
    acc = report.accounting
    [window] = report.windows
    first_start = [r for r in records if r["kind"] == "start"][0]
    # the allocation begins when ft_launcher started (the worker's parent), not when the trainer did
    assert window.start == first_start["setup"]["launcher_start"] < first_start["setup"]["process_start"]
    assert window.end == max(r["time"] for r in records)
    assert acc.productive + sum(acc.badput.values()) == pytest.approx(acc.allocated, abs=1e-6)
    assert acc.badput["checkpoint_save"] == pytest.approx(
        sum(r["blocking_s"] for r in records if r["kind"] == "checkpoint"), abs=1e-6)
    rerun = [r for r in records if r["kind"] == "train"][24:28]  # steps 21-24, run again after the restart
    assert [r["step"] for r in rerun] == [21, 22, 23, 24]
    assert acc.badput["wasted_progress"] == pytest.approx(sum(r["step_time_s"] for r in rerun), abs=1e-6)
    first_runs = [r for r in records if r["kind"] == "train"][:24] + [r for r in records if r["kind"] == "train"][28:]
    assert acc.productive == pytest.approx(sum(r["step_time_s"] for r in first_runs), abs=1e-6)
    [restart] = acc.interruptions
    assert restart.kind == "process" and acc.badput["restart_process"] > 0 and acc.badput["startup"] > 5


def _console_blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every ``$ command`` in the ```console blocks of a walkthrough."""
    out = []
    for block in re.findall(r"```console\n(.*?)```", markdown, flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], []))
            else:
                out[-1][1].append(line)
    return out


def _assert_lines_in_order(expected: list[str], actual: str, command: str) -> None:
    lines = [line.rstrip() for line in actual.splitlines()]
    position = 0
    for want in expected:
        if want == "...":
            continue
        try:
            position = lines.index(want.rstrip(), position) + 1
        except ValueError:
            raise AssertionError(f"{command}\n  expected line not found (in order): {want!r}\n--- output ---\n"
                                 f"{actual[-4000:]}") from None


@pytest.mark.slow
def test_cli_walkthrough_commands_print_what_the_walkthrough_shows(tmp_path, monkeypatch):
    """Every command in examples/cli.md runs; its shown output lines appear in order; errors exit 1.

    ``nemo megatron_resilience pretrain ...`` runs through NeMo-Run's real CLI in this process (one
    interpreter start-up instead of one per command; test_cli.py runs the installed script once);
    other commands run in bash.
    """
    from nemo_run.config import get_nemorun_home, set_nemorun_home
    from test_cli import nemo

    blocks = _console_blocks(open(os.path.join(EXAMPLES, "cli.md")).read())
    assert len(blocks) == 8
    env = _env(tmp_path)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    monkeypatch.chdir(tmp_path)
    saved_home = get_nemorun_home()
    set_nemorun_home(env["NEMORUN_HOME"])
    try:
        for command, expected in blocks:
            fails = any(line.startswith("Error:") for line in expected)
            prefix = "nemo megatron_resilience pretrain "
            if command.startswith(prefix):
                code, out, err = nemo(*shlex.split(command[len(prefix):]))
            else:
                proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env)
                code, out, err = proc.returncode, proc.stdout, proc.stderr
            assert code == (1 if fails else 0), f"{command}\n{out[-3000:]}\n{err[-3000:]}"
            _assert_lines_in_order(expected, out + ("\n" + err if fails else ""), command)
    finally:
        set_nemorun_home(saved_home)


def test_python_script_dryrun_renders_the_slurm_job(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "pretrain.py"), "--recipe", "gpt_350m", "--nodes", "2",
         "--account", "acct", "--partition", "batch", "--time", "02:00:00", "--dir", "/lustre/me/runs",
         "--preempt-time", "300", "--restarts", "5", "--dryrun", "train.max_steps=2000", "ft.calc_ft_timeouts=false"],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_lines_in_order([
        "run_dir=/lustre/me/runs/gpt_350m", "model.num_layers=24", "model.hidden_size=1024", "train.max_steps=2000",
        "ft.enabled=true", "ft.calc_ft_timeouts=false", "#SBATCH --account=acct", "#SBATCH --nodes=2",
        "#SBATCH --partition=batch", "#SBATCH --signal=SIGTERM@300", "#SBATCH --time=02:00:00",
    ], proc.stdout, "examples/pretrain.py --dryrun")
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("srun "))
    assert "ft_launcher" in srun and "--max-restarts 5" in srun and "--nproc-per-node 8" in srun


@pytest.mark.slow
def test_notebook_executes_against_the_local_executor(tmp_path):
    """The login-node notebook, run top to bottom by nbclient with NB_EXECUTOR=local_ft (2 CPU ranks)."""
    env = {"NB_EXECUTOR": "local_ft", "NB_GPUS_PER_NODE": "0", "NB_RANKS_PER_NODE": "2", "NB_MAX_STEPS": "8",
           "NB_DIR": str(tmp_path / "runs"), "NEMORUN_HOME": str(tmp_path / "nemo_run_home")}
    text = _execute_notebook(tmp_path, env)
    assert "gpt_tiny 1 node(s) x 2 rank(s): 2 layers, hidden 64" in text
    assert "rerun: validate_results | exit signal handler: True SIGTERM" in text
    assert "#SBATCH --signal=SIGTERM@60" in text and "ft_launcher" in text
    state = re.search(r"^state: (\S+)$", text, re.M)
    assert state and state.group(1) == "SUCCEEDED", text[-3000:] + _job_logs_tail(tmp_path / "nemo_run_home")
    assert "8 steps logged; loss " in text
    assert "checkpoints: ['iter_0000002', 'iter_0000004', 'iter_0000006', 'iter_0000008']" in text


def _job_logs_tail(home, chars: int = 6000) -> str:
    """The end of every log the job left under NEMORUN_HOME: why a state other than SUCCEEDED came about."""
    parts = []
    for d, _, files in sorted(os.walk(home)):
        for f in sorted(files):
            if f.endswith((".out", ".log", ".err")):
                with open(os.path.join(d, f), errors="replace") as fh:
                    parts.append(f"\n==== {os.path.join(d, f)}\n" + fh.read()[-chars:])
    return "".join(parts)


def _execute_notebook(tmp_path, env: dict) -> str:
    """Run the login-node notebook top to bottom with nbclient; returns the text of all outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(EXAMPLES, "slurm_login_node.ipynb"), as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.slow
@pytest.mark.slurm
def test_notebook_submits_to_the_real_local_slurm_cluster(tmp_path):
    """The same notebook with NB_EXECUTOR=slurm: sbatch through a LocalTunnel, status from sacct, logs, metrics."""
    from slurm.cluster import start_cluster

    cluster = start_cluster()  # the tests/slurm session fixture's cluster (idempotent: starts it if needed)
    env = {"NB_EXECUTOR": "slurm", "NB_ACCOUNT": cluster.account, "NB_PARTITION": cluster.partition,
           "NB_NODES": "1", "NB_GPUS_PER_NODE": "0", "NB_RANKS_PER_NODE": "2", "NB_TIME": "00:05:00",
           "NB_MAX_STEPS": "8", "NB_DIR": str(tmp_path / "runs"), "NEMORUN_HOME": str(tmp_path / "nrhome"),
           "PATH": cluster.env["PATH"]}
    text = _execute_notebook(tmp_path, env)
    assert "gpt_tiny 1 node(s) x 2 rank(s): 2 layers, hidden 64" in text
    assert f"#SBATCH --partition={cluster.partition}" in text and "#SBATCH --signal=SIGTERM@60" in text
    assert "state: SUCCEEDED" in text, text[-4000:]
    assert "8 steps logged; loss " in text
    assert "checkpoints: ['iter_0000002', 'iter_0000004', 'iter_0000006', 'iter_0000008']" in text
