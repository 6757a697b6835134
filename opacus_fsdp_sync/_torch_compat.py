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
