"""The one place that calls private autograd APIs (verified on torch 2.6 and 2.13)."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """True while autograd executes a backward pass on this thread.

    A forward that runs then is an activation-checkpointing recomputation: Opacus must not
    capture its activations a second time.

    Raises:
        RuntimeError: if this torch build lacks ``torch._C._current_graph_task_id``.
    """
    fn = getattr(torch._C, "_current_graph_task_id", None)
    if fn is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._C._current_graph_task_id; opacus_fsdp_sync "
            "cannot tell activation-checkpointing recomputation from a forward. Turn activation "
            "checkpointing off or use torch 2.6-2.13."
        )
    return fn() != -1
