"""A bench's command line end: run, print the table and write the files on rank 0, end the group.

The op ledger (:mod:`.ledger`), the host-time bench (:mod:`.host_overhead`) and the Poisson
memory bench (:mod:`.poisson_memory`) each write ``DIR/{name}.json`` (the result) and
``DIR/{name}.md`` (its table); the JSON names the code that measured it (``code``,
:func:`.provenance.code_version`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .provenance import code_version


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def save(out: str | None, name: str, result: dict, table: str) -> None:
    """Writes ``{out}/{name}.json`` and ``{out}/{name}.md`` (nothing when ``out`` is None).

    The JSON is ``result`` with ``code`` (:func:`.provenance.code_version`) added unless it has
    one.
    """
    if out is None:
        return
    if "code" not in result:
        result = {**result, "code": code_version()}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=2))
    (folder / f"{name}.md").write_text(table)


def run_and_save(
    run: Callable[[], dict], markdown: Callable[[dict], str], out: str | None, name: str
) -> int:
    """``run()``; on rank 0 prints its table and :func:`save`s both; ends the process group.

    Returns:
        0, the command's exit status (an error in ``run`` propagates after the group ends).
    """
    import torch.distributed as dist

    try:
        result = run()
        table = markdown(result)
        if _rank0():
            print(table, flush=True)
            save(out, name, result, table)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
