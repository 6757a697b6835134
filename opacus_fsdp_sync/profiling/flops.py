"""FLOPs and matmul shapes per step phase, from PyTorch's own FLOP formulas.

:class:`PhaseFlopCounter` is a dispatch mode that prices every op PyTorch's FLOP counter knows
(``torch.utils.flop_counter.flop_registry``: matmuls, convolutions, attention) and files it under
:func:`~opacus_fsdp_sync.profiling.phases.current_phase`. It also keeps the output shape of every
matmul, so a test can prove that no weight-gradient matmul ran in a phase.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .phases import current_phase

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class PhaseFlopCounter(TorchDispatchMode):
    """Counts FLOPs per phase and records the output shapes of matmuls per phase."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.flops: dict[str, int] = defaultdict(int)
        self.matmul_shapes: dict[str, list[tuple[int, ...]]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in flop_registry:
            count = flop_registry[packet](*args, **kwargs, out_val=out)
            with self._lock:
                p = current_phase()
                self.flops[p] += int(count)
                if packet in _MATMULS:
                    self.matmul_shapes[p].append(tuple(out.shape))
        return out
