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
* ``--inprocess-restart`` (run here with 0.19.2 and nvidia-resiliency-ext 0.7.0 on 2 CPU ranks under ft_launcher,
  ``tests/megatron_lm/test_megatron_lm_inprocess_restart.py``; the releases read in Megatron-LM's history): from
  core_v0.13.0 ``maybe_wrap_for_inprocess_restart`` wraps ``pretrain`` in nvidia-resiliency-ext's
  ``inprocess.Wrapper``, whose finalize (``destroy_state``) destroys Megatron-LM's global state before each restart
  iteration. No release passes ``--inprocess-max-iterations`` to the wrapper (parsed, never used, 0.13.0 to main),
  so a restart iteration that fails is restarted forever. Three things make every restart iteration fail:

  - with ``--enable-ft-package`` (every release with in-process restart, 0.13.0 to Megatron-LM's main at
    d98e8a64dd): ``pretrain`` starts with ``ft_integration.setup()``, which asserts that no rank monitor client
    exists; only a ``pretrain`` that returns (or exits) shuts the client down, and ``destroy_state`` does not, so
    every restart iteration fails with ``AssertionError: rank monitor client is already initialized.`` (measured:
    0.19.2, rank 1 raising at step 8, both ranks, every iteration);
  - :data:`INPROCESS_ARGS_DESTROYED_FROM`: Megatron-LM PR #4225 ("Extract args init to launch scripts", first in
    core_v0.18.0) moved argument parsing out of ``pretrain`` into ``pretrain_gpt.py``, *before* the wrapped call;
    the finalize destroys those arguments and nothing parses them again, so without ``--enable-ft-package`` every
    restart iteration fails with ``AssertionError: args is not initialized.`` (measured: 0.19.2, both ranks; about
    150 iterations in 8 minutes by hand, never resuming). Unchanged on main at d98e8a64dd;
  - :data:`INPROCESS_STORE_UNPREFIXED_FROM`: Megatron-LM PR #4420 (main, in core_v0.18.0; backported to
    core_v0.17.1 by PR #4453) annotates ``pretrain``'s ``inprocess_call_wrapper`` as ``Optional[Any]``; the wrapper
    hands its ``CallWrapper`` only to a parameter annotated ``CallWrapper`` (0.7.0's ``param_utils.check_type``
    returns False for ``Optional[Any]``), so ``pretrain`` never prefixes the restart store per iteration
    (``PrefixStore(str(iteration), store)``) and a restart iteration's process group meets the previous one's
    keys. Seen once, by hand, with 0.19.2 and an entry that parses its arguments *inside* the wrapped function
    (so that the second cause does not apply; no FT package): the first two restart iterations failed in gloo's
    rendezvous ("Gloo connectFullMesh failed ... Connect timeout", then "Connection refused" to the previous
    iteration's address), the third resumed from the checkpoint and finished; how many fail is timing.
"""

from __future__ import annotations

# nvidia-resiliency-ext's own default is 5.0 (FaultToleranceConfig.safety_factor, 0.4.1 to 0.7.0).
NVRX_DEFAULT_SAFETY_FACTOR = 5.0
LEARNED_TIMEOUT_SAFETY_FACTOR = 20.0
# --inprocess-restart (above): with --enable-ft-package no restart iteration can run on any release; from 0.18.0
# none can without it either (the arguments are gone); from 0.17.1 the restart store is shared by every iteration.
# 0.17.0 and earlier annotate ``Optional[CallWrapper]`` and parse the arguments inside ``pretrain``.
INPROCESS_ARGS_DESTROYED_FROM = (0, 18)
INPROCESS_STORE_UNPREFIXED_FROM = (0, 17, 1)


__all__ = ["INPROCESS_ARGS_DESTROYED_FROM", "INPROCESS_STORE_UNPREFIXED_FROM", "LEARNED_TIMEOUT_SAFETY_FACTOR",
           "NVRX_DEFAULT_SAFETY_FACTOR"]
