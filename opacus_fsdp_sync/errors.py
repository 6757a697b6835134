"""The package's error classes and the one helper that records a failed cleanup on an error.

A private step that fails is cleaned up (gradient sync re-enabled, FSDP state reset, gradients
dropped) while its error propagates. A cleanup part that fails too must never replace the
step's own error: :func:`attach_cleanup_error` records it on that error instead, as a note and
in ``error.cleanup_errors``, and logs it.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("opacus_fsdp_sync")


class UnsupportedConfigurationError(ValueError):
    """A model/API combination that the sync-skipping backward cannot handle."""


def attach_cleanup_error(error: BaseException, later: BaseException) -> None:
    """Records ``later`` (raised while cleaning up after ``error``) on ``error`` and logs it.

    ``error.cleanup_errors`` lists every such failure in order; Python 3.11+ also shows each as
    a note under the traceback. An exception type that takes no attributes only gets the log.
    """
    logger.error(
        "[Ghost] cleaning up after %s raised %s: %s",
        type(error).__name__,
        type(later).__name__,
        later,
        exc_info=(type(later), later, later.__traceback__),
    )
    try:
        errors = error.__dict__.setdefault("cleanup_errors", [])
    except AttributeError:  # an exception type with __slots__
        return
    errors.append(later)
    if sys.version_info >= (3, 11):
        error.add_note(f"While cleaning up after it: {type(later).__name__}: {later}")
