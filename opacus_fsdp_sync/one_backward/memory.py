"""The one-backward memory budget: what a step will keep, checked before its first pass.

One backward keeps each hooked layer's inputs and output gradient (or its per-sample gradients)
from the first pass until the gradient phase. Before the first pass, :class:`MemoryBudget` adds
up what the layers captured in the forward would keep (:meth:`~..hooks.contract.StepHooks.
keep_estimate`) and compares it with ``one_backward_memory_budget``:

- within the budget, the step runs as planned; per-sample gradients that the policy chooses
  during the pass may add only what is left of the budget (its ``headroom``);
- over it, ``Linear`` layers whose per-sample gradients are smaller than what they would keep
  take them, the largest saving first, until the step fits (:func:`plan_memory`);
- still over it, the step takes the two-pass step, which keeps nothing of the kind.

Every path is one of the step's existing exact paths. In a distributed run the ranks agree by
one all-reduce (MAX) of a one-element flag per step whenever a budget is in force: one rank over
it sends every rank to the two-pass step, whose collectives differ from the one-backward
hand-off's (on CUDA, reading the flag waits for the device once per step). Without a budget
(CPU, option unset) nothing is estimated and nothing communicated.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..hooks.contract import KeptLayer, StepHooks
from ..options import auto_memory_budget
from ..profiling.memory import size_text

logger = logging.getLogger("opacus_fsdp_sync")


@dataclass(frozen=True)
class MemoryPlan:
    """What a step keeps under its budget, decided before its first pass."""

    needed: int
    """Bytes kept with every layer keeping its inputs and output gradient."""
    budget: int
    """The budget in bytes."""
    per_sample: frozenset[int] = frozenset()
    """Layers (ids) that keep per-sample gradients to fit."""
    planned: int = 0
    """Bytes kept with them (what the smallest choice keeps when ``two_pass``)."""
    two_pass: bool = False
    """Nothing fits: the step takes two backward passes."""
    other_rank: bool = False
    """``two_pass`` because another rank was over its budget."""
    layers: int = 0
    """Layers that would keep something."""

    @property
    def headroom(self) -> int | None:
        """Bytes the per-sample gradients chosen in the pass may add (None when two-pass)."""
        return None if self.two_pass else max(0, self.budget - self.planned)

    @property
    def outcome(self) -> str:
        """``"fits"``, ``"per-sample"`` or ``"two-pass"``."""
        if self.two_pass:
            return "two-pass"
        return "per-sample" if self.per_sample else "fits"

    def describe(self) -> str:
        """One log line's worth: the numbers and the choice."""
        head = (
            f"one backward would keep {size_text(self.needed)} of layer inputs and output "
            f"gradients ({self.layers} layers) against one_backward_memory_budget "
            f"{size_text(self.budget)}"
        )
        if self.other_rank:
            return f"{head}: another rank is over its budget, so every rank takes two passes"
        if self.two_pass:
            return (
                f"{head}; per-sample gradients wherever smaller still keep "
                f"{size_text(self.planned)}: the step takes two backward passes (exact, slower)"
            )
        return (
            f"{head}: {len(self.per_sample)} Linear layer(s) keep per-sample gradients instead "
            f"(exact), {size_text(self.planned)} kept"
        )


def total_bytes(layers: list[KeptLayer], per_sample: frozenset[int]) -> int:
    """Bytes kept when the layers in ``per_sample`` keep per-sample gradients (inputs once)."""
    inputs: dict[tuple, int] = {}
    total = 0
    for layer in layers:
        if layer.layer in per_sample:
            total += layer.per_sample or 0
            continue
        total += layer.grad_out
        inputs.update(layer.inputs)
    return total + sum(inputs.values())


def _savings(layers: list[KeptLayer]) -> list[tuple[int, frozenset[int]]]:
    """Disjoint choices ``(bytes saved, layers)`` of per-sample gradients, largest first.

    Layers reading one input free it only together, and only where no other layer keeps it:
    such a group is one choice when that saves more than its members that save on their own.
    """
    holders: dict[tuple, list[KeptLayer]] = {}
    size: dict[tuple, int] = {}
    for layer in layers:
        for key, n in layer.inputs:
            holders.setdefault(key, []).append(layer)
            size[key] = n
    choices, seen = [], set()
    for layer in layers:
        if layer.per_sample is None or layer.layer in seen:
            continue
        keys = [k for k, _ in layer.inputs]
        group = [m for m in holders[keys[0]] if m.per_sample is not None] if keys else [layer]
        seen.update(m.layer for m in group)
        ids = frozenset(m.layer for m in group)
        own = [(m.grad_out - m.per_sample, frozenset({m.layer})) for m in group]
        alone = [c for c in own if c[0] > 0]
        freed = all({h.layer for h in holders[k]} == ids for k in keys)
        whole = sum(s for s, _ in own) + (sum(size[k] for k in keys) if freed else 0)
        if whole > sum(s for s, _ in alone):
            choices.append((whole, ids))
        else:
            choices.extend(alone)
    return sorted(choices, key=lambda c: -c[0])


def plan_memory(layers: list[KeptLayer], budget: int) -> MemoryPlan:
    """Fits what one backward keeps into ``budget`` (see the module).

    Args:
        layers: What each layer would keep (:meth:`~..hooks.contract.StepHooks.keep_estimate`).
        budget: Bytes.
    """
    needed = total_bytes(layers, frozenset())
    plan = MemoryPlan(needed=needed, budget=budget, planned=needed, layers=len(layers))
    if needed <= budget:
        return plan
    chosen: frozenset[int] = frozenset()
    planned = needed
    for _, group in _savings(layers):
        chosen |= group
        planned = total_bytes(layers, chosen)
        if planned <= budget:
            return dataclasses.replace(plan, per_sample=chosen, planned=planned)
    return dataclasses.replace(plan, planned=planned, two_pass=True)


class MemoryBudget:
    """Checks each one-backward step against ``one_backward_memory_budget`` (see the module).

    Args:
        option: The option's value (None: :func:`~..options.auto_memory_budget`).
        device: The model's device.
        distributed: Ranks must agree on the two-pass step (a distributed API, world > 1).
        tp_group: Tensor parallelism's group, whose ranks must also agree on the budget (the
            smallest): they keep the same layers, so that the layers replicated over tp get
            their clipped gradients along the same path, bit for bit.
    """

    def __init__(
        self,
        option: int | None,
        device: torch.device,
        *,
        distributed: bool,
        tp_group=None,
    ) -> None:
        self.option = option
        self.device = device
        self.distributed = distributed
        self.tp_group = tp_group
        #: The last step's plan (None without a budget).
        self.last: MemoryPlan | None = None
        self._logged: set[str] = set()

    def budget(self) -> int | None:
        """The budget now: the option, else the automatic one (None: no limit).

        Under tensor parallelism the smallest of the tp group's (collective over the tp group
        when a budget is in force).
        """
        budget = self.option if self.option is not None else auto_memory_budget(self.device)
        if budget is None or self.tp_group is None:
            return budget
        agreed = torch.tensor([budget], dtype=torch.int64, device=_comm_device(self.device))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.tp_group)
        return int(agreed.item())

    def plan(self, hooks: StepHooks) -> MemoryPlan | None:
        """This step's plan, agreed across ranks; logged once per outcome other than fitting.

        Every rank must call it at the same point of every one-backward step (a collective when
        distributed and a budget is in force).
        """
        budget = self.budget()
        if budget is None:
            self.last = None
            return None
        plan = plan_memory(hooks.keep_estimate(), budget)
        if self.distributed:
            flag = torch.tensor([int(plan.two_pass)], device=_comm_device(self.device))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not plan.two_pass:
                plan = dataclasses.replace(
                    plan, two_pass=True, other_rank=True, per_sample=frozenset()
                )
        outcome = plan.outcome + (" (another rank)" if plan.other_rank else "")
        if plan.outcome != "fits" and outcome not in self._logged:
            self._logged.add(outcome)
            logger.warning(
                "[Ghost] memory: %s (logged once; engine.last_step_memory has each step's)",
                plan.describe(),
            )
        self.last = plan
        return plan


def _comm_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")
