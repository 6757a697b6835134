"""Entry point of ``python -m opacus_fsdp_sync.train`` and ``opacus-fsdp-sync-train``."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, trains, and leaves (``os._exit`` after a distributed run on CPU)."""
    import torch.distributed as dist

    from ..known_warnings import quiet_known_warnings
    from .config import parse_args
    from .loop import train

    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stdout, force=True)
    cfg = parse_args(argv)
    quiet_known_warnings()  # after parse_args: --help and flag errors stay short
    code = 0
    try:
        train(cfg)
    except Exception:
        logging.getLogger(__name__).exception("training failed")
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torch 2.13 CPU: normal teardown after FSDP use can abort


if __name__ == "__main__":
    main()
