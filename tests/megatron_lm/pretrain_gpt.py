"""A ``pretrain_gpt.py``-shaped entry for Megatron-LM's real training loop, on CPU (this project's own, for tests).

Megatron-LM's ``pretrain_gpt.py`` lives in its repository, not in the megatron-core wheel; the wheel (0.19.2, the
newest lane's ``.venv-newest``) does ship ``megatron.training`` (``pretrain``, the argument parser, checkpointing,
``ft_integration``, the exit-signal handler). This script is what a Megatron-LM user's entry does, written here:
parse Megatron-LM's command line, wrap ``pretrain`` for in-process restart when asked
(``inprocess_restart.maybe_wrap_for_inprocess_restart``), build the GPT config and the run's config container from
the arguments, and hand ``pretrain`` a dataset provider (``--mock-data``: ``MockGPTDataset``) and a forward step.
Tensor and pipeline parallel size 1 only (the batch is the data iterator's, not broadcast across a TP group).
The one difference from a GPU run is the first line: :mod:`cpu_layer` (beside this file) is installed before
``megatron.training`` is imported.

How to run it (the lane's tests do this through ``run.Script`` and ft_launcher; by hand)::

    PYTHONPATH=/work/main:/work/main/.venv-newest TORCH_COMPILE_DISABLE=1 \
    .venv/bin/torchrun --nproc-per-node 2 tests/megatron_lm/pretrain_gpt.py \
        --distributed-backend gloo --transformer-impl local --use-cpu-initialization \
        --no-gradient-accumulation-fusion --no-persist-layer-norm \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \
        --micro-batch-size 2 --global-batch-size 4 --train-iters 20 --lr 1e-3 --hidden-dropout 0 \
        --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 \
        --save /tmp/ckpt --load /tmp/ckpt --save-interval 10 --log-interval 1

``tests/megatron_lm/megatron_lm_run.py`` has these flags as data (``tiny_gpt_args``) and reads the per-step losses
from Megatron-LM's ``iteration`` lines.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_layer  # noqa: E402  (before megatron.training: it fills typing.override on Python 3.11)

cpu_layer.install()

from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.training import get_args, inprocess_restart, pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402


def loss_func(loss_mask, output_tensor):
    """Summed token losses, their count, and the pair Megatron-LM averages over data-parallel ranks for its log."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


STEP_DELAY_S = float(os.environ.get("STEP_DELAY_S", "0"))  # the chaos benchmark's steps: compute-sized, as on a GPU


def forward_step(data_iterator, model, return_schedule_plan=False):
    if STEP_DELAY_S:
        time.sleep(STEP_DELAY_S)
    batch = next(data_iterator)
    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    output = model(tokens, batch["position_ids"], batch.get("attention_mask"), labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    if not args.mock_data:
        raise SystemExit("tests/megatron_lm/pretrain_gpt.py trains on --mock-data only")
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, split=args.split,
        tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples,
        lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()


datasets_provider.is_distributed = True  # every rank builds its own (TP 1)


def main() -> None:
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise SystemExit("tests/megatron_lm/pretrain_gpt.py runs tensor and pipeline parallel size 1 only")
    train, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    train(config, datasets_provider, ModelType.encoder_or_decoder, forward_step, store=store)


if __name__ == "__main__":
    main()
