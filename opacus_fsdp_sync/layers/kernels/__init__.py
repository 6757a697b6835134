"""Fused Triton kernels beside the ``Linear`` room's torch path (see ``docs/kernels.md``).

- :mod:`.ops`: the ``torch.library`` custom ops (``opacus_fsdp_sync::ghost_norm_linear``,
  ``::per_sample_norm_linear``, ``::clipped_grad_linear``) with fake impls and FLOP formulas;
  each falls back to the torch path where Triton cannot launch;
- :mod:`.triton_linear`: the Triton kernels (imported only when Triton imports);
- :mod:`.linear`: what the ``Linear`` room calls (squared norms, clipped gradients);
- :mod:`.availability`: whether Triton imports and whether the kernels apply to a tensor.
- :mod:`.rows` / :mod:`.triton_rows`: the row kernels (the coefficients' row scaling and the
  Gram dots), on by default for large CUDA tensors (``OPACUS_FSDP_SYNC_ROW_KERNELS``).
- :mod:`.triton_noise`: the noise kernel (the noised gradient in one pass), chosen by
  :mod:`opacus_fsdp_sync.optimizers.noise_kernel` (``OPACUS_FSDP_SYNC_NOISE_KERNEL``).

The option is :attr:`~opacus_fsdp_sync.options.GhostOptions.fused_kernels` (True: on CUDA, and
on CPU under Triton's interpreter; None, the default, and False: the torch path, measured faster
on an H100).
"""

from .availability import describe, triton_available, use_fused
from .linear import linear_clipped_grad, linear_sq_norms, weight_sq_norm
from .ops import clipped_grad_linear, ghost_norm_linear, per_sample_norm_linear

__all__ = [
    "clipped_grad_linear",
    "describe",
    "ghost_norm_linear",
    "linear_clipped_grad",
    "linear_sq_norms",
    "per_sample_norm_linear",
    "triton_available",
    "use_fused",
    "weight_sq_norm",
]
