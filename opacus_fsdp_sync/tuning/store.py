"""Norm plans: their keys and choices, and the JSON file they are kept in between runs.

The file (``tune_norms_cache`` or ``OPACUS_FSDP_SYNC_NORM_PLAN``) holds one table per device
name and torch version (:func:`device_name`); rank 0 reads it at start and merges what it tunes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ..layers.linear import Candidate

logger = logging.getLogger("opacus_fsdp_sync")


@dataclass(frozen=True)
class NormKey:
    """What a norm plan depends on: the layer's shape, the inputs' length, dtype and device type.

    Attributes:
        d_in: Input features.
        d_out: Output features.
        seq: Sequence length ``T``.
        dtype: The output gradient's dtype (``"torch.bfloat16"``, ...).
        device: Device type (``"cpu"``, ``"cuda"``); the device name is the table's namespace.
        weight: Whether the weight is trainable.
        bias: Whether a trainable bias is there.
        readers: Trainable ``Linear`` layers reading the same input (they share its Gram).
    """

    d_in: int
    d_out: int
    seq: int
    dtype: str
    device: str
    weight: bool = True
    bias: bool = False
    readers: int = 1

    def __str__(self) -> str:
        dtype = self.dtype.replace("torch.", "")
        shared = f", input shared by {self.readers}" if self.readers > 1 else ""
        params = ("weight" if self.weight else "") + ("+bias" if self.bias else "")
        return (
            f"Linear {self.d_in}->{self.d_out} ({params or 'frozen'}) T={self.seq} {dtype} "
            f"{self.device}{shared}"
        )


@dataclass(frozen=True)
class Choice:
    """A key's plan: the fastest Gram block, and whether per-sample gradients beat it.

    ``block`` is also what a layer uses when the per-step byte budget declines its per-sample
    gradients.
    """

    block: int
    per_sample: bool = False

    def __str__(self) -> str:
        return str(Candidate(per_sample=True)) if self.per_sample else str(Candidate(self.block))


def device_name(device: torch.device) -> str:
    """The name a stored table is filed under (with the torch version, see :class:`NormTuner`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu {platform.machine()} ({torch.get_num_threads()} threads)"
    return device.type


def dump_key(key: NormKey) -> str:
    """A key as the file stores it."""
    return json.dumps(dataclasses.asdict(key), sort_keys=True)


def load_key(text: str) -> NormKey:
    """A key from the file."""
    return NormKey(**json.loads(text))


def load_table(path: str, name: str) -> dict[NormKey, Choice]:
    """The table stored under ``name`` in ``path`` (empty, with a warning, if unreadable)."""
    try:
        stored = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        logger.warning("[Ghost] norm plan: cannot read %s (%s); tuning from scratch", path, err)
        return {}
    return {load_key(k): Choice(**c) for k, c in stored.get(name, {}).items()}


def store_table(path: str, name: str, table: dict[NormKey, Choice]) -> None:
    """Merges ``table`` into the file under ``name`` (written to a temporary file, then moved)."""
    p = Path(path)
    try:
        stored = json.loads(p.read_text()) if p.exists() else {}
    except ValueError:
        stored = {}
    stored[name] = {dump_key(k): dataclasses.asdict(c) for k, c in table.items()}
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
    os.replace(tmp, p)
