"""Megatron-LM's own traceback lines, captured from the lane ``make test-megatron-lm`` (tests/megatron_lm/), are
classified by the job-level room's monitors: an exception raised without a message (``raise InjectedException``
in nvidia-resiliency-ext's fault injector, called from megatron-core 0.19.2's training loop) ends its traceback
with the bare class name, which the ``python_exception`` monitor missed (the attempt was 'unknown', from the
launcher's exit) until its message part became optional.
"""

from __future__ import annotations

from megatron_resilience.jobs.classifier import AttemptEvidence, classify
from megatron_resilience.jobs.decision import Cluster, decide
from megatron_resilience.jobs.monitors import load_monitors, scan
from megatron_resilience.jobs.policies import load_policy

# The end of rank 1's traceback in nemo_run's combined.log of the lane's 'exception' run (LocalExecutor, ft_launcher
# 0.7.0), and rank 0's gloo error after its peer left.
CAPTURED = """\
[default1]:[rank1]:   File "/work/main/.venv-newest/megatron/training/training.py", line 3863, in train
[default1]:[rank1]:     _maybe_raise_workload_exception()
[default1]:[rank1]:   File "/work/main/.venv-newest/nvidia_resiliency_ext/shared_utils/inject_fault.py", line 147, in \
maybe_raise_workload_exception
[default1]:[rank1]:     raise InjectedException
[default1]:[rank1]: nvidia_resiliency_ext.shared_utils.inject_fault.InjectedException
"""


def test_an_exception_without_a_message_is_a_python_exception_and_megatron_transient_stops():
    policy = load_policy("megatron_transient")
    signals = scan([("log", line) for line in CAPTURED.splitlines()], load_monitors(list(policy.monitors)))
    assert [(s.monitor, s.error_type, s.fields.get("exception"), s.fields.get("rank")) for s in signals] == [
        ("python_exception", "python_exception", "nvidia_resiliency_ext.shared_utils.inject_fault.InjectedException",
         "1")]
    cls = classify(AttemptEvidence(exit_code=1, signals=signals))
    assert (cls.error_type, cls.source) == ("python_exception", "log")
    decision = decide(cls, policy, [], {"nodes": ["localhost"]}, Cluster(nodes=["localhost"]))
    assert (decision.action, decision.final) == ("stop", True)


def test_the_raise_line_itself_is_not_an_exception():
    signals = scan([("log", '[default1]:[rank1]:     raise InjectedException')], load_monitors(["megatron_basic"]))
    assert [s.monitor for s in signals] == []
