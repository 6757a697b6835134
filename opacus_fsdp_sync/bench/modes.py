"""The profiling suite's modes: one row each, dispatched through one table.

Benchmark code (see :mod:`opacus_fsdp_sync.bench`): the harness under
``memory_test/fsdp_llama3_profiling/`` and the tests read it; the library does not.
"""

from __future__ import annotations

import itertools
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


#: The two-pass modes (``one_backward`` off), one per combination of the two switches that cut
#: the first backward's collectives: (restricted_first_pass, keep_unsharded) -> (name,
#: description). ``_build_modes`` walks every combination, so a missing one fails at import.
_TWO_PASS = {
    (False, False): ("ghost_fsdp_sync", "ours: first backward without gradient sync"),
    (False, True): ("ghost_fsdp_keep", "ours: + parameters kept unsharded between the passes"),
    (True, False): ("ghost_fsdp_restricted", "ours: + first backward w.r.t. activations only"),
    (True, True): ("ghost_fsdp_parity", "ours: both (the non-private step's collectives)"),
}

#: The one-backward modes: the options each sets beyond ``restricted_first_pass=True,
#: one_backward=True``.
_ONE_BACKWARD = {
    "ghost_fsdp_one_backward_ghost_norms": (
        {"per_sample_grads": False},
        "ours: one backward, ghost norms for every layer (no per-sample gradients)",
    ),
    "ghost_fsdp_one_backward_full_gram": (
        {"per_sample_grads": False, "gram_block": 0},
        "A/B for gram_block: as ..._ghost_norms, with full Gram matrices",
    ),
    "ghost_fsdp_one_backward_per_sample": (
        {"per_sample_grads": True},
        "ours: one backward, per-sample gradients for every sequence Linear layer",
    ),
    "ghost_fsdp_one_backward": (
        {},
        "ours (default): one backward, per-sample gradients where cheaper",
    ),
    "ghost_fsdp_one_backward_tuned": (
        {"tune_norms": True},
        "A/B for tune_norms: the default with norm strategies tuned (also on CPU)",
    ),
    "ghost_fsdp_one_backward_untuned": (
        {"tune_norms": False},
        "A/B for tune_norms: the default with the static norm rules (tuning off)",
    ),
    "ghost_fsdp_one_backward_fused_kernels": (
        {"fused_kernels": True},
        "A/B for fused_kernels: the default with the fused Triton kernels for Linear layers",
    ),
}


def _build_modes() -> dict[str, ModeSpec]:
    """The table, in the order tables and plots list the modes."""
    modes = {
        "no_dp": ModeSpec(private=False, description="non-private FSDP (the floor)"),
        "ghost_fsdp": ModeSpec(
            private=True,
            engine_kwargs={"sync_optimization": False},
            description="upstream Opacus ghost clipping (both passes synced)",
        ),
    }
    for restricted, keep in itertools.product((False, True), repeat=2):
        name, description = _TWO_PASS[restricted, keep]
        modes[name] = ModeSpec(
            private=True,
            engine_kwargs={
                "restricted_first_pass": restricted,
                "keep_unsharded": keep,
                "one_backward": False,
            },
            description=description,
        )
    for name, (extra, description) in _ONE_BACKWARD.items():
        modes[name] = ModeSpec(
            private=True,
            engine_kwargs={"restricted_first_pass": True, "one_backward": True, **extra},
            description=description,
        )
    return modes


MODES: dict[str, ModeSpec] = _build_modes()

#: The package's default private step (``PrivacyEngine`` with default options): the mode tables
#: and plots mark.
DEFAULT_MODE = "ghost_fsdp_one_backward"


def get_mode(name: str) -> ModeSpec:
    """Returns the spec of mode ``name``.

    Raises:
        ValueError: naming the allowed modes.
    """
    if name not in MODES:
        raise ValueError(f"mode={name!r}: choose one of {', '.join(MODES)}")
    return MODES[name]
