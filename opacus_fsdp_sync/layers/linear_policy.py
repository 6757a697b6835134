"""When sequence ``Linear`` layers take per-sample gradients instead of ghost norms (the rule).

The per-sample gradients themselves are the ``Linear`` room's (:mod:`.linear`).

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

from .linear_grams import flop_fraction, resolve_block


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
    :func:`~opacus_fsdp_sync.layers.linear_grams.resolve_block`): the cost rule prices the ghost
    norm at the FLOPs of the upper block triangle."""
    active: bool = False
    """Set per backward by the first pass: True only when its gradients will be kept."""
    forced: frozenset[int] = frozenset()
    """Set per backward by the one-backward memory budget: layers (ids) that take per-sample
    gradients whatever the cost rule and ``budget_bytes`` say (they make the step fit)."""
    headroom: int | None = None
    """Set per backward by the memory budget: bytes that the per-sample gradients this policy
    chooses may add to what one backward keeps, each counted as its bytes less the output
    gradient it replaces (None: no limit)."""
    added: int = 0
    used_bytes: int = 0
    taken: int = 0
    declined: int = 0
    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def reset(self) -> None:
        """Starts a new step's accounting (and forgets anything a failed step left)."""
        self.used_bytes = self.taken = self.declined = self.added = 0
        self.forced, self.headroom = frozenset(), None
        self.stash.clear()

    def limit(self, forced: frozenset[int], headroom: int | None) -> None:
        """This backward's :attr:`forced` layers and :attr:`headroom`."""
        self.forced, self.headroom, self.added = frozenset(forced), headroom, 0

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
        (:func:`~opacus_fsdp_sync.layers.linear_grams.flop_fraction`). Per-sample gradients: the
        same matmul FLOPs as the weight gradient they replace, plus ``4 d_in d_out`` FLOPs and
        ``3 d_in d_out`` element reads and writes, priced at the machine balance.

        Args:
            t: Sequence length.
            d_in: Input features.
            d_out: Output features.
            element_size: Bytes per gradient element.
            device: The layer input's device (for ``"auto"`` settings).
            blocked: False where the ghost norm takes full Grams whatever ``gram_block`` says
                (DTensor inputs, see :class:`~opacus_fsdp_sync.layers.linear_norms.GramCache`).
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
        per-sample gradients fit the budget at all (:class:`~opacus_fsdp_sync.tuning.NormTuner`
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
                (:mod:`opacus_fsdp_sync.tuning`); None applies the cost rule
                (:meth:`cheaper`). Ignored without ``only_when_cheaper``.
        """
        if not self.active:
            return False
        n, t, d_in = a.shape
        d_out = g.shape[-1]
        nbytes = n * d_in * d_out * g.element_size()
        if id(layer) in self.forced:
            self.used_bytes += nbytes
            self.taken += 1
            return True
        plain = type(a) is torch.Tensor and type(g) is torch.Tensor  # DTensors: full Grams
        if cheaper is None and self.only_when_cheaper:
            cheaper = self.cheaper(t, d_in, d_out, g.element_size(), a.device, blocked=plain)
        if self.only_when_cheaper and not cheaper:
            return False
        if self.used_bytes + nbytes > self.budget_bytes:
            self.declined += 1
            return False
        if self.headroom is not None:
            values = d_in * d_out if layer.weight.requires_grad else 0
            values += d_out if layer.bias is not None and layer.bias.requires_grad else 0
            grows = (n * values - g.numel()) * g.element_size()  # minus the output gradient
            if self.added + grows > self.headroom:
                self.declined += 1
                return False
            self.added += grows
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
