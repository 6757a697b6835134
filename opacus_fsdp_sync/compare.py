"""Old path of the comparison suite; it lives in :mod:`opacus_fsdp_sync.bench.compare`.

A re-export shim so that ``from opacus_fsdp_sync.compare import ...`` and
``python -m opacus_fsdp_sync.compare`` keep working. The core package does not import it.
"""

import sys

from .bench.compare import (
    APIS,
    CHECKS,
    METHODS,
    CompareConfig,
    main,
    rank_main,
    render,
    run_suite,
)

__all__ = [
    "APIS",
    "CHECKS",
    "METHODS",
    "CompareConfig",
    "main",
    "rank_main",
    "render",
    "run_suite",
]

if __name__ == "__main__":
    sys.exit(main())
