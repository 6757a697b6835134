"""A CPU ``torch.Generator`` whose whole Mersenne Twister state comes from a seed's every bit.

``torch.Generator().manual_seed(s)`` keeps only ``s``'s low 32 bits (``at::mt19937`` seeds
through ``init_with_uint32``): a CPU noise stream seeded that way is one of 2**32, and a search
over them is feasible. Here the 624 words of the state are expanded from the whole seed by
numpy's ``SeedSequence`` and written with ``set_state``.

The byte layout of a CPU generator's state is torch's (``CPUGeneratorImplState``: a legacy pod
of a 64-bit seed, ``left``, ``seeded``, ``next`` and 624 64-bit words holding the 32-bit state,
then the normal-sample caches). It is not public, so :func:`check_layout` proves it once per
process: a generator given a known state must draw what numpy's ``MT19937`` draws from that
state; anything else raises :class:`~.distributed.version_gate.TorchInternalsError` naming the
torch version. CUDA generators (Philox) keep a seed's 64 bits and are seeded as torch does.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .distributed.version_gate import TorchInternalsError, tested_versions_text

_FEATURE = "CPU DP generators seeded with every bit of their seed"
#: Words of the Mersenne Twister state.
STATE_WORDS = 624
#: Byte offsets in ``CPUGeneratorImplState`` (torch 2.x): the seed, ``left``, ``seeded``,
#: ``next``, then the state words (each in a uint64 slot).
_SEED, _LEFT, _SEEDED, _NEXT, _WORDS = 0, 8, 12, 16, 24
#: The size of ``CPUGeneratorImplState`` (the legacy pod and the float normal cache).
STATE_BYTES = 5056


def expand_seed(seed: int) -> np.ndarray:
    """The 624 state words (uint32) of ``seed``: every bit of it counts, none of them are all 0."""
    return np.random.SeedSequence(seed).generate_state(STATE_WORDS, np.uint32)


def _with_words(seed: int, words: np.ndarray) -> torch.Generator:
    gen = torch.Generator()
    state = gen.get_state().clone()
    if state.numel() != STATE_BYTES:
        raise TorchInternalsError(
            f"a CPU torch.Generator's state is {state.numel()} bytes under torch "
            f"{torch.__version__}, not the {STATE_BYTES} this package writes (tested: torch "
            f"{tested_versions_text()}). Use a tested torch release, or secure_mode=True.",
            feature=_FEATURE,
        )
    raw = state.numpy()  # shares memory with ``state``
    header = np.array([seed & (2**64 - 1)], dtype=np.uint64).view(np.uint8)
    raw[_SEED : _SEED + 8] = header
    raw[_LEFT : _LEFT + 4] = np.array([1], dtype=np.int32).view(np.uint8)  # twist on first draw
    raw[_SEEDED : _SEEDED + 4] = np.array([1], dtype=np.int32).view(np.uint8)
    raw[_NEXT : _NEXT + 8] = np.array([0], dtype=np.uint64).view(np.uint8)
    slots = words.astype(np.uint64).view(np.uint8)
    raw[_WORDS : _WORDS + slots.size] = slots
    gen.set_state(state)
    return gen


@functools.cache
def check_layout() -> None:
    """Proves once per process that :func:`cpu_generator` sets the state it means to.

    A generator given known words must draw what numpy's ``MT19937`` draws from them (31-bit
    ``randint`` values are the low bits of raw 32-bit outputs).

    Raises:
        TorchInternalsError: if torch's CPU generator state has another layout.
    """
    words = expand_seed(20261128)
    gen = _with_words(20261128, words)
    ours = torch.randint(0, 2**31, (8,), generator=gen, dtype=torch.int64).numpy()
    reference = np.random.MT19937()
    reference.state = {"bit_generator": "MT19937", "state": {"key": words, "pos": STATE_WORDS}}
    raw = reference.random_raw(16).astype(np.int64) & (2**31 - 1)
    # An int64 randint takes 64 random bits per value (the second word is the low one) on the
    # tested releases; one word per value is accepted too.
    if not (np.array_equal(ours, raw[1::2]) or np.array_equal(ours, raw[:8])):
        raise TorchInternalsError(
            f"a CPU torch.Generator given a Mersenne Twister state under torch {torch.__version__} "
            f"does not draw what that state draws: its layout changed (tested: torch "
            f"{tested_versions_text()}). Use a tested torch release, or secure_mode=True.",
            feature=_FEATURE,
        )


def cpu_generator(seed: int) -> torch.Generator:
    """A CPU generator whose state is :func:`expand_seed` of ``seed`` (checked layout)."""
    check_layout()
    return _with_words(seed, expand_seed(seed))


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` that depends on every bit of ``seed`` (< 2**64).

    On CPU the whole Mersenne Twister state is expanded from ``seed``
    (:func:`cpu_generator`); elsewhere ``manual_seed`` (CUDA's Philox keeps 64 bits).
    """
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_generator(seed)
    return torch.Generator(device=device).manual_seed(seed)
