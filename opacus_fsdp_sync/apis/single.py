"""Single device: no gradient sync to skip; one backward hands gradients straight to ``p.grad``.

Also the controller every API gets when the optimisation is switched off
(``sync_optimization=False``): the first pass then runs as upstream's.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed.layout import listing
from ..errors import UnsupportedConfigurationError
from .api import SINGLE, ApiRecord, Capabilities, WholeStepHandoff, opacus_optimizer


class NullController:
    """Single device, or the optimisation switched off: the first pass runs unchanged."""

    api: str | None = SINGLE
    requires_restricted = False
    enabled_message = ""

    def begin_first_pass(self) -> None:
        """Does nothing."""

    def end_first_pass(self) -> None:
        """Does nothing."""

    def abort(self) -> None:
        """Does nothing."""


class SingleDeviceHandoff(WholeStepHandoff):
    """Sets ``p.grad`` (adding to what is there, as autograd would); no collective."""

    phase = "reduce_scatter"
    """The hand-off's phase name (shared with the sharded APIs' timings)."""

    def hand(self, grads: dict) -> None:
        """Adds each parameter's clipped gradient (summed over its uses) to ``p.grad``."""
        from ..one_backward.step import hand_to_single_device

        hand_to_single_device(grads)


def _controller(modules: list[nn.Module], **_) -> NullController:
    return NullController()


def _handoff(modules: list[nn.Module]) -> SingleDeviceHandoff:
    return SingleDeviceHandoff()


def _check_layout(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuses a DDP wrapper below the model's top (counted as one process otherwise)."""
    nested = [n for n, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
    if nested:
        raise UnsupportedConfigurationError(
            f"DistributedDataParallel wraps {listing(nested)} but not the model passed to "
            "make_private: the engine would count the run as one process (no averaging over "
            "ranks, each rank its own noise). Pass the DDP-wrapped model itself: "
            "DistributedDataParallel(model)."
        )


RECORD = ApiRecord(
    name=SINGLE,
    title="single device",
    capabilities=Capabilities(
        distributed=False, generic_replay=True, ghost_modes=("ghost", "ghost_fsdp")
    ),
    make_controller=_controller,
    make_handoff=_handoff,
    plan_optimizer=opacus_optimizer,
    check_layout=_check_layout,
)
