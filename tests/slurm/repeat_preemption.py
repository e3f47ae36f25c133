"""Issue 11's acceptance run, outside the suite: the job that once lost a preemption, N times, cores saturated.

    .venv/bin/python -m pytest -p no:cacheprovider tests/slurm/repeat_preemption.py     # REPEAT=10 by default

The file name keeps pytest from collecting it in ``make test`` (CI runs the same job form once, in
``test_resilience_on_slurm.py::test_2b...[torchrun]``); named on the command line it runs. Each copy is that
test's job: ``gpt_tiny`` on 2 ranks under torchrun through ``SlurmExecutor`` with ``PreemptionPlugin``,
``scancel -s SIGTERM`` once it trained ``SIGNAL_AFTER_STEP`` steps (before the first interval checkpoint),
so the save at the signal is each process's first. All copies run at once, next to an uninterrupted
reference, with the load generator keeping every core busy; each must checkpoint at the signal, be
requeued, resume from that checkpoint and end COMPLETED with per-step losses equal to the reference's.
"""

from __future__ import annotations

import os
import threading

from loadgen import saturated

from slurm import test_resilience_on_slurm as m
from slurm.cluster import wait_for_job
from slurm.jobs import signal_when_training, tiny_task

REPEAT = int(os.environ.get("REPEAT", "10"))


def test_signal_before_the_first_save_n_times_under_load(slurm_cluster, nemorun_home, slurm_tmp):
    root = os.path.join(slurm_tmp, "repeat_preemption")

    def submit(name, plugins=()):
        task = tiny_task(root, name, max_steps=m.STEPS, save_interval=10)
        executor = slurm_cluster.executor(time="00:30:00", ntasks_per_node=2, launcher="torchrun")
        return m.submit(name, task, executor, list(plugins), run_dir=task.run_dir)

    with saturated(seconds=3600):
        ref = submit("ref")
        copies = [submit(f"copy{i}", [m.PreemptionPlugin(preempt_time=m.PREEMPT_TIME)]) for i in range(REPEAT)]
        sent: dict = {}
        signallers = [threading.Thread(target=signal_when_training, args=(job, sent, m.SIGNAL_AFTER_STEP),
                                       daemon=True) for job in copies]
        for t in signallers:
            t.start()
        finals = {job.name: wait_for_job(job.slurm_id, timeout=3000) for job in [ref, *copies]}
        for t in signallers:
            t.join(timeout=10)

    failures = []
    for job in copies:
        try:
            assert isinstance(sent.get(job.name), float), f"{job.name}: not signalled: {sent.get(job.name)}"
            stopped = m._assert_resumed_and_completed(job, finals, max_steps=m.STEPS, ranks=2, ref=ref)
            print(f"{job.name} (job {job.slurm_id}): signalled, stopped after step {stopped}, requeued, resumed, "
                  "COMPLETED, losses equal the reference's")
        except AssertionError as err:
            failures.append(f"{job.name}: {str(err)[:2000]}")
    assert not failures, "\n\n".join(failures)
