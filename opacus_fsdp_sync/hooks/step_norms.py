"""Per-sample norms that belong to one backward: reset each step, unused layers count as zero.

Upstream Opacus keeps each hooked layer's per-sample norms on the parameter (``_norm_sample``,
one device) or on the layer (``norm_sample``, FSDP) and overwrites them when the layer's backward
hook fires. A layer the forward skipped in a step (a flag, a data-dependent branch) keeps the
norms of an earlier step: its stale norms then over-clip every sample, and the step crashes when
the layer had never run (no norms at all) or when the batch size changed (norms of another size).

A layer that did not run has a zero per-sample gradient in that step. Here every layer's norms
are cleared at the start of each backward, and :meth:`StepNormsMixin.get_norm_sample` takes the
norms reported in that backward only, an unreported layer counting as zero. Where Opacus's own
optimizer reads every ``p.grad`` (one device), the parameters of a layer that did not run get a
zero gradient (their clipped gradient) instead of none, as a clip-each-sample loop computes it.
"""

from __future__ import annotations

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp import (
    GradSampleHooksFastGradientClippingFSDP,
)
from torch import nn

from .._opacus_internals import module_norm_samples, param_norm_sample
from ..distributed.layout import Layout
from ..distributed.tensor_parallel import tp_norm_sum, tp_sharded


class NoNormsError(RuntimeError):
    """No hooked layer reported a per-sample norm in the last backward."""


class StepNormsMixin:
    """Per-sample norms of the current backward only (see the module docstring).

    Under tensor parallelism it also sums the norms over the tp group (``_tp_sum``).

    Sits below the shared-weight mixin (whose ``get_norm_sample`` adds its cross terms to this
    one's result) and above Opacus's hooks class, whose ``get_norm_sample`` it replaces.
    """

    #: Sums per-sample norms over tp (tensor parallelism), else None.
    _tp_sum = None
    #: The tp process group (tensor parallelism), else None.
    _tp_group = None

    def _init_step_norms(self, hooked: list[nn.Module], layout: Layout) -> None:
        self._norms_per_module = isinstance(self, GradSampleHooksFastGradientClippingFSDP)
        # FSDP1 unregisters parameters during forward and backward: count them now.
        self._n_trainable = {
            id(m): sum(1 for p in m.parameters(recurse=False) if p.requires_grad) for m in hooked
        }
        self._step_layers = list(hooked)
        self._init_tp_norms(hooked, layout)
        self.reset_norms()

    def _init_tp_norms(self, hooked: list[nn.Module], layout: Layout) -> None:
        """Which reported norms are partial (tp-sharded parameters) and the tp group's sum.

        The tp group is the layout's (found from any parameter on a tp mesh, frozen ones
        included: a model whose tensor-parallel layers are frozen still sums its norms over tp,
        which makes the coefficients bit-identical on every tp rank).
        """
        #: Per layer (FSDP) or parameter id (one device): whether each norm is a tp shard's.
        self._tp_partial: dict[int, list[bool]] = {}
        self._tp_sum = None
        #: The tp process group (tensor parallelism), else None.
        self._tp_group = None
        if not layout.tensor_parallel:
            return
        for m in hooked:
            flags = [tp_sharded(p) for p in m.parameters(recurse=False) if p.requires_grad]
            self._tp_partial[id(m)] = flags
        self._tp_sum = tp_norm_sum(layout.tp_group)
        self._tp_group = layout.tp_group

    def reset_norms(self) -> None:
        """Forgets every layer's per-sample norms (the start of a backward)."""
        if self._norms_per_module:
            for m in self._step_layers:
                # a plain attribute (not a parameter, buffer or layer): set without
                # nn.Module.__setattr__'s checks, once per layer and step
                m.__dict__["norm_sample"] = [None] * self._n_trainable[id(m)]
        else:
            for p in self.trainable_parameters:
                p._norm_sample = None

    def _reported_norms(self, partial: bool | None = None) -> list[torch.Tensor]:
        """The norms reported in this backward (``partial``: only tp shards' / only the rest)."""
        if partial is not None:
            return self._reported_tp_norms(partial)
        if self._norms_per_module:
            return [
                ns
                for m in self.iterate_submodules(self._module)
                for ns in module_norm_samples(m)
                if ns is not None
            ]
        norms = (param_norm_sample(p) for p in self.trainable_parameters)
        return [ns for ns in norms if ns is not None]

    def get_norm_sample(self) -> torch.Tensor:
        """Per-sample norms of the last backward; a layer that did not report counts as zero.

        Raises:
            NoNormsError: when no hooked layer reported (the batch size is unknown).
        """
        norms = self._reported_norms()
        if norms and self._tp_sum is not None:  # tensor parallelism: shards' squares over tp
            norm = self._tp_sum(self._reported_norms(True), self._reported_norms(False))
            self.per_sample_gradient_norms = norm
            return norm
        if not norms:
            raise NoNormsError(
                "opacus_fsdp_sync: no hooked layer reported a per-sample norm in this backward "
                "(did the forward run any trainable layer in training mode?)"
            )
        device = norms[0].device
        norm = torch.stack([ns if ns.device == device else ns.to(device) for ns in norms])
        norm = norm.norm(2, dim=0)
        self.per_sample_gradient_norms = norm
        return norm

    def _reported_tp_norms(self, partial: bool) -> list[torch.Tensor]:
        if not self._norms_per_module:
            return [
                p._norm_sample
                for p in self.trainable_parameters
                if param_norm_sample(p) is not None and tp_sharded(p) is partial
            ]
        return [
            ns
            for m in self.iterate_submodules(self._module)
            for ns, flag in zip(module_norm_samples(m), self._tp_partial.get(id(m), ()))
            if ns is not None and flag is partial
        ]

    def get_clipping_coef(self) -> torch.Tensor:
        """Opacus's coefficients; then zero gradients for the layers that did not run (one device).

        Called once per step between the norm pass and the clipped gradients (by our backward and
        by upstream's). Opacus's one-device optimizers read ``p.grad`` of every parameter, and a
        layer that did not run has a zero clipped gradient: its parameters get a zero ``p.grad``
        where they have none, and the clipped gradients add to it. Under FSDP the optimizers read
        a missing gradient as zeros, so nothing is set.
        """
        coef = super().get_clipping_coef()
        if not self._norms_per_module:
            for p in self.trainable_parameters:
                if p._norm_sample is None and p.grad is None:
                    p.grad = torch.zeros_like(p)
        return coef
