"""Drawing the step's Gaussian noise while the clipped gradients are computed and reduced.

The noise does not depend on the gradients, so it can be drawn before they exist: in a
background thread on CPU (the draw releases the GIL and fills the time the main thread spends
waiting for collectives), on a side stream on CUDA. The engine starts the draw after the first
pass (:meth:`~opacus_fsdp_sync.backward.SyncDPTensor.backward`), beside the weight gradients and
the reduce-scatters. The draws come from the optimizer's own
generator in the same order as a draw at step time, so a seed gives the same noise either way.

On Linux the drawing thread runs at idle priority (``SCHED_IDLE``): it takes a core only when no
other thread wants it, so it never preempts a rank's main thread. Where ranks share the cores
(two ranks on two CPU cores), a drawing thread at normal priority slows whichever rank it lands
beside, and every rank then waits for that one at the next collective; at idle priority the draw
fills the waits instead, and at worst runs while the main thread waits for it at the step. Where
the ranks keep every core busy (2 ranks on 2 cores: their collectives' copies need the cores
too), it still costs about its own time wherever it runs; drawn during the first pass it slowed
that pass by 10 ms, drawn after it the step is about 3 ms shorter
(``results/cpu-2cores-small-late-noise/``). Idle priority keeps the thread off its own rank's
main thread, not off another rank's threads: ranks bound to their own cores
(:mod:`opacus_fsdp_sync.distributed.cpu_affinity`, as the profiling suite binds them) keep each
draw in its own rank's waits (``results/cpu-2cores-small-bound-cores/``).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)


def lower_to_idle_priority() -> bool:
    """Moves the calling thread to the ``SCHED_IDLE`` scheduling class (Linux); True if moved.

    Elsewhere (no ``os.sched_setscheduler``, or refused) the thread keeps its priority and
    False is returned: the draw is the same, only where its time goes differs.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as err:
        logger.debug("noise prefetch thread keeps its priority (%s)", err)
        return False
    return True


def noise_layout(tensors: list[torch.Tensor]) -> tuple[tuple, ...]:
    """``((shape, dtype, device), ...)`` of ``tensors``: what :func:`draw_flat_noise` draws for."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def draw_flat_noise(layout: tuple[tuple, ...], std: float, generator) -> list[torch.Tensor]:
    """``N(0, std^2)`` noise for each tensor of ``layout``, as views of one flat draw per key.

    One buffer per ``(dtype, device)``, drawn in order of first appearance in ``layout`` (the
    same draws whether this runs during the backward or at step time); the returned views follow
    ``layout``'s order and shapes.
    """

    def draw(key: tuple, idx: list[int]) -> torch.Tensor:
        flat = torch.empty(sum(layout[i][0].numel() for i in idx), dtype=key[0], device=key[1])
        return flat.normal_(0.0, std, generator=generator)

    return flat_views(layout, draw)


def flat_views(layout: tuple[tuple, ...], make) -> list[torch.Tensor]:
    """Views shaped as ``layout``'s entries of one flat buffer per ``(dtype, device)``.

    Args:
        layout: :func:`noise_layout` of the tensors.
        make: ``make((dtype, device), indices)`` returns the flat buffer for the entries at
            ``indices`` (their elements, in order); called per key in order of first appearance.

    Returns:
        One view per entry, in ``layout``'s order.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (_, dtype, device) in enumerate(layout):
        groups.setdefault((dtype, device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(layout)
    for key, idx in groups.items():
        flat = make(key, idx)
        for i, part in zip(idx, flat.split([layout[i][0].numel() for i in idx])):
            out[i] = part.view(layout[i][0])
    return out


class NoisePrefetch:
    """One pending draw: ``draw(layout, std)`` (by default :func:`draw_flat_noise`).

    Args:
        layout: ``((shape, dtype, device), ...)`` of the gradients the noise is for.
        std: The standard deviation drawn with.
        draw: ``draw(layout, std) -> views``, drawing from generators nothing else uses until
            :meth:`take`.
    """

    def __init__(self, layout: tuple[tuple, ...], std: float, draw):
        self.std = std
        self.layout = layout
        cuda = [device for (_, _, device) in layout if device.type == "cuda"]
        #: The draw itself (:meth:`DrawAhead.result` waits for it).
        self.ahead = DrawAhead(
            lambda: draw(layout, std),
            cuda[0] if cuda else torch.device("cpu"),
        )

    def take(self, std: float) -> list[torch.Tensor]:
        """Waits for the draw; returns the views, rescaled if ``std`` differs from the drawn one.

        Always call it before the generator is used again (it joins the drawing thread).

        Raises:
            BaseException: whatever the background draw raised.
        """
        views = self.ahead.result()
        if std != self.std and views:
            torch._foreach_mul_(views, std / self.std)
        return views


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream this process draws noise on for ``device`` (made on first use).

    The same stream every step: the caching allocator keeps a freed block for the stream it was
    allocated on, so the next step's draw (the size of all local gradients, 4.9 GB in fp32 for
    Llama-3.2-1B on one GPU) reuses it. ``torch.cuda.Stream()`` hands out the next of a pool of
    streams at each call; a new one per step left each step's buffer cached for a stream no
    later draw used, until an allocation failed, the allocator freed every cached block and
    retried. On one H100 the campaign's profiled step spent 75 ms in 32 ``cudaFree`` and 26 ms in
    one ``cudaMalloc`` there, at the noise buffer's allocation
    (``memory_test/fsdp_llama3_profiling/results/gpu-h100-campaign/torch-path/``).

    Args:
        device: A CUDA device (without an index: the current one).

    Returns:
        The device's side stream.
    """
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class DrawAhead:
    """Runs ``draw()`` (a list of tensors from a generator nothing else uses meanwhile) now.

    On CPU in a background thread, on CUDA on a side stream; :meth:`result` waits for it.

    Args:
        draw: Returns the list of noise tensors, drawing in the same order as a draw at step
            time would (so a seed gives the same noise either way).
        device: Where the tensors are drawn.
    """

    def __init__(self, draw, device: torch.device):
        self._out: list[torch.Tensor] | None = None
        self._error: BaseException | None = None
        self._thread = None
        self._event = None
        if device.type == "cuda":
            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._out = draw()
            self._event = stream.record_event()
        else:
            self._thread = threading.Thread(
                target=self._run, args=(draw,), daemon=True, name="dp-noise-prefetch"
            )
            self._thread.start()

    def _run(self, draw) -> None:
        try:
            lower_to_idle_priority()  # this thread only: it ends with the draw
            self._out = draw()
        except BaseException as err:  # re-raised in result()
            self._error = err

    def result(self) -> list[torch.Tensor]:
        """Waits for the draw and returns its tensors (ready on the current CUDA stream).

        Raises:
            BaseException: whatever the background draw raised.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:  # at every call (a save may have waited for it first)
            raise self._error
        if self._event is not None:
            current = torch.cuda.current_stream(self._event.device)
            current.wait_event(self._event)
            for t in one_per_storage(self._out):  # views of one flat draw: one record each
                t.record_stream(current)
            self._event = None
        return self._out


def one_per_storage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct storage among ``tensors`` (first seen), e.g. for ``record_stream``.

    The caching allocator tracks streams per allocation, so recording a stream on one view
    covers every view of the same storage. Empty tensors (no allocation) are left out.
    """
    seen: set[tuple] = set()
    out = []
    for t in tensors:
        if t.untyped_storage().nbytes() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
