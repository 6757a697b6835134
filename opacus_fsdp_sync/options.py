"""The engine's options (one typed dataclass) and the keep-unsharded memory policy."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger("opacus_fsdp_sync")


@dataclass(kw_only=True)
class GhostOptions:
    """How :class:`~opacus_fsdp_sync.PrivacyEngine` runs a ghost-clipping step.

    Every option is exact (tested against upstream Opacus and a clip-each-sample loop); they
    change only cost.
    """

    sync_optimization: bool = True
    """False runs upstream Opacus's two passes unchanged (every option below off), for A/B."""
    restricted_first_pass: bool = True
    """Differentiate the norm-only first pass w.r.t. activations only: no weight gradients, no
    reduce-scatter, about half that pass's FLOPs. Fails loudly if a hooked layer is missed."""
    keep_unsharded: bool | str = "auto"
    """FSDP2: keep parameters unsharded between the passes, so the second backward issues no
    all-gather (the non-private step's count). ``"auto"``: on when the unsharded parameters fit
    ``keep_unsharded_budget_bytes``."""
    keep_unsharded_budget_bytes: int | None = None
    """Budget for ``keep_unsharded="auto"``. None: half the free CUDA memory, or a quarter of
    the available host memory on CPU."""
    one_backward: bool = True
    """With the activations-only first pass: compute each layer's clipped weight gradient from it
    and hand it to the API's reduction instead of a second backward (one device; FSDP2's and
    FSDP1's own reduce-scatter; DDP: one bucketed all-reduce averaging as DDP does). DDP with a
    communication hook or its mixed precision, and a layer without a direct formula under FSDP,
    take the two-pass step (logged)."""
    fast_norms: bool = True
    """Linear ghost norms with each input's Gram matrix computed once for all layers reading it
    (q/k/v, gate/up) and an fp32 elementwise contraction instead of upstream's gemv: equal to
    upstream to rounding (the Gram matrices keep the model's dtype, as upstream's), not bit for
    bit. False keeps upstream's norm kernels (then the two-pass options reproduce upstream Opacus
    bit for bit)."""
    gram_block: int | str = "auto"
    """With ``fast_norms``: tokens per row block of the symmetric Gram matrices, of which only the
    upper block triangle is computed (:mod:`opacus_fsdp_sync.layers.linear_grams`; about 5/8 of
    the Gram FLOPs at four blocks), by the layer input's device for ``"auto"``: 64 on CPU
    (measured), 512 on accelerators (not yet measured on a GPU); 0: full Gram matrices."""
    per_sample_grads: bool | str = "auto"
    """One backward with ``fast_norms``: sequence ``Linear`` layers materialise per-sample
    gradients in the first pass (norms and clipped gradient from them, no ghost norm; see
    :mod:`opacus_fsdp_sync.layers.linear_policy`). ``"auto"``: where that saves FLOPs, while
    the step's per-sample gradients fit ``per_sample_grads_budget_bytes``; True: every sequence
    Linear layer that fits; False: ghost norms only."""
    per_sample_grads_budget_bytes: int | None = None
    """Budget of per-sample gradient bytes per step. None: a quarter of the free CUDA memory, or
    an eighth of the available host memory on CPU."""
    tune_norms: bool | str = "auto"
    """With ``fast_norms``: choose each sequence ``Linear`` layer's norm strategy (full Grams,
    each sensible ``gram_block``, per-sample gradients within their budget) by timing them on
    the real inputs the first time a layer shape, dtype, device and sequence length is met, and
    reuse the fastest (:mod:`opacus_fsdp_sync.tuning`; every candidate is exact). Replaces
    ``gram_block="auto"`` and the ``per_sample_grads="auto"`` cost rule; an explicit block or
    ``per_sample_grads=True``/``False`` is kept. ``"auto"``: on for accelerators, off on CPU
    (where it does not pay for the benchmark's preset); distributed runs tune on rank 0 at the
    first step and agree by one broadcast."""
    tune_norms_cache: str | None = None
    """JSON file of tuned plans, keyed by device name and torch version, read at the start and
    extended by what a run tunes. None: ``OPACUS_FSDP_SYNC_NORM_PLAN`` if set, else no file."""
    one_backward_memory_budget: int | None = None
    """Bytes one backward may keep from its first pass to its gradient phase (the layers' inputs
    and output gradients, or per-sample gradients), checked before each first pass: over it,
    ``Linear`` layers whose per-sample gradients are smaller take them until the step fits,
    else the step takes two backward passes (both exact; logged once each). None: on CUDA the
    free device memory less a margin (:func:`auto_memory_budget`), on CPU no limit."""
    tune_norms_memory_budget: int | None = None
    """Bytes one ``tune_norms`` candidate's working set may take (Gram matrices: ``4 N T^2``
    each in fp32); a candidate over it is never timed (logged). None: as
    ``one_backward_memory_budget``'s automatic budget."""
    fused_kernels: bool | None = None
    """Fused Triton kernels for ``Linear`` layers (:mod:`opacus_fsdp_sync.layers.kernels`): the
    ghost norm without ``T x T`` Grams (or the per-sample-gradient norm as a GEMM epilogue where
    that has fewer FLOPs) with ``fast_norms``, and the one-backward clipped gradient with the
    coefficients folded in. True: on CUDA, and on CPU under Triton's interpreter
    (``TRITON_INTERPRET=1``, for tests; needs ``triton``). None (default) and False: the torch
    path, which the GPU campaign measured faster on an H100 (``docs/kernels.md``). Exact to
    floating-point rounding (the summation order differs)."""
    timing: bool | None = None
    """Log ``[Ghost]`` per-phase timings each step; None reads ``OPACUS_FSDP_SYNC_TIMING``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.per_sample_grads, bool) or self.per_sample_grads == "auto"):
            raise ValueError(
                f"per_sample_grads={self.per_sample_grads!r}: choose True, False or 'auto'"
            )
        block = self.gram_block
        if block != "auto" and (type(block) is not int or block < 0):
            raise ValueError(
                f"gram_block={block!r}: choose 'auto', 0 (full Gram matrices) or a positive "
                "number of tokens per row block"
            )
        if not (isinstance(self.tune_norms, bool) or self.tune_norms == "auto"):
            raise ValueError(f"tune_norms={self.tune_norms!r}: choose True, False or 'auto'")
        cache = self.tune_norms_cache
        if cache is not None and not isinstance(cache, (str, os.PathLike)):
            raise ValueError(f"tune_norms_cache={cache!r}: a file path or None")
        psg_budget = self.per_sample_grads_budget_bytes
        if psg_budget is not None and psg_budget < 0:
            raise ValueError(f"per_sample_grads_budget_bytes={psg_budget}: must be >= 0")
        if not (isinstance(self.keep_unsharded, bool) or self.keep_unsharded == "auto"):
            raise ValueError(
                f"keep_unsharded={self.keep_unsharded!r}: choose True, False or 'auto'"
            )
        for name, flag in (
            ("sync_optimization", self.sync_optimization),
            ("restricted_first_pass", self.restricted_first_pass),
            ("one_backward", self.one_backward),
            ("fast_norms", self.fast_norms),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: must be True or False")
        budget = self.keep_unsharded_budget_bytes
        if budget is not None and budget < 0:
            raise ValueError(f"keep_unsharded_budget_bytes={budget}: must be >= 0")
        if self.fused_kernels is not None and not isinstance(self.fused_kernels, bool):
            raise ValueError(
                f"fused_kernels={self.fused_kernels!r}: choose None (default: the torch path), "
                "True (the fused Triton kernels on CUDA) or False"
            )
        check_budget("one_backward_memory_budget", self.one_backward_memory_budget)
        check_budget("tune_norms_memory_budget", self.tune_norms_memory_budget)

    @property
    def effective(self) -> GhostOptions:
        """The options in force: everything off when ``sync_optimization`` is False."""
        if self.sync_optimization:
            return self
        return GhostOptions(
            sync_optimization=False,
            restricted_first_pass=False,
            keep_unsharded=False,
            one_backward=False,
            fast_norms=False,
            per_sample_grads=False,
            tune_norms=False,
            fused_kernels=False,
            timing=self.timing,
        )


def split_options(kwargs: dict) -> dict:
    """Removes the :class:`GhostOptions` fields from ``kwargs`` and returns them."""
    names = {f.name for f in dataclasses.fields(GhostOptions)}
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


def check_budget(name: str, value: object) -> None:
    """Raises unless ``value`` is None or a whole number of bytes >= 0.

    Raises:
        ValueError: naming the option and what to pass.
    """
    if value is None or (type(value) is int and value >= 0):
        return
    raise ValueError(
        f"{name}={value!r}: pass a whole number of bytes >= 0 (for example 8 * 2**30 for "
        "8 GiB), or None for the automatic budget"
    )


#: The automatic budgets' margin on CUDA: this share of the device's memory (at least
#: :data:`MIN_MARGIN_BYTES`) is left free (see :func:`auto_memory_budget`).
MARGIN_SHARE = 0.1
MIN_MARGIN_BYTES = 2 * 2**30


def auto_memory_budget(device: torch.device) -> int | None:
    """The automatic memory budget: on CUDA what is free now less a margin; elsewhere None.

    Free is the driver's free memory (``torch.cuda.mem_get_info``) plus what PyTorch's caching
    allocator holds unused (``memory_reserved - memory_allocated``: freed blocks it reuses). The
    margin, a tenth of the device's memory and at least 2 GiB, is for what the step allocates
    beside the bytes a budget counts: the gradient phase's clipped gradients (on one device and
    DDP a full gradient copy, under FSDP one group's unsharded gradients and its reduce-scatter
    buffers), the backward's transient activation gradients and norm work, workspaces that
    cuBLAS and NCCL create on first use, and the allocator's rounding and fragmentation, none
    of which the bytes kept or a candidate's working set include. The one-backward check also
    counts layer inputs that are already allocated as if they were new, which leaves more slack.
    On CPU, where a process can page rather than fail, there is no automatic limit.
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    margin = max(int(total * MARGIN_SHARE), MIN_MARGIN_BYTES)
    return max(0, free + cached - margin)


def default_budget(device: torch.device) -> int:
    """Half the free CUDA memory, or a quarter of ``MemAvailable`` on CPU (0 if unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return 0


def decide_keep_unsharded(
    options: GhostOptions, extra_bytes: int, device: torch.device, *, one_backward: bool = False
) -> bool:
    """Applies the keep-unsharded policy and logs the choice and why.

    Args:
        options: The engine's options (``keep_unsharded``, ``keep_unsharded_budget_bytes``).
        extra_bytes: Bytes per rank that unsharded parameters take between the passes.
        device: Where the parameters live (for the default budget).
        one_backward: The step runs one backward, whose hand-off never gathers parameters
            again: ``"auto"`` then keeps nothing unsharded.
    """
    mib = extra_bytes / 2**20
    auto = options.keep_unsharded is not True and options.keep_unsharded is not False
    if auto and one_backward:
        logger.info(
            "[Ghost] keep_unsharded=auto -> off: one backward gathers no parameter again "
            "(%.1f MiB per rank not held)",
            mib,
        )
        return False
    if auto:
        budget = options.keep_unsharded_budget_bytes
        budget = default_budget(device) if budget is None else budget
        keep = extra_bytes <= budget
        logger.info(
            "[Ghost] keep_unsharded=auto -> %s: unsharded parameters need %.1f MiB per rank "
            "between the passes, budget %.1f MiB",
            "on" if keep else "off",
            mib,
            budget / 2**20,
        )
        return keep
    logger.info(
        "[Ghost] keep_unsharded=%s (set by the user; %.1f MiB per rank between the passes)",
        options.keep_unsharded,
        mib,
    )
    return bool(options.keep_unsharded)
