"""Multi-node settings as they are rendered, without a cluster: the rendezvous join timeout that
FaultTolerancePlugin puts into a multi-node sbatch script, read back by the installed ft_launcher's own
parser and launch config; and the local Slurm cluster's config for one and for several nodes
(``scripts/slurm/render.sh``).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from golden_cases import CASES, partial_task, render, slurm
from nvrx_releases import job_step

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()

from megatron_resilience.config import ConfigError  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDER = os.path.join(ROOT, "scripts", "slurm", "render.sh")


def _rdzv_conf(script: str) -> str | None:
    m = re.search(r"^export PET_RDZV_CONF=(\S+)$", script, re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("case, join_timeout", [("ft_preemption_2x8_partial", 600), ("ft_preemption_4x8_partial", 300)])
def test_multi_node_ft_launcher_gets_our_rendezvous_join_timeout(case, join_timeout, monkeypatch, tmp_path):
    """ft_launcher reads PET_RDZV_CONF as --rdzv-conf, and its launch config keeps our join timeout
    (nvidia-resiliency-ext only fills in its own when none is given)."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import config_from_args

    from megatron_resilience.upstream import ft_launcher_args_parser

    script = render(case)
    assert _rdzv_conf(script) == f"join_timeout={join_timeout}"
    monkeypatch.setenv("PET_RDZV_CONF", _rdzv_conf(script))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in this process otherwise
    monkeypatch.delenv("PET_FT_CFG_PATH", raising=False)
    args = ft_launcher_args_parser().parse_args(job_step(script, str(tmp_path))["argv"])
    config = config_from_args(args)[0]
    assert int(config.rdzv_configs["join_timeout"]) == join_timeout
    assert (config.min_nodes, config.max_nodes) == ((2, 2) if case.startswith("ft_preemption_2x8") else (4, 4))


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if "x8" not in c])
def test_single_node_scripts_have_no_rendezvous_settings(case):
    assert _rdzv_conf(render(case)) is None


def test_users_rdzv_conf_is_kept_and_a_second_join_timeout_is_an_error():
    executor = slurm(nodes=2, gpus=8, env_vars={"PET_RDZV_CONF": "read_timeout=120"})
    script = preview(partial_task(), executor, [FaultTolerancePlugin(rdzv_join_timeout=90)], name="gpt")
    assert _rdzv_conf(script) == "read_timeout=120,join_timeout=90"
    executor = slurm(nodes=2, gpus=8, env_vars={"PET_RDZV_CONF": "join_timeout=120"})
    with pytest.raises(ConfigError, match=r"PET_RDZV_CONF.*sets join_timeout, but FaultTolerancePlugin"
                                          r"\.rdzv_join_timeout=600 does"):
        preview(partial_task(), executor, [FaultTolerancePlugin(), PreemptionPlugin()], name="gpt")


@pytest.mark.parametrize("value", [0, -5, 1.5, "600"])
def test_rdzv_join_timeout_must_be_a_positive_whole_number(value):
    with pytest.raises(ConfigError, match=r"FaultTolerancePlugin\.rdzv_join_timeout: must be"):
        FaultTolerancePlugin(rdzv_join_timeout=value)


# --- the local Slurm cluster's config ---------------------------------------------------------------------------


def _render_cluster(tmp_path, **env) -> dict[str, str]:
    state = tmp_path / "state"
    state.mkdir()
    (state / "db.pass").write_text("secret")
    full = {k: v for k, v in os.environ.items() if not k.startswith("MR_SLURM_")}
    full.update(MR_SLURM_STATE_DIR=str(state), **env)
    subprocess.run(["bash", RENDER, str(tmp_path / "out")], check=True, env=full, capture_output=True, text=True)
    return {name: (tmp_path / "out" / name).read_text() for name in ("slurm.conf", "cgroup.conf", "slurmdbd.conf")}


def test_single_node_layout_renders_one_localhost_node_with_default_ports(tmp_path):
    conf = _render_cluster(tmp_path)
    slurm_conf = conf["slurm.conf"]
    assert slurm_conf.startswith("# Single-node test cluster written by scripts/slurm/start.sh")
    assert [line for line in slurm_conf.splitlines() if line.startswith(("NodeName=", "PartitionName="))] == [
        "NodeName=localhost NodeAddr=127.0.0.1 CPUs=16 Boards=1 SocketsPerBoard=1 CoresPerSocket=16 "
        "ThreadsPerCore=1 RealMemory=16000 State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"]
    state = tmp_path / "state"
    assert f"SlurmdSpoolDir={state}/slurmd\n" in slurm_conf and f"SlurmdPidFile={state}/run/slurmd.pid\n" in slurm_conf
    assert "Port=" not in slurm_conf and "DbdPort" not in conf["slurmdbd.conf"]  # Slurm's defaults 6817-6819
    assert "StoragePass=secret\n" in conf["slurmdbd.conf"] and "@" not in "".join(conf.values())


def test_multinode_preset_renders_one_slurmd_per_node_with_own_port_spool_and_reserved_fault_node(tmp_path):
    conf = _render_cluster(tmp_path, MR_SLURM_INSTANCE="multinode")
    slurm_conf, state = conf["slurm.conf"], tmp_path / "state"
    nodes = re.findall(r"^NodeName=(\S+) NodeAddr=127\.0\.0\.1 Port=(\d+) CPUs=16 ", slurm_conf, re.M)
    assert nodes == [("mn1", "7831"), ("mn2", "7832"), ("mn3", "7833")]
    assert "\nPartitionName=debug Nodes=mn1,mn2 Default=YES " in slurm_conf
    assert "\nPartitionName=faults Nodes=mn1,mn2,mn3 MaxTime=INFINITE" in slurm_conf
    # Per node (%n = node name): spool dir, pid and log file; cluster-wide: its own name and ports.
    for line in (f"SlurmdSpoolDir={state}/slurmd/%n", f"SlurmdPidFile={state}/run/slurmd-%n.pid",
                 f"SlurmdLogFile={state}/log/slurmd-%n.log", "ClusterName=mrmulti", "SlurmctldPort=7817",
                 "AccountingStoragePort=7819"):
        assert f"\n{line}\n" in slurm_conf
    assert "\nDbdPort=7819\n" in conf["slurmdbd.conf"] and "\nStoragePort=33062\n" in conf["slurmdbd.conf"]
