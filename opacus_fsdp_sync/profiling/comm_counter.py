"""Counts collectives and their bytes per kind and per step phase.

Built on :class:`torch.utils._python_dispatch.TorchDispatchMode`: every ``c10d`` op (what FSDP2,
FSDP1 and DDP issue on gloo and NCCL) and every functional collective of ``_c10d_functional`` is
seen at dispatch, without patching any function. Phases come from
:func:`opacus_fsdp_sync.profiling.phases.current_phase`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .phases import current_phase

# Op name (without namespace and overload) -> collective kind.
_KINDS = {
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def collective_kind(func) -> str | None:
    """The collective kind of an op overload (``all_gather``, ...), or None for other ops."""
    if getattr(func, "namespace", "") not in _NAMESPACES:
        return None
    return _KINDS.get(func._schema.name.split("::")[-1])


@dataclass
class CollectiveStats:
    """Number of calls and bytes moved (the largest tensor argument of each call)."""

    count: int = 0
    bytes: int = 0


def _tensor_bytes(obj: object) -> int:
    """Bytes of the largest tensor in ``obj`` (a tensor or a nested list of tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return max((_tensor_bytes(o) for o in obj), default=0)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """A dispatch mode that counts collectives per phase and kind.

    Use it as a context manager around the code to observe::

        with CollectiveCounter() as counter, phase("forward"):
            loss = model(x)
        print(counter.table())

    Bytes are the size of the largest tensor argument of a call: the gathered output for an
    all-gather, the unreduced input for a reduce-scatter, the buffer for an all-reduce.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.stats: dict[str, dict[str, CollectiveStats]] = defaultdict(
            lambda: defaultdict(CollectiveStats)
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        kind = collective_kind(func)
        if kind is not None:
            nbytes = max(_tensor_bytes(args), _tensor_bytes(list(kwargs.values())))
            with self._lock:
                entry = self.stats[current_phase()][kind]
                entry.count += 1
                entry.bytes += nbytes
        return func(*args, **kwargs)

    def reset(self) -> None:
        """Forgets everything counted so far."""
        with self._lock:
            self.stats.clear()

    def count(self, kind: str, phase: str | None = None) -> int:
        """Number of collectives of ``kind``, in ``phase`` or in all phases when None."""
        phases = [phase] if phase is not None else list(self.stats)
        return sum(self.stats[p][kind].count for p in phases if p in self.stats)

    def bytes(self, kind: str, phase: str | None = None) -> int:
        """Bytes moved by collectives of ``kind``, in ``phase`` or in all phases when None."""
        phases = [phase] if phase is not None else list(self.stats)
        return sum(self.stats[p][kind].bytes for p in phases if p in self.stats)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"count": n, "bytes": b}}}``, JSON-ready."""
        return {
            p: {k: {"count": s.count, "bytes": s.bytes} for k, s in kinds.items()}
            for p, kinds in self.stats.items()
        }

    def table(self) -> str:
        """A small Markdown table of counts and MiB per phase and kind."""
        lines = ["| phase | kind | count | MiB |", "| --- | --- | ---: | ---: |"]
        for p, kinds in self.stats.items():
            for k, s in sorted(kinds.items()):
                lines.append(f"| {p} | {k} | {s.count} | {s.bytes / 2**20:.3f} |")
        return "\n".join(lines)
