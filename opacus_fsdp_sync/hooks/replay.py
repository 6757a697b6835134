"""Recording the calls of hooked layers without a sampler, for the generic room's replays.

The replays themselves are the generic room's (:mod:`opacus_fsdp_sync.layers.generic`).
"""

from __future__ import annotations

import torch
from torch import nn

from .._opacus_internals import captured_activations
from ..layers.generic import ForwardCall, ReplayInputs
from ..layers.registry import room_named


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
        generic = room_named("generic")
        for m in hooked:
            if id(m) in self._replayed:
                self.NORM_SAMPLERS[type_of(m)] = generic.norm
                handle = m.register_forward_pre_hook(self._record_call, with_kwargs=True)
                self.autograd_grad_sample_hooks.append(handle)

    def _record_call(self, module, args, kwargs):
        if self.hooks_enabled and module.training and torch.is_grad_enabled():
            module._replay_next = ForwardCall.record(args, kwargs)

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Upstream's capture; the captured inputs of a replayed layer carry its call."""
        if id(module) not in self._replayed:
            return super().capture_activations_hook(module, forward_input, forward_output)
        acts = captured_activations(module)
        before = len(acts) if acts is not None else 0
        result = super().capture_activations_hook(module, forward_input, forward_output)
        call = module.__dict__.pop("_replay_next", None)
        acts = captured_activations(module)
        if acts is not None and len(acts) > before:
            acts[-1] = ReplayInputs(acts[-1], call)
        return result

    def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
        """Exposes the call of the inputs about to be used as ``module._replay_call``."""
        if id(module) not in self._replayed:
            return super().capture_backprops_hook(
                module, forward_input, forward_output, *args, **kwargs
            )
        acts = captured_activations(module)
        last = acts[-1] if acts else None
        module._replay_call = last.call if isinstance(last, ReplayInputs) else None
        try:
            return super().capture_backprops_hook(
                module, forward_input, forward_output, *args, **kwargs
            )
        finally:
            module._replay_call = None
