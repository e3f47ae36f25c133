"""NeMo-Run plugins (login node, submit time). Never imports torch or megatron.

``FaultTolerancePlugin`` runs the trainer under ft_launcher with in-job restarts and job retries;
``PreemptionPlugin`` makes Slurm signal the trainer before the time limit so it checkpoints and is
requeued; ``preview`` renders the sbatch script a job would run without submitting it.
"""

from megatron_resilience.plugins.fault_tolerance import FaultTolerancePlugin
from megatron_resilience.plugins.preemption import PreemptionPlugin
from megatron_resilience.plugins.preview import preview

__all__ = ["FaultTolerancePlugin", "PreemptionPlugin", "preview"]
