"""The DP-aware sharding configuration: one typed, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

STRATEGIES = ("full", "shard_grad_op", "hybrid_full", "no_shard")
WRAP_POLICIES = ("transformer", "size_based", "per_layer")
BACKENDS = ("fsdp2", "fsdp1")
TIED_WEIGHTS = ("shard_together", "refuse")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _dtype(name: str | None, field: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"{field}={name!r}: choose one of {sorted(_DTYPES)} or None")
    return _DTYPES[name]


@dataclass(kw_only=True)
class ShardingConfig:
    """How :func:`~opacus_fsdp_sync.sharding.shard_model` shards a model.

    Every layout it produces is one Opacus ghost clipping accepts: sharded layers keep their
    original type as the second base class, and a weight shared by several layers stays in one
    FSDP unit (its exact per-sample norm comes from :mod:`opacus_fsdp_sync.layers.tied`).
    """

    strategy: str = "full"
    """``full`` (ZeRO-3: reshard after forward), ``shard_grad_op`` (ZeRO-2: keep parameters
    unsharded from forward to backward), ``hybrid_full`` (shard inside a group, replicate across
    groups: 2-D mesh), ``no_shard`` (replicate everything: a (world, 1) mesh, or FSDP1 NO_SHARD)."""
    wrap_policy: str = "transformer"
    """``transformer`` (one unit per decoder block plus the root: few, large collectives),
    ``size_based`` (a unit for each module holding at least ``min_num_params`` not yet wrapped),
    ``per_layer`` (a unit per parameter-owning layer, as Opacus's ``FSDP2Wrapper``)."""
    min_num_params: int = 100_000
    """Threshold of the ``size_based`` policy."""
    block_classes: tuple[type, ...] | None = None
    """Transformer block classes; None finds classes named ``*DecoderLayer``/``*Block``."""
    param_dtype: str | None = None
    """Compute dtype of parameters (``bf16``, ``fp16``, ``fp32``, None: unchanged)."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduction (None: the parameter dtype)."""
    output_dtype: str | None = None
    """Dtype of each unit's outputs (None: unchanged)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (needs CUDA)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward (non-reentrant; exact with ghost clipping:
    the recomputation's forward hooks are ignored)."""
    backend: str = "fsdp2"
    """``fsdp2`` (``fully_shard``) or ``fsdp1`` (``FullyShardedDataParallel``)."""
    replicate_degree: int | None = None
    """``hybrid_full``: number of replica groups (the world size must be a multiple); None: 2
    when possible."""
    tied_weights: str = "shard_together"
    """``shard_together`` keeps every layer owning a shared weight in one unit; ``refuse``
    raises if the model shares weights."""
    tp_degree: int = 1
    """Tensor-parallel degree (FSDP2 only): above 1, ``parallelize_module`` applies
    :attr:`tp_plan` over a mesh dimension ``"tp"`` of this size before ``fully_shard`` shards
    over the data-parallel dimensions (torchtitan's mesh: ``dp_replicate``, ``dp_shard``,
    ``tp``). The world size must be a multiple of it."""
    tp_plan: dict | None = None
    """``{module name: ParallelStyle}`` for ``parallelize_module``; None with ``tp_degree > 1``
    takes the Llama plan (:func:`~opacus_fsdp_sync.sharding.tensor_parallel.llama_tp_plan`:
    q/k/v/gate/up column-wise, o/down row-wise in every decoder layer)."""

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("strategy", self.strategy, STRATEGIES),
            ("wrap_policy", self.wrap_policy, WRAP_POLICIES),
            ("backend", self.backend, BACKENDS),
            ("tied_weights", self.tied_weights, TIED_WEIGHTS),
        ):
            if value not in allowed:
                raise ValueError(f"{field}={value!r}: choose one of {', '.join(allowed)}")
        _dtype(self.param_dtype, "param_dtype")
        _dtype(self.reduce_dtype, "reduce_dtype")
        _dtype(self.output_dtype, "output_dtype")
        if self.min_num_params < 1:
            raise ValueError(f"min_num_params={self.min_num_params}: must be at least 1")
        if self.replicate_degree is not None and self.replicate_degree < 1:
            raise ValueError(f"replicate_degree={self.replicate_degree}: must be at least 1")
        if not isinstance(self.tp_degree, int) or self.tp_degree < 1:
            raise ValueError(f"tp_degree={self.tp_degree!r}: must be a whole number, at least 1")
        if self.tp_degree > 1 and self.backend != "fsdp2":
            raise ValueError(
                f"tp_degree={self.tp_degree} needs backend='fsdp2' (FSDP1 does not compose with "
                "torch's tensor parallelism here)"
            )
        if self.tp_degree > 1 and self.strategy == "no_shard":
            raise ValueError(
                f"tp_degree={self.tp_degree} with strategy='no_shard' is not tested: use 'full' "
                "or 'hybrid_full'"
            )

    @classmethod
    def for_precision(cls, precision: str, **kwargs) -> ShardingConfig:
        """``"bf16"``: bf16 parameters with fp32 gradient reduction; ``"fp32"``: no casting.

        Raises:
            ValueError: for any other precision.
        """
        if precision == "bf16":
            return cls(param_dtype="bf16", reduce_dtype="fp32", **kwargs)
        if precision == "fp32":
            return cls(**kwargs)
        raise ValueError(f"precision={precision!r}: choose 'bf16' or 'fp32'")

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None]:
        """``(param, reduce, output)`` torch dtypes."""
        return (
            _dtype(self.param_dtype, "param_dtype"),
            _dtype(self.reduce_dtype, "reduce_dtype"),
            _dtype(self.output_dtype, "output_dtype"),
        )
