"""Per-example losses from a Hugging Face model's logits, for the DP criterion.

One record is one example and one privacy unit. A causal language model's per-example loss is
the mean next-token cross-entropy over the example's trained tokens: labels ``-100`` (prompt,
padding, the non-assistant turns of TRL's completion-only and assistant-only masks) are
skipped, and the DP criterion, given ``shape=``, divides each row's sum by its own count of
trained tokens, so every example weighs the same before clipping whatever its length. The
Trainer's ``num_items_in_batch`` (one token count for the whole batch) is not used: it would
couple the examples of a batch. Sequence classification: one cross-entropy per example.
"""

from __future__ import annotations

import torch
from torch import nn

from ._hf_internals import base_model

#: Label of a position no loss is computed on (Hugging Face and TRL collators).
IGNORE_INDEX = -100


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or the base model under a peft wrapper) is a causal language model.

    The Trainer's own test: the class name is one of transformers' causal-LM classes.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = base_model(model)
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(base).__mro__)


def per_example_loss(criterion, logits: torch.Tensor, labels: torch.Tensor, *, causal: bool):
    """The DP criterion's loss of a batch, one term per example.

    Args:
        criterion: The criterion ``make_private`` returned (a cross-entropy underneath, with
            ``ignore_index=-100``).
        logits: ``(B, T, V)`` token logits, or ``(B, C)`` class logits.
        labels: ``(B, T)`` token labels (unshifted, as Hugging Face models take them) or
            ``(B,)`` class labels.
        causal: Shift by one (next-token prediction) before comparing.

    Returns:
        The criterion's loss (its ``backward()`` runs the private step).

    Raises:
        ValueError: for labels whose shape does not match the logits.
    """
    if logits.dim() == 2:
        return criterion(logits, labels)
    # rows may differ: an empty batch's forward runs on a stand-in example (its loss is
    # weighted zero by the criterion, whatever the empty labels), whose length need not be the
    # empty batch's (the stand-in is the last non-empty batch's first example)
    if labels.dim() == 2 and labels.shape[0] == 0:
        labels = labels.new_full((0, logits.shape[1]), IGNORE_INDEX)
    if labels.dim() != 2 or labels.shape[1] != logits.shape[1]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
            "expected one label per token, as Hugging Face collators produce"
        )
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return criterion(*flat, shape=logits.shape[:2])
