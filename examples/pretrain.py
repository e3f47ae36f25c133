"""Submit resilient GPT pretraining from Python: recipe -> overrides -> executor -> plugins -> run.Experiment.

On a Slurm login node (the job is submitted from this machine; use ``--ssh-host`` to submit from elsewhere)::

    python examples/pretrain.py --recipe gpt_126m --nodes 2 --account ACCT --partition batch --time 04:00:00 \\
        --dir /lustre/$USER/runs --dryrun            # print the final config and the sbatch script
    python examples/pretrain.py ... (same, without --dryrun)   # submit, print the experiment id and exit

On this machine (CPU ranks under ft_launcher, waits for the job and prints its log tail)::

    python examples/pretrain.py --recipe gpt_tiny --executor local_ft --dir /tmp/runs train.max_steps=20

Anything after the options is a ``section.field=value`` override, as on the ``nemo`` command line.
The driver is guarded by ``if __name__ == "__main__"``: ``run.Experiment.from_id`` re-imports it.
"""

import argparse
import sys

from megatron_resilience.upstream import import_nemo_run

run = import_nemo_run()
import fiddle as fdl  # noqa: E402

from megatron_resilience.config.overrides import config_to_overrides  # noqa: E402
from megatron_resilience.plugins import FaultTolerancePlugin, PreemptionPlugin, preview  # noqa: E402
from megatron_resilience.recipes import RECIPES, apply_overrides, validate  # noqa: E402
from megatron_resilience.recipes.cli import local_ft, slurm  # noqa: E402


def build(args: argparse.Namespace):
    if args.executor == "slurm":
        executor = fdl.build(slurm(account=args.account, partition=args.partition, nodes=args.nodes, time=args.time,
                                   gpus_per_node=None if args.cpu else args.gpus_per_node,
                                   ntasks_per_node=args.gpus_per_node, host=args.ssh_host, user=args.ssh_user,
                                   job_dir=args.job_dir or ""))
    else:
        executor = fdl.build(local_ft(ntasks_per_node=args.gpus_per_node or 2))
    gpus = executor.nproc_per_node()
    task = RECIPES[args.recipe](dir=args.dir, name=args.name or args.recipe, num_nodes=executor.nnodes(),
                                num_gpus_per_node=gpus)
    task = apply_overrides(task, args.overrides)
    config = validate(task, num_nodes=executor.nnodes(), num_gpus_per_node=gpus)  # fail here, not on the cluster
    plugins = [FaultTolerancePlugin(num_in_job_restarts=args.restarts, num_job_retries_on_failure=args.retries),
               PreemptionPlugin(preempt_time=args.preempt_time)]
    return task, executor, plugins, config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="gpt_126m")
    parser.add_argument("--name", default=None, help="run name (default: the recipe's); runs go to DIR/NAME")
    parser.add_argument("--dir", default=None, help="root of run directories (default: ./runs)")
    parser.add_argument("--executor", choices=["slurm", "local_ft"], default="slurm")
    parser.add_argument("--account", default="")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (slurm default 8, local 2)")
    parser.add_argument("--cpu", action="store_true", help="Slurm partition without GPUs: --gpus-per-node CPU ranks")
    parser.add_argument("--time", default="04:00:00")
    parser.add_argument("--ssh-host", default=None)
    parser.add_argument("--ssh-user", default=None)
    parser.add_argument("--job-dir", default=None, help="where NeMo-Run keeps job files on the cluster (SSH)")
    parser.add_argument("--restarts", type=int, default=3, help="in-job restarts (ft_launcher)")
    parser.add_argument("--retries", type=int, default=2, help="job requeues after a failure (Slurm)")
    parser.add_argument("--preempt-time", type=int, default=60, help="seconds before the time limit to stop")
    parser.add_argument("--dryrun", action="store_true", help="print the config (and sbatch script); submit nothing")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    if args.executor == "slurm" and args.gpus_per_node is None:
        args.gpus_per_node = 8

    task, executor, plugins, config = build(args)
    print("\n".join(config_to_overrides(config)))
    if args.dryrun:
        if args.executor == "slurm":
            print(preview(task, executor, plugins, name=args.name or args.recipe))
        return 0

    detach = args.executor == "slurm"  # a Slurm job outlives this script; a local one is waited for
    with run.Experiment(f"pretrain_{args.recipe}", executor=executor) as exp:
        exp.add(task, executor=executor, plugins=plugins, name=args.name or args.recipe)
        exp.run(detach=detach)
    print(f"experiment: {exp._id}")
    if detach:
        print(f"status: python -c \"import nemo_run as run; run.Experiment.from_id('{exp._id}').status()\"")
        return 0
    job = exp.jobs[0]
    state = job.state.name if hasattr(job.state, "name") else str(job.state)
    print(f"job state: {state}")
    return 0 if state == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
