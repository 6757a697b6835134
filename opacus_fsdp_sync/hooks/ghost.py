"""Our Opacus ghost-clipping classes: upstream's plus exact norms and first-pass book-keeping.

The engine uses them for every ``ghost`` / ``ghost_fsdp`` model it prepares. Each layer type's
norm comes from its room (:mod:`opacus_fsdp_sync.layers`: padding-aware embedding norms, a direct
RMSNorm norm where autograd agrees with it, Gram-matrix ``Linear`` norms with ``fast_norms``);
around Opacus's hooks: shared-weight cross terms (:mod:`.tied`), activations-only first-pass
sources and the missed-hook check (:mod:`.first_pass`), norms that belong to one backward, a
layer that did not run counting as zero (:mod:`.step_norms`), recorded calls for exact replays of
the layers no room claims (:mod:`.replay`), tensor-parallel captures and what sequence
parallelism refuses (:mod:`.tensor_parallel`).
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

from .._opacus_internals import (
    activations_list,
    captured_activations,
    count_module_forward,
    module_norm_samples,
    param_norm_sample,
)
from .._torch_compat import in_backward
from ..distributed.layout import Layout, detect_layout
from ..distributed.tensor_parallel import on_tp_mesh
from ..layers import norm_samplers
from ..layers.linear import GramCache, LinearRoom
from ..layers.norms import rms_norm_types, saved_normalized
from ..layers.registry import room_named
from .contract import KeptLayer, OpacusStepHooks, StepHooks, reset_opacus_step_state
from .first_pass import PassTrackingMixin
from .kept import estimate, linear_per_sample_bytes
from .lean import LeanLaneMixin
from .output_grads import OutputGradHooksMixin
from .replay import ReplayMixin
from .step_norms import StepNormsMixin
from .tensor_parallel import TensorParallelMixin
from .tied import TiedNormMixin


def _bias_optional(upstream):
    """Opacus's ``LayerNorm`` per-sample gradient; the room's same sums where it fails (no bias)."""

    def grad_sampler(layer, activations, backprops):
        if layer.bias is not None:
            return upstream(layer, activations, backprops)
        grads = room_named("layer_norm").per_sample_grad(layer, activations, backprops)
        return {layer.weight: grads["weight"]} if "weight" in grads else {}

    return grad_sampler


class _Ours(
    LeanLaneMixin,
    OutputGradHooksMixin,
    ReplayMixin,
    PassTrackingMixin,
    TiedNormMixin,
    StepNormsMixin,
    TensorParallelMixin,
):
    """Mixins first (they wrap Opacus's hooks), then the upstream class."""

    #: The layers Opacus hooked, found at wrap time (None while Opacus's ``__init__`` runs).
    _hooked: list[nn.Module] | None = None
    _trainable: frozenset[int] = frozenset()

    def __init__(self, m: nn.Module, *, layout: Layout | None = None, **kwargs):
        super().__init__(m, **kwargs)
        #: The model's :class:`~..distributed.layout.Layout` (the engine's; detected here when
        #: the hooks are built without one): its tp group sums the norms, its sequence group
        #: the norm rooms' sequence shards.
        self.layout = detect_layout(m) if layout is None else layout
        # Instance-level sampler table: upstream's (with any registered by the user), then each
        # room's norm for its layer types (:func:`..layers.norm_samplers`).
        self.NORM_SAMPLERS = {
            **GradSampleHooksFastGradientClipping.NORM_SAMPLERS,
            **norm_samplers(m),
        }
        # LayerNorm(bias=False): upstream's per-sample gradient reads the bias (a crash)
        self.GRAD_SAMPLERS = {
            t: _bias_optional(f) if issubclass(t, nn.LayerNorm) else f
            for t, f in self.GRAD_SAMPLERS.items()
        }
        #: Layer types whose norm is the RMSNorm room's (:meth:`_keep_normalized`).
        self._rms_types = frozenset(rms_norm_types(m))
        if self.layout.sequence_group is not None:
            self.NORM_SAMPLERS = {
                t: self._with_sequence_group(f) for t, f in self.NORM_SAMPLERS.items()
            }
        self._init_tied()
        self._init_pass_tracking()
        # FSDP1 unregisters parameters during forward and backward, when Opacus looks for the
        # layers that own trainable parameters: remember them as they are now.
        self._hooked = list(super().iterate_submodules(self._module))
        self._trainable = frozenset(id(m) for m in self._hooked)
        self._init_step_norms(self._hooked, self.layout)
        tp_device = next((p.device for p in m.parameters() if on_tp_mesh(p)), None)
        self._init_sequence_check(tp_device)
        fsdp = isinstance(self, GradSampleHooksFastGradientClippingFSDP)
        self._init_replay([] if fsdp else self._hooked, self._get_type)
        #: Set by :meth:`use_fast_norms`: Gram matrices shared between Linear layers.
        self.gram_cache: GramCache | None = None
        #: Set by :meth:`use_fast_norms`: per-sample gradients of sequence Linear layers.
        self.per_sample_policy = None
        #: Set by :meth:`use_fast_norms`: the measured norm plan (``tune_norms``), or None.
        self.norm_tuner = None
        self._init_lanes(self._hooked)

    def configure_norms(
        self, *, policy, gram_block: int | str, tuner, fused_kernels: bool | None = None
    ) -> bool:
        """:meth:`use_fast_norms` (the :class:`~.contract.StepHooks` setup call); True."""
        self.use_fast_norms(policy, gram_block=gram_block, tuner=tuner, fused_kernels=fused_kernels)
        return True

    def use_timer(self, timer, *, norms: bool) -> None:
        """The shared-weight cross terms' ``tied_norm`` phase, and ``norms`` if asked."""
        self.tied_timer = timer
        if norms:
            self.time_norms(timer)

    def use_fast_norms(
        self,
        per_sample_policy=None,
        gram_block: int | str = 0,
        tuner=None,
        fused_kernels: bool | None = None,
    ) -> None:
        """Linear norms from shared input Gram matrices (see :mod:`..layers.linear`).

        Args:
            per_sample_policy: A :class:`~..layers.linear_policy.PerSampleGradPolicy` (one
                backward only): the sequence layers it takes materialise per-sample gradients.
            gram_block: Tokens per row block of the symmetric Grams (:mod:`..layers.linear_grams`),
                or ``"auto"`` (by the input's device); 0 computes full Grams.
            tuner: A :class:`~..tuning.NormTuner`: Gram blocks and per-sample gradients
                chosen by measurement instead of the static rules.
            fused_kernels: The option of that name: Linear norms from the fused kernels
                (:mod:`..layers.kernels`) where they apply.
        """
        self.gram_cache = GramCache(gram_block)
        self.per_sample_policy = per_sample_policy
        self.norm_tuner = tuner
        self.NORM_SAMPLERS[nn.Linear] = LinearRoom.fast_norm(
            self.gram_cache, per_sample_policy, tuner, fused_kernels
        )

    # -- the step's contract (:class:`.contract.StepHooks`) -----------------------------------
    def begin_step(self) -> list[torch.Tensor]:
        """Starts a backward: forgets the last norms and returns this pass's sources."""
        self.reset_norms()
        return self.take_first_pass_sources()

    def keep_estimate(self) -> list[KeptLayer]:
        """What each layer captured in this forward would keep (:func:`.kept.estimate`)."""
        captured = self._captured.values()
        return estimate(captured, self._outputs, self._per_sample_bytes)

    def _per_sample_bytes(self, module: nn.Module, inputs: list, meta: tuple) -> int | None:
        """Per-sample gradient bytes of a layer that can take them (fast norms, one backward)."""
        if (
            self.per_sample_policy is None
            or self._get_type(module) is not nn.Linear
            or module in self._tied_by_module
        ):
            return None
        return linear_per_sample_bytes(module, inputs, meta)

    def begin_first_pass(
        self, *, keep: bool, per_sample: frozenset[int] = frozenset(), headroom: int | None = None
    ) -> None:
        """Whether the first pass keeps each layer's inputs and output gradient (one backward).

        ``per_sample`` and ``headroom`` go to the per-sample gradient policy
        (:meth:`~..layers.linear_policy.PerSampleGradPolicy.limit`).
        """
        self.keep_for_grads = keep
        if self.per_sample_policy is not None:
            self.per_sample_policy.limit(per_sample, headroom)

    def end_first_pass(self, *, completed: bool, restricted: bool) -> None:
        """Drops the shared Grams, ends the tuner's pass (if ``completed``), stops keeping.

        Raises:
            Exception: what the tuner's end of pass raised (the rest is done all the same).
        """
        try:
            if self.gram_cache is not None:
                self.gram_cache.clear()  # every norm of this step is computed
            if completed and self.norm_tuner is not None:
                # On every rank at this point: the first call agrees on the plan (a collective).
                self.norm_tuner.end_pass()
        finally:
            self.keep_for_grads = False
            if not restricted:
                self.forget_pass()

    def layer_type(self, module: nn.Module) -> type:
        """The layer type Opacus sees (FSDP2's ``FSDP<Class>`` mapped back to ``<Class>``)."""
        return self._get_type(module)

    def abort(self) -> None:
        """Drops what a failed step left: Opacus's per-step state, then our records."""
        try:
            reset_opacus_step_state(self)
        finally:
            self.forget_pass()

    def forget_pass(self) -> None:
        """Drops what a failed step recorded, the shared Gram matrices included."""
        super().forget_pass()
        if self.gram_cache is not None:
            self.gram_cache.clear()
        if self.per_sample_policy is not None:
            self.per_sample_policy.reset()

    def iterate_submodules(self, module: nn.Module):
        """The layers Opacus hooked, as found at wrap time (see ``__init__``)."""
        if self._hooked is not None and module is self._module:
            return iter(self._hooked)
        return super().iterate_submodules(module)

    def _is_trainable(self, module: nn.Module) -> bool:
        params = list(module.parameters(recurse=False))
        if params:
            return any(p.requires_grad for p in params)
        return id(module) in self._trainable

    def one_output_layer_types(self) -> set[type]:
        """The RMSNorm-like layer types (they return one tensor): output tensor hooks."""
        return rms_norm_types(self._module)

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Upstream's capture; for FSDP, trainability is judged from the wrap-time parameters.

        A tensor-parallel layer's input arrives as a DTensor: it is captured as its local
        tensor (:meth:`.tensor_parallel.TensorParallelMixin._tp_capture_input`). A one-output
        layer whose inputs were captured gets its output-gradient hook
        (:meth:`.output_grads.OutputGradHooksMixin.hook_output`); where its output is a view,
        the layer returns a non-view alias of it instead (:meth:`~.output_grads.
        OutputGradHooksMixin.unviewed_output`). A lane layer in the plain case takes
        :meth:`.lean.LeanLaneMixin.lean_capture` instead of the chain below.
        """
        output = self.unviewed_output(module, forward_output)
        if self.lean_capture(module, forward_input, output):  # the plain case (.lean)
            return output if output is not forward_output else None
        acts = captured_activations(module)
        before = len(acts) if acts else 0
        try:
            result = self._capture(module, forward_input, output)
        except NotImplementedError as err:  # upstream's message speaks of tied parameters only
            if "Parameter tying" not in str(err):
                raise
            raise NotImplementedError(
                f"{type(module).__name__} ran twice before a backward: called twice in one "
                "forward, two forwards before one backward, or a forward whose loss never went "
                "backward. Ghost clipping needs one call per hooked layer and backward: use a "
                "separate layer for each call (weights shared between layers are supported)."
            ) from err
        acts = captured_activations(module)
        self.hook_output(module, output, captured=bool(acts) and len(acts) > before)
        return output if output is not forward_output else result

    def _capture(self, module, forward_input, forward_output):
        forward_input = self._tp_capture_input(module, forward_input, forward_output)
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
            result = super().capture_activations_hook(module, forward_input, forward_output)
            self._keep_normalized(module, forward_input, forward_output)
            return result
        # FSDP1 inside forward: parameters unregistered; Opacus's FSDP capture, with our check.
        if in_backward() or not (
            self._is_trainable(module)
            and module.training
            and torch.is_grad_enabled()
            and self.hooks_enabled
        ):
            return None
        self._record_pass_inputs(module, forward_input, forward_output)
        activations_list(module).append([t.detach() for t in forward_input])
        self._keep_normalized(module, forward_input, forward_output)
        if count_module_forward(module) > 1:
            raise NotImplementedError(
                f"{type(module).__name__} was called more than once in one forward; ghost "
                "clipping needs one call per layer per forward."
            )
        return None

    def _keep_normalized(self, module, forward_input, forward_output) -> None:
        """An RMSNorm layer keeps its forward's normalised input in place of its input.

        For a layer whose norm is the RMSNorm room's, where its forward saved ``xhat`` for
        autograd (:func:`..layers.norms.saved_normalized`), the entry this forward just
        captured (the input, same memory as ``forward_input[0]``) is replaced by it: the norm
        then reads it instead of renormalising the input, and the input is not held beyond the
        forward.
        """
        if (
            type(module) not in self._rms_types
            or not forward_input
            or type(forward_input[0]) is not torch.Tensor
        ):
            return  # another room's layer: it reads its input
        x = forward_input[0]
        captured_list = captured_activations(module)
        if not captured_list:
            return  # nothing captured
        entry = captured_list[-1]
        captured = entry[0] if entry else None
        if (
            type(captured) is not torch.Tensor
            or captured.data_ptr() != x.data_ptr()
            or captured.shape != x.shape
        ):
            return  # not this forward's capture of x
        xhat = saved_normalized(module, x, forward_output)
        if xhat is not None:
            entry[0] = xhat

    def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
        """Local output gradients, as the layer's input covers them (:meth:`_tp_output_grads`)."""
        grads = self._tp_output_grads(module, forward_output)
        result = super().capture_backprops_hook(module, forward_input, grads, *args, **kwargs)
        self._scale_reported_norms(module)
        return result

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        """Upstream's, leaving a ghost-normed layer's output gradient unscaled.

        Upstream multiplies every output gradient by the batch size for a mean loss (a pass over
        each, the head's ``N x T x V`` included). The norms are linear in it, so a layer with a
        norm sampler gets the raw gradient and its norms are scaled afterwards
        (:meth:`_scale_reported_norms`); per-sample gradients it stashes are scaled with the
        clipping coefficients (:func:`..one_backward.clipped_gradients`).
        """
        lazy = self._get_type(module) in self.NORM_SAMPLERS and loss_reduction == "mean"
        out = super().rearrange_grad_samples(
            module=module,
            backprops=backprops,
            loss_reduction="sum" if lazy else loss_reduction,
            batch_first=batch_first,
        )
        if lazy:
            module._ghost_backprop_scale = module.max_batch_len
        return out

    def _scale_reported_norms(self, module: nn.Module) -> None:
        """Multiplies the norms ``module`` just reported by its output gradient's scale."""
        self._scale_norms(module, module.__dict__.pop("_ghost_backprop_scale", 1))

    def _scale_norms(self, module: nn.Module, scale: int) -> None:
        """Multiplies the norms ``module`` just reported by ``scale`` (nothing for 1)."""
        if scale == 1:
            return
        if self._norms_per_module:
            norms = module_norm_samples(module) or []
            module.norm_sample = [None if ns is None else ns * scale for ns in norms]
            return
        for p in module.parameters(recurse=False):
            if p.requires_grad and param_norm_sample(p) is not None:
                p._norm_sample = p._norm_sample * scale


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


def step_hooks(module) -> StepHooks:
    """The step's view of a model's hooks: ours, or Opacus's behind :class:`OpacusStepHooks`."""
    return module if isinstance(module, _Ours) else OpacusStepHooks(module)
