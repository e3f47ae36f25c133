"""In-process restart and local checkpoints, piece by piece: settings, port blocks, store keys, the records'
attempt fields, the choice of tier, local retention, and what the upstream adapters fix (two real gloo processes
where the adapter is about gloo: a blocked collective freed, a replica fetched without CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_resilience.config import CheckpointConfig, ConfigError, InProcessConfig
from megatron_resilience.config import ports as ports_mod
from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.runtime.metrics import attempt_info, describe_attempt
from megatron_resilience.upstream.nvrx_inprocess import describe_interruptions, why_restarts_ended

REPO = Path(__file__).resolve().parents[1]


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


# --- tiers --------------------------------------------------------------------------------------------------------

def test_the_newest_step_wins_and_ties_go_to_the_cheapest_tier():
    from megatron_resilience.runtime.local_checkpoint import choose_tier

    assert choose_tier({"memory": None, "local": None, "persistent": None}) is None
    assert choose_tier({"memory": 6, "local": 6, "persistent": 4}) == (
        "memory", 6, "the newest; on equal steps the cheapest tier is read; older, ignored: persistent; found: "
                     "memory step 6, local step 6, persistent step 4")
    assert choose_tier({"memory": None, "local": 4, "persistent": 8}) == (
        "persistent", 8, "the newest; older, ignored: local; found: memory none, local step 4, persistent step 8")
    assert choose_tier({"memory": None, "local": 8, "persistent": 8})[0] == "local"
    assert choose_tier({"memory": None, "local": 10, "persistent": 8})[:2] == ("local", 10)


def test_session_names_the_run_and_the_layout():
    from megatron_resilience.runtime.local_checkpoint import session_name

    one = session_name("/runs/gpt", world=16, tp=2, pp=2)
    assert one.startswith("gpt-") and one.endswith("-w16tp2pp2")
    assert session_name("/runs/gpt", world=8, tp=2, pp=2) != one  # another layout cannot read these parts
    assert session_name("/other/gpt", world=16, tp=2, pp=2) != one


def test_local_retention_keeps_n_per_rank_and_superseded_steps_are_discarded(tmp_path):
    from megatron_resilience.upstream.nvrx_local_checkpoint import local_checkpoint_manager

    manager = local_checkpoint_manager(str(tmp_path), "s", keep_last_n=2)
    folder = tmp_path / "s" / "0"
    folder.mkdir(parents=True)
    names = [f"iter_{step:07d}_{rank}_local.pt" for step in (2, 4, 6) for rank in (0, 1)]
    names.append("iter_0000008_0_local.dirty.pt")  # a save cut off mid-write
    for name in names:
        (folder / name).write_bytes(b"x")
    manager._cleanup(6)  # upstream calls it after step 6 is complete on every rank
    assert sorted(p.name for p in folder.iterdir()) == [
        "iter_0000004_0_local.pt", "iter_0000004_1_local.pt", "iter_0000006_0_local.pt", "iter_0000006_1_local.pt",
        "iter_0000008_0_local.dirty.pt"]
    assert manager.discard_from(6) == [str(folder / "iter_0000006_0_local.pt"), str(folder / "iter_0000006_1_local.pt"),
                                       str(folder / "iter_0000008_0_local.dirty.pt")]
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000004_0_local.pt", "iter_0000004_1_local.pt"]


def test_a_save_cut_off_mid_write_no_longer_blocks_its_step(tmp_path):
    """A rank killed (or aborted by an in-process restart) inside ``torch.save`` leaves ``iter_X_r_local.dirty.pt``;
    upstream opens that name in exclusive-create mode, so every later save of step X failed, on every restart and
    requeue onto the same disk. ``forget_after`` (every (re)start) removes it and the parts newer than the step
    resumed. One gloo rank in this process."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import SameMachineReplicationException

    from megatron_resilience.runtime.distributed import destroy_distributed
    from megatron_resilience.upstream import nvrx_local_checkpoint as local

    def part(value: float):
        tensor = ShardedTensor.from_rank_offsets("w", torch.full((3,), value), replica_id=0)
        return local.tensor_aware_state_dict({"w": tensor})

    def manager():  # a new one per (re)start, as LocalTier builds it
        return local.local_checkpoint_manager(str(tmp_path), "s", keep_last_n=1)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        manager().save(part(2.0), 2)
        folder = tmp_path / "s" / "0"
        (folder / "iter_0000004_0_local.dirty.pt").write_bytes(b"partial")  # step 4's save, cut off
        (folder / "iter_0000006_1_local.pt").write_bytes(b"x")  # a replica of a step this run never resumed
        upstream_alone = manager()
        assert upstream_alone.find_latest() == 2  # the half-written file is never read
        with pytest.raises(SameMachineReplicationException, match=r"Checkpoint '\(4, 0, 's'\)' already exists"):
            upstream_alone.save(part(4.0), 4)  # what every restart met before
        restarted = manager()
        assert restarted.find_latest() == 2
        assert restarted.forget_after(2) == [str(folder / "iter_0000004_0_local.dirty.pt"),
                                             str(folder / "iter_0000006_1_local.pt")]
        restarted.save(part(4.0), 4)
        assert sorted(p.name for p in folder.iterdir()) == ["iter_0000004_0_local.pt"]  # step 2 cleaned up as usual
        resumed = manager()
        assert resumed.find_latest() == 4
        state, _ = resumed.load()
        assert [t.tolist() for t in state.tensors] == [[4.0, 4.0, 4.0]]
        assert resumed.forget_after(4) == []
    finally:
        destroy_distributed()


# --- upstream adapters, on two real gloo processes ----------------------------------------------------------------

def _two_ranks(tmp_path, body: str, timeout: float = 900) -> list[str]:
    """Run ``body`` on ranks 0 and 1 (gloo, a store on a reserved port); returns each rank's stdout."""
    sys.path.insert(0, str(REPO / "tests"))
    from resilience_support.ports import reserve

    block = reserve()
    script = tmp_path / "two_ranks.py"
    script.write_text(textwrap.dedent("""
        import datetime, os, sys, time, threading, torch, torch.distributed as dist
        rank = int(sys.argv[1]); port = int(sys.argv[2]); root = sys.argv[3]
        # generous: a rank's imports took minutes beside the other suites (CI), and nothing here is a timing
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=600))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    """) + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(block.base), str(tmp_path)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        block.release()
    return outs


@pytest.mark.slow
def test_shutting_down_gloo_connections_frees_a_blocked_collective_on_both_sides(tmp_path):
    outs = _two_ranks(tmp_path, """
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


@pytest.mark.slow
def test_a_replica_is_fetched_over_gloo_without_cuda(tmp_path):
    """Rank 1's part exists only as rank 0's replica: upstream's fetch sends it with ``.cuda()`` (fails without a
    GPU); the adapter's group wrapper sends on the backend's device. No cpu_compat here: the adapter alone."""
    outs = _two_ranks(tmp_path, """
        import shutil
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy
        from megatron_resilience.upstream import nvrx_local_checkpoint as local
        def manager(strategy):
            return local.local_checkpoint_manager(root + "/local", "s", keep_last_n=1, strategy=strategy)
        ours, cliques = local.replication_strategy(factor=2, jump=1, timeout=datetime.timedelta(seconds=300))
        saver = manager(ours)
        part = {"w": ShardedTensor.from_rank_offsets(f"w{rank}", torch.full((3,), float(rank + 1)), replica_id=0)}
        saver.save(local.tensor_aware_state_dict(part), 4)  # CPU tensors: upstream's basic state dict wants CUDA
        dist.barrier()
        if rank == 1:
            shutil.rmtree(saver.local_ckpt_dir)     # rank 1's node lost its disk
        dist.barrier()
        upstream = CliqueReplicationStrategy(ours.local_group.group)   # upstream's own group wrapper
        for name, strategy in (("upstream", upstream), ("adapter", ours)):
            loader = manager(strategy)
            try:
                step = loader.find_latest()
                print(name, "missing", loader.ranks_without_own_part(step))
                state, _ = loader.load()
                print(name, "loaded", step, [t.tolist() for t in state.tensors][0])
            except Exception as err:
                print(name, "failed", type(err).__name__, str(err)[:80])
            dist.barrier()
    """)
    assert "upstream missing [1]" in outs[0] and "adapter missing [1]" in outs[0], outs
    assert "upstream failed" in outs[1] and "CUDA" in outs[1], outs  # upstream's fetch needs a GPU
    assert "adapter loaded 4 [2.0, 2.0, 2.0]" in outs[1], outs  # rank 1's own values, from rank 0's replica
    assert "adapter loaded 4 [1.0, 1.0, 1.0]" in outs[0], outs


@pytest.mark.slow
def test_a_restart_after_a_save_cut_off_mid_write_resumes_and_saves_that_step_again(tmp_path):
    """The resume path itself (``TieredCheckpoints.load_latest`` on a real tiny GPT, DP 2): step 4's local save was
    cut off, rank 0's part renamed and rank 1's half-written. The restart resumes step 2, each rank removes what it
    left of step 4, the step is trained and saved again, and the next restart resumes it bit for bit."""
    outs = _two_ranks(tmp_path, """
        import logging, types
        from pathlib import Path
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        from megatron_resilience.runtime import cpu_compat
        cpu_compat.install()
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
        sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
        from test_checkpoint import _build, _same, _snapshot, _train_step
        from megatron_resilience.config import CheckpointConfig, PretrainConfig
        from megatron_resilience.runtime.local_checkpoint import build_checkpoints
        config = PretrainConfig(run_dir=root + "/run",
                                checkpoint=CheckpointConfig(local_dir=root + "/local", local_interval=2))
        def restart(seed):  # a new process: another model, new tiers, the resume
            state = _build(seed=seed)
            tiers = build_checkpoints(config, dist=types.SimpleNamespace(world_size=2, tp=1, pp=1))
            tiers.load_latest(state)
            return state, tiers
        state, tiers = restart(1)
        for _ in range(2):
            _train_step(state)
        tiers.save_local(state)
        losses = [_train_step(state) for _ in range(2)]
        folder = Path(tiers.local.manager.local_ckpt_dir)
        step2 = folder / f"iter_0000002_{rank}_local.pt"
        if rank == 0:   # renamed before rank 1's write was cut off
            (folder / "iter_0000004_0_local.pt").write_bytes(step2.read_bytes())
        else:
            (folder / "iter_0000004_1_local.dirty.pt").write_bytes(step2.read_bytes()[:100])
        dist.barrier()
        state, tiers = restart(2)
        print("resumed", tiers.resumed_from, sorted(p.name for p in folder.iterdir()))
        again = [_train_step(state) for _ in range(2)]
        print("losses equal", again == losses)
        try:
            tiers.save_local(state)
            print("saved", sorted(p.name for p in folder.iterdir()))
        except Exception as err:
            print("save failed", type(err).__name__, err)
            raise
        expected = _snapshot(state)
        state, tiers = restart(3)
        print("resumed", tiers.resumed_from, "diff", _same(expected, _snapshot(state)))
    """)
    for rank, out in enumerate(outs):
        assert f"resumed {{'tier': 'local', 'step': 2}} ['iter_0000002_{rank}_local.pt']" in out, out
        assert "losses equal True" in out and f"saved ['iter_0000004_{rank}_local.pt']" in out, out
        assert "resumed {'tier': 'local', 'step': 4} diff []" in out, out
    left = {0: "iter_0000004_0_local.pt", 1: "iter_0000004_1_local.dirty.pt"}
    for rank, out in enumerate(outs):
        assert (f"checkpoint: rank {rank} removed local files of saves cut off mid-write or newer than the step "
                f"resumed (2): {left[rank]}") in out, out


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
