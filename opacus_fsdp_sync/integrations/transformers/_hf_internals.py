"""The one place that reads Hugging Face attributes which not every release or class declares.

``TrainingArguments``, TRL's ``SFTConfig`` and accelerate's ``Accelerator`` differ in the fields
they carry (``loss_type`` and ``packing`` are TRL's, ``train_sampling_strategy`` is gone from
recent transformers, ``parallelism_config`` is new in accelerate), and the DP trainer overrides
private ``Trainer`` methods. Every such read is here, under a name that says what it reads.
Checked on transformers 5.23 / 5.24, TRL's ``SFTConfig`` of the ``[trl]`` extra and accelerate
1.x; a field a class does not declare reads as its documented default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: The argument fields that turn activation checkpointing on (``TrainingArguments`` has the
#: first; TRL's ``SFTConfig`` both).
CHECKPOINTING_FLAGS = ("gradient_checkpointing", "activation_checkpointing")


def first_set_flag(args, names: Iterable[str]) -> tuple[str, object] | None:
    """The first of ``names`` that ``args`` declares with a truthy value.

    Args:
        args: ``TrainingArguments`` or a subclass (``SFTConfig``).
        names: Field names, some declared only by some argument classes.

    Returns:
        ``(name, value)``, or None when none is set (or declared).
    """
    for name in names:
        value = getattr(args, name, None)
        if value:
            return name, value
    return None


def sampling_strategy(args) -> str:
    """``args.train_sampling_strategy`` (transformers' sampler choice), ``"random"`` if absent."""
    return getattr(args, "train_sampling_strategy", "random")


def groups_by_length(args) -> bool:
    """``args.group_by_length`` (batches of similar lengths), False where not declared."""
    return bool(getattr(args, "group_by_length", False))


def loss_type(args) -> str | None:
    """``args.loss_type`` (TRL's ``SFTConfig``), ``"nll"`` (its default) for other classes."""
    return getattr(args, "loss_type", "nll")


def data_parallel_gpus(args) -> int:
    """``args.n_gpu``: devices ``torch.nn.DataParallel`` would split one process's batch over."""
    return getattr(args, "n_gpu", 1)


def checkpointing_requested(args) -> bool:
    """Whether any of :data:`CHECKPOINTING_FLAGS` that ``args`` declares is on."""
    return first_set_flag(args, CHECKPOINTING_FLAGS) is not None


def turn_off_checkpointing(args) -> None:
    """Sets every one of :data:`CHECKPOINTING_FLAGS` that ``args`` declares to False."""
    for name in CHECKPOINTING_FLAGS:
        if hasattr(args, name):
            setattr(args, name, False)


def missing_trainer_methods(trainer_cls: type, names: Iterable[str]) -> list[str]:
    """The private ``Trainer`` methods among ``names`` that ``trainer_cls`` does not define."""
    return [name for name in names if not hasattr(trainer_cls, name)]


def replaced_methods(trainer_cls: type, expected: Mapping[str, object]) -> list[str]:
    """The methods of ``trainer_cls`` that are not the functions in ``expected`` (by name).

    Args:
        trainer_cls: The trainer's class (a user's subclass may replace a method).
        expected: Method name -> the function the DP trainer relies on.
    """
    return [
        name for name, function in expected.items() if getattr(trainer_cls, name) is not function
    ]


def parallelism_sizes(accelerator) -> dict[str, int]:
    """Tensor, context and sequence parallel degrees from accelerate's ``parallelism_config``.

    Reads ``accelerator.parallelism_config`` (absent on older accelerate, None when unset) and
    its ``tp_size``, ``cp_size``, ``sp_size`` (1 where absent or unset).

    Returns:
        ``{"tp_size": ..., "cp_size": ..., "sp_size": ...}``; empty without a config.
    """
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return {}
    return {name: getattr(config, name, 1) or 1 for name in ("tp_size", "cp_size", "sp_size")}


def base_model(model):
    """The model under a peft wrapper (``PeftModel.get_base_model()``), else ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
