"""Node-local checkpoints (``checkpoint.local_dir``): which tier a (re)start reads, the session a layout writes to,
retention per rank, a save cut off mid-write, and the replica fetch that nvidia-resiliency-ext can only do on CUDA
(on two real gloo processes). The in-process restart that reads them is ``test_inprocess_units.py``."""

from __future__ import annotations

import pytest
from resilience_support.two_ranks import two_ranks

# --- tiers --------------------------------------------------------------------------------------------------------

def test_the_newest_step_wins_and_ties_go_to_the_cheapest_tier():
    from megatron_resilience.checkpointing.tiers import choose_tier

    assert choose_tier({"memory": None, "local": None, "persistent": None}) is None
    assert choose_tier({"memory": 6, "local": 6, "persistent": 4}) == (
        "memory", 6, "the newest; on equal steps the cheapest tier is read; older, ignored: persistent; found: "
                     "memory step 6, local step 6, persistent step 4")
    assert choose_tier({"memory": None, "local": 4, "persistent": 8}) == (
        "persistent", 8, "the newest; older, ignored: local; found: memory none, local step 4, persistent step 8")
    assert choose_tier({"memory": None, "local": 8, "persistent": 8})[0] == "local"
    assert choose_tier({"memory": None, "local": 10, "persistent": 8})[:2] == ("local", 10)


def test_session_names_the_run_and_the_layout():
    from megatron_resilience.checkpointing.tiers import session_name

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



# --- replicas, on two real gloo processes ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_replica_is_fetched_over_gloo_without_cuda(tmp_path):
    """Rank 1's part exists only as rank 0's replica: upstream's fetch sends it with ``.cuda()`` (fails without a
    GPU); the adapter's group wrapper sends on the backend's device. No cpu_compat here: the adapter alone."""
    outs = two_ranks(tmp_path, """
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
    outs = two_ranks(tmp_path, """
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
        from megatron_resilience.checkpointing.tiers import build_checkpoints
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
