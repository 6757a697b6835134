"""Whether a distributed layout can be made private, and whether it is distributed at all.

Opacus decides "distributed" from the type of the object passed to ``make_private``
(``DDP``, ``DPDDP`` or an ``FSDPModule``). A model sharded without a root unit (``fully_shard`` on
its layers only), or wrapped one level down, is then counted as one process: the expected batch
is not divided by the world size, and gradient and noise both come out ``1 / world_size`` of what
the accountant assumes. The engine decides from the layout instead, and refuses the layouts whose
noise it cannot calibrate: trainable parameters that no FSDP unit manages (each rank would step
them on its own gradient and its own noise) and a DDP wrapper below the model's top.

Two layouts are refused in every ``grad_sample_mode`` (:func:`check_parallelism`): torch's
DDP-based composable ``replicate``, which Opacus also counts as one process, and tensor
parallelism (DTensor parameters that FSDP2 did not shard on its own), whose per-sample norms
would need the layer's shards summed across ranks.

What the engine decided about the layout travels as one frozen value, :class:`Layout`, built
once per ``make_private`` call (:func:`detect_layout`) and handed to the API record's optimizer
builder, the hooks and the layer rooms as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedConfigurationError
from ._fsdp2_internals import handed_dtensors
from .detect import composable_apis, ddp_replicated_modules
from .tensor_parallel import check_names, tensor_parallel_layout

_SHOWN = 4


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def listing(names: list[str]) -> str:
    """The first few names, and how many more there are."""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _fsdp2_units(model: nn.Module) -> dict[int, nn.Module | None]:
    """Each parameter's FSDP2 unit: the nearest ``FSDPModule`` at or above its owning module."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, nn.Module | None] = {}

    def walk(module: nn.Module, unit: nn.Module | None) -> None:
        unit = module if isinstance(module, FSDPModule) else unit
        for p in module.parameters(recurse=False):
            units.setdefault(id(p), unit)
        for child in module.children():
            walk(child, unit)

    walk(model, None)
    return units


def _fsdp_placements(param, unit: nn.Module | None) -> bool:
    """Whether a DTensor parameter's placements can be its FSDP2 unit's own.

    ``fully_shard`` shards on its mesh's last dimension (dim 0 of a 1-D mesh, the shard dim of
    HSDP's (replicate, shard) mesh) with a plain ``Shard`` and replicates on the others; the
    FSDP-based ``replicate`` replicates on its 1-D mesh. Tensor parallelism adds mesh dimensions
    after FSDP's with its own placements (a ``Shard``, or ``_StridedShard`` on FSDP's dimension).
    """
    from torch.distributed.tensor import Shard

    if unit is None:
        return False
    *others, last = param.placements
    if not all(pl.is_replicate() for pl in others):
        return False
    if "replicate" in composable_apis(unit):
        return last.is_replicate() and param.device_mesh.ndim == 1
    return type(last) is Shard


def _tensor_parallel(model: nn.Module) -> list[str]:
    """Trainable DTensor parameters that are not FSDP2's own, with their placements.

    Not FSDP2's own: outside every FSDP2 unit, a DTensor already when FSDP2 took it, or with
    placements FSDP2 does not make.
    """
    from torch.distributed.tensor import DTensor

    units = _fsdp2_units(model)
    handed = handed_dtensors(list({id(u): u for u in units.values() if u is not None}.values()))
    return [
        f"{n}: {_placement_text(p)}"
        for n, p in _trainable(model)
        if isinstance(p, DTensor)
        and not (handed.get(id(p)) is False and _fsdp_placements(p, units[id(p)]))
    ]


def check_context_parallel(model: nn.Module) -> None:
    """Refuses parameters on a mesh with a context-parallel dimension (a name with a ``cp`` part).

    Under context parallelism every rank holds a part of each sequence, and each would clip its
    part of a sample's gradient on its own (docs/context_parallel.md). Detected by the mesh
    dimension names FSDP2 shards over (torchtitan's ``dp_shard_cp``, ``cp``); context
    parallelism on a mesh the parameters do not live on is not visible here.

    Raises:
        UnsupportedConfigurationError: naming the parameters and mesh dimensions.
    """
    from torch.distributed.tensor import DTensor

    found = [
        (n, name)
        for n, p in _trainable(model)
        if isinstance(p, DTensor)
        for name in p.device_mesh.mesh_dim_names or ()
        if "cp" in name.split("_")
    ]
    if found:
        raise UnsupportedConfigurationError(
            "context parallelism is not supported: "
            f"{listing([f'{n} (mesh dimension {d!r})' for n, d in found])}. Each rank would clip "
            "its part of a sample's gradient alone, and the noise would not match the clipping. "
            "Shard over the data-parallel dimensions only (design: docs/context_parallel.md)."
        )


def _under_fsdp2(model: nn.Module, foreign: list[str]) -> bool:
    """Whether every tensor-parallel parameter sits in a ``fully_shard`` unit, or none exists.

    No FSDP2 unit: tensor parallelism alone (:mod:`.tp`). FSDP's ``replicate`` over TP is not
    tested, hence refused.
    """
    units = _fsdp2_units(model)
    if all(u is None for u in units.values()):
        return True
    names = {t.split(":")[0] for t in foreign}
    return all(
        units[id(p)] is not None and "replicate" not in composable_apis(units[id(p)])
        for n, p in _trainable(model)
        if n in names
    )


def _placement_text(param) -> str:
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    dims = [f"{pl!r} on mesh dim {name!r}" for pl, name in zip(param.placements, names)]
    return dims[0] if len(dims) == 1 else "(" + ", ".join(dims) + ")"


def check_parallelism(model: nn.Module, *, tensor_parallel: bool = False) -> None:
    """Refuses DDP-based composable ``replicate``, and tensor parallelism unless calibrated.

    No ``grad_sample_mode`` calibrates the first: Opacus counts it as one process. Tensor
    parallelism is calibrated by the ghost modes under FSDP2 (``tensor_parallel=True``:
    :mod:`.tensor_parallel`), on a mesh whose tp dimension is named; Opacus's own modes would
    see DTensors mixed with local tensors in their norm hooks.

    Args:
        model: The user's model, unwrapped from Opacus.
        tensor_parallel: Whether tensor-parallel layers on an FSDP2 model are accepted.

    Raises:
        UnsupportedConfigurationError: naming the replicated modules, or the parameters with
            their placements and mesh dimensions, and what to use instead.
    """
    check_context_parallel(model)
    replicated = ddp_replicated_modules(model)
    if replicated:
        where = (
            "the model itself"
            if "" in replicated
            else "module(s) " + listing([n for n in replicated if n])
        )
        raise UnsupportedConfigurationError(
            "torch's composable replicate (torch.distributed._composable.replicate, DDP "
            f"underneath) manages {where}. Opacus cannot see it and counts the run as one "
            "process: the clipped gradients are not averaged over ranks as the accountant "
            "assumes and each rank adds its own noise, so the replicas drift apart. Wrap the "
            "model in torch.nn.parallel.DistributedDataParallel instead "
            "(DistributedDataParallel(model)), or shard it with FSDP2's fully_shard."
        )
    foreign = _tensor_parallel(model)
    if foreign and tensor_parallel and _under_fsdp2(model, foreign):
        names = {t.split(":")[0] for t in foreign}
        check_names(model, [(n, p) for n, p in _trainable(model) if n in names])
        return
    if foreign:
        raise UnsupportedConfigurationError(
            f"tensor parallelism is not supported here: {len(foreign)} trainable parameter(s) "
            "are DTensors sharded or replicated other than by FSDP2 alone: "
            f"{listing(foreign)}. Their per-sample norms need every rank's shard (and "
            "their noise the tensor-parallel ranks' shares). Data parallelism is supported: "
            "FSDP2 (fully_shard on a 1-D mesh) and HSDP (fully_shard on a 2-D (replicate, "
            "shard) mesh); tensor parallelism with grad_sample_mode='ghost_fsdp' on a model "
            "that fully_shard wraps after parallelize_module (a data-parallel mesh dimension of "
            "size 1 is fine); else drop parallelize_module, or freeze those parameters."
        )


def check_layout(model: nn.Module, found) -> None:
    """Refuses a layout whose gradients or noise would differ between replicas.

    Args:
        model: The user's model, unwrapped from Opacus.
        found: What :func:`~.registry.detect_api` found in it (its record checks the rest).

    Raises:
        UnsupportedConfigurationError: naming the parameters or wrapper at fault and how to
            shard the model instead (see also :func:`check_parallelism`, which it calls first).
    """
    check_parallelism(model, tensor_parallel=True)
    found.record.check_layout(model, found.modules)


def world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if world_size() > 1 else 0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one model is laid out over the ranks: built once at detection, passed as a value.

    Every piece of the engine that depends on the composition (the sampler's shares, the
    expected batch per rank, the optimizer's gradient divisor, the per-sample norms' sum over
    tp, the norm rooms' sum over sequence shards) reads it from here, never from an attribute
    on the user's model.
    """

    dp_degree: int = 1
    """Ranks that take different examples: the world size over the tp degree."""
    dp_rank: int = 0
    """This rank's data-parallel index (the same on every rank of its tp group)."""
    tp_group: object = None
    """The tensor-parallel process group of this rank (None without tensor parallelism)."""
    tp_degree: int = 1
    """Ranks in the tp group (1 without tensor parallelism)."""
    sequence_group: object = None
    """The group sequence-sharded activations are split over: the tp group under tensor
    parallelism (a layer whose input is split along the tokens sums its norm room's partial
    per-sample gradients over it), else None."""
    cp_degree: int = 1
    """Context-parallel ranks: always 1 (context parallelism is refused at detection,
    :func:`check_context_parallel`)."""

    @property
    def tensor_parallel(self) -> bool:
        """Whether the model is tensor-parallel."""
        return self.tp_group is not None


def detect_layout(model: nn.Module) -> Layout:
    """The model's :class:`Layout` (collective under tensor parallelism).

    Args:
        model: The user's model, unwrapped from Opacus.

    Raises:
        UnsupportedConfigurationError: see :func:`.tensor_parallel.tensor_parallel_layout`.
    """
    tp = tensor_parallel_layout(model)
    if tp is None:
        return Layout(dp_degree=world_size(), dp_rank=rank())
    return Layout(
        dp_degree=tp.dp_degree,
        dp_rank=tp.dp_rank,
        tp_group=tp.group,
        tp_degree=tp.degree,
        sequence_group=tp.group,
    )
