"""FSDP2 hand-off, one parameter group at a time, in backward order.

Each FSDP2 group's clipped weight gradients are computed and handed to FSDP2's own
post-backward (reduce-scatter with its reduce dtype, averaging and padding, then reshard) before
the next group's are computed, as a normal backward interleaves them. Only one group's unsharded
gradients are alive at a time (plus, on CUDA, the one whose reduce-scatter is in flight) instead
of the whole model's, and on CUDA the next group's weight-gradient matmuls overlap the
reduce-scatter, which FSDP2 runs on its own stream. The arithmetic is the same as handing all
gradients over at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn

from ..distributed import _fsdp2_internals as internals


class FSDP2Handoff:
    """Delivers clipped gradients to FSDP2 group by group (see the module docstring).

    Args:
        modules: The outermost FSDP2 modules.
    """

    #: The engine's phase name for the hand-off.
    phase = "reduce_scatter"

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def deliver(
        self,
        kept: list,
        compute: Callable[[list], dict],
        reduce_phase: Callable[[], AbstractContextManager],
    ) -> None:
        """Computes and reduces every group's clipped gradients; FSDP2 is idle afterwards.

        Args:
            kept: The first pass's ``(module, inputs, grad_out)`` entries; emptied as they are
                used, so their memory goes with their group.
            compute: Maps a list of entries to ``{id(param): (param, gradient)}``, summed over
                each parameter's uses in those entries.
            reduce_phase: A context manager factory timing each group's hand-off.

        Raises:
            FSDPInternalsError: for a trainable parameter FSDP2 does not manage, or missing
                internals.
        """
        groups, index = internals.param_group_index(self.modules)
        entries = list(kept)
        kept.clear()
        owners = [self._groups_of(entry[0], index) for entry in entries]
        pending: dict[int, tuple] = {}
        for gi in reversed(range(len(groups))):
            todo = [
                j
                for j, owner in enumerate(owners)
                if entries[j] is not None and (gi in owner or not owner)
            ]
            if todo:
                grads = compute([entries[j] for j in todo])
                for j in todo:
                    entries[j] = None
                for pid, (param, grad) in grads.items():
                    if pid not in index:
                        raise internals.unmanaged_param_error(param)
                    if pid in pending:  # a shared weight: its uses add up
                        grad = pending[pid][1] + grad
                    pending[pid] = (param, grad)
                del grads
            with reduce_phase():
                for pid in [pid for pid in pending if index[pid][0] == gi]:
                    internals.set_unsharded_grad(index[pid][1], pending.pop(pid)[1])
                internals.group_post_backward(groups[gi])
        if pending:  # cannot happen: every parameter's group was visited
            raise internals.FSDPInternalsError(
                f"{len(pending)} clipped gradient(s) were left undelivered"
            )
        with reduce_phase():
            internals.finish_backward(self.modules)

    @staticmethod
    def _groups_of(module: nn.Module, index: dict) -> set[int]:
        out = set()
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                if id(p) not in index:
                    raise internals.unmanaged_param_error(p)
                out.add(index[id(p)][0])
        return out
