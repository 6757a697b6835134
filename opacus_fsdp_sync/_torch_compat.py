"""The one place that calls private autograd APIs (tested on the releases of the version gate)."""

from __future__ import annotations

import torch

from .distributed import version_gate


def in_backward() -> bool:
    """True while autograd executes a backward pass on this thread.

    A forward that runs then is an activation-checkpointing recomputation: Opacus must not
    capture its activations a second time.

    Raises:
        TorchInternalsError: if this torch build lacks ``torch._C._current_graph_task_id``.
    """
    fn = getattr(torch._C, "_current_graph_task_id", None)
    if fn is None:
        raise version_gate.internals_error(
            "telling activation-checkpointing recomputation from a forward",
            "torch._C._current_graph_task_id",
            "Turn activation checkpointing off, or install a tested torch release.",
        )
    return fn() != -1


def saved_operands(node) -> list[torch.Tensor]:
    """The operands a binary autograd node (``MulBackward0`` and kin) holds for its backward.

    Only tensors autograd holds itself are returned: one packed by saved-tensor hooks (activation
    checkpointing, offloading) is left out, since unpacking it would run the hook (a
    non-reentrant checkpoint would recompute its whole region). An operand the node did not save
    (its partner needs no gradient) is left out too.

    Args:
        node: An autograd node (a tensor's ``grad_fn``).

    Raises:
        TorchInternalsError: if the node lacks ``_raw_saved_self``/``_raw_saved_other`` or a saved
            tensor lacks ``unpack_hook`` (not the tested torch releases).
    """
    try:
        raws = {"self": node._raw_saved_self, "other": node._raw_saved_other}
        held = [n for n, raw in raws.items() if raw is not None and raw.unpack_hook is None]
    except AttributeError as exc:
        raise version_gate.internals_error(
            "the RMSNorm norm from the forward's normalised input",
            f"autograd nodes' _raw_saved_self/_raw_saved_other and unpack_hook ({exc})",
            "Install a tested torch release.",
        ) from exc
    saved = [node._saved_self if n == "self" else node._saved_other for n in held]
    return [t for t in saved if isinstance(t, torch.Tensor)]


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None when ``t`` is not a view.

    Raises:
        TorchInternalsError: if tensors lack ``_base`` (not the tested torch releases).
    """
    try:
        return t._base
    except AttributeError as exc:
        raise version_gate.internals_error(
            "telling a hooked layer's view output from a tensor of its own",
            f"Tensor._base ({exc})",
            "Install a tested torch release.",
        ) from exc
