"""The one torch version gate shared by the FSDP2, FSDP1 and DDP internals modules.

The private attributes our internals read are checked by the test-suite on the torch releases in
:data:`TESTED_TORCH_VERSIONS` (CI runs it on each of them). Another release warns once, when the
package is imported, and every private access that does not find what it expects raises a
:class:`TorchInternalsError` naming the running torch, the tested ones and the feature that needed
it, with the way out, rather than a bare ``AttributeError`` or a silently wrong gradient.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

#: torch releases (major.minor) on which the whole test-suite runs, in CI. ``setup.py`` admits
#: this range and no more.
TESTED_TORCH_VERSIONS = ("2.13", "2.15")

_warned = False


class TorchInternalsError(RuntimeError):
    """A private torch attribute that a feature needs is not as on the tested torch releases.

    Attributes:
        feature: What needed the attribute (e.g. ``"FSDP2 sync-skipping first pass"``).
        torch_version: The running torch version.
    """

    def __init__(self, message: str, *, feature: str = "", torch_version: str = ""):
        super().__init__(message)
        self.feature = feature
        self.torch_version = torch_version or torch.__version__


def torch_minor(version: str | None = None) -> str:
    """The ``major.minor`` of a torch version string (the running torch by default).

    Args:
        version: e.g. ``"2.15.0+cu132"``; None reads ``torch.__version__``.
    """
    version = torch.__version__ if version is None else version
    return ".".join(str(version).split("+")[0].split(".")[:2])


def is_tested(version: str | None = None) -> bool:
    """Whether ``version`` (the running torch by default) is one of the tested releases."""
    return torch_minor(version) in TESTED_TORCH_VERSIONS


def tested_versions_text() -> str:
    """The tested releases as a reader sees them: ``"2.13, 2.15"``."""
    return ", ".join(TESTED_TORCH_VERSIONS)


def warn_if_untested() -> bool:
    """Warns once per process when the running torch is not a tested release.

    Returns:
        True when this call warned.
    """
    global _warned
    if _warned or is_tested():
        return False
    _warned = True
    warnings.warn(
        f"opacus_fsdp_sync was tested on torch {tested_versions_text()}; this is torch "
        f"{torch.__version__}. Its FSDP2, FSDP1 and DDP internals check what they read and fail "
        "loudly, but run the exactness tests (bash scripts/test.sh) before trusting results.",
        UserWarning,
        stacklevel=3,
    )
    return True


def internals_error(
    feature: str,
    what: str,
    remedy: str,
    *,
    cls: type[TorchInternalsError] = TorchInternalsError,
) -> TorchInternalsError:
    """Builds the error for a private torch attribute that is missing or not as expected.

    Args:
        feature: The feature that needed it, as a user knows it.
        what: The attribute or behaviour that was not found.
        remedy: The way out (an option that avoids the feature, another torch release).
        cls: The error class (a subclass of :class:`TorchInternalsError`).

    Returns:
        The error, ready to raise. Its message names the running torch, the tested releases and
        the feature.
    """
    return cls(
        f"opacus_fsdp_sync: {feature} needs {what}, which torch {torch.__version__} does not "
        f"have as the tested torch releases ({tested_versions_text()}) do. {remedy}",
        feature=feature,
    )


def versioned_cleanup_error(
    err: Exception, feature: str, *, cls: type[TorchInternalsError] = TorchInternalsError
) -> TorchInternalsError:
    """The versioned error for a cleanup that failed (``err`` itself when it is one).

    Args:
        err: What the cleanup raised.
        feature: The cleanup, as a user knows it ("recovering FSDP2 after a failed step").
        cls: The error class when ``err`` is not already a :class:`TorchInternalsError`.
    """
    if isinstance(err, TorchInternalsError):
        return err
    out = internals_error(
        feature,
        f"a cleanup that works (it raised {type(err).__name__}: {err})",
        "The next step would be wrong: restart from a checkpoint.",
        cls=cls,
    )
    out.__cause__ = err
    return out


@contextlib.contextmanager
def private_access(
    feature: str,
    what: str,
    remedy: str,
    *,
    cls: type[TorchInternalsError] = TorchInternalsError,
) -> Iterator[None]:
    """Turns an ``AttributeError`` raised by a private access inside the block into a versioned one.

    Args:
        feature: See :func:`internals_error`.
        what: See :func:`internals_error`.
        remedy: See :func:`internals_error`.
        cls: See :func:`internals_error`.

    Raises:
        TorchInternalsError: (of class ``cls``) chained from the ``AttributeError``.
    """
    try:
        yield
    except AttributeError as err:
        raise internals_error(feature, what, remedy, cls=cls) from err
