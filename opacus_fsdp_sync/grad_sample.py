"""Our Opacus ghost-clipping classes: upstream's plus exact norms and first-pass book-keeping.

The engine uses them for every ``ghost`` / ``ghost_fsdp`` model it prepares: shared-weight cross
terms and padding-aware embedding norms (:mod:`.tied`), activations-only first-pass sources and
the missed-hook check (:mod:`.first_pass`), a direct RMSNorm norm where autograd agrees with it
(:mod:`.rms_norm`), norms that belong to one backward, a layer that did not run counting as zero
(:mod:`.step_norms`), exact replays of the layers without a formula (:mod:`.replay`).
"""

from __future__ import annotations

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
    GradSampleModuleFastGradientClippingFSDP,
)
from torch import nn

from ._torch_compat import in_backward
from .first_pass import PassTrackingMixin
from .linear_norm import GramCache, make_linear_norm_sampler
from .replay import ReplayMixin
from .rms_norm import rms_norm_samplers
from .step_norms import StepNormsMixin
from .tied.grad_sample import TiedNormMixin


class _Ours(ReplayMixin, PassTrackingMixin, TiedNormMixin, StepNormsMixin):
    """Mixins first (they wrap Opacus's hooks), then the upstream class."""

    def __init__(self, m: nn.Module, **kwargs):
        super().__init__(m, **kwargs)
        # Instance-level sampler table: upstream's, padding-aware embeddings, direct RMSNorm.
        self.NORM_SAMPLERS = {**type(self).NORM_SAMPLERS, **rms_norm_samplers(m)}
        self._init_tied()
        self._init_pass_tracking()
        # FSDP1 unregisters parameters during forward and backward, when Opacus looks for the
        # layers that own trainable parameters: remember them as they are now.
        self._hooked = list(super().iterate_submodules(self._module))
        self._trainable = {id(m) for m in self._hooked}
        self._init_step_norms(self._hooked)
        fsdp = isinstance(self, GradSampleHooksFastGradientClippingFSDP)
        self._init_replay([] if fsdp else self._hooked, self._get_type)
        #: Set by :meth:`use_fast_norms`: Gram matrices shared between Linear layers.
        self.gram_cache: GramCache | None = None
        #: Set by :meth:`use_fast_norms`: per-sample gradients of sequence Linear layers.
        self.per_sample_policy = None
        #: Set by :meth:`use_fast_norms`: the measured norm plan (``tune_norms``), or None.
        self.norm_tuner = None

    def use_fast_norms(self, per_sample_policy=None, gram_block: int | str = 0, tuner=None) -> None:
        """Linear norms from shared input Gram matrices (see :mod:`.linear_norm`).

        Args:
            per_sample_policy: A :class:`~.one_backward.per_sample.PerSampleGradPolicy` (one
                backward only): the sequence layers it takes materialise per-sample gradients.
            gram_block: Tokens per row block of the symmetric Grams (:mod:`.block_gram`), or
                ``"auto"`` (by the input's device); 0 computes full Grams.
            tuner: A :class:`~.norm_tuner.NormTuner`: Gram blocks and per-sample gradients
                chosen by measurement instead of the static rules.
        """
        self.gram_cache = GramCache(gram_block)
        self.per_sample_policy = per_sample_policy
        self.norm_tuner = tuner
        self.NORM_SAMPLERS[nn.Linear] = make_linear_norm_sampler(
            self.gram_cache, per_sample_policy, tuner
        )

    def take_first_pass_sources(self) -> list[torch.Tensor]:
        """Starts a backward: forgets the last norms and returns this pass's sources."""
        self.reset_norms()
        return super().take_first_pass_sources()

    def forget_pass(self) -> None:
        """Drops what a failed step recorded, the shared Gram matrices included."""
        super().forget_pass()
        if self.gram_cache is not None:
            self.gram_cache.clear()
        if self.per_sample_policy is not None:
            self.per_sample_policy.reset()

    def iterate_submodules(self, module: nn.Module):
        """The layers Opacus hooked, as found at wrap time (see ``__init__``)."""
        hooked = getattr(self, "_hooked", None)
        if hooked is not None and module is self._module:
            return iter(hooked)
        return super().iterate_submodules(module)

    def _is_trainable(self, module: nn.Module) -> bool:
        params = list(module.parameters(recurse=False))
        if params:
            return any(p.requires_grad for p in params)
        return id(module) in getattr(self, "_trainable", ())

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Upstream's capture; for FSDP, trainability is judged from the wrap-time parameters."""
        if (
            self.gram_cache is not None
            and self.hooks_enabled
            and module.training
            and torch.is_grad_enabled()
            and forward_input
            and isinstance(forward_input[0], torch.Tensor)
            and issubclass(self._get_type(module), nn.Linear)
            and getattr(getattr(module, "weight", None), "requires_grad", False)
            and not in_backward()
        ):
            self.gram_cache.note_input(forward_input[0])
        if not isinstance(self, GradSampleHooksFastGradientClippingFSDP) or any(
            True for _ in module.parameters(recurse=False)
        ):
            return super().capture_activations_hook(module, forward_input, forward_output)
        # FSDP1 inside forward: parameters unregistered; Opacus's FSDP capture, with our check.
        if in_backward() or not (
            self._is_trainable(module)
            and module.training
            and torch.is_grad_enabled()
            and self.hooks_enabled
        ):
            return None
        self._record_pass_inputs(module, forward_input, forward_output)
        if not hasattr(module, "activations"):
            module.activations = []
        module.activations.append([t.detach() for t in forward_input])
        module._forward_counter = getattr(module, "_forward_counter", 0) + 1
        if module._forward_counter > 1:
            raise NotImplementedError(
                f"{type(module).__name__} was called more than once in one forward; ghost "
                "clipping needs one call per layer per forward."
            )
        return None


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
