"""Per-sample gradients of sequence ``Linear`` layers, where they are cheaper than ghost norms.

In the one-backward step a layer's clipped gradient is computed anyway, from its kept input ``A``
and output gradient ``G`` (``T x d_in`` and ``T x d_out`` per sample). Its ghost norm costs
``2 T^2 (d_in + d_out)`` FLOPs per sample on top. Materialising the per-sample gradients
``G_n^T A_n`` instead costs what the batched weight gradient costs (``2 T d_in d_out`` per sample)
and gives both the norms and, once the clipping coefficients ``c`` are known, the clipped gradient
``sum_n c_n G_n^T A_n`` as one small matrix-vector product. The ghost norm's FLOPs are saved;
the per-sample gradients cost memory traffic (``N d_in d_out`` values written and read twice)
and memory (held per layer until the coefficients are known). ``"auto"`` weighs the FLOPs
against the traffic with the machine's balance (a CPU core: sequences of a few dozen tokens and
up; an H100 in bf16: rarely at T = 1024), and a byte budget per step caps the memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..block_gram import flop_fraction, resolve_block


@dataclass
class PerSampleGradPolicy:
    """Which sequence ``Linear`` layers materialise per-sample gradients in a step.

    Layers are taken greedily in backward order while the step's materialised bytes fit
    ``budget_bytes``; with ``only_when_cheaper`` a layer must also save FLOPs (see the module).
    """

    budget_bytes: int
    only_when_cheaper: bool = True
    flops_per_byte: float | None = None
    """Machine balance for the cost rule: the ghost norm's FLOPs are weighed against the bytes
    the per-sample gradients move (written once, read for the norm and for the weighted sum).
    None: :func:`machine_balance` of the layer input's device (10 on CPU, 400 on accelerators)."""
    gram_block: int | str = 0
    """Row block of the ghost norm's symmetric Grams (``"auto"`` or tokens, as
    :func:`~opacus_fsdp_sync.block_gram.resolve_block`): the cost rule prices the ghost norm at
    the FLOPs of the upper block triangle."""
    active: bool = False
    """Set per backward by the first pass: True only when its gradients will be kept."""
    used_bytes: int = 0
    taken: int = 0
    declined: int = 0
    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def reset(self) -> None:
        """Starts a new step's accounting (and forgets anything a failed step left)."""
        self.used_bytes = self.taken = self.declined = 0
        self.stash.clear()

    def cheaper(
        self,
        t: int,
        d_in: int,
        d_out: int,
        element_size: int,
        device: torch.device,
        blocked: bool = True,
    ) -> bool:
        """Whether per-sample gradients beat the ghost norm for one sample of this layer.

        Ghost norm: ``2 T^2 (d_in + d_out)`` FLOPs, times the block triangle's share
        (:func:`~opacus_fsdp_sync.block_gram.flop_fraction`). Per-sample gradients: the same
        matmul FLOPs as the weight gradient they replace, plus ``4 d_in d_out`` FLOPs and
        ``3 d_in d_out`` element reads and writes, priced at the machine balance.

        Args:
            t: Sequence length.
            d_in: Input features.
            d_out: Output features.
            element_size: Bytes per gradient element.
            device: The layer input's device (for ``"auto"`` settings).
            blocked: False where the ghost norm takes full Grams whatever ``gram_block`` says
                (DTensor inputs, see :class:`~opacus_fsdp_sync.linear_norm.GramCache`).
        """
        balance = self.flops_per_byte
        balance = machine_balance(device) if balance is None else balance
        block = resolve_block(self.gram_block, device) if blocked else 0
        ghost = 2 * t * t * (d_in + d_out) * flop_fraction(t, block)
        direct = 4 * d_in * d_out + balance * 3 * d_in * d_out * element_size
        return ghost > direct

    def may_take(self, a: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether per-sample gradients are a choice to weigh for this layer in this step.

        They are when this step keeps them, the policy weighs cost (``"auto"``) and one layer's
        per-sample gradients fit the budget at all (:class:`~opacus_fsdp_sync.norm_tuner.NormTuner`
        times them only then).
        """
        nbytes = a.shape[0] * a.shape[-1] * g.shape[-1] * g.element_size()
        return self.active and self.only_when_cheaper and nbytes <= self.budget_bytes

    def take(
        self, layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, cheaper: bool | None = None
    ) -> bool:
        """Whether ``layer`` (input ``a``: ``(N, T, d_in)``) materialises; accounts its bytes.

        Args:
            layer: The layer.
            a: Its input.
            g: Its output gradient.
            cheaper: Whether per-sample gradients are the cheaper choice, as measured
                (:mod:`opacus_fsdp_sync.norm_tuner`); None applies the cost rule
                (:meth:`cheaper`). Ignored without ``only_when_cheaper``.
        """
        if not self.active:
            return False
        n, t, d_in = a.shape
        d_out = g.shape[-1]
        plain = type(a) is torch.Tensor and type(g) is torch.Tensor  # DTensors: full Grams
        if cheaper is None and self.only_when_cheaper:
            cheaper = self.cheaper(t, d_in, d_out, g.element_size(), a.device, blocked=plain)
        if self.only_when_cheaper and not cheaper:
            return False
        nbytes = n * d_in * d_out * g.element_size()
        if self.used_bytes + nbytes > self.budget_bytes:
            self.declined += 1
            return False
        self.used_bytes += nbytes
        self.taken += 1
        return True


def machine_balance(device: torch.device) -> float:
    """FLOPs per byte of memory traffic the cost rule assumes: 10 on CPU, 400 on accelerators.

    An H100 in bf16 has about 200 (about 600 TFLOP/s against 3 TB/s); 400 is what one measured
    run asked for (Llama-3.2-1B shape, T = 1024, batch 8: per-sample gradients 5 % slower than
    ghost norms), so CUDA takes per-sample gradients only where they win clearly.
    """
    return 10.0 if device.type == "cpu" else 400.0


def linear_per_sample_grads(
    layer: nn.Linear, a: torch.Tensor, g: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``{"weight": (N, d_out, d_in), "bias": (N, d_out)}`` for the trainable parameters."""
    out = {}
    if layer.weight.requires_grad:
        out["weight"] = torch.bmm(g.transpose(1, 2), a.to(g.dtype))
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = g.sum(1)
    return out


def per_sample_norms(psgs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's per-sample gradient norm, accumulated in fp32."""
    return {
        name: torch.linalg.vector_norm(t.flatten(1), dim=1, dtype=torch.float32)
        for name, t in psgs.items()
    }


def clipped_sum(psgs: dict[str, torch.Tensor], scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum_n scale_n psg_n`` per parameter, in the psg dtype.

    fp32: one matrix-vector product. Lower precision: the fp32 coefficients are split into a
    high and a low part in that dtype (``hi + lo`` carries about 16 significant bits), so two
    products of the stored per-sample gradients replace converting them to fp32; each product
    accumulates in fp32 and the result has the dtype's own rounding, as a batched matmul would.
    """
    out = {}
    for name, t in psgs.items():
        flat = t.flatten(1)
        row = scale.view(1, -1)
        if flat.dtype == torch.float32:
            res = row @ flat
        else:
            hi = row.to(flat.dtype)
            lo = (row - hi.float()).to(flat.dtype)
            res = ((hi @ flat).float() + (lo @ flat).float()).to(flat.dtype)
        out[name] = res.view(t.shape[1:])
    return out
