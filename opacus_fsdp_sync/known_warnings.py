"""Three warnings every rank of a ghost-clipping run prints, known to be harmless here.

:func:`quiet_known_warnings` silences exactly these (each by its message and category), once
per process, and says so in one ``[Ghost]`` line. The quick start and the trainer call it; a
library import never does, so a user's own program keeps every warning unless it opts in.
"""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("opacus_fsdp_sync")

#: ``(message regex, category, why it is harmless here)``; the regexes match the warnings'
#: openings as the tested releases word them (torch 2.13-2.15, opacus 1.6).
KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (
        # torch/distributed/fsdp/_fully_shard/_fsdp_state.py (_register_pre_backward_hook):
        # the model's output (HF's logits) is a view. The pre-backward hook that all-gathers the
        # parameters sits on that view and is lost only if the view is changed in place; the
        # quick start and the trainer slice and reshape it out of place (and the exactness tests
        # compare FSDP2 gradients with the clip-each-sample loop, which a skipped all-gather
        # would break).
        r"FSDP2-wrapped module \(.*\) returned a view tensor\. An in-place op on this view",
        UserWarning,
        "FSDP2's 'returned a view tensor' (the outputs are never changed in place)",
    ),
    (
        # torch/utils/hooks.py (BackwardHook): Opacus's full backward hooks on layers whose
        # input needs no gradient (the embedding's token ids; every layer in the first pass,
        # which differentiates with respect to activations only). Opacus's hooks read the
        # output gradient alone, which torch still passes.
        r"Full backward hook is firing when gradients are computed with respect to module "
        r"outputs since no inputs require gradients",
        UserWarning,
        "torch's 'Full backward hook is firing' (Opacus's hooks read the output gradient only)",
    ),
    (
        # opacus/privacy_engine.py (PrivacyEngine.__init__), whenever secure_mode is off. The
        # draws then come from torch generators seeded from OS entropy (docs/privacy.md);
        # secure_mode=True draws from the OS CSPRNG itself.
        r"Secure RNG turned off",
        UserWarning,
        "Opacus's 'Secure RNG turned off' (noise and Poisson draws come from torch generators "
        "seeded from OS entropy; secure_mode=True for the OS CSPRNG itself, see docs/privacy.md)",
    ),
)

_quieted = False


def quiet_known_warnings() -> None:
    """Ignores the :data:`KNOWN_WARNINGS`, once per process, and logs what and why."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    for pattern, category, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    logger.info(
        "[Ghost] warnings silenced as harmless here: %s",
        "; ".join(why for _, _, why in KNOWN_WARNINGS),
    )
