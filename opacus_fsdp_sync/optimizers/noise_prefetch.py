"""Drawing the next step's Gaussian noise while the backward runs.

The noise does not depend on the gradients, so it can be drawn before they exist: in a
background thread on CPU (the draw releases the GIL and fills the time the main thread spends
waiting for collectives), on a side stream on CUDA. The draws come from the optimizer's own
generator in the same order as a draw at step time, so a seed gives the same noise either way.
"""

from __future__ import annotations

import threading

import torch


class NoisePrefetch:
    """One pending draw: a flat buffer per ``(dtype, device)`` of ``N(0, std^2)`` samples.

    Args:
        sizes: ``{(dtype, device): numel}`` of the flat buffers, in the order they are drawn.
        std: The standard deviation drawn with.
        generator: The generator to draw from (used by nothing else until :meth:`take`).
    """

    def __init__(self, sizes: dict[tuple, int], std: float, generator: torch.Generator):
        self.std = std
        self._keys = list(sizes)
        cuda = [dev for (_, dev) in sizes if dev.type == "cuda"]

        def draw() -> list[torch.Tensor]:
            return [
                torch.empty(n, dtype=dtype, device=dev).normal_(0.0, std, generator=generator)
                for (dtype, dev), n in sizes.items()
            ]

        self._ahead = DrawAhead(draw, cuda[0] if cuda else torch.device("cpu"))

    def take(self, std: float) -> dict[tuple, torch.Tensor]:
        """Waits for the draw; returns the buffers, rescaled if ``std`` differs from the drawn one.

        Always call it before the generator is used again (it joins the drawing thread).

        Raises:
            BaseException: whatever the background draw raised.
        """
        buffers = self._ahead.result()
        if std != self.std:
            for buf in buffers:
                buf.mul_(std / self.std)
        return dict(zip(self._keys, buffers))


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
            stream = torch.cuda.Stream(device)
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
            if self._error is not None:
                raise self._error
        if self._event is not None:
            current = torch.cuda.current_stream(self._event.device)
            current.wait_event(self._event)
            for t in self._out:
                t.record_stream(current)
            self._event = None
        return self._out
