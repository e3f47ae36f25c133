"""A small stand-alone training script that knows nothing of megatron_resilience: it takes argparse flags only.

It stands for "your own training script" in the plugin docs and tests: the plugins configure it through a
``script_args_converter_fn`` (here Megatron-LM's flag names: ``megatron_lm_args``), and it reports what
reached it: rank 0 appends one JSON line per run to ``--report`` (the FT settings its rank monitor got from
ft_launcher, the preemption signal, where it resumed and stopped).

    python examples/argparse_trainer.py --train-iters 100 --save /tmp/ckpt --report /tmp/report.json \\
        [--enable-ft-package] [--calc-ft-timeouts] [--exit-signal-handler] [--exit-signal SIGTERM]

It fits y = 3x + 1 with plain-Python SGD (no torch: it starts in well under a second), checkpoints every
``--save-interval`` steps as ``iter_<N>.json`` plus ``latest_checkpointed_iteration.txt`` (the tracker name
Megatron-LM uses, so ft_launcher's progress tracker can read it) and resumes from the newest one. With
``--enable-ft-package`` under ft_launcher it reports setup/step/checkpointing sections to its rank
monitor (nvidia-resiliency-ext's ``RankMonitorClient``); with ``--exit-signal-handler`` it saves and exits 0
after the step during which the signal arrived. When training finished, rank 0 touches
``$FAULT_TOL_FINISHED_FLAG_FILE`` if set: nvidia-resiliency-ext's autoresume contract, which nemo_run's FT
sbatch script relies on to stop requeueing. With ``--like-megatron-lm`` it does what Megatron-LM's
``pretrain_gpt.py`` does instead: it never touches that flag and ends with Megatron-LM's
``[after training is done]`` line (the job-level decision then reads the checkpoint tracker against
``--train-iters``) and resumes only from ``--load``, as Megatron-LM does (the plugins add it);
``--fail-in-attempt N`` makes every rank exit 1 after one step in Slurm attempt N.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

TRACKER = "latest_checkpointed_iteration.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--save", required=True, help="checkpoint directory")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from (default: --save; with "
                   "--like-megatron-lm, as Megatron-LM: only --load, none -> from step 0)")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--report", required=True, help="rank 0 appends one JSON line per run")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--enable-ft-package", action="store_true")
    p.add_argument("--calc-ft-timeouts", action="store_true")
    p.add_argument("--exit-signal-handler", action="store_true")
    p.add_argument("--exit-signal", default="SIGTERM")
    p.add_argument("--exit-signal-handler-for-dataloader", action="store_true")
    p.add_argument("--fail-first-cycle", action="store_true", help="exit 1 after one step in the first cycle")
    p.add_argument("--fail-in-attempt", type=int, default=None,
                   help="exit 1 after one step in every cycle of this Slurm attempt (SLURM_RESTART_COUNT)")
    p.add_argument("--like-megatron-lm", action="store_true",
                   help="never touch $FAULT_TOL_FINISHED_FLAG_FILE; end with Megatron-LM's end-of-training line")
    return p.parse_args(argv)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load(save: str | None) -> tuple[int, float, float]:
    if save is None:
        return 0, 0.0, 0.0
    try:
        with open(os.path.join(save, TRACKER)) as f:
            step = int(f.read().strip())
        with open(os.path.join(save, f"iter_{step}.json")) as f:
            state = json.load(f)
        return step, state["w"], state["b"]
    except FileNotFoundError:
        return 0, 0.0, 0.0


def save(directory: str, step: int, w: float, b: float) -> None:
    os.makedirs(directory, exist_ok=True)
    write_atomic(os.path.join(directory, f"iter_{step}.json"), json.dumps({"step": step, "w": w, "b": b}))
    write_atomic(os.path.join(directory, TRACKER), str(step))


class RankMonitor:
    """nvidia-resiliency-ext's rank monitor client when FT is on and ft_launcher started us, else nothing."""

    def __init__(self, enabled: bool):
        self.client = None
        if enabled and os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()

    def timeouts(self) -> dict:
        if self.client is None:
            return {}
        cfg = self.client.cfg
        return {"rank_section_timeouts": dict(cfg.rank_section_timeouts or {}),
                "rank_out_of_section_timeout": cfg.rank_out_of_section_timeout,
                "initial_rank_heartbeat_timeout": cfg.initial_rank_heartbeat_timeout,
                "rank_heartbeat_timeout": cfg.rank_heartbeat_timeout}

    def section(self, name: str, start: bool) -> None:
        if self.client is not None:
            (self.client.start_section if start else self.client.end_section)(name)

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    cycle = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    received: dict = {}
    if args.exit_signal_handler:
        def on_signal(signum, frame):
            received.setdefault("signal", signal.Signals(signum).name)
            received.setdefault("wall_time", time.time())
        signal.signal(getattr(signal, args.exit_signal), on_signal)

    monitor = RankMonitor(args.enable_ft_package)
    monitor.section("setup", True)
    step, w, b = load(args.load if args.like_megatron_lm else (args.load or args.save))
    resumed_from = step
    rng = random.Random(1234 + step)
    monitor.section("setup", False)
    print(f"rank {rank}: cycle {cycle}, resuming at step {step}; FT {'on' if monitor.client else 'off'} "
          f"{monitor.timeouts()}", flush=True)
    report = {"argv": sys.argv[1:], "rank": rank, "cycle": cycle, "resumed_from": resumed_from,
              "ft": {"connected": monitor.client is not None, **monitor.timeouts()}, "exit_signal": args.exit_signal,
              "exit_signal_handler": args.exit_signal_handler}
    stopped = "finished"
    while step < args.train_iters:
        monitor.section("step", True)
        x = rng.uniform(-1.0, 1.0)
        error = (w * x + b) - (3.0 * x + 1.0)
        w, b = w - 0.1 * error * x, b - 0.1 * error
        time.sleep(args.step_time)
        step += 1
        monitor.section("step", False)
        print(f"rank {rank}: step {step} loss {error * error:.6f}", flush=True)
        if args.fail_first_cycle and cycle == 0:
            print(f"rank {rank}: failing the first cycle on purpose", flush=True)
            return 1
        if args.fail_in_attempt is not None and args.fail_in_attempt == int(os.environ.get("SLURM_RESTART_COUNT", 0)):
            print(f"rank {rank}: failing Slurm attempt {args.fail_in_attempt} on purpose", flush=True)
            return 1
        signalled = bool(received)
        if rank == 0 and (step % args.save_interval == 0 or signalled or step == args.train_iters):
            monitor.section("checkpointing", True)
            save(args.save, step, w, b)
            monitor.section("checkpointing", False)
        if signalled:
            stopped = "signal"
            print(f"rank {rank}: {received['signal']} received: saved at step {step}, exiting 0", flush=True)
            break
    if stopped == "finished":
        print(f"rank {rank}: training finished at step {step} (w={w:.3f} b={b:.3f})", flush=True)
        if args.like_megatron_lm and rank == 0:
            print(f"[after training is done] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ", flush=True)
    monitor.close()
    if rank == 0:
        flag = os.environ.get("FAULT_TOL_FINISHED_FLAG_FILE")
        if stopped == "finished" and flag and not args.like_megatron_lm:
            open(flag, "a").close()
        with open(args.report, "a") as f:
            f.write(json.dumps({**report, "stopped": stopped, "finished_step": step, "signal": received or None,
                                "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
