"""CPU time of a step beside its wall time: what ranks that share the cores compete for.

On a machine with as many ranks as cores (the CPU bench: 2 ranks on 2 cores), a step's wall time
is bounded by the CPU time every rank's threads need (the main thread, the backend's
communication threads, the noise drawing thread), not by the main thread's alone. Work that one
process hides on an idle core (a background noise draw) costs wall time there. The CPU time of
the whole process and of the calling thread, read around each step, shows how much of a
difference between two steps is work and how much is waiting (wall time above process CPU time).

``time.process_time`` counts every thread of the process, ``time.thread_time`` the calling one;
both are per process, so each rank reads its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuTimes:
    """Milliseconds one block of code took, by three clocks.

    Attributes:
        wall_ms: ``time.perf_counter``.
        process_ms: CPU time of every thread of the process (``time.process_time``).
        thread_ms: CPU time of the calling thread (``time.thread_time``).
    """

    wall_ms: float
    process_ms: float
    thread_ms: float

    def minus(self, ms: float) -> CpuTimes:
        """These times less ``ms`` on every clock (at least zero), e.g. a one-off busy span.

        Args:
            ms: Milliseconds of work inside the block that the calling thread did (so it counts
                on all three clocks), to leave out of the step's times.
        """
        return CpuTimes(
            *(max(0.0, v - ms) for v in (self.wall_ms, self.process_ms, self.thread_ms))
        )


class CpuStopwatch:
    """Reads the three clocks at :meth:`start` and :meth:`stop`.

    Example::

        watch = CpuStopwatch()
        watch.start()
        step()
        times = watch.stop()  # CpuTimes(wall_ms=..., process_ms=..., thread_ms=...)
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), time.thread_time()

    def start(self) -> None:
        """Starts a measurement (a running one is restarted)."""
        self._start = self._now()

    def stop(self) -> CpuTimes:
        """Ends the measurement started by :meth:`start` and returns it.

        Raises:
            RuntimeError: without a :meth:`start` before it.
        """
        if self._start is None:
            raise RuntimeError("CpuStopwatch.stop() called before start()")
        end, start = self._now(), self._start
        self._start = None
        wall, proc, thread = ((b - a) * 1e3 for a, b in zip(start, end))
        return CpuTimes(wall_ms=wall, process_ms=proc, thread_ms=thread)
