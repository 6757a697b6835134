"""Which code produced a result: the checkout's git commit, and whether it was modified.

Every committed result names the code it measured. Benches record :func:`code_version` of the
package's own checkout beside their numbers (the profiling suite in ``environment.code``, the
benches that :mod:`.results_io` saves in ``code``), so that a result is traced to its commit
without reading the log it came from.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

#: The package's checkout (the folder holding ``opacus_fsdp_sync/``).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str) -> str | None:
    """``git -C root args`` stdout, stripped; None when git or the repository is missing."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.debug("git %s in %s: %s", args, root, error)
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_version(root: Path | None = None) -> dict[str, str | bool | None]:
    """The commit checked out at ``root`` and whether tracked files differ from it.

    Args:
        root: The top folder of a git checkout; None: the package's own (:data:`PACKAGE_ROOT`).

    Returns:
        ``{"commit": the full hash, "modified": whether a tracked file is changed}``; both None
        where ``root`` is not a checkout's top folder (an installed wheel, or a package
        installed inside another project's repository) or without git. Untracked files do not count
        as a change (results written into the tree are untracked while they are measured).
    """
    root = PACKAGE_ROOT if root is None else root
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = _git(root, "rev-parse", "HEAD")
    if top is None or commit is None or Path(top).resolve() != Path(root).resolve():
        return {"commit": None, "modified": None}  # not a checkout's top (an enclosing repo's)
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "modified": None if status is None else bool(status)}
