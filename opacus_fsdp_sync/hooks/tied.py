"""Opacus ghost-clipping hooks whose per-sample norms are exact for shared (tied) weights.

Upstream gets tied weights wrong: on one device ``ghost`` refuses them, and ``ghost_fsdp``
computes ``sqrt(|G1|^2 + |G2|^2)``, dropping the cross term. Here, for every weight used by
several layers, each use's own squared norm and every pair's cross term ``2 <G1, G2>`` (the tied
room, :mod:`opacus_fsdp_sync.layers.tied`) go into a per-sample accumulator that
:meth:`get_norm_sample` adds to the norms of all other parameters. Without shared weights the
mixin defers to upstream.
"""

from __future__ import annotations

import contextlib

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
)
from opacus.layers import DPGRU, DPLSTM, DPRNN
from opacus.utils.module_utils import requires_grad, trainable_parameters
from torch import nn

from .._opacus_internals import activations_list, drop_batch_len_when_consumed, norm_samples_list
from ..layers import tied as ct
from ..layers.registry import room_named
from ..layers.tied import SharedParameter, check_supported, find_shared_parameters, pad


class TiedNormMixin:
    """Adds exact shared-weight norms to an Opacus ghost-clipping hooks class."""

    def _init_tied(self) -> None:
        # the layers Opacus hooks: its RNN containers only re-expose their cells' weights
        hooked = frozenset(
            id(m)
            for m in self.iterate_submodules(self._module)
            if type(m) not in (DPRNN, DPLSTM, DPGRU)
        )
        self._tied = find_shared_parameters(self._module, hooked)
        check_supported(self._tied, self.NORM_SAMPLERS, self._get_type)
        # module -> [(shared weight, its attribute name on that module)]
        self._tied_by_module: dict[nn.Module, list[tuple[SharedParameter, str]]] = {}
        for s in self._tied:
            for _, m, local in s.owners:
                self._tied_by_module.setdefault(m, []).append((s, local))
        self._tied_param_ids = {id(s.param) for s in self._tied}
        self._tied_is_fsdp = isinstance(self, GradSampleHooksFastGradientClippingFSDP)
        self._tied_sq: torch.Tensor | None = None
        #: A StepTimer (set by the engine) that times the shared-weight work as ``tied_norm``.
        self.tied_timer = None
        self._tied_room = room_named("tied")
        self._tied_fired: dict[int, list] = {}

    @property
    def shared_weights(self) -> list[SharedParameter]:
        """The weights several hooked layers use (aliases of one layer's weight left out)."""
        return self._tied

    def _get_type(self, module: nn.Module) -> type:
        """The layer type Opacus sees (FSDP2's ``FSDP<Class>`` mapped back to ``<Class>``)."""
        if isinstance(self, GradSampleHooksFastGradientClippingFSDP):
            return self._get_module_type(module)
        return type(module)

    # -- hooks ---------------------------------------------------------------------------------
    def capture_activations_hook(self, module, forward_input, _forward_output):
        """Upstream's capture, counting a shared weight once per owning layer (one device)."""
        if module not in self._tied_by_module or self._tied_is_fsdp:  # FSDP counts per module
            return super().capture_activations_hook(module, forward_input, _forward_output)
        # One device: upstream counts forwards per parameter and refuses any count above 1;
        # a shared weight is legitimately counted once per owner.
        if (
            not requires_grad(module)
            or not module.training
            or not torch.is_grad_enabled()
            or not self.hooks_enabled
        ):
            return
        activations_list(module).append([t.detach() for t in forward_input])
        for _, p in trainable_parameters(module):
            p._forward_counter += 1
            limit = len(self._owners_of(p)) if id(p) in self._tied_param_ids else 1
            if p._forward_counter > limit:
                raise NotImplementedError(
                    f"A {type(module).__name__} layer owning a weight was called more than once in "
                    "one forward; ghost clipping needs one call per layer per forward."
                )

    def capture_backprops_hook(
        self, module, _forward_input, forward_output, loss_reduction, batch_first
    ):
        """Own norms of a shared-weight owner, plus the weight's squared norm and cross terms."""
        if not self.hooks_enabled or module not in self._tied_by_module:
            return super().capture_backprops_hook(
                module, _forward_input, forward_output, loss_reduction, batch_first
            )
        activations, backprops = self.rearrange_grad_samples(
            module=module,
            backprops=forward_output[0].detach(),
            loss_reduction=loss_reduction,
            batch_first=batch_first,
        )
        activations = [
            t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
            for t in activations
        ]
        norms = self.NORM_SAMPLERS[self._get_type(module)](module, activations, backprops)
        norms = {p: ns for p, ns in norms.items() if p.requires_grad}
        shared_now = set()
        # the output gradient as the norms saw it, unscaled (see rearrange_grad_samples)
        scale = float(getattr(module, "_ghost_backprop_scale", 1))
        timed = self.tied_timer.phase("tied_norm") if self.tied_timer else contextlib.nullcontext()
        with timed:
            for s, local in self._tied_by_module[module]:
                current = getattr(module, local)  # under FSDP2: the unsharded parameter
                shared_now.add(id(current))
                self._add_use(s, module, activations[0], backprops, norms[current], scale)
        own = {p: (torch.zeros_like(ns) if id(p) in shared_now else ns) for p, ns in norms.items()}
        self._store_own_norms(module, own)
        drop_batch_len_when_consumed(module)

    def _store_own_norms(self, module: nn.Module, norms: dict) -> None:
        if self._tied_is_fsdp:
            stored = norm_samples_list(module, trainable_parameters(module))
            for idx, ns in enumerate(norms.values()):
                stored[idx] = ns
            module._forward_counter -= 1
        else:
            for p, ns in norms.items():
                p._norm_sample = ns
                p._forward_counter -= 1

    # -- shared-weight bookkeeping ----------------------------------------------------------------
    def _owners_of(self, p: nn.Parameter) -> list:
        return next(s.owners for s in self._tied if s.param is p)

    def _add_use(self, s: SharedParameter, module, inputs, grads, own_norm, scale=1.0) -> None:
        """Adds one use's squared norm and its cross terms with the uses seen before it.

        ``grads`` and ``own_norm`` belong to the output gradient divided by ``scale`` (the
        same for every use: the batch size of a mean loss, or 1).
        """
        if self._tied_sq is None:
            self._tied_sq = torch.zeros(own_norm.shape[0], device=own_norm.device)
        sq = scale * scale
        self._tied_sq += sq * own_norm.float() ** 2
        fired = self._tied_fired.setdefault(id(s.param), [])
        use = self._tied_room.Use(module, inputs.detach(), grads.detach())
        for earlier in fired:
            self._tied_sq += (2.0 * sq) * self._tied_room.norm(earlier, use)
        fired.append(use)
        if len(fired) == len(s.owners):
            del self._tied_fired[id(s.param)]
            return
        if isinstance(module, nn.Linear):
            # Reduce b (N, T, V) against every Embedding still to fire: keep (N, S, D) only.
            waiting = [
                m
                for _, m, _ in s.owners
                if m is not module
                and isinstance(m, nn.Embedding)
                and all(u.module is not m for u in fired)
            ]
            for emb in waiting:
                ids = emb.activations[-1][0]
                use.partials[emb] = ct.linear_partial(inputs, grads, ids, pad(emb))
            if len(waiting) == len(s.owners) - len(fired):
                use.grads = None

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample norms of the whole gradient, shared weights' cross terms included.

        Raises:
            RuntimeError: when a shared weight's uses did not all report in this backward.
        """
        if self._tied_fired:
            self._tied_fired.clear()
            self._tied_sq = None
            raise RuntimeError(
                "opacus_fsdp_sync: not every use of a shared weight was seen in this backward; "
                "the per-sample norm would be wrong. Run each layer owning it once per forward."
            )
        norm = super().get_norm_sample()
        if self._tied_sq is not None:
            total = norm.float() ** 2 + self._tied_sq.to(norm.device)
            norm = total.clamp(min=0).sqrt().to(norm.dtype)
            self._tied_sq = None
            self.per_sample_gradient_norms = norm
        return norm
