"""The profiling suite's modes: one row each, dispatched through one table."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """How one mode trains.

    Attributes:
        private: False trains without Opacus (the non-private floor).
        engine_kwargs: Keyword arguments of :class:`opacus_fsdp_sync.PrivacyEngine`.
        grad_sample_mode: Opacus mode for private training under FSDP2.
        description: One line for tables and logs.
    """

    private: bool
    engine_kwargs: dict = field(default_factory=dict)
    grad_sample_mode: str = "ghost_fsdp"
    description: str = ""


MODES: dict[str, ModeSpec] = {
    "no_dp": ModeSpec(private=False, description="non-private FSDP (the floor)"),
    "ghost_fsdp": ModeSpec(
        private=True,
        engine_kwargs={"sync_optimization": False},
        description="upstream Opacus ghost clipping (both passes synced)",
    ),
    "ghost_fsdp_sync": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": False,
            "keep_unsharded": False,
            "one_backward": False,
        },
        description="ours: first backward without gradient sync",
    ),
    "ghost_fsdp_keep": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": False,
            "keep_unsharded": True,
            "one_backward": False,
        },
        description="ours: + parameters kept unsharded between the passes",
    ),
    "ghost_fsdp_restricted": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": True,
            "keep_unsharded": False,
            "one_backward": False,
        },
        description="ours: + first backward w.r.t. activations only",
    ),
    "ghost_fsdp_parity": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": True,
            "keep_unsharded": True,
            "one_backward": False,
        },
        description="ours: both (the non-private step's collectives)",
    ),
    "ghost_fsdp_one_backward_ghost_norms": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": True,
            "one_backward": True,
            "per_sample_grads": False,
        },
        description="ours: one backward, ghost norms for every layer (no per-sample gradients)",
    ),
    "ghost_fsdp_one_backward_full_gram": ModeSpec(
        private=True,
        engine_kwargs={
            "restricted_first_pass": True,
            "one_backward": True,
            "per_sample_grads": False,
            "gram_block": 0,
        },
        description="A/B for gram_block: as ..._ghost_norms, with full Gram matrices",
    ),
    "ghost_fsdp_one_backward": ModeSpec(
        private=True,
        engine_kwargs={"restricted_first_pass": True, "one_backward": True},
        description="ours (default): one backward, per-sample gradients where cheaper",
    ),
    "ghost_fsdp_one_backward_tuned": ModeSpec(
        private=True,
        engine_kwargs={"restricted_first_pass": True, "one_backward": True, "tune_norms": True},
        description="A/B for tune_norms: the default with norm strategies tuned (also on CPU)",
    ),
    "ghost_fsdp_one_backward_untuned": ModeSpec(
        private=True,
        engine_kwargs={"restricted_first_pass": True, "one_backward": True, "tune_norms": False},
        description="A/B for tune_norms: the default with the static norm rules (tuning off)",
    ),
}


def get_mode(name: str) -> ModeSpec:
    """Returns the spec of mode ``name``.

    Raises:
        ValueError: naming the allowed modes.
    """
    if name not in MODES:
        raise ValueError(f"mode={name!r}: choose one of {', '.join(MODES)}")
    return MODES[name]
