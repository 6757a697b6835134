"""Time per step phase and op class, read from a ``torch.profiler`` Chrome trace.

The profiling suite's ``--op-profile`` step runs inside
:func:`~opacus_fsdp_sync.profiling.timers.profiler_ranges`, so each timed phase is a range named
``phase::<name>`` in its trace. On CUDA this module sums the device's work (kernels, copies and
fills) by the phase that launched it: the CPU range holding the launch (the runtime call with the
same ``correlation`` id), whichever thread opened the range; the backward's kernels are launched
from autograd's threads, outside the main thread's GPU annotations, which hold only its own
launches. A CPU trace has no device events: there it sums the CPU ops' self time (each op's time
less the ops it called) inside the CPU ranges.

Each event goes to the innermost range holding it (``norms`` inside ``first_backward``), so the
table's ``own`` column adds up without double counting and ``all`` is the phase with its inner
phases, as the step timer reports it.

Classes follow the op ledger's (:data:`.op_ledger.CLASSES`), read from kernel names: ``matmul``
(cuBLAS/CUTLASS GEMMs, ``aten::mm`` and the like, the fused Triton kernels), ``copy`` (copies,
casts, memcpy and memset), ``reduction``, ``collective`` (NCCL, gloo) and ``elementwise`` (the
rest).

Run: ``python -m opacus_fsdp_sync.bench.trace_phases TRACE.json[.gz] [--out FILE.md]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..profiling.timers import RANGE_PREFIX
from .op_ledger import CLASSES

#: Trace categories of work on the device.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Trace categories of the host calls that launch it (matched by ``args.correlation``).
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})

_COLLECTIVE = ("nccl", "c10d::", "gloo", "all_reduce", "allreduce", "reduce_scatter", "all_gather")
_MATMUL = (
    "gemm", "gemv", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "aten::mm", "aten::bmm",
    "aten::addmm", "aten::baddbmm", "aten::addbmm", "_ghost_norm_kernel", "_per_sample_norm",
    "_clipped_grad", "flash", "attention",
)  # fmt: skip
_COPY = ("copy", "memcpy", "memset", "fill", "aten::cat", "catarray", "aten::clone")
_REDUCTION = ("reduce", "aten::sum", "aten::norm", "aten::mean", "aten::amax", "vecdot")


def op_class(name: str, category: str = "kernel") -> str:
    """The op ledger's class of one trace event, from its name (and category).

    Args:
        name: A kernel's or an op's name.
        category: The event's trace category (``gpu_memcpy`` and ``gpu_memset`` are copies).
    """
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    low = name.lower()
    for cls, marks in (
        ("collective", _COLLECTIVE),
        ("matmul", _MATMUL),
        ("copy", _COPY),
        ("reduction", _REDUCTION),
    ):
        if any(mark in low for mark in marks):
            return cls
    return "elementwise"


@dataclass
class PhaseTime:
    """One phase's time in microseconds: its own (innermost) by class, and its inner phases'."""

    by_class: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_name: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    inner: float = 0.0

    @property
    def own(self) -> float:
        """Time of the events whose innermost range is this phase."""
        return sum(self.by_class.values())


@dataclass(frozen=True)
class _Span:
    name: str
    start: float
    end: float


def load(path: str | Path) -> list[dict]:
    """The events of a Chrome trace.

    Args:
        path: A ``torch.profiler`` trace, ``.json`` or gzipped ``.json.gz``.

    Returns:
        Its ``traceEvents``.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def _spans(events: list[dict], category: str) -> list[_Span]:
    return [
        _Span(e["name"][len(RANGE_PREFIX) :], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == category
        and str(e.get("name", "")).startswith(RANGE_PREFIX)
    ]


def _self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """CPU ops with their self time: duration less that of the ops nested in them (per thread)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [event, end, children's time]
        for e in thread_ops:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            while stack and stack[-1][1] <= start:
                done = stack.pop()
                out.append((done[0], float(done[0]["dur"]) - done[2]))
            if stack:
                stack[-1][2] += float(e["dur"])
            stack.append([e, end, 0.0])
        out.extend((done[0], float(done[0]["dur"]) - done[2]) for done in stack)
    return out


def phase_times(events: list[dict]) -> tuple[dict[str, PhaseTime], str]:
    """Time by phase (innermost range) and class, and whether it is device or CPU time.

    CPU time adds up the threads that ran at once (a noise-drawing thread's ops land in the
    phase the main thread was in), so on CPU it is op time, not wall time.

    Args:
        events: A trace's events (:func:`load`).

    Returns:
        ``({phase: PhaseTime}, "device" | "cpu")``; events outside every range go to
        ``"(outside)"``.

    Raises:
        ValueError: The trace has no ``phase::`` range (not a profiled step of the suite).
    """
    spans = _spans(events, "user_annotation")
    work = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    if work:  # (event, when it was launched, its device time)
        kind = "device"
        launched = {
            e["args"]["correlation"]: float(e["ts"])
            for e in events
            if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
        }
        timed = [
            (e, launched.get(e.get("args", {}).get("correlation"), -1.0), float(e["dur"]))
            for e in work
        ]
    else:
        kind = "cpu"
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        timed = [(e, float(e["ts"]), dur) for e, dur in _self_times(ops)]
    if not spans:
        raise ValueError(
            f"no '{RANGE_PREFIX}<name>' range in the trace: profile a step inside "
            "opacus_fsdp_sync.profiling.profiler_ranges() (the suite's --op-profile does)"
        )
    times: dict[str, PhaseTime] = defaultdict(PhaseTime)
    for e, start, dur in timed:
        holding = [s for s in spans if s.start <= start < s.end]
        inner = min(holding, key=lambda s: s.end - s.start) if holding else None
        name = inner.name if inner else "(outside)"
        cls = op_class(str(e.get("name", "")), str(e.get("cat", "")))
        times[name].by_class[cls] += dur
        times[name].by_name[str(e.get("name", ""))] += dur
        for outer in holding:
            if outer is not inner and outer.name != name:
                times[outer.name].inner += dur
    return dict(times), kind


def report(times: dict[str, PhaseTime], kind: str, title: str, top: int = 6) -> str:
    """A Markdown table of ``times`` (milliseconds) and each phase's largest ops.

    Args:
        times: :func:`phase_times`'s first result.
        kind: Its second (``"device"`` or ``"cpu"``).
        title: The table's heading.
        top: How many of each phase's largest ops to list.

    Returns:
        The Markdown text.
    """
    cols = " | ".join(CLASSES)
    lines = [
        f"# {title}",
        "",
        f"{kind} time (ms) per phase; `own`: the phase less its inner phases, by class; "
        "`all`: with them."
        + (" CPU time sums concurrent threads: op time, not wall time." if kind == "cpu" else ""),
        "",
        f"| phase | all | own | {cols} |",
        "| --- | " + " | ".join(["---:"] * (2 + len(CLASSES))) + " |",
    ]
    order = sorted(times, key=lambda n: -(times[n].own + times[n].inner))
    for name in order:
        t = times[name]
        by = " | ".join(f"{t.by_class.get(c, 0.0) / 1e3:.1f}" for c in CLASSES)
        lines.append(f"| {name} | {(t.own + t.inner) / 1e3:.1f} | {t.own / 1e3:.1f} | {by} |")
    total = sum(t.own for t in times.values())
    lines += ["", f"Total: {total / 1e3:.1f} ms.", ""]
    for name in order:
        ranked = sorted(times[name].by_name.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"- **{name}**: " + "; ".join(f"{n[:70]} {v / 1e3:.2f}" for n, v in ranked))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Prints (or writes) the phase table of each trace given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz)")
    parser.add_argument("--out", help="write the Markdown here instead of printing it")
    parser.add_argument("--top", type=int, default=6, help="largest ops listed per phase")
    args = parser.parse_args(argv)
    parts = []
    for path in args.traces:
        times, kind = phase_times(load(path))
        parts.append(report(times, kind, Path(path).name, args.top))
    text = "\n".join(parts)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
