"""What the ghost-clipping step may call on the hooks: one named contract.

The step (:mod:`opacus_fsdp_sync.backward`) runs a private backward as: begin the step (take the
first pass's sources), under a memory budget estimate what one backward would keep, say whether
the first pass keeps what one backward needs (and which layers keep per-sample gradients), run
the first pass, finish the norms its hooks deferred and check every hooked layer reported, end
the first pass, take the
coefficients, then take what was kept (one backward) or run the second pass with the hooks
disabled; a failed step aborts.
:class:`StepHooks` names every call; our hooks classes (:mod:`.ghost`) implement it, and a model
that Opacus's own classes wrapped before ``make_private`` is driven through
:class:`OpacusStepHooks`, which does nothing where ours keep book.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
)
from torch import nn

from .._opacus_internals import forget_step_state

#: What one backward keeps per layer: ``(layer, inputs, output gradient)``, or
#: ``(layer, None, per-sample gradients by parameter name)``.
Kept = list[tuple[nn.Module, object, object]]


@dataclass(frozen=True)
class KeptLayer:
    """What one hooked layer would keep for one backward, known before the backward runs."""

    layer: int
    """``id`` of the layer."""
    inputs: tuple[tuple[tuple, int], ...]
    """``(memory key, bytes)`` per input tensor; layers reading one tensor share its key."""
    grad_out: int
    """Bytes of its output gradient."""
    per_sample: int | None
    """Bytes of its per-sample gradients where it can keep those instead, else None."""


class StepHooks(Protocol):
    """The calls the engine (setup) and the step make on the hooks, in the order they make them."""

    def configure_norms(
        self, *, policy, gram_block: int | str, tuner, fused_kernels: bool | None = None
    ) -> bool:
        """Linear norms from shared input Gram matrices, per-sample gradients by ``policy``.

        ``fused_kernels`` is the option of that name: the fused ``Linear`` norm kernels.

        Returns:
            Whether these hooks compute them (False: Opacus's own norm kernels run).
        """
        ...

    def use_timer(self, timer, *, norms: bool) -> None:
        """Times the shared-weight cross terms in ``timer`` (the norms too if ``norms``)."""
        ...

    def begin_step(self) -> list[torch.Tensor]:
        """Forgets the last step's norms; returns this step's first-pass sources (may be empty)."""
        ...

    def keep_estimate(self) -> list[KeptLayer]:
        """After the forward: what each captured layer would keep if the first pass kept."""
        ...

    def begin_first_pass(
        self, *, keep: bool, per_sample: frozenset[int] = frozenset(), headroom: int | None = None
    ) -> None:
        """Whether the first pass keeps each layer's inputs and output gradient (one backward).

        Args:
            keep: Keep them (one backward).
            per_sample: Layers (ids) that keep per-sample gradients instead, whatever the
                per-sample gradient policy would choose.
            headroom: Bytes that per-sample gradients the policy chooses in this pass may add
                to what is kept (None: no limit).
        """
        ...

    def finish_norms(self) -> None:
        """After the first pass's backward: the norms its hooks deferred (one backward)."""
        ...

    def check_all_reported(self) -> None:
        """After a restricted first pass: raises unless every captured layer reported."""
        ...

    def end_first_pass(self, *, completed: bool, restricted: bool) -> None:
        """The first pass is over (``completed``: without error); stops keeping.

        Drops what only the first pass needed; when ``completed``, ends the pass of the norm
        tuner (a collective on the first call in a distributed run: every rank calls this at the
        same point); after an unrestricted pass, forgets the pass's records.
        """
        ...

    def get_clipping_coef(self) -> torch.Tensor:
        """The per-sample clipping coefficients of the norms the first pass computed."""
        ...

    def take_kept(self) -> Kept:
        """What the first pass kept (and forgets it)."""
        ...

    def layer_type(self, module: nn.Module) -> type:
        """The layer type Opacus sees for ``module`` (FSDP2's ``FSDP<Class>`` mapped back)."""
        ...

    def sequence_group(self, module: nn.Module):
        """The group ``module``'s input was split over along the tokens, or None.

        A room that sums sequence shards sums the layer's gradients over it.
        """
        ...

    def disable_hooks(self) -> None:
        """No hook fires until :meth:`enable_hooks` (the second pass, the gradient phase)."""
        ...

    def enable_hooks(self) -> None:
        """Hooks fire again."""
        ...

    def abort(self) -> None:
        """Drops everything a failed step left on the hooks and the hooked layers."""
        ...


def reset_opacus_step_state(hooks) -> None:
    """Forgets the activations and forward counters a failed step left on Opacus's hooks.

    Without this, a step whose first backward raised leaves ``_forward_counter`` at 1 and the
    next forward fails with a misleading "Parameter tying is not supported" error.
    """
    for module in hooks.iterate_submodules(hooks._module):
        forget_step_state(module)


class OpacusStepHooks:
    """:class:`StepHooks` over an Opacus hooks object that is not ours (wrapped by the user).

    It records no sources (the step then runs an unrestricted first pass and two passes), keeps
    nothing and checks nothing; coefficients and hook switches are Opacus's own.
    """

    def __init__(self, hooks) -> None:
        self.hooks = hooks

    def configure_norms(
        self, *, policy, gram_block: int | str, tuner, fused_kernels: bool | None = None
    ) -> bool:
        """Nothing: Opacus's classes compute their own norms."""
        return False

    def use_timer(self, timer, *, norms: bool) -> None:
        """Nothing to time beyond the step's phases."""

    def begin_step(self) -> list[torch.Tensor]:
        """No sources: Opacus's classes do not record them."""
        return []

    def keep_estimate(self) -> list[KeptLayer]:
        """Nothing would be kept."""
        return []

    def begin_first_pass(
        self, *, keep: bool, per_sample: frozenset[int] = frozenset(), headroom: int | None = None
    ) -> None:
        """Nothing to keep (``keep`` is False without sources)."""

    def finish_norms(self) -> None:
        """Nothing deferred: Opacus's hooks compute their norms in the backward."""

    def check_all_reported(self) -> None:
        """Nothing recorded to check."""

    def end_first_pass(self, *, completed: bool, restricted: bool) -> None:
        """Nothing to drop."""

    def get_clipping_coef(self) -> torch.Tensor:
        """Opacus's coefficients."""
        return self.hooks.get_clipping_coef()

    def take_kept(self) -> Kept:
        """Nothing kept."""
        return []

    def layer_type(self, module: nn.Module) -> type:
        """As Opacus's FSDP class maps it, else the module's own type."""
        if isinstance(self.hooks, GradSampleHooksFastGradientClippingFSDP):
            return self.hooks._get_module_type(module)
        return type(module)

    def sequence_group(self, module: nn.Module):
        """None: Opacus's hooks do not see sequence shards."""
        return None

    def disable_hooks(self) -> None:
        """Opacus's switch."""
        self.hooks.disable_hooks()

    def enable_hooks(self) -> None:
        """Opacus's switch."""
        self.hooks.enable_hooks()

    def abort(self) -> None:
        """Opacus's per-step state on the hooked layers."""
        reset_opacus_step_state(self.hooks)
