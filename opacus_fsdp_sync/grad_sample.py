"""Our Opacus ghost-clipping classes: upstream's plus exact norms and first-pass book-keeping.

The engine uses them for every ``ghost`` / ``ghost_fsdp`` model it prepares: shared-weight cross
terms and padding-aware embedding norms (:mod:`.tied`), activations-only first-pass sources and
the missed-hook check (:mod:`.first_pass`).
"""

from __future__ import annotations

from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleFastGradientClippingFSDP,
)
from torch import nn

from .first_pass import PassTrackingMixin
from .tied.grad_sample import TiedNormMixin


class _Ours(PassTrackingMixin, TiedNormMixin):
    """Mixins first (they wrap Opacus's hooks), then the upstream class."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        self._init_tied()
        self._init_pass_tracking()


class GhostGradSampleModule(_Ours, GradSampleModuleFastGradientClipping):
    """``grad_sample_mode="ghost"`` (one device, DDP)."""


class GhostGradSampleHooks(_Ours, GradSampleHooksFastGradientClipping):
    """``ghost`` with ``wrap_model=False``."""


class GhostFSDPGradSampleModule(_Ours, GradSampleModuleFastGradientClippingFSDP):
    """``grad_sample_mode="ghost_fsdp"`` (FSDP2)."""


class GhostFSDPGradSampleHooks(_Ours, GradSampleHooksFastGradientClippingFSDP):
    """``ghost_fsdp`` with ``wrap_model=False``."""


_CLASSES = {
    ("ghost", True): GhostGradSampleModule,
    ("ghost", False): GhostGradSampleHooks,
    ("ghost_fsdp", True): GhostFSDPGradSampleModule,
    ("ghost_fsdp", False): GhostFSDPGradSampleHooks,
}


def ghost_class(grad_sample_mode: str, wrap_model: bool) -> type:
    """Our Opacus class for a ghost mode and ``wrap_model`` setting."""
    return _CLASSES[(grad_sample_mode, wrap_model)]
