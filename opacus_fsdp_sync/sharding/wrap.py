"""Wrap policies: which submodules become their own FSDP unit."""

from __future__ import annotations

from torch import nn

from ..layers.tied import find_shared_parameters
from .config import ShardingConfig


def find_blocks(model: nn.Module, classes: tuple[type, ...] | None = None) -> list[nn.Module]:
    """Transformer blocks (outermost matches only).

    Blocks are instances of ``classes``, or, when None, of classes named ``*DecoderLayer`` or
    ``*Block``.

    Raises:
        ValueError: when no block is found (name the classes in ``block_classes``).
    """

    def is_block(m: nn.Module) -> bool:
        if classes is not None:
            return isinstance(m, classes)
        name = type(m).__name__
        return name.endswith("DecoderLayer") or name.endswith("Block")

    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if is_block(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    if not found:
        raise ValueError(
            f"wrap_policy='transformer' found no block in {type(model).__name__}; set "
            "ShardingConfig.block_classes to the block class(es), or use wrap_policy='size_based'."
        )
    return found


def _owns_shared(model: nn.Module) -> set[int]:
    """Ids of modules owning a weight shared with another module (kept in the root unit)."""
    return {id(m) for s in find_shared_parameters(model) for _, m, _ in s.owners}


def _has_own_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False))


def _can_be_own_unit(m: nn.Module) -> bool:
    """False for a layer with trainable weights and no Opacus sampler.

    Opacus computes such a layer's norms with functorch, which deep-copies the layer, and FSDP
    forbids deep copies of its units.
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping as Ghost

    if not any(p.requires_grad for p in m.parameters(recurse=False)):
        return True
    samplers = set(Ghost.GRAD_SAMPLERS) | set(Ghost.NORM_SAMPLERS)
    return type(m) in samplers


def units(model: nn.Module, config: ShardingConfig) -> list[nn.Module]:
    """Submodules to shard as their own unit, innermost first (the root is added by the caller).

    No unit contains only part of the owners of a shared weight: such owners stay in the
    root unit (FSDP2 refuses a parameter in two groups).
    """
    shared = _owns_shared(model)
    chosen = _choose(model, config, shared)
    return [m for m in chosen if _can_be_own_unit(m)]


def _choose(model: nn.Module, config: ShardingConfig, shared: set[int]) -> list[nn.Module]:
    if config.wrap_policy == "transformer":
        blocks = find_blocks(model, config.block_classes)
        return [b for b in blocks if not any(id(m) in shared for m in b.modules())]
    if config.wrap_policy == "per_layer":
        return [
            m
            for m in model.modules()
            if m is not model and _has_own_params(m) and id(m) not in shared
        ]
    # size_based: post-order, count parameters not yet in a unit.
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> int:
        remaining = sum(visit(c) for c in m.children())
        remaining += sum(p.numel() for p in m.parameters(recurse=False))
        if (
            m is not model
            and remaining >= config.min_num_params
            and not any(id(x) in shared for x in m.modules())
        ):
            chosen.append(m)
            return 0
        return remaining

    visit(model)
    return chosen
