"""What a DP Trainer refuses before training, and how the Trainer's batch settings map.

Every refusal names the setting and why: either the accountant's epsilon would not hold (a
sampler other than the shared Poisson draw, examples packed together), or the engine could not
clip each example's gradient exactly (loss scaling, recomputed forwards, fused kernels that
bypass the layers' hooks, losses the per-example criterion does not compute).
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from dataclasses import dataclass

from torch.utils.data import IterableDataset

from ...errors import UnsupportedConfigurationError
from ._hf_internals import (
    data_parallel_gpus,
    first_set_flag,
    groups_by_length,
    loss_type,
    missing_trainer_methods,
    parallelism_sizes,
    replaced_methods,
    sampling_strategy,
)
from .arguments import DPArguments

logger = logging.getLogger(__name__)

#: ``TrainingArguments`` fields refused when truthy, and why.
_REFUSED_FLAGS: dict[str, str] = {
    "fp16": "fp16 loss scaling scales the per-example gradients before clipping; use bf16 or fp32",
    "gradient_checkpointing": "recomputed forwards fire the layers' hooks twice, so "
    "per-example norms come out wrong; turn activation checkpointing off",
    "activation_checkpointing": "recomputed forwards fire the layers' hooks twice, so "
    "per-example norms come out wrong; turn activation checkpointing off",
    "torch_compile": "compiled modules bypass the per-layer hooks that compute per-example norms",
    "use_liger_kernel": "Liger's fused kernels bypass the per-layer hooks that compute "
    "per-example norms",
    "label_smoothing_factor": "label smoothing is not the per-example criterion's loss",
    "deepspeed": "DeepSpeed runs its own backward and gradient partitioning; use DDP or FSDP2",
    "auto_find_batch_size": "a retried batch size would re-run steps whose draws were already "
    "counted; set max_physical_batch_size instead",
    "neftune_noise_alpha": "NEFTune scales each example's embedding noise by its batch's padded "
    "length, so one example's gradient depends on the others in its batch",
}

#: ``SFTConfig`` fields refused when truthy, and why.
_REFUSED_SFT_FLAGS: dict[str, str] = {
    "packing": "packing concatenates several records into one example, so one privacy unit is "
    "no longer one example (the accountant's epsilon would not hold); one record is one example",
    "padding_free": "padding-free batches flatten every example into one sequence, so "
    "per-example clipping would clip the whole batch as one example",
    "activation_offloading": "not tested with the per-layer hooks that compute per-example norms",
}


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How the Trainer's batch settings map onto the DP step."""

    logical_batch_size: int
    """Expected global batch of one optimizer step."""
    max_physical_batch_size: int
    """Most examples per forward/backward on one rank."""
    mapped_accumulation: int
    """The ``gradient_accumulation_steps`` folded into the logical batch (1: none)."""


def plan_batches(args, dp: DPArguments, data_parallel_ranks: int) -> BatchPlan:
    """Maps ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` onto the DP step.

    One optimizer step is one logical (Poisson) batch; physical batches inside it take the
    place of gradient accumulation. Without ``logical_batch_size``, the logical batch is what
    the Trainer would have stepped on (``per_device_train_batch_size x
    gradient_accumulation_steps x data-parallel ranks``); with it, accumulation must be 1.

    Raises:
        UnsupportedConfigurationError: ``gradient_accumulation_steps > 1`` together with
            ``logical_batch_size`` (two answers to one question).
    """
    per_device = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    if dp.logical_batch_size is not None and accumulation != 1:
        raise UnsupportedConfigurationError(
            f"gradient_accumulation_steps={accumulation} with DPArguments.logical_batch_size="
            f"{dp.logical_batch_size}: one optimizer step is one logical Poisson batch, split "
            "into physical batches of at most max_physical_batch_size. Set "
            "gradient_accumulation_steps=1, or leave logical_batch_size unset to use "
            "per_device_train_batch_size x gradient_accumulation_steps x ranks."
        )
    logical = dp.logical_batch_size or per_device * accumulation * data_parallel_ranks
    return BatchPlan(
        logical_batch_size=logical,
        max_physical_batch_size=dp.max_physical_batch_size or per_device,
        mapped_accumulation=accumulation,
    )


def check_hub(args) -> None:
    """Refuses pushing checkpoint folders to the Hub (before the Trainer contacts it).

    Args:
        args: The ``TrainingArguments`` (None: nothing to check).

    Raises:
        UnsupportedConfigurationError: for ``hub_strategy`` ``"checkpoint"`` or
            ``"all_checkpoints"`` with ``push_to_hub``.
    """
    if args is None:
        return
    if args.push_to_hub and str(args.hub_strategy).split(".")[-1].lower() in (
        "checkpoint",
        "all_checkpoints",
    ):
        raise UnsupportedConfigurationError(
            f"push_to_hub with hub_strategy={args.hub_strategy!r}: the checkpoint folders the "
            "Hub would receive hold dp/, the sampler's seed and the noise generators' states, "
            "from which every noise draw can be rebuilt. Use hub_strategy='every_save' or "
            "'end' (the model and privacy.json only)."
        )


def check_training_arguments(args) -> None:
    """Refuses the ``TrainingArguments`` (or ``SFTConfig``) a DP run cannot honour.

    Raises:
        UnsupportedConfigurationError: naming the first refused setting and why.
    """
    refused = {**_REFUSED_FLAGS, **_REFUSED_SFT_FLAGS}
    found = first_set_flag(args, refused)
    if found is not None:
        name, value = found
        raise UnsupportedConfigurationError(f"{name}={value!r}: {refused[name]}.")
    strategy = sampling_strategy(args)
    if strategy != "random" or groups_by_length(args):
        raise UnsupportedConfigurationError(
            f"train_sampling_strategy={strategy!r}: the DP trainer draws every batch with the "
            "shared Poisson sampler (each example joins each step with probability q), which "
            "the accountant's epsilon assumes; samplers that order or group examples "
            "('sequential', 'group_by_length', 'batch_rebalance') are refused."
        )
    loss = loss_type(args)
    if loss not in ("nll", None):
        raise UnsupportedConfigurationError(
            f"loss_type={loss!r}: the DP trainer's per-example loss is the mean next-token "
            "cross-entropy (loss_type='nll')."
        )
    if data_parallel_gpus(args) > 1:
        raise UnsupportedConfigurationError(
            f"n_gpu={args.n_gpu} (torch.nn.DataParallel): launch one process per device "
            "(torchrun) for DDP or FSDP2."
        )
    fsdp_config = args.fsdp_config or {}
    if args.fsdp and str(fsdp_config.get("version", fsdp_config.get("fsdp_version", 1))) != "2":
        raise UnsupportedConfigurationError(
            "fsdp with fsdp_version 1 (accelerate's FSDP1 plugin) is not supported by the DP "
            "trainer: set fsdp_config={'version': 2}, or shard the model with "
            "fully_shard yourself before handing it to the Trainer."
        )


#: The Trainer's private methods the DP trainer overrides (checked on transformers 5.24): if a
#: release renames one, its override would silently never run.
TRAINER_HOOKS = (
    "_prepare_for_training",
    "_get_grad_norm",
    "_track_num_input_tokens",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_remove_unused_columns",
    "_get_collator_with_removed_columns",
)


def check_trainer_version() -> None:
    """Refuses a transformers release whose Trainer lacks a method the DP trainer overrides.

    Raises:
        UnsupportedConfigurationError: naming the missing methods and the release.
    """
    import transformers

    missing = missing_trainer_methods(transformers.Trainer, TRAINER_HOOKS)
    if missing:
        raise UnsupportedConfigurationError(
            f"transformers {transformers.__version__}: Trainer has no {', '.join(missing)}, "
            "which the DP trainer overrides (checked on transformers 5.24); install the [hf] "
            "extra's transformers."
        )


def check_world(args) -> None:
    """Refuses a Trainer that runs as one process inside a process group of several ranks.

    Under ``torchrun`` on CPU, ``TrainingArguments`` without ``use_cpu=True`` see one process
    while the process group has several: every rank would then train alone, each releasing
    its own noisy model of the same data.

    Raises:
        UnsupportedConfigurationError: naming both sizes.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and args.world_size != world:
        raise UnsupportedConfigurationError(
            f"the process group has {world} ranks but the Trainer runs on {args.world_size} "
            "(TrainingArguments.world_size): every rank would train its own model on the same "
            "data. On CPU under torchrun, pass use_cpu=True."
        )


def check_parallelism(accelerator) -> None:
    """Refuses tensor, context and sequence parallelism from accelerate's parallelism config.

    Raises:
        UnsupportedConfigurationError: naming the parallelism.
    """
    for name, size in parallelism_sizes(accelerator).items():
        if size > 1:
            raise UnsupportedConfigurationError(
                f"parallelism_config.{name}={size}: the DP trainer runs data parallelism only "
                "(DDP, FSDP2); see docs/tensor_parallel.md and docs/context_parallel.md."
            )


def check_trainer(trainer, expected: dict[str, object]) -> None:
    """Refuses what a trainer instance brings on top of its arguments.

    Args:
        trainer: The DP trainer.
        expected: Method name -> the function the DP trainer relies on (a subclass that
            replaces one of them replaces the sampling).

    Raises:
        UnsupportedConfigurationError: for an iterable training set, a custom loss function,
            or a subclass that replaces the training sampler or loader.
    """
    if isinstance(trainer.train_dataset, IterableDataset) or (
        trainer.train_dataset is not None and not isinstance(trainer.train_dataset, Sized)
    ):
        raise UnsupportedConfigurationError(
            "an iterable training set: Poisson sampling draws examples by index from a "
            "map-style dataset with len() (datasets.Dataset, a list, a torch Dataset)."
        )
    if trainer.compute_loss_func is not None:
        raise UnsupportedConfigurationError(
            "compute_loss_func: the DP trainer computes one loss per example from the logits "
            "(see opacus_fsdp_sync.integrations.transformers.loss); a batch-level loss cannot "
            "be clipped per example."
        )
    replaced = replaced_methods(type(trainer), expected)
    if replaced:
        raise UnsupportedConfigurationError(
            f"{type(trainer).__name__}.{replaced[0]} is overridden: the DP trainer draws every "
            "batch with the shared Poisson sampler, which the accountant's epsilon assumes."
        )
