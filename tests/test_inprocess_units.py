"""In-process restart, piece by piece: settings, port blocks, store keys, the records' attempt fields, what the
upstream adapters fix (two real gloo processes where the adapter is about gloo: a blocked collective freed) and
c10d's state after a teardown cut short. Node-local checkpoints: ``test_local_checkpoint_units.py``."""

from __future__ import annotations

import subprocess

import pytest
from resilience_support.two_ranks import two_ranks

from megatron_resilience.config import CheckpointConfig, ConfigError, InProcessConfig
from megatron_resilience.config import ports as ports_mod
from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.runtime.metrics import attempt_info, describe_attempt
from megatron_resilience.upstream.nvrx_inprocess import describe_interruptions, why_restarts_ended

# --- settings -----------------------------------------------------------------------------------------------------

def test_defaults_are_valid_and_megatron_lm_names_are_ours():
    cfg = InProcessConfig()
    assert (cfg.enabled, cfg.max_iterations, cfg.soft_timeout, cfg.hard_timeout, cfg.granularity) == \
        (False, 3, 60.0, 90.0, "node")
    bridge = config_from_overrides(["run_dir=/r", "inprocess_restart.enabled=true", "inprocess_restart.soft_timeout=5",
                                    "inprocess_restart.hard_timeout=9", "inprocess_restart.granularity=rank",
                                    "checkpoint.non_persistent_local_ckpt_dir=/local",
                                    "checkpoint.non_persistent_save_interval=3"])
    ip = bridge.inprocess
    assert (ip.enabled, ip.soft_timeout, ip.granularity) == (True, 5.0, "rank")
    assert (bridge.checkpoint.local_dir, bridge.checkpoint.local_interval) == ("/local", 3)


@pytest.mark.parametrize("changes, message", [
    ({"soft_timeout": 90.0}, "inprocess.soft_timeout: must be < inprocess.hard_timeout=90, got 90.0"),
    ({"hard_timeout": 200.0}, "inprocess.hard_timeout: must be < inprocess.barrier_timeout=120, got 200.0"),
    ({"heartbeat_interval": 60.0}, "inprocess.heartbeat_interval: must be < inprocess.heartbeat_timeout=60, got 60.0"),
    ({"heartbeat_timeout": 130.0}, "inprocess.heartbeat_timeout: must be < inprocess.barrier_timeout=120, got 130.0"),
    # Megatron-LM's defaults (1.0 / 1.0): the monitor process would postpone its timeout checks indefinitely
    ({"monitor_process_interval": 1.0},
     "inprocess.monitor_process_interval: must be < inprocess.progress_watchdog_interval=1, got 1.0"),
    ({"max_iterations": 0}, "inprocess.max_iterations: must be an integer >= 1, got 0"),
    ({"max_iterations": None}, "inprocess.max_iterations: must not be None, got None"),
    ({"granularity": "gpu"}, "inprocess.granularity: must be one of ['node', 'rank'], got 'gpu'"),
    ({"soft_timeout": -1.0}, "inprocess.soft_timeout: must be a number > 0, got -1.0"),
])
def test_bad_inprocess_settings_name_the_key(changes, message):
    with pytest.raises(ConfigError) as err:
        InProcessConfig(**changes)
    assert str(err.value) == message


@pytest.mark.parametrize("changes, message", [
    ({"local_interval": 5}, "checkpoint.local_dir: must be set when checkpoint.local_interval is set, got None"),
    ({"local_dir": "/l"}, "checkpoint.local_interval: must be set when checkpoint.local_dir is set, got None"),
    ({"local_dir": "/l", "local_interval": 0}, "checkpoint.local_interval: must be an integer >= 1, got 0"),
    ({"replication_factor": 2}, "checkpoint.replication_factor: needs checkpoint.local_dir (replicas are of local "
                                "checkpoints), got 2"),
    ({"local_dir": "/l", "local_interval": 2, "replication_jump": 8},
     "checkpoint.replication_jump: needs checkpoint.replication_factor > 1, got 8"),
    ({"local_dir": "/l", "local_interval": 2, "local_keep_last_n": 0},
     "checkpoint.local_keep_last_n: must be an integer >= 1, got 0"),
])
def test_bad_local_checkpoint_settings_name_the_key(changes, message):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(**changes)
    assert str(err.value) == message


def test_replica_groups_must_divide_the_world():
    cfg = CheckpointConfig(local_dir="/l", local_interval=2, replication_factor=2)
    assert cfg.replication_groups_fit(16, 8) is None  # 2 nodes of 8: ranks n and n+8 hold each other's parts
    assert cfg.replication_groups_fit(8, 8) == ("world size 8 is not a multiple of checkpoint.replication_jump x "
                                                "checkpoint.replication_factor = 8 x 2 = 16")
    assert CheckpointConfig().replication_groups_fit(8, 8) is None


def test_group_timeouts_per_backend():
    cfg = InProcessConfig(soft_timeout=10, hard_timeout=30)
    assert cfg.group_timeout_seconds("gloo") == 20.0  # frees a blocked survivor before its own hard timeout
    assert cfg.group_timeout_seconds("nccl") == 600.0  # never before the wrapper's abort
    assert InProcessConfig(hard_timeout=400, barrier_timeout=500).group_timeout_seconds("nccl") == 800.0


# --- ports and stores ---------------------------------------------------------------------------------------------

def test_a_job_port_block_comes_from_the_env_then_the_slurm_job_then_the_rendezvous_id():
    explicit = ports_mod.job_ports({"MEGATRON_RESILIENCE_JOB_PORT": "12000", "SLURM_JOB_ID": "7"})
    assert (explicit.base, explicit.process_group, explicit.inprocess, explicit.source) == \
        (12000, 12001, 12002, "MEGATRON_RESILIENCE_JOB_PORT")
    slurm = ports_mod.job_ports({"SLURM_JOB_ID": "1234", "TORCHELASTIC_RUN_ID": "x"})
    assert (slurm.base, slurm.source) == (25000 + 1234 % 1942 * 4, "SLURM_JOB_ID")
    assert ports_mod.job_ports({"SLURM_JOB_ID": "1234"}).base != ports_mod.job_ports({"SLURM_JOB_ID": "1235"}).base
    hashed = ports_mod.job_ports({"TORCHELASTIC_RUN_ID": "abc"})
    assert hashed.source == "TORCHELASTIC_RUN_ID" and 25000 <= hashed.base <= 32764 and hashed.base % 4 == 0
    assert ports_mod.job_ports({}) is None
    with pytest.raises(ValueError, match="MEGATRON_RESILIENCE_JOB_PORT: must be a port number 1024..65531, got 'x'"):
        ports_mod.job_ports({"MEGATRON_RESILIENCE_JOB_PORT": "x"})


def test_every_block_lies_below_the_default_ephemeral_range():
    top = ports_mod.block_base(ports_mod.BLOCKS - 1) + ports_mod.PORTS_PER_JOB - 1
    assert ports_mod.block_base(0) == 25000 and top <= 32767
    assert ports_mod.block_base(ports_mod.BLOCKS) == 25000  # wraps
    assert not ports_mod.overlaps_ephemeral(ports_mod.JobPorts(32764, "x"), (32768, 60999))
    assert ports_mod.overlaps_ephemeral(ports_mod.JobPorts(32766, "x"), (32768, 60999))


@pytest.mark.parametrize("job_id", [1, 1941, 1942, 123456789])
def test_the_batch_scripts_arithmetic_is_the_trainers(job_id):
    out = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job_id}; echo {ports_mod.slurm_block_base_shell()}"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert int(out) == ports_mod.job_ports({"SLURM_JOB_ID": str(job_id)}).base


def test_which_launches_use_the_job_store_and_its_keys_name_the_job():
    from megatron_resilience.runtime.job_store import job_key, uses_job_store

    ft = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert uses_job_store(ft)  # ft_launcher: its MASTER_PORT was released before rank 0 binds it
    assert not uses_job_store({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True"})  # torchrun
    assert uses_job_store({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_USE_AGENT_STORE": "True",
                           "MEGATRON_RESILIENCE_INPROCESS_RESTART": "0"})
    assert not uses_job_store({"SLURM_JOB_ID": "5"}) and not uses_job_store({})
    # the same on every rank of a cycle: agents count restarts differently (a membership change does not count)
    assert job_key({"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2"}) == \
        job_key({"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}) == \
        "megatron_resilience/5/r"
    assert job_key({}) == "megatron_resilience/-/-"


def test_a_node_is_slurms_node_where_slurm_started_the_rank():
    """Two Slurm nodes on one host (the multi-node test cluster) are two nodes for granularity=node: keyed by the
    host's name, the second node's rank was reserved as surplus and the job ran with world size 1."""
    import socket

    from megatron_resilience.resilience.inprocess import node_name

    assert [node_name({"SLURMD_NODENAME": n}) for n in ("mn1", "mn2")] == ["mn1", "mn2"]
    assert node_name({}) == socket.gethostname()


# --- records ------------------------------------------------------------------------------------------------------

def test_the_attempt_names_the_inprocess_restart():
    env = {"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2", "MEGATRON_RESILIENCE_INPROCESS_RESTART": "3",
           "SLURM_JOB_ID": "77"}
    attempt = attempt_info(env)
    assert attempt == {"slurm_restart": 1, "in_job_restart": 2, "inprocess_restart": 3, "job_id": "77"}
    assert describe_attempt(attempt) == "in-job restart 2, in-process restart 3, requeue 1 of job 77"
    assert attempt_info({})["inprocess_restart"] == 0
    assert describe_attempt(attempt_info({})) == "in-job restart 0, requeue 0"


def test_causes_and_the_end_of_restarts_in_our_words():
    assert describe_interruptions("Interruption.EXCEPTION on ranks={1}") == "exception on rank 1"  # 0.4.1
    assert describe_interruptions("Interruption.SOFT_TIMEOUT affecting ranks {0, 1}") == \
        "soft_timeout on ranks 0,1"  # 0.7.0
    assert describe_interruptions("Interruption.EXCEPTION on ranks={1}, Interruption.TERMINATED on ranks={0}") == \
        "exception on rank 1, terminated on rank 0"
    from nvidia_resiliency_ext.inprocess.exception import RestartAbort

    budget = RestartAbort("state.iteration=3 self.max_iterations=3 state.world_size=2 self.min_world_size=2 "
                          "state.active_world_size=2 self.min_active_world_size=1 ")
    lost = RestartAbort("state.iteration=1 self.max_iterations=3 state.world_size=1 self.min_world_size=2 "
                        "state.active_world_size=1 self.min_active_world_size=1 ")
    assert why_restarts_ended(budget) == "in-process budget exhausted (inprocess.max_iterations=3)"
    assert why_restarts_ended(lost) == ("a rank was lost (world size 1 of 2; a dead process is restarted by the "
                                        "launcher)")


# --- upstream adapters, on two real gloo processes ----------------------------------------------------------------

@pytest.mark.slow
def test_shutting_down_gloo_connections_frees_a_blocked_collective_on_both_sides(tmp_path):
    outs = two_ranks(tmp_path, """
        from megatron_resilience.upstream.pytorch import abort_gloo_connections
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 0:   # blocked: rank 1 never joins this all-reduce
            start = time.monotonic()
            try:
                dist.all_reduce(t)
                print("returned")
            except RuntimeError as err:
                print("freed", "Connection closed by peer" in str(err), time.monotonic() - start < 100)
            print("store still works", store.get("after") == b"1")
        else:
            time.sleep(2)
            print("shut", abort_gloo_connections({port}) > 0)   # the store's connection is kept
            store.set("after", "1")
            time.sleep(5)
    """)
    assert "freed True True" in outs[0] and "store still works True" in outs[0], outs
    assert "shut True" in outs[1], outs


def test_a_teardown_cut_short_still_leaves_the_next_groups_named_from_zero():
    """An in-process restart can interrupt ``destroy_process_group()`` after it dropped the default group and before
    it cleared c10d's tables, its name registry and its group counter; the next init must still register and name
    the default group "0" on every rank (else each rank waits for keys the others write under other names, or the
    init fails: "A process group is already registered under the name0")."""
    import torch.distributed as dist

    from megatron_resilience.runtime.distributed import destroy_distributed

    def init() -> str:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD.group_name

    try:
        assert init() == "0"
        dist.new_group([0])
        dist.new_group([0])
        dist.destroy_process_group()
        dist.distributed_c10d._world.group_count = 3  # what an interrupted destroy leaves behind, late in it
        destroy_distributed()
        assert init() == "0"
        dist.new_group([0])
        dist.distributed_c10d._update_default_pg(None)  # interrupted early: everything but the default group left
        assert not dist.is_initialized()
        destroy_distributed()
        assert init() == "0"
        assert dist.new_group([0]).group_name == "1"
    finally:
        destroy_distributed()
