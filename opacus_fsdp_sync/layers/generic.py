"""The generic room: exact replays of a layer's forward, for layers no other room claims.

Norm, per-sample gradient and clipped gradient all come from one replay of the recorded call
on the kept inputs: the per-sample gradients are vector-Jacobian products with one output
gradient row per sample (:func:`per_sample_grads`, their norms :func:`replay_norm_sample`), the
clipped gradient one vector-Jacobian product with the scaled output gradient
(:meth:`GenericRoom.clipped_grad`, which needs the parameters' full values). The hooks record
the calls (:mod:`opacus_fsdp_sync.hooks.replay`).

A hooked layer Opacus has no sampler for gets its per-sample norms from Opacus's functorch
path, which re-runs ``layer(activations[0])``: forward keyword arguments are dropped (the norm is
that of another function), and randomness inside the layer (dropout) fails under ``vmap``. The
one-backward step's generic path re-ran ``layer(*inputs)`` too, with the same loss of keyword
arguments, a fresh dropout mask, and a second update of any state the forward writes.

Here each such call is recorded as it happens: its keyword arguments (detached) and the RNG
state the forward started from (CPU, and the CUDA device of its input). A replay runs the layer's
own forward with both, inside :func:`torch.random.fork_rng` (the caller's RNG stream is left as
it was) and with the layer's state restored afterwards, so it computes exactly the forward that
ran, mask included, and counts as no call. Per-sample gradients come from one replay and batched
vector-Jacobian products, one output-gradient row per sample.

Limits: the replay calls the layer's ``forward`` itself, so hooks registered on that layer do
not run again (Opacus's must not); buffers (which Opacus refuses in trainable layers anyway) and
rebound attributes are restored, in-place changes to other objects are not; the layer must take
its batch in a positional input (Opacus reads the batch size from it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .registry import LayerRoom, register_layer, scale_rows

#: Bytes of batched output gradients formed at once for per-sample gradients.
BATCHED_VJP_BYTES = 256 * 2**20


def _detach(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


@dataclass
class ForwardCall:
    """What one call of a layer's forward started from, besides its positional inputs."""

    kwargs: dict = field(default_factory=dict)
    cpu_rng: torch.Tensor | None = None
    cuda_rng: tuple[torch.device, torch.Tensor] | None = None

    @classmethod
    def record(cls, args: tuple, kwargs: dict) -> ForwardCall:
        """The call about to run with ``args`` and ``kwargs`` (a forward pre-hook's view)."""
        cuda = None
        for t in args:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                cuda = (t.device, torch.cuda.get_rng_state(t.device))
                break
        return cls(_detach(dict(kwargs)), torch.get_rng_state(), cuda)


class ReplayInputs(list):
    """A layer's captured positional inputs, carrying the :class:`ForwardCall` they came with."""

    def __init__(self, inputs, call: ForwardCall | None):
        super().__init__(inputs)
        self.call = call


@contextlib.contextmanager
def _state_kept(module: nn.Module):
    """Restores the layer's buffers and its attributes (rebinding, not in-place changes)."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    attributes = dict(vars(module))
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for name in [k for k in vars(module) if k not in attributes]:
            delattr(module, name)
        for name, value in attributes.items():
            if module.__dict__.get(name) is not value:
                module.__dict__[name] = value


def replay(module: nn.Module, inputs, call: ForwardCall | None) -> torch.Tensor:
    """The layer's output for a recorded call, recomputed with autograd; nothing else changes.

    Args:
        module: The layer.
        inputs: Its positional inputs as captured.
        call: The recorded call (None: no keyword arguments, the current RNG state).

    Returns:
        The (first) output, differentiable w.r.t. the layer's parameters.
    """
    call = call if call is not None else ForwardCall()
    devices = [call.cuda_rng[0]] if call.cuda_rng is not None else []
    with torch.random.fork_rng(devices=devices), _state_kept(module), torch.enable_grad():
        if call.cpu_rng is not None:
            torch.set_rng_state(call.cpu_rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state(call.cuda_rng[1], call.cuda_rng[0])
        # ``forward`` itself: the layer's hooks (Opacus's among them) must not fire again.
        out = module.forward(*inputs, **call.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def per_sample_grads(
    module: nn.Module, inputs, call, backprops: torch.Tensor, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each sample's gradient of ``<backprops_n, output_n>`` w.r.t. ``params`` (batch first).

    One replay, then vector-Jacobian products with the output gradient of one sample at a time,
    batched (:data:`BATCHED_VJP_BYTES` at most at once).

    Returns:
        ``{name: (N, *param.shape)}``.
    """
    out = replay(module, inputs, call)
    n = backprops.shape[0]
    names = list(params)
    per_row = backprops.numel() * backprops.element_size()
    chunk = max(1, min(n, BATCHED_VJP_BYTES // max(per_row, 1)))
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    grad_out = backprops.to(out.dtype)
    for start in range(0, n, chunk):
        rows = range(start, min(n, start + chunk))
        batched = torch.zeros((len(rows), *grad_out.shape), dtype=out.dtype, device=out.device)
        for j, i in enumerate(rows):
            batched[j, i] = grad_out[i]
        grads = torch.autograd.grad(
            out,
            [params[k] for k in names],
            batched,
            retain_graph=True,
            is_grads_batched=True,
            allow_unused=True,
        )
        for k, g in zip(names, grads):
            p = params[k]
            parts[k].append(p.new_zeros((len(rows), *p.shape)) if g is None else g)
    return {k: torch.cat(v) for k, v in parts.items()}


def replay_norm_sample(layer: nn.Module, activations, backprops) -> dict:
    """Per-sample gradient norms by replaying the recorded forward (Opacus's sampler signature).

    Reads the call recorded for this backward from ``layer._replay_call``.
    """
    call = getattr(layer, "_replay_call", None)
    params = {n: p for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    grads = per_sample_grads(layer, activations, call, backprops, params)
    return {params[k]: g.flatten(1).norm(2, dim=-1) for k, g in grads.items()}


@register_layer()
class GenericRoom(LayerRoom):
    """Any layer no other room claims: see the module.

    Under FSDP the norms stay Opacus's (its per-sample gradient sampler for the type, or
    functorch); the hooks install :meth:`norm` for the other layers without a sampler.
    """

    name = "generic"
    direct = False
    norm = staticmethod(replay_norm_sample)

    def per_sample_grad(self, layer, activations, backprops):
        """:func:`per_sample_grads` of the trainable parameters, replaying the recorded call."""
        params = {n: p for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
        call = activations.call if isinstance(activations, ReplayInputs) else None
        return per_sample_grads(layer, activations, call, backprops, params)

    def clipped_grad(self, layer, inputs, grad_out, scale):
        """Replays the recorded forward on the kept inputs, differentiates w.r.t. the parameters.

        The replay (:func:`replay`) runs with the call's keyword arguments and RNG state (the
        same dropout mask) and leaves the layer's buffers and the caller's RNG as they were.
        The parameters registered now must hold their full values; frozen ones are left out
        (autograd refuses to differentiate w.r.t. them).
        """
        params = {n: p for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
        names = list(params)
        out = replay(layer, inputs, inputs.call if isinstance(inputs, ReplayInputs) else None)
        with torch.enable_grad():
            grads = torch.autograd.grad(
                out, [params[n] for n in names], scale_rows(grad_out, scale), allow_unused=True
            )
        return {n: g for n, g in zip(names, grads) if g is not None}
