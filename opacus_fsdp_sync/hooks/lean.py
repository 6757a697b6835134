"""One function per direction for the common layers, in place of the chain of mixin hooks.

Every hooked layer's forward and backward hook runs through a chain: our capture, the replay,
first-pass, shared-weight and tensor-parallel mixins, Opacus's capture and norm hooks, then our
norm scaling. Each link checks whether it applies, reads Opacus's per-step attributes through
``nn.Module.__getattr__`` and iterates the layer's parameters; at about 40 hooked layers in a
small Llama that is a few milliseconds of Python per step on CPU, beside norms that cost about
as much.

A *lane* is a layer for which every link but the plain ones is known at wrap time to do
nothing: a one-output layer on an output-gradient tensor hook (:mod:`.output_grads`) that is
not replayed, owns no shared weight, under an FSDP class (norms kept per layer) with neither
tensor nor sequence parallelism. Its forward hook runs :meth:`LeanLaneMixin.lean_capture`, one
function that does what the chain does for it, in the same order and with the same tensors:

- the shared input Gram's reader count (``Linear``, trainable weight);
- the first pass's records: the layer as captured, its output's shape and dtype, the output as
  a source where no input requires a gradient;
- Opacus's capture (detached inputs, forward counter);
- the RMSNorm room's normalised input in place of the input;
- the output-gradient hook, :meth:`LeanLaneMixin.lean_output_grad`, which marks the layer as
  reported, keeps what the one-backward step needs, computes the norms with the layer type's
  sampler on the unscaled output gradient inside the ``norms`` phase, and scales them by the
  batch size for a mean loss.

In a one-backward step, where the layer's inputs and output gradient are kept anyway, a
``Linear`` lane whose norm is a Gram contraction that can be batched (one row block, fp32 or
fp64, on CPU) defers it to the end of the first pass (:meth:`LeanLaneMixin.finish_norms`, called
by the step after the backward), where the layers that read one input finish theirs together;
the kept entries keep the order the hooks fired in. On the CPU bench at seq 64 that took the
step's ``norms`` phase from 11.2-12.2 to 10.5-10.8 ms
(``results/cpu-2cores-small-deferred-norms/``).

Any call that is not the plain case (hooks off, eval mode, no gradients, a recomputation in
backward, a frozen layer, a non-tensor input or output, a second call in one forward, FSDP1's
unregistered parameters, no norm sampler for the type, nothing captured, hooks added again with
other arguments) takes the full chain instead, so the
lane changes no result and no error: the tests compare both bit for bit
(``tests/test_lean_hooks.py``), and against the clip-each-sample loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
)
from torch import nn

from .._opacus_internals import capture_inputs, take_captured
from .._torch_compat import in_backward
from ..layers.linear_norms import GramJob, LinearNormSampler, finish_tails


@dataclass(frozen=True)
class Lane:
    """What a lane layer's hooks need, fixed at wrap time.

    Attributes:
        layer_type: The type Opacus sees (its norm sampler's key).
        linear: Whether it is a ``Linear`` (its input counts as a shared Gram's reader).
        rms: Whether its norm is the RMSNorm room's (it keeps its normalised input).
        hook: Its output-gradient hook (:meth:`LeanLaneMixin.lean_output_grad` bound to it).
    """

    layer_type: type
    linear: bool
    rms: bool
    hook: object


class LeanLaneMixin:
    """The lanes of a model's hooks (see the module docstring).

    Mixed into :class:`~.ghost._Ours`, whose other mixins and Opacus class provide the state it
    reads and writes (``_captured``, ``_outputs``, ``_sources``, ``_reported``, ``_kept``,
    ``keep_for_grads``, ``per_sample_policy``, ``gram_cache``, ``NORM_SAMPLERS``, the norm
    timer) and the full chain it falls back to.
    """

    #: Whether lane layers take the lean hooks (False: every layer takes the full chain; the
    #: tests compare both).
    lean_hooks: bool = True
    #: Whether a lane layer's norms wait for the end of a one-backward first pass
    #: (:meth:`finish_norms`) instead of running in its hook (False: in the hook; the tests
    #: compare both).
    defer_norms: bool = True
    #: Lane layers by ``id``.
    _lanes: dict[int, Lane] = {}
    #: The Gram jobs deferred in this first pass: ``(layer, sampler, job, entry, batch, slot)``.
    _deferred: list = []
    #: The squared Gram norms contracted in their hooks, finished at the end of this first pass:
    #: ``(the layer's norm_sample list, squares by trainable parameter, scale)``.
    _tails: list = []
    _lane_kwargs: dict | None = None

    def _init_lanes(self, hooked: list[nn.Module]) -> None:
        """Finds the lane layers among ``hooked`` (call once every mixin is initialised)."""
        self._lanes = {}
        self._deferred = []
        self._tails = []
        if (
            not isinstance(self, GradSampleHooksFastGradientClippingFSDP)
            or not self.use_ghost_clipping
            or self.layout.tensor_parallel
            or self.layout.sequence_group is not None
            or self._tp_sum is not None
            or not self._output_hook_kwargs.get("batch_first", True)
            or self._output_hook_kwargs.get("loss_reduction") not in ("mean", "sum")
        ):
            return
        #: The hook arguments the lanes were built for: hooks added again (``add_hooks`` with
        #: other arguments) make the lanes stand aside for the full chain.
        self._lane_kwargs = self._output_hook_kwargs
        for m in hooked:
            if (
                id(m) not in self._output_hooked
                or id(m) in self._replayed
                or m in self._tied_by_module
            ):
                continue
            layer_type = self._get_type(m)
            self._lanes[id(m)] = Lane(
                layer_type=layer_type,
                linear=issubclass(layer_type, nn.Linear),
                rms=type(m) in self._rms_types,
                hook=partial(self.lean_output_grad, m),
            )

    def lean_capture(self, module: nn.Module, forward_input: tuple, output) -> bool:
        """The forward hook of a lane layer in the plain case; False where the chain must run.

        Args:
            module: The layer.
            forward_input: Its positional inputs.
            output: Its output as the norms read it (the non-view alias where one was made).
        """
        lane = self._lanes.get(id(module))
        if (
            lane is None
            or not self.lean_hooks
            or not self.hooks_enabled
            or not module.training
            or not torch.is_grad_enabled()
            or type(output) is not torch.Tensor
            or not forward_input
            or any(type(t) is not torch.Tensor for t in forward_input)
            or module.__dict__.get("_forward_counter", 0) != 0
            or self._output_hook_kwargs is not self._lane_kwargs
        ):
            return False
        params = module._parameters
        if not any(p is not None and p.requires_grad for p in params.values()) or in_backward():
            return False
        key = id(module)
        if lane.linear and self.gram_cache is not None:
            weight = params.get("weight")
            if weight is not None and weight.requires_grad:
                self.gram_cache.note_input(forward_input[0])
        self._captured[key] = module
        self._outputs[key] = (tuple(output.shape), output.dtype)
        if output.requires_grad and not any(t.requires_grad for t in forward_input):
            self._sources.append(output)
        capture_inputs(module, forward_input)
        if lane.rms:
            self._keep_normalized(module, forward_input, output)
        if output.requires_grad:
            output.register_hook(lane.hook)
        return True

    def lean_output_grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        """The output-gradient hook of a lane layer (the full chain where not the plain case)."""
        sampler = self.NORM_SAMPLERS.get(self._lanes[id(module)].layer_type)
        state = module.__dict__
        if (
            not self.hooks_enabled
            or not self.lean_hooks
            or sampler is None
            or state.get("norm_sample") is None
            or not state.get("activations")  # nothing captured (a stale graph): the chain's error
        ):
            self._output_grad_hook(module, grad)
            return
        entry = self._report(module, grad)
        job = None
        with self._norms_phase():
            inputs, batch = take_captured(module)
            g = grad.detach()
            # the sampler read the raw gradient: for a mean loss its norms scale with the
            # batch, multiplied as the chain's _scale_norms multiplies them
            scale = batch if self._output_hook_kwargs["loss_reduction"] == "mean" else 1
            if entry is not None and self.defer_norms and isinstance(sampler, LinearNormSampler):
                routed = sampler.route(module, inputs, g)
                if isinstance(routed, GramJob) and sampler.batchable(routed):
                    job = routed  # finished with the other readers of its input (finish_norms)
                    norms = None
                elif isinstance(routed, GramJob):  # contracted now, its sqrt in finish_norms
                    squares = list(sampler.finish_squares(routed).values())
                    self._tails.append((module.__dict__["norm_sample"], squares, scale))
                    norms = None
                else:
                    norms = routed
            else:
                norms = sampler(module, inputs, g)
            if not state["activations"]:
                del state["max_batch_len"]
            if norms is not None:
                # the list was reset at the start of the backward, so only these are set
                stored = state["norm_sample"]
                for i, ns in enumerate(ns for p, ns in norms.items() if p.requires_grad):
                    stored[i] = ns if scale == 1 else ns * scale
        if job is not None:
            self._deferred.append((module, sampler, job, entry, batch, len(self._kept)))
            self._kept.append(None)  # the entry's place, filled as _keep would fill it
            return
        self._keep(module, entry)

    def finish_norms(self) -> None:
        """The ``Linear`` Gram contractions the lane hooks deferred in this first pass.

        In a one-backward step a lane ``Linear`` layer whose norm is routed to a Gram
        contraction that can be finished with others
        (:meth:`~..layers.linear_norms.LinearNormSampler.batchable`) leaves it for the end of
        the pass; there the contractions are finished together
        (:meth:`~..layers.linear_norms.LinearNormSampler.finish_batch`), the norms scaled as
        the chain scales them (:meth:`~.ghost._Ours._scale_norms`: the batch size for a mean
        loss), and each kept entry takes its place in the kept list as
        :meth:`~.first_pass.PassTrackingMixin._keep` would have put it there: the same norms
        and clipped gradients, bit for bit (``tests/test_lean_hooks.py``). Every other norm
        (per-sample gradients, Grams in several row blocks, the other layer types) is computed
        in its hook, while its output gradient is fresh.
        """
        self._finish_tails()
        deferred, self._deferred = self._deferred, []
        if not deferred:
            return
        mean = self._output_hook_kwargs["loss_reduction"] == "mean"
        sampler = deferred[0][1]
        jobs = [item[2] for item in deferred]
        scales = [item[4] if mean else 1 for item in deferred]
        # as in a backward hook (autograd runs them without grad mode): no graph is recorded
        with torch.no_grad(), self._norms_phase():
            finished = sampler.finish_batch(jobs, scales)
            for (module, _, _, entry, _, slot), by_param in zip(deferred, finished):
                stored = module.__dict__["norm_sample"]
                for k, ns in enumerate(ns for p, ns in by_param.items() if p.requires_grad):
                    stored[k] = ns
                self._kept[slot] = self._kept_entry(module, entry)

    def _finish_tails(self) -> None:
        """The ``clamp``/``sqrt``/scale of the Gram norms contracted in their hooks, at once.

        A lane ``Linear`` layer whose Gram contraction is not batched (several row blocks,
        fp16/bf16 Grams, a device that contracts by matmuls) contracts in its hook, while its
        Gram is cached; the elementwise rest of its norms waits for the end of the pass, where
        :func:`~..layers.linear_norms.finish_tails` takes it for every such layer in a few ops:
        the same numbers, bit for bit, with about three ops (GPU launches) fewer per layer.
        Only the norms' trainable parameters are stored, in order, as the hook stores them.
        """
        tails, self._tails = self._tails, []
        if not tails:
            return
        squares = [sq for _, sqs, _ in tails for sq in sqs]
        scales = [scale for _, sqs, scale in tails for _ in sqs]
        with torch.no_grad(), self._norms_phase():
            norms = iter(finish_tails(squares, scales))
            for stored, sqs, _ in tails:
                for i in range(len(sqs)):
                    stored[i] = next(norms)

    def forget_pass(self) -> None:
        """Drops the norms a failed pass deferred, then the rest of its records."""
        self._deferred = []
        self._tails = []
        super().forget_pass()
