"""Megatron-LM's own trainer (``megatron/training``, megatron-core 0.19.2's wheel) as the plugins must know it.

Facts measured by running it (tests/megatron_lm/, FACTS.md "Megatron-LM's real training loop on CPU") or read in
its source, each with the release it was seen in:

* ``RESUMES_FROM_LOAD_ONLY``: a restarted or requeued Megatron-LM resumes only from ``--load``; ``--save`` alone
  writes checkpoints that nothing reads back, so every in-job restart and every requeue trains again from step 0
  (0.19.2 under ft_launcher 0.7.0: kill -9 of a rank, the restarted group started at iteration 1);
* learned FT timeouts (``--calc-ft-timeouts``): ``megatron/training/ft_integration.py`` calls the rank monitor
  client's ``calculate_and_set_section_timeouts`` after each save and at the end, and nvidia-resiliency-ext's
  ``TimeoutsCalc`` sets each timeout to ``safety_factor`` x the longest interval it saw (merged with the previous
  learned value by an even average), and ft_launcher's rank monitor applies it as it comes. Neither has a minimum
  (0.19.2's ``ft_integration``, nvidia-resiliency-ext 0.4.1 to 0.7.0's ``timeouts_calc.py``): the one bound a
  launcher can set is ``safety_factor`` in its FT config (the clients take it from ft_launcher's config,
  ``reply_for_init.cfg``). Measured here with the default 5.0: 0.72 s per step and 1.6 s out of section, short
  enough that a healthy rank of a loaded machine is killed. :data:`LEARNED_TIMEOUT_SAFETY_FACTOR` is what the
  plugins give Megatron-LM tasks that learn timeouts instead;
* ``--inprocess-restart`` (0.19.2, read, not run): ``maybe_wrap_for_inprocess_restart`` wraps ``pretrain`` in
  nvidia-resiliency-ext's ``inprocess.Wrapper``, which hands its ``CallWrapper`` only to a parameter *annotated*
  ``CallWrapper``; 0.19.2's ``pretrain`` annotates ``inprocess_call_wrapper: Optional[Any]``, so it stays None,
  the store is never prefixed per restart iteration (``PrefixStore(str(iteration), store)``) and a second
  in-process iteration meets the first one's keys (nvidia-resiliency-ext 0.7.0's ``param_utils.check_type``
  returns False for ``Optional[Any]``, checked here).
"""

from __future__ import annotations

# nvidia-resiliency-ext's own default is 5.0 (FaultToleranceConfig.safety_factor, 0.4.1 to 0.7.0).
NVRX_DEFAULT_SAFETY_FACTOR = 5.0
LEARNED_TIMEOUT_SAFETY_FACTOR = 20.0
# The first megatron-core whose wheel's ``pretrain`` annotates ``inprocess_call_wrapper: Optional[Any]`` (above):
# seen in 0.19.2; earlier Megatron-LM source annotates it ``Optional[CallWrapper]``, which the wrapper fills.
INPROCESS_HANDLE_DROPPED_FROM = (0, 19)


__all__ = ["INPROCESS_HANDLE_DROPPED_FROM", "LEARNED_TIMEOUT_SAFETY_FACTOR", "NVRX_DEFAULT_SAFETY_FACTOR"]
