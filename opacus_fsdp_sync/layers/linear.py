"""The ``Linear`` room: ghost norms from Gram matrices, per-sample and clipped gradients.

All three come from the layer input ``A`` and output gradient ``G`` (``N x T x d`` each):
the norm from ``<A_n A_n^T, G_n G_n^T>`` (:mod:`.linear_grams`), the per-sample gradient
``G_n^T A_n`` (:func:`linear_per_sample_grads`, taken where :mod:`.linear_policy` or the tuner
says it is cheaper), the clipped gradient ``sum_n c_n G_n^T A_n`` as one matmul of ``c_n G_n``
and ``A`` (:meth:`LinearRoom.clipped_grad`). The strategies the tuner
(:mod:`opacus_fsdp_sync.tuning`) times are offered here (:meth:`LinearRoom.strategies`).

Ghost norms with Gram matrices shared between layers that read one input:

For a sequence input, sample n's weight-gradient norm is ``sqrt(<A_n A_n^T, G_n G_n^T>)``
(``A_n`` the layer input, ``G_n`` its output gradient, both ``T x d``). Upstream Opacus computes
both Gram matrices for every layer and contracts them with an ``einsum`` that becomes a batched
matrix-vector product (a cuBLAS gemv over ``T^2`` elements, about 0.5 ms a layer on an H100 at
T = 1024). Here:

- the input Gram ``A_n A_n^T`` is computed once per backward for all layers that read the same
  tensor (``q``/``k``/``v`` and ``gate``/``up`` in a Llama block): the forward hook counts the
  readers, and the Gram is released after the last one (in its hook, or at the end of the first
  pass for readers finished together there, :mod:`.linear_norms`);
- the Grams are held in fp32 (fp64 for fp64) and contracted by batched dot products, without
  writing their elementwise product;
- with ``gram_block`` (see :mod:`.linear_grams`), only the upper block triangle of each symmetric
  Gram is computed, up to about half the Gram FLOPs saved.

The result equals upstream's to floating-point rounding (not bit for bit: the summation order
differs); ``fast_norms=False`` in :class:`~opacus_fsdp_sync.options.GhostOptions` keeps upstream's
(Opacus's ``compute_linear_norm_sample``, the room's :meth:`~LinearRoom.norm`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from torch import nn

from .kernels import linear_clipped_grad as fused_clipped_grad
from .linear_grams import contract_output_grams, row_blocks, upper_gram
from .linear_norms import (
    GramCache,
    linear_per_sample_grads,
    make_linear_norm_sampler,
    memory_key,
    per_sample_norms,
)
from .registry import LayerRoom, register_layer, scale_rows


def clipped_sum(psgs: dict[str, torch.Tensor], scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum_n scale_n psg_n`` per parameter, in the psg dtype.

    fp32 and fp64: one matrix-vector product. Lower precision: the fp32 coefficients are split
    into a high and a low part in that dtype (``hi + lo`` carries about 16 significant bits), so two
    products of the stored per-sample gradients replace converting them to fp32; each product
    accumulates in fp32 and the result has the dtype's own rounding, as a batched matmul would.
    """
    out = {}
    for name, t in psgs.items():
        flat = t.flatten(1)
        row = scale.view(1, -1)
        if flat.dtype in (torch.float32, torch.float64):
            res = row.to(flat.dtype) @ flat
        else:
            hi = row.to(flat.dtype)
            lo = (row - hi.float()).to(flat.dtype)
            res = ((hi @ flat).float() + (lo @ flat).float()).to(flat.dtype)
        out[name] = res.view(t.shape[1:])
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


#: The scaled inputs shared within :func:`shared_scaled_inputs` (None outside it), by the memory
#: of the input they scale (:func:`input_key`: each layer's captured input is its own detached
#: view of one tensor).
_SCALED_INPUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "scaled_inputs", default=None
)


def input_key(a: torch.Tensor) -> tuple | None:
    """What identifies the memory of a plain tensor ``a`` (None for a DTensor: never shared)."""
    return memory_key(a) if type(a) is torch.Tensor else None


class SharedScaledInputs:
    """The handle :func:`shared_scaled_inputs` yields: drops an input's copies after its readers."""

    def __init__(self, memo: dict) -> None:
        self._memo = memo

    def release(self, key: tuple | None) -> None:
        """Drops the scaled copies of the input whose :func:`input_key` is ``key``."""
        self._memo.pop(key, None)


@contextlib.contextmanager
def shared_scaled_inputs() -> Iterator[SharedScaledInputs]:
    """Within it, ``Linear`` layers that scale one input by one scale share the scaled copy.

    A Llama block's ``gate`` and ``up`` projections read one input, narrower than their outputs,
    so :func:`linear_clipped_grad` scales that input for each: inside this block it is scaled
    once, the same tensor (bit for bit what each would compute). The copy is kept until the
    handle's :meth:`~SharedScaledInputs.release` is called for its input (after the input's
    last reader) or the block ends.
    """
    memo: dict = {}
    token = _SCALED_INPUTS.set(memo)
    try:
        yield SharedScaledInputs(memo)
    finally:
        _SCALED_INPUTS.reset(token)
        memo.clear()


def _scaled_input(a: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale_rows(a, scale, dtype)``, shared within :func:`shared_scaled_inputs`."""
    memo = _SCALED_INPUTS.get()
    key = input_key(a)
    if memo is None or key is None:
        return scale_rows(a, scale, dtype)
    copies = memo.setdefault(key, {"input": a})  # a held: its memory cannot be reused meanwhile
    which = (id(scale), dtype)
    if which not in copies:
        copies[which] = (scale, scale_rows(a, scale, dtype))  # scale held: its id stays its own
    return copies[which][1]


def linear_clipped_grad(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, scale: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``sum_n scale_n G_n^T A_n`` (and the bias's ``sum_n scale_n sum_t g_t``) in ``g``'s dtype.

    One matmul over every token. The per-sample factors scale the narrower of the two operands
    (the input for a wide head, the output gradient for a down projection), folded into the cast
    of the input to ``g``'s dtype where the input is scaled; a scaled input is shared by the
    layers that read it inside :func:`shared_scaled_inputs`.

    Args:
        layer: The layer.
        a: Its input ``(N, ..., d_in)``.
        g: Its output gradient ``(N, ..., d_out)``, unscaled.
        scale: ``(N,)`` fp32 per-sample factors.
    """
    bias = layer.bias is not None
    if a.shape[-1] < g.shape[-1]:
        a = _scaled_input(a, scale, g.dtype)
        out = {"weight": _flat(g).t() @ _flat(a)}
        if bias:  # per sample, then weighted: never the whole scaled gradient
            wide = torch.promote_types(g.dtype, torch.float32)
            per = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1, dtype=wide)
            out["bias"] = (per * scale.to(wide).view(-1, 1)).sum(0).to(g.dtype)
        return out
    g = scale_rows(g, scale)
    out = {"weight": _flat(g).t() @ _flat(a).to(g.dtype)}
    if bias:
        out["bias"] = _flat(g).sum(0)
    return out


@dataclass(frozen=True)
class Candidate:
    """One exact norm strategy: per-sample gradients, or Grams in row blocks (0: full Grams)."""

    block: int = 0
    per_sample: bool = False

    def __str__(self) -> str:
        if self.per_sample:
            return "per-sample gradients"
        return f"Gram blocks of {self.block}" if self.block else "full Grams"


#: A strategy's work as timed parts: ``(name, work, share)``; the cost is the sum of each part's
#: time times its share, and a part named alike in two strategies is the same work.
Work = list[tuple[str, Callable[[], object], float]]


@register_layer(nn.Linear)
class LinearRoom(LayerRoom):
    """``nn.Linear``: see the module. The norm is Opacus's unless fast norms replace it."""

    name = "linear"

    @staticmethod
    def norm(layer, activations, backprops):
        """Opacus's ``Linear`` norm (``fast_norms=False``), its inputs flattened to three dims.

        Upstream computes nothing for inputs of four or more dimensions (``(N, H, T, d)``),
        and such a layer then counted as zero in the flat norm: its samples were clipped too
        little. Flattened to ``(N, H T, d)`` it is the same per-sample gradient, and inputs of
        two or three dimensions reach upstream as they are (its numbers, bit for bit).
        """
        upstream = GradSampleHooksFastGradientClipping.NORM_SAMPLERS[nn.Linear]
        a = activations[0]
        if a.dim() > 3:
            a = a.reshape(a.shape[0], math.prod(a.shape[1:-1]), a.shape[-1])
            backprops = backprops.reshape(a.shape[0], a.shape[1], backprops.shape[-1])
            activations = [a, *activations[1:]]
        return upstream(layer, activations, backprops)

    def per_sample_grad(self, layer, activations, backprops):
        """``G_n^T A_n`` per sample (inputs of any rank, flattened to ``(N, T, d)``)."""
        a = activations[0]
        a = a.reshape(a.shape[0], math.prod(a.shape[1:-1]), a.shape[-1])
        g = backprops.reshape(a.shape[0], a.shape[1], backprops.shape[-1])
        return linear_per_sample_grads(layer, a, g)

    def clipped_grad(self, layer, inputs, grad_out, scale):
        """:func:`linear_clipped_grad`."""
        return linear_clipped_grad(layer, inputs[0], grad_out, scale)

    def clipped_grad_folded(self, layer, inputs, grad_out, coef, fused_kernels=None):
        """The fused kernel with the coefficients folded in (:func:`.kernels.linear_clipped_grad`).

        None where it does not apply (:meth:`clipped_grad` then scales the narrower operand).
        """
        return fused_clipped_grad(layer, inputs, grad_out, coef, fused_kernels)

    @staticmethod
    def fast_norm(cache: GramCache, policy=None, tuner=None, fused_kernels=None):
        """The Gram-matrix norm sampler (:func:`make_linear_norm_sampler`)."""
        return make_linear_norm_sampler(cache, policy, tuner, fused_kernels)

    @staticmethod
    def strategies(blocks: list[int], *, per_sample: bool, weight: bool) -> list[Candidate]:
        """The exact norm strategies to choose from: Gram blocks, then per-sample gradients.

        Args:
            blocks: Gram row blocks to offer (0: full Grams), in order; repeats are dropped.
            per_sample: Whether per-sample gradients may be taken in this step.
            weight: Whether the weight is trainable (per-sample gradients replace its matmul).
        """
        out = [Candidate(block=b) for b in dict.fromkeys(blocks)]
        return out + ([Candidate(per_sample=True)] if per_sample and weight else [])

    @staticmethod
    def working_set(
        layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, c: Candidate, *, with_weight_grad: bool
    ) -> int:
        """Bytes that strategy ``c`` allocates at once on input ``a`` and output gradient ``g``.

        Per-sample gradients: ``N d_out (d_in + 1)`` values in ``g``'s dtype (and in fp32 for
        narrower dtypes), and their weighted sum. A Gram strategy in row blocks of ``b`` tokens
        (0: one block): every row block of the input Gram in fp32
        (:func:`.linear_grams.upper_gram`, held for all of its readers), plus the largest row
        block of the output-gradient Gram in fp32 (and in ``g``'s dtype before it is widened, for
        narrower dtypes); full Grams take about ``4 N T^2`` bytes each in fp32.
        ``with_weight_grad`` adds the
        weight-gradient matmul's output (timed with the Gram strategies when per-sample
        gradients compete).
        """
        n, t, d_in = a.shape
        d_out = g.shape[-1]
        ea, eg = a.element_size(), g.element_size()
        weight = layer.weight.requires_grad
        wide = max(4, eg)
        if c.per_sample:  # narrower dtypes: the norms may read them through an fp32 copy
            return (n * (eg + (wide if eg < wide else 0)) + wide) * d_out * (d_in + 1)
        total = d_in * d_out * eg if with_weight_grad and weight else 0
        if not weight:  # bias only: no Gram at all
            return total + n * d_out * wide
        blocks = row_blocks(t, c.block)
        total += n * max(4, ea) * sum(w * (t - s) for s, w in blocks)
        first = n * blocks[0][1] * t  # the widest row block, rows 0 .. w against all columns
        return total + first * (wide + (eg if eg < wide else 0))

    @staticmethod
    def work(
        layer: nn.Linear,
        a: torch.Tensor,
        g: torch.Tensor,
        c: Candidate,
        readers: int,
        *,
        with_weight_grad: bool,
    ) -> Work:
        """What strategy ``c`` costs in the step, on input ``a`` and output gradient ``g``.

        A Gram strategy: the layer's share of its input's Gram (shared by ``readers`` layers),
        the output-gradient Gram and contraction, and, with ``with_weight_grad`` (when
        per-sample gradients, which replace it, compete), the gradient phase's weight-gradient
        matmul. Per-sample gradients: their matmul, norms and the weighted sum.
        """
        weight = layer.weight.requires_grad
        bias = layer.bias is not None and layer.bias.requires_grad
        if c.per_sample:
            scale = torch.ones(a.shape[0], device=a.device, dtype=torch.float32)

            def psg():
                grads = linear_per_sample_grads(layer, a, g)
                per_sample_norms(grads)
                clipped_sum(grads, scale)

            return [("per_sample", psg, 1.0)]
        parts: Work = []
        if with_weight_grad and weight:
            a2, g2 = _flat(a).to(g.dtype), _flat(g)
            parts.append(("weight_grad", lambda: g2.t() @ a2, 1.0))
        aat = upper_gram(a, c.block) if weight else None
        if weight:
            parts.append((f"input_gram {c.block}", lambda: upper_gram(a, c.block), 1 / readers))
        parts.append(
            (
                f"contract {c.block}",
                lambda: contract_output_grams(aat, g, c.block, bias=bias),
                1.0,
            )
        )
        return parts
