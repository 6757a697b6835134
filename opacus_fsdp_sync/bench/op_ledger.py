"""A dispatch-mode count of one step's ops: traffic, FLOPs and live tensor bytes per phase.

:class:`OpLedger` sees every aten op, custom op and collective a step dispatches (forward,
autograd's backward on the calling thread, the engine's own work) and files it under
:func:`~opacus_fsdp_sync.profiling.phases.current_phase`, by op class (:func:`op_class`):

- ``ops``: calls; views and ops that only allocate or touch metadata (:data:`NO_TRAFFIC`) are
  not counted;
- ``bytes_read`` / ``bytes_written``: the memory span of each tensor argument and result (a
  broadcast view counts the memory it covers, not its logical size); a result written in place
  counts as written, and as read too unless the op overwrites it (:data:`OVERWRITES`); an
  in-place op that returns nothing (``_foreach_add_``) counts its written arguments as written;
  a selecting op (:data:`SELECTS`: gathers, embeddings; and ``nll_loss_forward``) reads its
  indices and only the elements it selects, not its whole source;
- ``flops``: ``torch.utils.flop_counter``'s formula of the op (matmuls, their ``out_dtype``
  overloads, attention, and any custom op registered with ``register_flop_formula``); a custom
  op without one is listed in :attr:`OpLedger.unpriced`.

Live bytes: every storage a counted op allocates is followed until its last tensor dies (a
``weakref.finalize`` per tensor; autograd's saved tensors keep theirs alive). The ledger
records their peak within each phase and what is live when a phase ends (what it hands to the
next), counting only tensors made inside the ledger (not parameters or inputs made before it).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..hooks.first_pass import tensors_in
from ..profiling.comm_counter import collective_kind
from ..profiling.phases import current_phase

#: Op classes, in table order.
CLASSES = ("matmul", "copy", "elementwise", "reduction", "collective")

_A = torch.ops.aten
MATMULS = frozenset({_A.mm, _A.addmm, _A.bmm, _A.baddbmm, _A.addbmm, _A.dot, _A.vdot, _A.mv})
#: Ops that move data without arithmetic: copies, casts, concatenations, gathers.
COPIES = frozenset(
    {
        _A.copy_, _A._to_copy, _A.clone, _A.cat, _A.stack, _A._copy_from,
        _A._copy_from_and_resize, _A.index_select, _A.gather, _A.embedding, _A.index,
        _A.index_put_, _A.index_put, _A.scatter, _A.scatter_, _A.constant_pad_nd,
        _A.slice_scatter, _A.select_scatter, _A.slice_backward, _A.select_backward,
    }
)  # fmt: skip
REDUCTIONS = frozenset(
    {
        _A.sum, _A.mean, _A.linalg_vector_norm, _A.norm, _A.amax, _A.amin, _A.max, _A.min,
        _A.argmax, _A.prod, _A.var, _A.std, _A.var_mean, _A._softmax, _A._log_softmax,
        _A._softmax_backward_data, _A._log_softmax_backward_data, _A.nll_loss_forward,
        _A.nll_loss_backward, _A.nll_loss2d_forward, _A.embedding_dense_backward,
        _A.index_add_, _A.index_add, _A.scatter_add_, _A.scatter_add, _A.cumsum, _A.logsumexp,
        _A.all, _A.any, _A.linalg_vecdot,
    }
)  # fmt: skip
#: Ops that move no data: they allocate, or only rewrite metadata.
NO_TRAFFIC = frozenset(
    {
        _A.empty, _A.empty_like, _A.empty_strided, _A.new_empty, _A.new_empty_strided,
        _A.detach, _A._unsafe_view, _A.alias, _A.lift_fresh, _A.set_, _A.resize_,
        _A._local_scalar_dense, _A.is_same_size, _A.record_stream, _A.promote_types,
    }
)  # fmt: skip
#: Ops that read only the elements they select from their first argument (plus the indices):
#: gathers, and the loss that picks one log-probability per target.
SELECTS = frozenset({_A.gather, _A.index_select, _A.embedding, _A.index, _A.take})
#: In-place ops whose written argument is not read.
OVERWRITES = frozenset({_A.copy_, _A.fill_, _A.zero_, _A.index_put_, _A.scatter_})

#: Torch's own op namespaces: their ops without a formula are not reported as unpriced.
TORCH_NAMESPACES = frozenset(
    {"aten", "prims", "profiler", "c10d", "_c10d_functional", "c10d_functional", "fsdp", "_dtensor"}
)
#: Torch's custom ops (FSDP2's copy-in and copy-out) that only move data.
TORCH_COPY_OPS = frozenset({"chunk_cat", "all_gather_copy_in", "split_with_sizes_copy"})


def op_class(func) -> str:
    """``matmul``, ``copy``, ``elementwise``, ``reduction`` or ``collective`` of an op overload.

    Priced ops that are not plain matmuls (attention, convolutions, custom ops with a FLOP
    formula) count as matmuls.
    """
    packet = func.overloadpacket
    if collective_kind(func) is not None:
        return "collective"
    if packet in MATMULS or packet in flop_registry:
        return "matmul"
    if packet in COPIES or packet.__name__ in TORCH_COPY_OPS:
        return "copy"
    if packet in REDUCTIONS:
        return "reduction"
    return "elementwise"


def span_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a tensor covers (a broadcast view: once, not per logical element)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of a plain tensor's storage; None for subclasses or no storage."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
    except (RuntimeError, NotImplementedError):  # no storage, or one FSDP has freed
        return None


@dataclass
class Tally:
    """Ops, bytes and FLOPs of one op class (or one op name) in one phase."""

    ops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0

    def add(self, other: Tally) -> None:
        """Adds ``other`` into this tally."""
        self.ops += other.ops
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.flops += other.flops

    @property
    def bytes(self) -> int:
        """Bytes read and written."""
        return self.bytes_read + self.bytes_written


@dataclass
class PhaseMemory:
    """Live tensor bytes (made inside the ledger) in one phase."""

    peak: int = 0
    at_end: int = 0


@dataclass
class _Live:
    bytes: dict[int, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)
    total: int = 0


class OpLedger(TorchDispatchMode):
    """Counts a step's ops per phase and class, and follows its live tensor bytes (module)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_class: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
        self.by_op: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
        self.memory: dict[str, PhaseMemory] = defaultdict(PhaseMemory)
        self.phases: list[str] = []
        self.unpriced: set[str] = set()
        self._live = _Live()

    @property
    def live_bytes(self) -> int:
        """Bytes of the storages made inside the ledger that are alive now."""
        return self._live.total

    @property
    def peak_bytes(self) -> int:
        """The largest live bytes over every phase so far (0 before any op)."""
        return max((m.peak for m in self.memory.values()), default=0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        p = current_phase()
        if not self.phases or self.phases[-1] != p:
            if self.phases:
                self.memory[self.phases[-1]].at_end = self._live.total
            self.phases.append(p)
        packet = func.overloadpacket
        if func.is_view or packet in NO_TRAFFIC or func.namespace == "profiler":
            self._follow(func, args, kwargs, out, fresh=False)
            return out
        tally = self._tally(func, args, kwargs, out)
        cls = op_class(func)
        self.by_class[p][cls].add(tally)
        self.by_op[p][str(packet).split(".")[-1]].add(tally)
        self._follow(func, args, kwargs, out, fresh=True)
        mem = self.memory[p]
        mem.peak = max(mem.peak, self._live.total)
        return out

    def _tally(self, func, args, kwargs, out) -> Tally:
        schema = func._schema
        written_args = {
            a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        }
        overwrite = func.overloadpacket in OVERWRITES
        read = 0
        for a, value in zip(schema.arguments, args):
            if a.name in written_args and (overwrite or a.kwarg_only):
                continue
            read += sum(span_bytes(t) for t in tensors_in(value))
        for name, value in kwargs.items():
            if name not in written_args:
                read += sum(span_bytes(t) for t in tensors_in(value))
        written = sum(span_bytes(t) for t in tensors_in(out))
        if not tensors_in(out) and written_args:  # in place, returning nothing (foreach ops)
            written = sum(
                span_bytes(t)
                for a, value in zip(schema.arguments, args)
                if a.name in written_args
                for t in tensors_in(value)
            )
        packet = func.overloadpacket
        if packet in SELECTS or packet is _A.nll_loss_forward:
            read = self._selected_bytes(func, args, kwargs, out)
        flops = 0
        if packet in flop_registry:
            # the out_dtype overloads (bmm.dtype, ...) pass a dtype positionally where torch's
            # formulas expect the output shape: the formula gets the tensors only
            shaped = tuple(a for a in args if not isinstance(a, torch.dtype))
            flops = int(flop_registry[packet](*shaped, **kwargs, out_val=out))
        elif func.namespace not in TORCH_NAMESPACES:
            self.unpriced.add(str(packet))
        if collective_kind(func) is not None:
            read = max((span_bytes(t) for t in tensors_in((args, kwargs))), default=0)
            written = 0
        return Tally(ops=1, bytes_read=read, bytes_written=written, flops=flops)

    @staticmethod
    def _selected_bytes(func, args, kwargs, out) -> int:
        """Bytes a selecting op reads: the indices, the selected elements and any weights.

        The source (the first tensor argument of a gather, the table of an embedding) is read
        only where selected: as many elements as the result holds, or for ``nll_loss_forward``
        one per target.
        """
        source, *rest = tensors_in((args, kwargs))
        if func.overloadpacket is _A.nll_loss_forward:
            target = rest[0]
            selected = target.numel() * source.element_size()
        else:
            selected = sum(t.numel() for t in tensors_in(out)) * source.element_size()
        return selected + sum(span_bytes(t) for t in rest)

    def _follow(self, func, args, kwargs, out, *, fresh: bool) -> None:
        """Starts following each result's storage (fresh ones only; views keep theirs alive)."""
        live = self._live
        known_inputs = None
        for t in tensors_in(out):
            key = _storage(t)
            if key is None:
                continue
            ptr, nbytes = key
            if ptr not in live.bytes:
                if not fresh:
                    continue
                if known_inputs is None:
                    known_inputs = {k[0] for k in map(_storage, tensors_in((args, kwargs))) if k}
                if ptr in known_inputs:  # written into an argument made outside the ledger
                    continue
                live.bytes[ptr] = nbytes
                live.refs[ptr] = 0
                live.total += nbytes
            live.refs[ptr] += 1
            weakref.finalize(t, _release, live, ptr)

    def finish(self) -> None:
        """Records what is live at the end of the last phase."""
        if self.phases:
            self.memory[self.phases[-1]].at_end = self._live.total

    def totals(self) -> dict[str, Tally]:
        """Every phase's tallies summed, by class."""
        out: dict[str, Tally] = defaultdict(Tally)
        for classes in self.by_class.values():
            for cls, t in classes.items():
                out[cls].add(t)
        return out

    def op_totals(self) -> dict[str, Tally]:
        """Every phase's tallies summed, by op name."""
        out: dict[str, Tally] = defaultdict(Tally)
        for ops in self.by_op.values():
            for name, t in ops.items():
                out[name].add(t)
        return out


def _release(live: _Live, ptr: int) -> None:
    refs = live.refs.get(ptr)
    if refs is None:
        return
    if refs > 1:
        live.refs[ptr] = refs - 1
        return
    live.total -= live.bytes.pop(ptr)
    del live.refs[ptr]
