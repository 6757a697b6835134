"""Tensor parallelism in the hooks: local captures, and sequence parallelism exact or refused.

A tensor-parallel layer's input arrives as a DTensor and its output gradient as a local tensor
(or a DTensor): both are captured as local tensors, of which the hooks compute the partial norms
of the layer's shards (:mod:`..distributed.tensor_parallel`); a column-wise layer's gathered
output gradient is cut back to its own rows. The tp and sequence groups come from the model's
:class:`~..distributed.layout.Layout`, never from attributes on the user's modules.

Under sequence parallelism (torch's ``SequenceParallel``, ``RowwiseParallel(output_layouts=
Shard(1))``, ``PrepareModuleOutput`` to ``Shard(1)``) each tp rank holds part of every sample's
tokens between the tensor-parallel layers. A hooked layer on this rank's tokens computes the part
of each sample's gradient that those tokens make: exact only where its room sums the parts over
tp before squaring (an RMSNorm-like layer under ``SequenceParallel``) or where the tensor-parallel
layer sees every token (a column-wise layer gathers them; a row-wise layer's split output
gradient is gathered back, :func:`..distributed.tensor_parallel.gather_sequence`). Everything else
is refused, in the forward, before any gradient is formed:

- a trainable layer outside the tp plan fed this rank's tokens as a plain tensor (it would count
  its partial norm as the whole one): any hooked layer whose dim 1 is the sequence (all but
  convolutions and channel norms) that saw fewer tokens than the longest in the forward;
- a layer under ``SequenceParallel`` whose room does not sum over tp (``nn.LayerNorm``);
- a sequence length the tp degree does not divide (torch splits it unevenly and the gathers of
  the backward would not match: gloo fails, NCCL may hang).

Every tp rank must refuse the same forward, and before the collective that would fail (torch's
own all-gathers fail on uneven shards too), or the others wait in it. The ranks of a tp group see
the same examples, so the model input's length (dim 1) is the same on each; a sequence-sharded
DTensor input shows the split on every rank, and so do fewer tokens than the input's (torch
gives each rank at most ``ceil(T / tp)`` of ``T >= 2`` tokens). A layer's hook refuses on such
evidence at once. Whether the model splits the sequence at all is agreed once, by a one-element
all-reduce over tp after the first training forward; from then on an uneven length is refused
before the forward starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._torch_compat import in_backward
from ..distributed.tensor_parallel import (
    gather_sequence,
    local,
    own_output_features,
    sequence_group,
)
from ..errors import UnsupportedConfigurationError

#: Layers whose dim 1 is channels, not the sequence (their tokens are not compared).
_CHANNELS_FIRST = (
    nn.modules.conv._ConvNd,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.batchnorm._BatchNorm,
)


class TensorParallelMixin:
    """Captures local tensors, records each layer's tokens and refuses what is inexact.

    Expects ``layout`` (the model's :class:`~..distributed.layout.Layout`), ``_tp_group`` (None
    without tensor parallelism), ``NORM_SAMPLERS``, ``_get_type`` and Opacus's
    ``autograd_grad_sample_hooks`` from the classes it is mixed into.
    """

    def _tp_capture_input(self, module: nn.Module, forward_input, forward_output) -> tuple:
        """A layer's input as the capture keeps it: local tensors; its tokens noted.

        Raises:
            UnsupportedConfigurationError: a DTensor input without a tp layout, and what
                :meth:`_note_tokens` and :meth:`_note_tp_input` refuse.
        """
        if (
            self._tp_sum is not None
            and forward_input
            and self.hooks_enabled
            and module.training
            and torch.is_grad_enabled()
            and not in_backward()
        ):
            self._note_tokens(module, forward_input[0], forward_output)
        if not any(isinstance(t, DTensor) for t in forward_input):
            return forward_input
        if self._tp_group is None:  # DTensors without a tp layout: refuse, never guess
            raise UnsupportedConfigurationError(
                f"{type(module).__name__} received a DTensor input but the model has no "
                "parameter on a mesh dimension named 'tp': name the tensor-parallel mesh "
                "dimension 'tp'."
            )
        self._note_tp_input(module, forward_input)
        return tuple(local(t) for t in forward_input)

    def _tp_output_grads(self, module: nn.Module, forward_output) -> tuple:
        """Local output gradients; those split over tp along the tokens gathered first.

        Sequence parallelism splits a layer's output along the tokens after the layer ran on
        all of them (``RowwiseParallel(output_layouts=Shard(1))``, ``PrepareModuleOutput`` to
        ``Shard(1)``): its output gradient then holds this rank's tokens while its input holds
        every token. The gradient is all-gathered over tp along the tokens, so that both cover
        the same tokens; a column-wise layer's gathered gradient is cut back to its own rows.

        Raises:
            UnsupportedConfigurationError: for an output gradient whose tokens are not a split
                of the input's.
        """
        grads = tuple(local(g) if isinstance(g, DTensor) else g for g in forward_output)
        tokens = self._sequence_tokens.get(module)
        g = grads[0] if grads else None
        if self._tp_group is not None and tokens and g is not None and g.dim() > 2:
            if g.shape[1] * dist.get_world_size(self._tp_group) == tokens:
                grads = (gather_sequence(g, self._tp_group), *grads[1:])
            elif g.shape[1] != tokens:
                raise UnsupportedConfigurationError(
                    f"{type(module).__name__} sees {tokens} tokens in its input but {g.shape[1]}"
                    " in its output gradient: not a split of the sequence over tp"
                )
        if self._tp_group is not None and grads and grads[0] is not None:
            grads = (own_output_features(module, grads[0]), *grads[1:])
        return grads

    def _init_sequence_check(self, device: torch.device | None) -> None:
        """Hooks on the model: note its input's length before its forward, check after.

        Args:
            device: Where the tp group's collectives run (the tp parameters' device).
        """
        #: Each layer's tokens in this forward: ``module -> (tokens, laid out by TP)``.
        self._tp_step_tokens: dict = {}
        #: Whether the model splits the sequence over tp; None until the first forward agreed.
        self._sequence_split: bool | None = None
        #: Whether this forward showed a split so far.
        self._split_seen = False
        #: The model input's length (dim 1) in this forward, 0 when unknown.
        self._input_tokens = 0
        self._tp_device = device
        #: Each sequence layer's tokens in the last forward (its output gradient's are compared).
        self._sequence_tokens: dict[nn.Module, int] = {}
        #: The layers whose input was split over tp along the tokens in the last forward.
        self._on_sequence_shards: set[nn.Module] = set()
        if self._tp_group is None:
            return
        self._layer_names = {id(m): n for n, m in self._module.named_modules()}
        for handle in (
            self._module.register_forward_pre_hook(self._start_tokens, with_kwargs=True),
            self._module.register_forward_hook(self._check_tokens),
        ):
            self.autograd_grad_sample_hooks.append(handle)

    def _sequence_layer(self, module: nn.Module) -> bool:
        """Whether the layer's output gradient may be gathered along dim 1: Linear, RMSNorm-like.

        (A convolution's dim 1 is its channels: the gathers leave it alone.)
        """
        kind = self._get_type(module)
        sampler = self.NORM_SAMPLERS.get(kind)
        return issubclass(kind, nn.Linear) or getattr(sampler, "sums_sequence_shards", False)

    def _note_tokens(self, module: nn.Module, first, output) -> None:
        """Notes a layer's tokens (dim 1 of its input); refuses an uneven split at once.

        Raises:
            UnsupportedConfigurationError: see :meth:`_refuse_uneven`.
        """
        kind = self._get_type(module)
        if not isinstance(first, torch.Tensor) or issubclass(kind, _CHANNELS_FIRST):
            return
        if first.dim() < (2 if issubclass(kind, nn.Embedding) else 3):
            return  # (batch, features) or (batch,) ids: no sequence
        tokens = local(first).shape[1]
        self._tp_step_tokens[module] = (tokens, isinstance(first, DTensor))
        if self._sequence_layer(module):
            self._sequence_tokens[module] = tokens
        out = local(output) if isinstance(output, torch.Tensor) else None
        full = self._full_tokens()
        # a sequence-sharded input; fewer tokens than the input's, in the layer's input or in
        # its output (RowwiseParallel's output_layouts=Shard(1)): shown on every rank
        split = sequence_group(first) is not None or (
            full >= 2
            and (
                tokens < full
                or (out is not None and out.dim() == first.dim() and out.shape[1] < tokens)
            )
        )
        if split:
            self._split_seen = True
            self._refuse_uneven(full)

    def _full_tokens(self) -> int:
        """The longest sequence of this forward so far: the model input's, or a layer's."""
        return max([self._input_tokens, *(t for t, _ in self._tp_step_tokens.values())])

    def _refuse_uneven(self, full: int) -> None:
        """Refuses a sequence length the tp degree does not divide (sequence parallelism).

        Raises:
            UnsupportedConfigurationError: naming the length, the tp degree and the fix.
        """
        degree = dist.get_world_size(self._tp_group)
        if full % degree:
            raise UnsupportedConfigurationError(
                f"a sequence of {full} tokens under sequence parallelism over tp degree {degree}: "
                "torch splits it unevenly and the gathers of the split sequence would not match. "
                f"Pad every batch to a multiple of {degree} tokens (e.g. pad_to_multiple_of="
                f"{degree} in the collator), or drop sequence parallelism from the plan."
            )

    def _start_tokens(self, module, args, kwargs) -> None:
        """Before the model's forward: its input's length; an uneven one refused at once.

        Raises:
            UnsupportedConfigurationError: see :meth:`_refuse_uneven` (once the model is known
                to split the sequence, from its first forward).
        """
        self._tp_step_tokens, self._split_seen = {}, False
        first = next(
            (t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2),
            None,
        )
        self._input_tokens = local(first).shape[1] if first is not None else 0
        hooked = self.hooks_enabled and module.training and torch.is_grad_enabled()
        if self._sequence_split and self._input_tokens and hooked:
            self._refuse_uneven(self._input_tokens)

    def _check_tokens(self, module, args, output) -> None:
        """After the model's forward: refuses layers outside the plan fed this rank's tokens.

        Raises:
            UnsupportedConfigurationError: naming the layers and the fixes; the same error on
                every tp rank.
        """
        seen, self._tp_step_tokens = self._tp_step_tokens, {}
        if not seen:
            return
        full = self._full_tokens() if self._input_tokens else max(t for t, _ in seen.values())
        self._input_tokens = 0
        if self._sequence_split is None:
            flag = torch.tensor([int(self._split_seen)], device=self._tp_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._tp_group)
            self._sequence_split = bool(flag.item())
        if not self._sequence_split:
            return
        self._refuse_uneven(full)
        short = sorted(
            f"'{self._layer_names.get(id(m), '?')}' ({self._get_type(m).__name__})"
            for m, (t, laid_out) in seen.items()
            if t < full and not laid_out
        )
        if short:
            raise UnsupportedConfigurationError(
                f"{', '.join(short)} ran on a plain tensor of fewer tokens than the sequence "
                f"({full}): under sequence parallelism their per-sample gradients are this "
                "rank's part only. Put them in the tp plan (ColwiseParallel/RowwiseParallel for "
                "Linear, SequenceParallel for RMSNorm), feed them the whole sequence (e.g. "
                "ColwiseParallel(input_layouts=Shard(1)) before them), or freeze them."
            )

    def _note_tp_input(self, module: nn.Module, forward_input) -> None:
        """Notes whether the layer's input is split over tp along the tokens.

        See :meth:`sequence_group`.

        Such a layer computes partial per-sample gradients: its room sums them over the
        layout's sequence group before the norm
        (:func:`..distributed.tensor_parallel.sum_sequence_shards`).

        Raises:
            UnsupportedConfigurationError: for a layer on sequence shards whose room does not
                sum over tp.
        """
        group = sequence_group(forward_input[0])
        sampler = self.NORM_SAMPLERS.get(self._get_type(module))
        if group is not None and not getattr(sampler, "sums_sequence_shards", False):
            raise UnsupportedConfigurationError(
                f"{type(module).__name__} runs on sequence shards (sequence parallelism) and its "
                "per-sample norm does not sum them over tp: under SequenceParallel only "
                "RMSNorm-like layers (Hugging Face's LlamaRMSNorm and its copies) are supported."
            )
        if group is None:
            self._on_sequence_shards.discard(module)
        else:
            self._on_sequence_shards.add(module)

    def sequence_group(self, module: nn.Module):
        """The group ``module``'s room sums its sequence shards over: the layout's, or None.

        None unless the layer's input was split over tp along the tokens in the last forward.
        """
        return self.layout.sequence_group if module in self._on_sequence_shards else None

    def _with_sequence_group(self, sampler):
        """``sampler`` given :meth:`sequence_group` when it sums sequence shards, else itself.

        ``sampler`` has Opacus's norm-sampler signature; one that sums sequence shards is
        marked (:attr:`~..layers.registry.LayerRoom.sums_sequence_shards`).
        """
        if not getattr(sampler, "sums_sequence_shards", False):
            return sampler

        def norm(layer, activations, backprops):
            group = self.sequence_group(layer)
            return sampler(layer, activations, backprops, sequence_group=group)

        norm.sums_sequence_shards = True
        return norm
