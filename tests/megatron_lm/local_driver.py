"""One ``run.run`` of Megatron-LM's trainer on the LocalExecutor under ft_launcher 0.7.0, in a driver process of its
own, as the lane's local tests start it: ``pretrain_gpt.py`` (or a wrapper of it) through ``run.Script`` with
FaultTolerancePlugin + PreemptionPlugin + RestartPolicyPlugin(``megatron_transient``), 2 ranks, a NEMORUN_HOME of its
own. A process of its own so that several runs start together (most of their time is imports and first saves) and
a signal meant for one never reaches the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from megatron_lm_run import ENV, NEWEST, REPO

DRIVER = textwrap.dedent("""
    import json, sys
    from megatron_resilience.upstream import import_nemo_run
    run = import_nemo_run()
    from nemo_run.config import set_nemorun_home
    from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, RestartPolicyPlugin

    if __name__ == "__main__":
        spec = json.loads(sys.argv[1])
        if spec["without_inprocess_refusal"]:  # what a user would meet without the plugins' refusal (that test's aim)
            from megatron_resilience.plugins import megatron_lm_flags
            megatron_lm_flags.check_inprocess_restart = lambda *args, **kwargs: False
        set_nemorun_home(spec["home"])
        task = run.Script(path=spec["script"], entrypoint="python", args=spec["args"])
        plugins = [FaultTolerancePlugin(nvrx_version="0.7", **spec["ft"]), PreemptionPlugin(),
                   RestartPolicyPlugin(policy="megatron_transient")]
        executor = run.LocalExecutor(ntasks_per_node=2, launcher="ft", env_vars=spec["env"])
        run.run(task, executor=executor, name=spec["name"], plugins=plugins)
""")


def start(root, name: str, script: str, args: list[str], *, env: dict[str, str] | None = None, ft: dict | None = None,
          new_session: bool = False, without_inprocess_refusal: bool = False) -> tuple[subprocess.Popen, object]:
    """(the driver process, its NEMORUN_HOME) of run ``name`` under ``root`` (a pathlib folder); its output goes to
    ``<root>/<name>.driver.log``. ``without_inprocess_refusal``: the plugins' refusal of Megatron-LM's
    ``--inprocess-restart`` switched off in the driver, to show what it protects from."""
    home = root / f"{name}_home"
    home.mkdir()
    driver = root / "driver.py"
    if not driver.exists():
        driver.write_text(DRIVER)
    spec = {"home": str(home), "script": script, "args": args, "name": name, "env": {**ENV, **(env or {})},
            "ft": ft or {}, "without_inprocess_refusal": without_inprocess_refusal}
    environ = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               "PYTHONPATH": f"{NEWEST}:{REPO}", "OMP_NUM_THREADS": "1"}
    out = open(root / f"{name}.driver.log", "w")
    proc = subprocess.Popen([sys.executable, str(driver), json.dumps(spec)], env=environ, stdout=out,
                            stderr=subprocess.STDOUT, cwd=root, start_new_session=new_session)
    return proc, home


__all__ = ["DRIVER", "start"]
