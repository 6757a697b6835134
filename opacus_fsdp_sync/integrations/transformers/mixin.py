"""The Trainer overrides that make a Hugging Face (or TRL) trainer differentially private.

In the Trainer's own terms:

- ``__init__``: refuse what DP cannot honour (:mod:`.refusals`); map the batch settings (one
  optimizer step per logical Poisson batch, ``gradient_accumulation_steps`` folded into it,
  the Trainer's global gradient clipping off, data skipping on resume off: the sampler's state
  continues instead).
- ``get_train_dataloader``: a loader whose length is the steps per epoch (its batch is the
  logical batch); ``_prepare_for_training`` makes the prepared model private and replaces it
  with :class:`.batches.LogicalBatches` over the engine's shared Poisson sampler.
- ``training_step``: every physical batch of the logical step, forward and private backward,
  one optimizer step (the Trainer's) at the end.
- ``log``: the engine's accountant's epsilon in every log line.
- checkpoints carry the DP state (:mod:`.checkpoints`); ``save_model`` writes a model that
  ``from_pretrained`` loads (a peft adapter for a peft model) and its ``privacy.json``.

The Trainer methods overridden here whose names start with an underscore were checked against
transformers 5.24 (``Trainer._prepare_for_training``, ``_get_grad_norm``,
``_track_num_input_tokens``, ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from ._hf_internals import checkpointing_requested, turn_off_checkpointing
from .arguments import DPArguments
from .batches import LogicalBatch, LogicalBatches, batch_size
from .checkpoints import (
    full_state_dict,
    load_dp_checkpoint,
    save_dp_checkpoint,
    write_privacy_record,
)
from .loss import is_causal_lm, per_example_loss
from .refusals import (
    check_hub,
    check_parallelism,
    check_trainer,
    check_trainer_version,
    check_training_arguments,
    check_world,
    plan_batches,
)
from .session import DPSession, make_session

logger = logging.getLogger(__name__)

#: The learning-rate schedule's file in a Trainer checkpoint (transformers' ``SCHEDULER_NAME``).
SCHEDULER_FILE = "scheduler.pt"


def _copy_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The Trainer's arguments with ``TrainingArguments`` copied (never edit the user's)."""
    if kwargs.get("args") is not None:
        kwargs = {**kwargs, "args": copy.copy(kwargs["args"])}
    elif len(args) > 1 and args[1] is not None:
        args = (args[0], copy.copy(args[1]), *args[2:])
    return args, kwargs


def _sharded_by_user(model) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


class DPTrainerMixin:
    """DP-SGD with exact per-example clipping for a ``transformers.Trainer`` subclass.

    Put it first in the bases (``class DPTrainer(DPTrainerMixin, Trainer)``). Every argument of
    the Trainer is accepted as before; ``dp_args`` adds the DP ones.

    Args:
        *args: The Trainer's positional arguments.
        dp_args: The DP arguments.
        **kwargs: The Trainer's keyword arguments.

    Raises:
        UnsupportedConfigurationError: for a setting DP cannot honour (see :mod:`.refusals`).
    """

    #: Turn off activation checkpointing when the arguments have it on, instead of refusing
    #: it (TRL's ``SFTConfig`` turns it on by default; a Trainer user turns it on by choice).
    dp_checkpointing_off_by_default = False

    def __init__(self, *args, dp_args: DPArguments, **kwargs):
        if not isinstance(dp_args, DPArguments):
            raise TypeError(f"dp_args must be DPArguments, got {type(dp_args).__name__}")
        check_trainer_version()
        args, kwargs = _copy_arguments(args, kwargs)
        check_hub(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        self.dp_args = dp_args
        if self.dp_checkpointing_off_by_default:
            self._turn_off_checkpointing()
        check_training_arguments(self.args)
        check_world(self.args)
        check_parallelism(self.accelerator)
        check_trainer(
            self,
            {
                "_get_train_sampler": _trainer_class()._get_train_sampler,
                "get_train_dataloader": DPTrainerMixin.get_train_dataloader,
            },
        )
        self.dp_batches = plan_batches(self.args, dp_args, self.args.world_size)
        self._map_arguments()
        #: The private run (None until training starts).
        self.dp_session: DPSession | None = None
        self._dp_resume: str | None = None
        self._dp_causal = is_causal_lm(self.model)
        if _sharded_by_user(self.model) and not self.is_fsdp_enabled:
            # the model owns its placement and reduction, as a model sharded at load time does:
            # accelerate then neither moves nor wraps it in DDP
            self.is_distributed_loading_by_transformers = True

    def _turn_off_checkpointing(self) -> None:
        if checkpointing_requested(self.args):
            logger.warning(
                "[Ghost] activation checkpointing off (on by default in %s): recomputed "
                "forwards would fire the per-layer norm hooks twice; memory is bounded by "
                "max_physical_batch_size instead",
                type(self.args).__name__,
            )
            turn_off_checkpointing(self.args)

    def _map_arguments(self) -> None:
        args, plan = self.args, self.dp_batches
        if plan.mapped_accumulation != 1:
            logger.info(
                "[Ghost] gradient_accumulation_steps=%d folded into the logical batch (%d): "
                "one optimizer step per logical Poisson batch",
                plan.mapped_accumulation,
                plan.logical_batch_size,
            )
            args.gradient_accumulation_steps = 1
            self.accelerator.gradient_accumulation_steps = 1
        if args.max_grad_norm:
            logger.info(
                "[Ghost] TrainingArguments.max_grad_norm=%g (global clipping) off: each example "
                "is clipped at DPArguments.max_grad_norm=%g",
                args.max_grad_norm,
                self.dp_args.max_grad_norm,
            )
            args.max_grad_norm = 0.0
        args.ignore_data_skip = True  # a resume continues the sampler's own state
        if args.dataloader_num_workers:
            logger.info(
                "[Ghost] dataloader_num_workers=%d not used: each logical batch is drawn and "
                "collated when the step asks for it (a prefetched draw would be counted unused)",
                args.dataloader_num_workers,
            )
        logger.info(
            "[Ghost] DP batches: expected logical batch %d over %d rank(s), physical batches "
            "of at most %d per rank",
            plan.logical_batch_size,
            args.world_size,
            plan.max_physical_batch_size,
        )

    # -- data -------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """A loader whose ``len()`` is the steps per epoch (batch: the logical batch).

        Only its length, dataset and collator are used: the batches come from the shared
        Poisson sampler once the model is private.
        """
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets comes with trl
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return DataLoader(
            dataset, batch_size=self.dp_batches.logical_batch_size, collate_fn=collator
        )

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The next ``num_batches`` logical batches; no token count (each example has its own)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    # -- making the model private --------------------------------------------------------------

    def train(self, *args, **kwargs):
        """The Trainer's ``train``; one call per DP trainer (the engine is bound to one run)."""
        if self.dp_session is not None:
            raise RuntimeError("a DP trainer trains once: build a new one for another run")
        return super().train(*args, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint
        )
        from accelerate.optimizer import AcceleratedOptimizer

        inner = self.optimizer
        if isinstance(inner, AcceleratedOptimizer):
            inner = inner.optimizer
        model.train()  # an evaluate() before train() leaves it in eval mode
        session = make_session(
            model=model,
            optimizer=inner,
            data_loader=train_dataloader,
            dp=self.dp_args,
            total_steps=max_steps,
        )
        self.dp_session = session
        self.optimizer = session.optimizer
        self.model_wrapped = session.module
        if self._created_lr_scheduler:  # rebuilt on the DP optimizer, which steps
            self.lr_scheduler, self._created_lr_scheduler = None, False
            self.create_scheduler(num_training_steps=max_steps)
        if self._dp_resume is not None:
            load_dp_checkpoint(
                self._dp_resume,
                session,
                fresh_noise=self.dp_args.fresh_noise,
                steps_after_checkpoint=self.dp_args.steps_after_checkpoint,
                ledger_folder=self.args.output_dir,
            )
            path = os.path.join(self._dp_resume, SCHEDULER_FILE)
            if os.path.isfile(path):
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            logger.info(
                "[Ghost] resumed from %s: %d draws counted, epsilon %.4g",
                self._dp_resume,
                session.steps_counted,
                session.epsilon(),
            )
        batches = LogicalBatches(
            sampler=session.sampler,
            dataset=train_dataloader.dataset,
            collate_fn=train_dataloader.collate_fn,
            max_physical_batch_size=self.dp_batches.max_physical_batch_size,
        )
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        self.callback_handler.train_dataloader = batches
        return session.module, batches

    # -- the step ----------------------------------------------------------------------------

    def training_step(self, model, inputs: LogicalBatch, num_items_in_batch=None) -> torch.Tensor:
        """Forward and private backward of every physical batch of one logical batch.

        The optimizer steps once, when the Trainer calls it after this returns: earlier
        physical batches only accumulate their clipped sums.

        Returns:
            The mean per-example loss of this rank's examples (not private).
        """
        session = self.dp_session
        if session is None:
            raise RuntimeError(
                "training_step before the model was made private: the Trainer did not call "
                "_prepare_for_training (another transformers release?)"
            )
        opt = session.optimizer
        model.train()
        opt.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        last = len(inputs) - 1
        for i, batch in enumerate(inputs):
            batch = self._prepare_inputs(batch)
            with self.compute_loss_context_manager():
                loss = self._private_loss(model, batch)
            loss.backward()
            n = batch_size(batch)
            if n:
                total, count = total + float(loss) * n, count + n
            if i < last:
                opt.signal_skip_step(do_skip=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
        opt.signal_skip_step(do_skip=False)
        return torch.tensor(total / max(count, 1), device=self.args.device)

    def _private_loss(self, model, batch: dict):
        labels = batch.pop("labels")
        if self._dp_causal:
            batch["use_cache"] = False
        outputs = model(**batch)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        return per_example_loss(self.dp_session.criterion, logits, labels, causal=self._dp_causal)

    def _get_grad_norm(self, model, grad_norm=None):
        # The norm of the clipped sum before noise is not private: never computed or logged.
        return None

    def _track_num_input_tokens(self, inputs):
        for batch in inputs if isinstance(inputs, LogicalBatch) else [inputs]:
            super()._track_num_input_tokens(batch)

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate, summed over the physical batches of a logical batch."""
        if isinstance(inputs, LogicalBatch):
            return sum(super(DPTrainerMixin, self).floating_point_ops(b) for b in inputs)
        return super().floating_point_ops(inputs)

    # -- logs --------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with the accountant's ``epsilon`` (at ``dp_args.delta``)."""
        if self.dp_session is not None:
            logs["epsilon"] = self.dp_session.epsilon()
        super().log(logs, start_time)

    @property
    def epsilon(self) -> float:
        """The accountant's epsilon so far (0 before training)."""
        return 0.0 if self.dp_session is None else self.dp_session.epsilon()

    # -- checkpoints and models ----------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.dp_session is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_dp_checkpoint(output_dir, self.dp_session)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The weights come from the checkpoint's dp/ folder once the model is private.
        self._dp_resume = resume_from_checkpoint

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        # Loaded with the DP state once the model is private (_prepare_for_training).
        if checkpoint is not None:
            self._dp_resume = checkpoint

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes a model ``from_pretrained`` loads (a peft adapter for a peft model).

        Every rank must call it (sharded weights are gathered to rank 0). Beside the weights:
        ``privacy.json``, the run's privacy record so far.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        source = self.dp_session.module if self.dp_session is not None else self.model
        state = full_state_dict(source)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
            if self.dp_session is not None:
                write_privacy_record(output_dir, self.dp_session)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def _trainer_class():
    from transformers import Trainer

    return Trainer
