"""Per-phase step timers: CUDA events on CUDA, ``time.perf_counter`` on CPU.

On CUDA the events are only recorded inside the step; they are read (which waits for them) when
the timings are asked for, so timing adds no synchronisation inside a step. Beside them each
phase also reads the host's clock (``perf_counter``, no synchronisation): the host's time in
the phase, :attr:`StepTimer.last_host_step`. A phase whose host time is far shorter than its
device time ran while the GPU was busy. One whose host time reaches its device time was either
bound by the host issuing its work (the GPU waited for launches) or waited for the device inside
(a synchronising call: ``.item()``, an allocator retry); the two readings need a trace to tell
apart. On CPU the two are one clock and the same numbers. Inside
:func:`profiler_ranges` (a profiled step) each timed phase is also a
``torch.profiler.record_function`` range named ``phase::<name>`` (:data:`RANGE_PREFIX`) in the
profiler's trace, by which :mod:`opacus_fsdp_sync.bench.trace_phases` attributes each op and each
kernel launch to its phase. Outside, no range is opened: one costs
about 5 us on a CPU, and the ``norms`` phase opens once per layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .phases import phase

logger = logging.getLogger("opacus_fsdp_sync")

#: Environment variable that switches step timing on when set to ``1``.
TIMING_ENV = "OPACUS_FSDP_SYNC_TIMING"

#: Prefix of the profiler range of each timed phase (``phase::forward``, ``phase::norms``, ...).
RANGE_PREFIX = "phase::"

_ranges_on = False


@contextlib.contextmanager
def profiler_ranges() -> Iterator[None]:
    """Within the block, every timed phase is also a profiler range (``phase::<name>``).

    Yields:
        Nothing; the ranges close with the block (nested blocks keep them on).
    """
    global _ranges_on
    previous, _ranges_on = _ranges_on, True
    try:
        yield
    finally:
        _ranges_on = previous


def timing_enabled_from_env() -> bool:
    """Returns True when ``OPACUS_FSDP_SYNC_TIMING`` is set to ``1``, ``true`` or ``yes``."""
    return os.environ.get(TIMING_ENV, "").strip().lower() in {"1", "true", "yes"}


@dataclass
class _Pending:
    name: str
    start: object
    end: object = None
    #: For an excluded phase: the phases open around it, from which its time is deducted.
    within: tuple[str, ...] = ()
    #: The host's clock (``perf_counter``) when the phase was entered and left.
    host_start: float = 0.0
    host_end: float = 0.0


@dataclass
class StepTimer:
    """Times named phases of one step and logs them as ``[Ghost] name: X.XXX ms``.

    Attributes:
        enabled: When False every method is a no-op (no events, no clock reads).
        device: Device whose clock is used: CUDA events on a CUDA device, else wall clock.
        log: Whether resolved timings are logged through ``logging.getLogger("opacus_fsdp_sync")``.
    """

    enabled: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: bool = True
    _pending: list[_Pending] = field(default_factory=list, repr=False)
    _last: dict[str, float] = field(default_factory=dict, repr=False)
    _last_host: dict[str, float] = field(default_factory=dict, repr=False)
    _open: list[str] = field(default_factory=list, repr=False)

    @property
    def clock(self) -> str:
        """``"cuda_event"`` or ``"perf_counter"``: the clock the timings come from."""
        return "cuda_event" if self.device.type == "cuda" else "perf_counter"

    def phase(self, name: str, *, excluded: bool = False) -> contextlib.AbstractContextManager:
        """Times the ``with`` block as phase ``name`` of the current step.

        Args:
            name: The phase.
            excluded: Report the phase on its own and deduct its time from every phase of this
                timer open around it (one-off work such as tuning, kept out of the step's
                timings).

        Returns:
            A context manager (a :class:`_Span`; a plain object, not a generator, because the
            ``norms`` phase opens once per layer and step).
        """
        if not self.enabled:
            return contextlib.nullcontext()
        return _Span(self, name, excluded)

    def end_step(self) -> None:
        """Closes the step: on CPU resolves and logs at once; on CUDA defers to :meth:`flush`."""
        if self.enabled and self.clock == "perf_counter":
            self.flush()

    def flush(self) -> dict[str, float]:
        """Resolves the recorded phases (waiting for CUDA events), logs them and returns them.

        Returns:
            Milliseconds per phase of the last completed step (empty when nothing was timed).
        """
        if not self._pending:
            return dict(self._last)
        device: list[tuple[_Pending, float]] = []
        for item in self._pending:
            if self.clock == "cuda_event":
                item.end.synchronize()
                device.append((item, item.start.elapsed_time(item.end)))
            else:
                device.append((item, (item.end - item.start) * 1e3))
        resolved = _resolve(device)
        self._last_host = _resolve(
            [(item, (item.host_end - item.host_start) * 1e3) for item in self._pending]
        )
        self._pending.clear()
        if self.log:
            for name, ms in resolved.items():
                logger.info("[Ghost] %s: %.3f ms", name, ms)
        self._last = resolved
        return dict(resolved)

    @property
    def last_step(self) -> dict[str, float]:
        """Milliseconds per phase of the last step (resolves pending CUDA events first)."""
        return self.flush()

    @property
    def last_host_step(self) -> dict[str, float]:
        """The host's milliseconds in each phase of the last step (see the module docstring)."""
        self.flush()
        return dict(self._last_host)


def _resolve(spans: list[tuple[_Pending, float]]) -> dict[str, float]:
    """Milliseconds per phase name, summed over its spans, excluded phases deducted around them."""
    resolved: dict[str, float] = {}
    deduct: dict[str, float] = {}
    for item, ms in spans:
        resolved[item.name] = resolved.get(item.name, 0.0) + ms
        for outer in item.within:
            deduct[outer] = deduct.get(outer, 0.0) + ms
    for outer, ms in deduct.items():
        if outer in resolved:
            resolved[outer] = max(0.0, resolved[outer] - ms)
    return resolved


class _Span:
    """One timed phase of a :class:`StepTimer` (what :meth:`StepTimer.phase` returns).

    Entered, it opens the phase's profiler range where :func:`profiler_ranges` asks for them,
    then reads the clock (records a CUDA event); left, it reads the clock and closes the range.
    """

    __slots__ = ("_timer", "_name", "_excluded", "_range", "_pending")

    def __init__(self, timer: StepTimer, name: str, excluded: bool) -> None:
        self._timer = timer
        self._name = name
        self._excluded = excluded
        self._range = None
        self._pending: _Pending | None = None

    def __enter__(self) -> None:
        if self._pending is not None:
            raise RuntimeError(f"the timer's phase {self._name!r} is already open")
        timer = self._timer
        if _ranges_on:
            self._range = torch.profiler.record_function(RANGE_PREFIX + self._name)
            self._range.__enter__()
        try:
            if timer.clock == "cuda_event":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                host = time.perf_counter()
            else:
                start = host = time.perf_counter()
        except BaseException:
            self._close_range(None, None, None)
            raise
        within = tuple(timer._open) if self._excluded else ()
        timer._open.append(self._name)
        self._pending = _Pending(self._name, start, within=within, host_start=host)

    def __exit__(self, *exc) -> bool:
        timer, pending = self._timer, self._pending
        self._pending = None
        timer._open.pop()
        try:
            if timer.clock == "cuda_event":
                pending.host_end = time.perf_counter()
                pending.end = torch.cuda.Event(enable_timing=True)
                pending.end.record()
            else:
                pending.end = pending.host_end = time.perf_counter()
            timer._pending.append(pending)
        finally:
            self._close_range(*exc)
        return False

    def _close_range(self, *exc) -> None:
        """Closes the profiler range this span opened, if any (once)."""
        opened, self._range = self._range, None
        if opened is not None:
            opened.__exit__(*exc)


def step_phase(name: str, timer: StepTimer | None = None) -> contextlib.AbstractContextManager:
    """Announces phase ``name`` (:func:`.phases.phase`) and times it with ``timer`` (if given).

    The engine's phases and the hooks' per-layer ``norms`` phase take it: a plain context manager
    (no generator), entering the announcement first and leaving it last.

    Args:
        name: The phase.
        timer: The step's timer, or None to announce only.

    Returns:
        The context manager.
    """
    return _StepPhase(name, timer)


class _StepPhase:
    """What :func:`step_phase` returns (one object per use)."""

    __slots__ = ("_announced", "_timed")

    def __init__(self, name: str, timer: StepTimer | None) -> None:
        self._announced = phase(name)
        self._timed = None if timer is None else timer.phase(name)

    def __enter__(self) -> None:
        self._announced.__enter__()
        if self._timed is not None:
            try:
                self._timed.__enter__()
            except BaseException:
                self._announced.__exit__(None, None, None)
                raise

    def __exit__(self, *exc) -> bool:
        try:
            if self._timed is not None:
                self._timed.__exit__(*exc)
        finally:
            self._announced.__exit__(*exc)
        return False
