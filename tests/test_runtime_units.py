"""Runtime pieces proven without a process group: the batch sampler's resume arithmetic, how a rank reads who
it is (torchrun or a bare ``srun``), and (in a fresh subprocess) what ``cpu_compat`` maps to CPU."""

from __future__ import annotations

import pytest


def test_sampler_resumes_exactly_and_splits_the_global_batch():
    """Pure sampler logic (no processes): resuming from consumed_samples continues the same order."""
    from megatron_resilience.runtime.data import GlobalBatchSampler

    def take(consumed, rank, n):
        sampler = GlobalBatchSampler(dataset_len=100, consumed_samples=consumed, micro_batch_size=2,
                                     dp_rank=rank, dp_size=2)
        return [next(sampler) for _ in range(n)]

    # global batch 8 = 2 micro-batches x 2 per rank x dp 2: step 1 covers samples 0..7, rank 0 takes 0,1 and 4,5.
    assert take(0, 0, 2) == [[0, 1], [4, 5]]
    assert take(0, 1, 2) == [[2, 3], [6, 7]]
    straight = take(0, 1, 6)
    assert take(8, 1, 4) == straight[2:]  # resume after step 1 (8 samples consumed)
    assert take(96, 0, 2) == [[96, 97], [0, 1]]  # wraps around a short dataset


# --- who a rank is: torchrun/ft_launcher variables, or Slurm's under a bare srun -----------------------------

SRUN_TASK = {  # what Slurm 22.05 exports to task 3 of `srun --ntasks-per-node=2` on 2 nodes (measured here: 1 node)
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
}


@pytest.mark.parametrize("environ, expected", [
    ({}, (0, 1, 0, "single", None, None)),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", **SRUN_TASK}, (1, 2, 1, "launcher", None, None)),
    (SRUN_TASK, (3, 4, 1, "slurm", "gpu007", 15000 + 4242)),
    ({**SRUN_TASK, "SLURM_JOB_ID": "1234567"}, (3, 4, 1, "slurm", "gpu007", 15000 + 4567)),
    ({**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, (3, 4, 1, "slurm", "10.0.0.1", 29500)),
    # One node: every rank is local, so no node name needs resolving (a node's name need not be its host's).
    ({**SRUN_TASK, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "mn3"}, (3, 4, 1, "slurm", "127.0.0.1", 19242)),
    # The batch shell has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step: a trainer started there is alone.
    ({k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0"},
     (0, 1, 0, "single", None, None)),
], ids=["plain", "torchrun-inside-srun", "srun", "srun-big-job-id", "srun-with-master", "srun-one-node",
        "batch-shell"])
def test_launch_env_reads_torchrun_or_srun_variables(environ, expected):
    from megatron_resilience.runtime.launch_env import launch_env

    env = launch_env(environ)
    assert (env.rank, env.world_size, env.local_rank, env.source, env.master_addr, env.master_port) == expected


@pytest.mark.parametrize("nodelist, first", [
    ("localhost", "localhost"), ("gpu[007-010,12]", "gpu007"), ("a1,b[2-3]", "a1"), ("b[2-3],a1", "b2"),
    ("rack[1-2]-n[08-09]", "rack1-n08"), ("node[3,1]", "node3"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    from megatron_resilience.runtime.launch_env import first_host

    assert first_host(nodelist) == first


CPU_COMPAT_PROBE = r"""
import json, torch
from megatron.core import tensor_parallel
from megatron_resilience.runtime import cpu_compat

assert not cpu_compat.is_installed()
cpu_compat.install()
cpu_compat.install()  # idempotent
out = {
    "empty_cuda": str(torch.empty(2, device="cuda").device),
    "zeros_index": str(torch.zeros(2, device=torch.cuda.current_device()).device),
    "dot_cuda": str(torch.ones(2).cuda().device),
    "to_cuda": str(torch.ones(2).to("cuda:0").device),
    "type": torch.ones(2).type(),
    "stream": torch.cuda.current_stream().query(),
}
torch.manual_seed(7)
state = torch.cuda.get_rng_state()
out["rng_is_cpu"] = bool(torch.equal(state, torch.get_rng_state()))
tracker = tensor_parallel.get_cuda_rng_tracker()
tracker.add("model-parallel-rng", 123)
saved = cpu_compat.get_rng_tracker_states()
with tracker.fork():
    a = torch.rand(3)
cpu_compat.set_rng_tracker_states(saved)
with tracker.fork():
    b = torch.rand(3)
out["tracker_replays"] = bool(torch.equal(a, b))
out["default_untouched"] = bool(torch.equal(torch.get_rng_state(), state))
print(json.dumps(out))
"""


def test_cpu_compat_maps_cuda_to_cpu_and_keeps_rng_state_real():
    """In a fresh process (the patches are process-wide): CUDA requests land on CPU; RNG states are real."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CPU_COMPAT_PROBE], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "empty_cuda": "cpu", "zeros_index": "cpu", "dot_cuda": "cpu", "to_cuda": "cpu",
        "type": "torch.cuda.FloatTensor",  # what Megatron's optimizer and clip_grads assert
        "stream": True, "rng_is_cpu": True, "tracker_replays": True, "default_untouched": True,
    }


def test_a_lost_peer_is_one_line_also_when_it_is_the_cause_of_another_error():
    """Issue 23: a surviving rank whose collective failed because another rank died logs one line; a save or a
    cleanup that failed because of it (the gloo error as its cause or context) too, not chained tracebacks."""
    from megatron_resilience.trainer import lost_a_peer

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:35228. This is typically caused by a remote worker crashing.")
    assert lost_a_peer(gloo) == "Connection closed by peer"
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise ValueError("checkpoint save failed") from err
    except ValueError as wrapped:
        assert lost_a_peer(wrapped) == "Connection closed by peer"
    try:
        try:
            raise gloo
        except RuntimeError:
            raise KeyError("state") from None  # a context suppressed on purpose is still the context
    except KeyError as during:
        assert lost_a_peer(during) == "Connection closed by peer"
    assert lost_a_peer(ValueError("bad value")) is None
    assert lost_a_peer(ConnectionResetError(104, "Connection reset by peer")) == "Connection reset by peer"
