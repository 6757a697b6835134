"""Linear norm strategies chosen by measurement on the running device (``tune_norms``).

Every strategy the ``Linear`` room offers for a sequence layer's per-sample norm
(:meth:`~opacus_fsdp_sync.layers.linear.LinearRoom.strategies`) is exact (they differ only in
summation order): full Gram matrices (``gram_block=0``), the upper block triangle of the Grams
in row blocks of ``b`` tokens (:mod:`..layers.linear_grams`), or, in the one-backward step,
materialised per-sample gradients (:mod:`..layers.linear_policy`). Which one is fastest depends
on the device, the layer's shape, the dtype and the sequence length, and the static rules
(``gram_block="auto"``, the machine-balance cost rule) only guess it. :class:`NormTuner` times
each candidate on the real inputs of the first layer that meets a new :class:`NormKey`, keeps the
fastest in a table, and reuses it for every later layer and step with that key.

What is timed is what differs in the step: for a Gram strategy, the layer's share of its input's
Gram (the Gram is computed once for all layers reading that input, see :mod:`..layers.linear`), its
output-gradient Gram and the contraction, plus, when per-sample gradients are a candidate, the
weight-gradient matmul the gradient phase then runs; for per-sample gradients, their batched
matmul, norms and the weighted sum that replaces that matmul. A candidate whose working set
(:meth:`~..layers.linear.LinearRoom.working_set`: full Gram matrices take ``4 N T^2`` bytes
each in fp32, 16 GiB per sample at 64k tokens) is over ``tune_norms_memory_budget`` is never
timed nor chosen (logged); if no Gram strategy fits, the one with the least working set is
taken untimed.

The key leaves the batch size out. Every candidate costs the same per sample (``N`` independent
problems of one shape), so the ranking hardly depends on ``N``, while under Poisson sampling the
local batch size changes every step and differs between ranks: a key holding it would re-tune
every step, and ranks would disagree on when to tune. The sequence length stays in (the Gram
work grows as ``T^2``, the per-sample gradients' as ``T``).

Agreement across ranks (FSDP2, FSDP1, DDP with a world size above 1): all ranks must take the
same plan, and no rank may enter a collective that another skips. Shapes can differ between
ranks (the batch size always may, the sequence length may with per-batch padding), so "the key
is new" is not a rank-independent event. Tuning therefore happens once, in the first backward of
the run, and on rank 0 only (the other ranks use the static rules for that step); at the end of
that first pass every rank enters one ``broadcast_object_list`` of rank 0's table, whatever it
saw. Afterwards the plan is collective-free: a key missing from the agreed table takes the choice
of the same layer shape at the nearest tuned sequence length (ties: the shorter), else the static
rules, the same on every rank since the table is. This assumes, as FSDP itself does, that every
rank runs the same number of backward passes (the shared Poisson sampler guarantees it). On one
process every new key is tuned when it is met.

Persistence (``tune_norms_cache`` or ``OPACUS_FSDP_SYNC_NORM_PLAN``): a JSON file of tables keyed
by the device name and torch version; a run starts with the stored table and adds what it tunes
(rank 0 reads and writes it; :mod:`.store`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..layers.linear import Candidate, LinearRoom
from ..options import auto_memory_budget
from ..profiling.memory import size_text
from .store import Choice, NormKey, device_name, dump_key, load_key, load_table, store_table
from .timing import candidate_timer

logger = logging.getLogger("opacus_fsdp_sync")

#: Environment variable naming the JSON file of stored norm plans.
NORM_PLAN_ENV = "OPACUS_FSDP_SYNC_NORM_PLAN"


def sensible_blocks(seq: int, *, smallest: int = 32, most: int = 16) -> list[int]:
    """Gram row blocks worth timing at length ``seq``.

    Powers of two from ``smallest`` below ``seq`` that split it into at most ``most`` blocks
    (each extra block costs kernel launches while saving less).
    """
    out, b = [], smallest
    while b < seq:
        if math.ceil(seq / b) <= most:
            out.append(b)
        b *= 2
    return out


@dataclass
class NormTuner:
    """Times the exact Linear norm strategies per :class:`NormKey` and keeps the fastest.

    Attributes:
        device: Where the norms run (the model's device).
        gram_block: The ``gram_block`` option: ``"auto"`` tunes the block, a number fixes it.
        distributed: Agree on rank 0's table across the default process group (see the module).
        cost_fn: ``(key, candidate) -> ms`` instead of timing (tests inject costs with it).
        repeats: Timed calls per candidate (after one warm-up); the fastest counts.
        blocks: Gram blocks to try instead of :func:`sensible_blocks` (tests).
        cache_path: JSON file of stored tables (None: none).
        timer: The engine's :class:`~opacus_fsdp_sync.profiling.timers.StepTimer`: tuning is
            reported as its own ``norm_tuning`` phase and deducted from the phases around it.
        memory_budget: Bytes a candidate's working set may take
            (:meth:`~..layers.linear.LinearRoom.working_set`); a candidate over it is never
            timed. None: :func:`~..options.auto_memory_budget` when tuning (no limit on CPU).
    """

    device: torch.device
    gram_block: int | str = "auto"
    distributed: bool = False
    cost_fn: Callable[[NormKey, Candidate], float] | None = None
    repeats: int = 3
    blocks: tuple[int, ...] | None = None
    cache_path: str | None = None
    timer: object = None
    memory_budget: int | None = None
    table: dict[NormKey, Choice] = field(default_factory=dict)
    #: Candidates left untimed per key because their working set was over the budget (bytes).
    skipped: dict[NormKey, dict[Candidate, int]] = field(default_factory=dict)
    #: Measured (or injected) milliseconds per candidate of each key tuned in this process.
    costs: dict[NormKey, dict[Candidate, float]] = field(default_factory=dict)
    #: Milliseconds spent timing candidates, in all.
    tuning_ms: float = 0.0
    #: Keys timed in this process (a key met again is not timed again).
    tuned: list[NormKey] = field(default_factory=list)
    agreed: bool = False
    _new: list[NormKey] = field(default_factory=list)
    _groups: dict[int, set[NormKey]] = field(default_factory=dict)
    _derived: dict[NormKey, Choice | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = f"{device_name(self.device)} | torch {torch.__version__}"
        self.rank = dist.get_rank() if self.distributed else 0
        if self.rank == 0 and self.cache_path and os.path.exists(self.cache_path):
            self.table.update(load_table(self.cache_path, self.name))
            if self.table:
                logger.info(
                    "[Ghost] norm plan: %d stored entries for %s from %s",
                    len(self.table),
                    self.name,
                    self.cache_path,
                )

    def key(self, layer: nn.Linear, a: torch.Tensor, g: torch.Tensor, readers: int) -> NormKey:
        """The key of a sequence layer's norm (input ``a``: ``(N, T, d_in)``)."""
        return NormKey(
            d_in=a.shape[-1],
            d_out=g.shape[-1],
            seq=a.shape[1],
            dtype=str(g.dtype),
            device=a.device.type,
            weight=bool(layer.weight.requires_grad),
            bias=layer.bias is not None and bool(layer.bias.requires_grad),
            readers=readers,
        )

    def candidates(self, key: NormKey, per_sample: bool) -> list[Candidate]:
        """The Linear room's strategies: Gram blocks (full Grams first), per-sample gradients."""
        if self.gram_block != "auto":
            blocks = [int(self.gram_block)]
        elif self.blocks is not None:
            blocks = [0, *(b for b in self.blocks if 0 < b < key.seq)]
        else:
            blocks = [0, *sensible_blocks(key.seq)]
        return LinearRoom.strategies(blocks, per_sample=per_sample, weight=key.weight)

    def choose(
        self,
        layer: nn.Linear,
        a: torch.Tensor,
        g: torch.Tensor,
        *,
        readers: int = 1,
        per_sample: bool = False,
        group: int | None = None,
    ) -> Choice | None:
        """The plan for this layer's norm, timing the candidates first if the key is new.

        Args:
            layer: The ``Linear`` layer.
            a: Its input ``(N, T, d_in)``, a plain tensor.
            g: Its output gradient ``(N, T, d_out)``.
            readers: Trainable layers reading ``a`` (the Gram is shared among them).
            per_sample: Whether per-sample gradients are a candidate (one backward,
                ``per_sample_grads="auto"``, one layer's bytes within the budget).
            group: Identifies ``a`` within this pass: layers sharing an input share a block.

        Returns:
            The choice, or None for the static rules (a rank other than 0 in the tuning step, or
            an agreed table without this shape).
        """
        key = self.key(layer, a, g, readers)
        if group is not None:
            self._groups.setdefault(group, set()).add(key)
        if key in self.table:
            return self.table[key]
        if self.agreed:
            return self._nearest(key)
        if self.rank != 0:
            return None
        timed = self.timer.phase("norm_tuning", excluded=True) if self.timer else None
        start = time.perf_counter()
        with timed or contextlib.nullcontext():
            choice = self._tune(key, layer, a, g, per_sample)
        self.tuning_ms += (time.perf_counter() - start) * 1e3
        self.table[key] = choice
        self.tuned.append(key)
        self._new.append(key)
        return choice

    def _tune(self, key, layer, a, g, per_sample: bool) -> Choice:
        cands, smallest = self._within_budget(key, layer, a, g, per_sample)
        if not any(not c.per_sample for c in cands):  # no Gram strategy fits: none is timed
            return Choice(block=smallest.block, per_sample=bool(cands))
        if self.cost_fn is not None:
            costs = {c: float(self.cost_fn(key, c)) for c in cands}
        else:
            measure = candidate_timer(layer, a.detach(), g.detach(), key.readers, self.repeats)
            costs = {c: measure(c, per_sample) for c in cands}
        self.costs[key] = costs
        ghost = min((c for c in cands if not c.per_sample), key=lambda c: (costs[c], c.block))
        psg = Candidate(per_sample=True)
        return Choice(block=ghost.block, per_sample=psg in costs and costs[psg] < costs[ghost])

    def _within_budget(self, key, layer, a, g, per_sample: bool):
        """The candidates whose working set fits the budget, and the smallest Gram strategy.

        Logs (a warning) the ones left out, with their working sets and the budget.
        """
        cands = self.candidates(key, per_sample)
        budget = self.memory_budget
        budget = auto_memory_budget(self.device) if budget is None else budget
        sizes = {
            c: LinearRoom.working_set(layer, a, g, c, with_weight_grad=per_sample) for c in cands
        }
        smallest = min((c for c in cands if not c.per_sample), key=lambda c: sizes[c])
        if budget is None:
            return cands, smallest
        over = {c: sizes[c] for c in cands if sizes[c] > budget}
        if over:
            self.skipped[key] = over
            fit = [c for c in cands if c not in over]
            logger.warning(
                "[Ghost] norm plan: %s (batch %d): not timed, working set over the tuning "
                "budget of %s: %s%s",
                key,
                a.shape[0],
                size_text(budget),
                ", ".join(f"{c} ({size_text(n)})" for c, n in over.items()),
                "" if any(not c.per_sample for c in fit) else f"; {smallest} untimed, the least",
            )
        return [c for c in cands if c not in over], smallest

    def _nearest(self, key: NormKey) -> Choice | None:
        """An agreed table's choice for the same shape at the nearest tuned length, or None."""
        if key not in self._derived:
            same = [k for k in self.table if dataclasses.replace(k, seq=key.seq) == key]
            best = min(same, key=lambda k: (abs(math.log(k.seq / key.seq)), k.seq), default=None)
            choice = None if best is None else self.table[best]
            self._derived[key] = choice
            logger.info(
                "[Ghost] norm plan: %s was not tuned (tuning is agreed across ranks once, at the "
                "first step): %s",
                key,
                f"{choice}, as at T={best.seq}" if best else "the static rules",
            )
        return self._derived[key]

    def end_pass(self) -> None:
        """End of a first backward: consolidates, agrees (distributed, once), logs and stores.

        Every rank must call it at the same point of every backward: in a distributed run the
        first call is a collective.
        """
        self._consolidate()
        groups, self._groups = self._groups, {}
        del groups
        if self.distributed and not self.agreed:
            payload = [{dump_key(k): dataclasses.asdict(c) for k, c in self.table.items()}]
            dist.broadcast_object_list(payload, src=0, device=_comm_device(self.device))
            self.table = {load_key(k): Choice(**c) for k, c in payload[0].items()}
            self.agreed = True
            if self.rank != 0:
                self._new.clear()
        if not self._new:
            return
        lines = [f"  {k}: {self.table[k]}{self._costs_text(k)}" for k in self._new]
        logger.info(
            "[Ghost] norm plan: %d new entr%s (%s, tuning %.1f ms so far):\n%s",
            len(self._new),
            "y" if len(self._new) == 1 else "ies",
            self.name,
            self.tuning_ms,
            "\n".join(lines),
        )
        self._new.clear()
        if self.rank == 0 and self.cache_path:
            store_table(self.cache_path, self.name, self.table)

    def _costs_text(self, key: NormKey) -> str:
        costs = self.costs.get(key)
        if not costs:
            return ""
        return " (" + ", ".join(f"{c}: {ms:.3f} ms" for c, ms in costs.items()) + ")"

    def _consolidate(self) -> None:
        """Layers reading one input take one Gram block: the least total cost over them.

        Keys timed in this pass only; a block changes only where every key of the group has a
        cost for it (so stored or agreed entries are never changed).
        """
        fresh = set(self._new)
        for keys in self._groups.values():
            ghost = [k for k in keys if k in fresh and not self.table[k].per_sample]
            blocks = {c.block for k in ghost for c in self.costs.get(k, {}) if not c.per_sample}
            if len(ghost) < 2 or len({self.table[k].block for k in ghost}) == 1:
                continue
            common = [
                b for b in sorted(blocks) if all(Candidate(block=b) in self.costs[k] for k in ghost)
            ]
            if common:
                best = min(
                    common, key=lambda b: sum(self.costs[k][Candidate(block=b)] for k in ghost)
                )
                for k in ghost:
                    self.table[k] = Choice(block=best)


def _comm_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def tuning_wanted(option: bool | str, device: torch.device) -> bool:
    """Resolves ``tune_norms``: ``"auto"`` is on for accelerators and off on CPU.

    CPU is off by default because there tuning does not pay for the benchmark's ``small`` preset
    (see the README's options table): the static rules were measured on CPU and tuning
    costs a few hundred milliseconds once.
    """
    if option == "auto":
        return device.type != "cpu"
    return bool(option)


def make_norm_tuner(
    *,
    option: bool | str,
    cache_path: str | None,
    device: torch.device,
    gram_block: int | str,
    distributed: bool,
    timer=None,
    memory_budget: int | None = None,
) -> NormTuner | None:
    """The engine's tuner for ``tune_norms``, or None; logs the decision."""
    on = tuning_wanted(option, device)
    path = cache_path or os.environ.get(NORM_PLAN_ENV) or None
    if not on:
        logger.info("[Ghost] norm tuning: off (tune_norms=%s, %s)", option, device.type)
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    agree = distributed and world > 1
    logger.info(
        "[Ghost] norm tuning: on (tune_norms=%s, %s)%s%s",
        option,
        device.type,
        ": tuned on rank 0 at the first step, agreed by one broadcast" if agree else "",
        f", stored in {path}" if path else "",
    )
    return NormTuner(
        device=device,
        gram_block=gram_block,
        distributed=agree,
        cache_path=path,
        timer=timer,
        memory_budget=memory_budget,
    )
