"""LocalExecutor end to end: run.run with both plugins starts the real ft_launcher on this machine.

Two CPU ranks of the tiny GPT run 3 steps under ft_launcher (nemo_run's local torchx path). The
trainer's FT integration logs the timeouts it received from its rank monitor: they are the plugin's
section timeouts, which only reach ft_launcher through the FT YAML (PET_FT_CFG_PATH), and no
heartbeat timeout is set in sections mode.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent("""
    import sys
    from megatron_resilience.upstream import import_nemo_run
    run = import_nemo_run()
    from nemo_run.config import set_nemorun_home
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin

    if __name__ == "__main__":
        home = sys.argv[1]
        set_nemorun_home(home)
        task = run.Script(path="megatron_resilience", m=True, entrypoint="python",
                          args=[f"run_dir={home}/run", "train.max_steps=3", "train.device=cpu"])
        plugins = [FaultTolerancePlugin(setup_timeout=611, step_timeout=181, checkpointing_timeout=421,
                                        out_of_section_timeout=301, num_in_job_restarts=1),
                   PreemptionPlugin()]
        run.run(task, executor=run.LocalExecutor(ntasks_per_node=2, launcher="ft"), name="ftlocal", plugins=plugins)
""")


@pytest.mark.slow
def test_local_executor_runs_ft_launcher_with_the_plugin_config(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    home = tmp_path / "home"
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(driver), str(home)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = glob.glob(str(home / "experiments" / "ftlocal" / "*" / "ftlocal" / "**" / "combined.log"), recursive=True)
    assert len(logs) == 1, logs
    with open(logs[0]) as f:
        log = f.read()
    assert ("FT: connected to the rank monitor (mode=sections); section timeouts: checkpointing=421.00s setup=611.00s "
            "step=181.00s out_of_section=301.00s (learned: none)") in log
    assert "heartbeat timeouts" not in log  # the trainer warns if ft_launcher had any in sections mode
    assert "training ended: finished at step 3" in log
    assert len(glob.glob(str(home / "ft_configs" / "ft_cfg_*.yml"))) == 1
