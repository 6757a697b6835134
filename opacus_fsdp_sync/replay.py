"""Exact replays of a layer's forward, for layers without a norm or gradient formula.

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


class ReplayMixin:
    """Records each call of the hooked layers without a sampler, for exact replays.

    A forward pre-hook (with keyword arguments) records the call; the captured positional
    inputs then carry it (:class:`ReplayInputs`) into the one-backward step, and the norm hook
    finds it on ``layer._replay_call``. Only for the one-device / DDP classes: under FSDP the
    generic one-backward path is not taken and the norms stay Opacus's.
    """

    def _init_replay(self, hooked: list[nn.Module], type_of) -> None:
        self._replayed = {
            id(m)
            for m in hooked
            if type_of(m) not in self.NORM_SAMPLERS and type_of(m) not in self.GRAD_SAMPLERS
        }
        for m in hooked:
            if id(m) in self._replayed:
                self.NORM_SAMPLERS[type_of(m)] = replay_norm_sample
                handle = m.register_forward_pre_hook(self._record_call, with_kwargs=True)
                self.autograd_grad_sample_hooks.append(handle)

    def _record_call(self, module, args, kwargs):
        if self.hooks_enabled and module.training and torch.is_grad_enabled():
            module._replay_next = ForwardCall.record(args, kwargs)

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Upstream's capture; the captured inputs of a replayed layer carry its call."""
        acts = getattr(module, "activations", None)
        before = len(acts) if acts is not None else 0
        result = super().capture_activations_hook(module, forward_input, forward_output)
        call = module.__dict__.pop("_replay_next", None)
        acts = getattr(module, "activations", None)
        if id(module) in self._replayed and acts is not None and len(acts) > before:
            acts[-1] = ReplayInputs(acts[-1], call)
        return result

    def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
        """Exposes the call of the inputs about to be used as ``module._replay_call``."""
        acts = getattr(module, "activations", None)
        last = acts[-1] if acts else None
        module._replay_call = getattr(last, "call", None)
        try:
            return super().capture_backprops_hook(
                module, forward_input, forward_output, *args, **kwargs
            )
        finally:
            module._replay_call = None
