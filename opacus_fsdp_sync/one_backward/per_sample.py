"""Per-sample gradients of sequence ``Linear`` layers, where they are cheaper than ghost norms.

In the one-backward step a layer's clipped gradient is computed anyway, from its kept input ``A``
and output gradient ``G`` (``T x d_in`` and ``T x d_out`` per sample). Its ghost norm costs
``2 T^2 (d_in + d_out)`` FLOPs per sample on top. Materialising the per-sample gradients
``G_n^T A_n`` instead costs what the batched weight gradient costs (``2 T d_in d_out`` per sample)
and gives both the norms and, once the clipping coefficients ``c`` are known, the clipped gradient
``sum_n c_n G_n^T A_n`` as one small matrix-vector product. So the ghost norm's FLOPs are saved
whenever ``T^2 (d_in + d_out) > 2 d_in d_out`` (the per-sample gradients' norm and weighted sum
cost about ``4 d_in d_out``), at the price of holding ``N d_in d_out`` values per layer until the
coefficients are known: a byte budget per step decides how many layers take this path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class PerSampleGradPolicy:
    """Which sequence ``Linear`` layers materialise per-sample gradients in a step.

    Layers are taken greedily in backward order while the step's materialised bytes fit
    ``budget_bytes``; with ``only_when_cheaper`` a layer must also save FLOPs (see the module).
    """

    budget_bytes: int
    only_when_cheaper: bool = True
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

    def take(self, layer: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether ``layer`` (input ``a``: ``(N, T, d_in)``) materialises; accounts its bytes."""
        if not self.active:
            return False
        n, t, d_in = a.shape
        d_out = g.shape[-1]
        if self.only_when_cheaper and t * t * (d_in + d_out) <= 2 * d_in * d_out:
            return False
        nbytes = n * d_in * d_out * g.element_size()
        if self.used_bytes + nbytes > self.budget_bytes:
            self.declined += 1
            return False
        self.used_bytes += nbytes
        self.taken += 1
        return True


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
    """``sum_n scale_n psg_n`` per parameter (fp32 accumulation, result in the psg dtype)."""
    out = {}
    for name, t in psgs.items():
        flat = t.flatten(1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out[name] = (scale.view(1, -1) @ flat).view(t.shape[1:]).to(t.dtype)
    return out
