"""A stand-in trainer that follows the runtime loop's hook contract, for resilience tests and the benchmark.

``python workload.py run_dir=... train.max_steps=... ft.enabled=true ...`` (the trainer's own
key=value overrides). It trains a tiny linear model with data parallelism on gloo (gradients
all-reduced), logs per-step losses to ``run_dir/metrics.jsonl`` and saves a checkpoint
(atomic rename) every ``checkpoint.save_interval`` steps and when it stops. It calls the
``TrainingHooks`` exactly where runtime/loop.py does, so what it proves about the hooks
holds for the trainer; the trainer-level proofs run the real ``-m megatron_resilience``.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_resilience.config.overrides import config_from_overrides
from megatron_resilience.resilience import build_hooks
from megatron_resilience.runtime.state import TrainState

STEP_SECONDS = float(os.environ.get("WORKLOAD_STEP_SECONDS", "0.02"))


def load(ckpt_dir, model, opt):
    path = os.path.join(ckpt_dir or "", "latest.pt")
    if not ckpt_dir or not os.path.exists(path):
        return 0
    blob = torch.load(path)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    return blob["step"]


def save(ckpt_dir, model, opt, step, rank):
    if rank == 0 and ckpt_dir:
        os.makedirs(ckpt_dir, exist_ok=True)
        tmp = os.path.join(ckpt_dir, "latest.pt.tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, os.path.join(ckpt_dir, "latest.pt"))
        print(f"saved checkpoint at step {step}", flush=True)
    dist.barrier()


def main(argv):
    config = config_from_overrides(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hooks = build_hooks(config, rank=rank, world_size=world)
    ckpt = config.checkpoint
    with hooks.setup_section():
        dist.init_process_group("gloo")
        torch.manual_seed(config.train.seed)
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = load(ckpt.load_dir, model, opt)
    state = TrainState(model=[model], optimizer=opt, scheduler=None, step=step)
    hooks.after_setup(state)
    if rank == 0:
        print(f"resuming at step {step}" if step else "starting from scratch", flush=True)

    def train_step(step):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, 16, generator=g)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        time.sleep(STEP_SECONDS)
        t = loss.detach().clone()
        dist.all_reduce(t)
        return t.item() / world

    reason = "finished"
    metrics = open(os.path.join(config.run_dir, "metrics.jsonl"), "a") if rank == 0 else None
    while state.step < config.train.max_steps:
        step = state.step + 1
        with hooks.step_section(step):
            loss = hooks.wrap_train_step(lambda: train_step(step))()
        state.step = step
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss, "time": time.time()}) + "\n")
            metrics.flush()
        if ckpt.save_interval and step % ckpt.save_interval == 0:
            with hooks.checkpoint_section():
                save(ckpt.save, model, opt, step, rank)
        stop = hooks.after_step(state)
        if stop:
            reason = stop
            break
    if not (ckpt.save_interval and state.step % ckpt.save_interval == 0):
        with hooks.checkpoint_section():
            save(ckpt.save, model, opt, state.step, rank)
    hooks.on_exit(state, reason)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
