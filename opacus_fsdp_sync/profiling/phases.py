"""The name of the step phase currently running (forward, first_backward, ...).

The engine's backward and the profiling harness announce phases here; observers such as the
collective counter attribute what they see to :func:`current_phase` without being wired into
the engine.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_CURRENT_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "opacus_fsdp_sync_phase", default="other"
)

#: Phases of one ghost-clipping step, in order.
STEP_PHASES = ("forward", "first_backward", "re-enable_sync", "second_backward", "optimizer_step")


def current_phase() -> str:
    """Returns the innermost phase announced with :func:`phase`, or ``"other"``."""
    return _CURRENT_PHASE.get()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks the code in the ``with`` block as belonging to phase ``name``.

    Args:
        name: Phase name, e.g. one of :data:`STEP_PHASES`.
    """
    token = _CURRENT_PHASE.set(name)
    try:
        yield
    finally:
        _CURRENT_PHASE.reset(token)
