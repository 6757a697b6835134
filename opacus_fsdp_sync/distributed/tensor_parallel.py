"""Tensor parallelism (torch's ``parallelize_module``) under flat per-sample clipping.

A tensor-parallel ``Linear`` holds a shard of its weight on each rank of the tensor-parallel
(tp) group: ``ColwiseParallel`` shards the output features (``Shard(0)``), ``RowwiseParallel``
the input features (``Shard(1)``; its bias is replicated). Every tp rank of a data-parallel
group sees the same examples, and each computes the part of every sample's gradient that
belongs to its shard. What exact flat clipping needs, and where it is done:

- **Per-sample norms** (:func:`tp_norm_sum`): the squared norm of a sample's
  gradient is the sum of its shards' partial squared norms, all-reduced over the tp group once
  per step before the square root; a parameter replicated over tp (a norm weight, a rowwise
  bias, a layer left out of the plan) is counted once. The hooks see the layer's input as a
  DTensor and its output gradient as a local tensor; both are taken as local tensors
  (:func:`local`), which is what the partial norms are of.
- **Sequence parallelism**: an output gradient split over tp along the tokens is gathered
  (:func:`gather_sequence`), a column-wise layer's gathered output features are cut back to its
  rows (:func:`own_output_features`), an RMSNorm's per-sample and clipped gradients on sequence
  shards are summed over tp (:func:`sum_sequence_shards`).
- **Clipped gradients** (one backward): the layer rooms compute them from the local tensors,
  which gives this rank's tp shard; :func:`as_param_grad` hands it over as a DTensor.
- **Noise per placement** (:func:`noise_keys`): a coordinate sharded over tp gets its own draw on
  each tp rank, a coordinate replicated over tp the same draw on every tp rank (the replicas
  stay bit-identical).
- **The data-parallel degree** is the world size over the tp degree: it sets the expected batch
  per rank, the shared Poisson sampler's shares (the tp ranks of one data-parallel group take
  the same examples: :attr:`TensorParallelLayout.dp_rank`) and the gradient divisor.

The tp mesh dimension is found by name: ``"tp"``, torchtitan's (``init_device_mesh(...,
mesh_dim_names=("dp", "tp"))``). Only public torch API is used (DTensor placements, device
meshes, process groups).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedConfigurationError

logger = logging.getLogger(__name__)

#: Names of the tensor-parallel mesh dimension (torchtitan's).
TP_DIM_NAMES = ("tp",)
#: Separates the tp coordinate in a noise-stream key (coordinates are never negative).
_TP_MARK = -1


def local(t):
    """The local tensor of a DTensor (anything else unchanged)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tp_dims(param) -> tuple[int, ...]:
    """The mesh dimensions of a DTensor parameter that are named as tensor-parallel."""
    names = param.device_mesh.mesh_dim_names or ()
    return tuple(i for i, n in enumerate(names) if n in TP_DIM_NAMES)


def on_tp_mesh(param) -> bool:
    """Whether a parameter is a DTensor on a mesh with a tensor-parallel dimension."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and bool(_tp_dims(param))


def tp_sharded(param) -> bool:
    """Whether a parameter is sharded over a tensor-parallel mesh dimension."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return False
    return any(not param.placements[i].is_replicate() for i in _tp_dims(param))


@dataclass(frozen=True)
class TensorParallelLayout:
    """The tensor-parallel side of a model's layout (see the module docstring).

    Detection's intermediate: the engine reads it through :class:`..layout.Layout`.

    Per-sample norms are summed over ``group`` by the hooks (:func:`tp_norm_sum`).

    Attributes:
        group: The tp process group of this rank.
        degree: Ranks in the tp group.
        dp_degree: Data-parallel ranks (world size over ``degree``).
        dp_rank: This rank's data-parallel index (the same on every rank of its tp group).
    """

    group: object
    degree: int
    dp_degree: int
    dp_rank: int


def tp_group(param):
    """The process group of a tp-sharded DTensor parameter's tensor-parallel mesh dimension."""
    return param.device_mesh.get_group(_tp_dims(param)[0])


def tp_norm_sum(group):
    """``sum(sharded, replicated) -> norms`` over the tp process group ``group``.

    The returned function takes this rank's per-sample norms of tp-sharded parameter shards
    and those of parameters replicated over tp, and returns
    ``sqrt(all_reduce_tp(sum sharded^2 + [tp rank 0] sum replicated^2))`` in fp32 (or wider):
    the whole-model per-sample norms, bit-identical on every tp rank (the replicated terms come
    from one rank, so ranks that computed them along other paths cannot disagree). Collective
    over the tp group: every tp rank calls it once per step.
    """
    first = dist.get_rank(group) == 0

    def total(sharded: list[torch.Tensor], replicated: list[torch.Tensor]) -> torch.Tensor:
        ref = (sharded or replicated)[0]
        # fp32 at least (bf16 norms summed one by one would lose the small terms)
        dtype = torch.promote_types(ref.dtype, torch.float32)
        sq = torch.zeros(ref.shape, dtype=dtype, device=ref.device)
        for ns in sharded:
            sq = sq + ns.to(device=ref.device, dtype=dtype).pow(2)
        if first:  # replicated terms once, from one tp rank: every rank gets the same sum
            for ns in replicated:
                sq = sq + ns.to(device=ref.device, dtype=dtype).pow(2)
        dist.all_reduce(sq, group=group)
        return sq.sqrt()

    return total


def tensor_parallel_layout(model: nn.Module) -> TensorParallelLayout | None:
    """The model's tensor-parallel layout, or None when no parameter is on a tp mesh dimension.

    Collective when tensor-parallel (the data-parallel index of each tp group is agreed on).

    Raises:
        UnsupportedConfigurationError: a tp-sharded parameter outside a ``Linear`` layer, or
            trainable DTensors on a mesh without dimension names (the tp dimension is found by
            its name ``"tp"``).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = [(n, p) for n, p in params if tp_sharded(p)]
    # the tp group from every parameter on a tp mesh: frozen tensor-parallel layers (only
    # norms, a head or adapters trained) still set the data-parallel degree
    on_tp = [(n, p) for n, p in model.named_parameters() if on_tp_mesh(p)]
    if not on_tp:
        return None
    owners = {id(p): type(m) for m in model.modules() for p in m.parameters(recurse=False)}
    other = [n for n, p in sharded if not _is_linear(owners.get(id(p)))]
    if other:
        raise UnsupportedConfigurationError(
            f"tensor-parallel parameters outside Linear layers ({', '.join(other[:4])}): "
            "per-sample norms of sharded Embedding or other layers are not implemented. Keep them "
            "out of parallelize_module's plan (they stay replicated over tp)."
        )
    meshes = {id(p.device_mesh): p for _, p in on_tp}
    groups = set()
    for p in meshes.values():
        dims = _tp_dims(p)
        if len(dims) != 1:
            raise UnsupportedConfigurationError(
                "tensor parallelism over several mesh dimensions named 'tp': use one."
            )
        groups.add(tp_group(p))
    if len(groups) != 1:
        raise UnsupportedConfigurationError(
            "tensor-parallel parameters on different tp groups: use one tp mesh dimension for "
            "every parallelized layer."
        )
    group = groups.pop()
    degree = dist.get_world_size(group)
    world = dist.get_world_size()
    leader = min(dist.get_process_group_ranks(group))
    leaders: list[int] = [0] * world
    dist.all_gather_object(leaders, leader)
    order = sorted(set(leaders))
    if world % degree or len(order) * degree != world:
        raise UnsupportedConfigurationError(
            f"tp groups of {degree} ranks do not tile the {world} ranks: every rank must belong "
            "to one tp group of the same size."
        )
    layout = TensorParallelLayout(
        group=group,
        degree=degree,
        dp_degree=world // degree,
        dp_rank=order.index(leader),
    )
    logger.info(
        "[Ghost] tensor parallelism: tp degree %d, data-parallel degree %d; %d tp-sharded "
        "parameters (per-sample norms all-reduced over tp)",
        degree,
        layout.dp_degree,
        len(sharded),
    )
    return layout


def check_names(model: nn.Module, foreign: list | None = None) -> None:
    """Refuses tensor-parallel parameters on a mesh without a dimension named ``"tp"``.

    Args:
        model: The user's model.
        foreign: ``(name, parameter)`` of the DTensor parameters that are not FSDP2's own (all
            trainable DTensors when None).

    Raises:
        UnsupportedConfigurationError: naming the parameters and the fix.
    """
    from torch.distributed.tensor import DTensor

    if foreign is None:
        foreign = [
            (n, p)
            for n, p in model.named_parameters()
            if p.requires_grad and isinstance(p, DTensor)
        ]
    unnamed = [n for n, p in foreign if not _tp_dims(p)]
    if unnamed:
        raise UnsupportedConfigurationError(
            f"DTensor parameters on a mesh without a dimension named 'tp' "
            f"({', '.join(unnamed[:4])}): name the tensor-parallel dimension 'tp', e.g. "
            "init_device_mesh('cuda', (dp, tp), mesh_dim_names=('dp', 'tp')) or "
            "ShardingConfig(tp_degree=...)."
        )


def _is_linear(kind: type | None) -> bool:
    return kind is not None and issubclass(kind, nn.Linear)


def _mesh_structure(mesh) -> tuple:
    """A mesh as ints every process hashes alike: its shape and its dims' names (CRC-32)."""
    names = mesh.mesh_dim_names or ()
    return tuple(mesh.mesh.shape), tuple(zlib.crc32(n.encode()) for n in names)


def noise_keys(params) -> list[tuple]:
    """Each parameter's noise-stream key: its mesh, and its coordinates on the dims it is sharded.

    A key is ``(mesh, ((dim, coordinate), ...))`` for the mesh dims the parameter is sharded
    over, the mesh named by its shape and dim names (not its ranks: the data-parallel sub-mesh
    of two tp ranks holds the same replicas on other ranks). Parameters on meshes of another
    shape never share a key: a 1-D mesh's coordinate ``(2,)`` and an HSDP mesh's shard
    coordinate ``(0,)`` once gave two ranks one key over different parameters, so one rank's
    noise was drawn again on another rank's other coordinates. Parameters replicated over tp
    leave the tp coordinate out (one stream for all tp ranks); parameters sharded over tp keep
    it after a marker (-1). Plain tensors beside tp-sharded parameters (tensor parallelism
    alone) are replicated over tp and share one key; other plain tensors take their rank's own.
    Keys hold ints only: their hash, which seeds the stream, is the same in every process. The
    stream's seed also names the parameters it covers (see
    :class:`~..optimizers.fsdp2.NoiseStreams`), so ranks share a stream only over the same
    parameters.
    """
    from torch.distributed.tensor import DTensor

    # Plain parameters beside tp-sharded ones: tensor parallelism alone, where they are
    # replicated over tp, as the tp mesh's replicated DTensors are (one key for both)
    tp_meshes = [p.device_mesh for p in params if tp_sharded(p)]
    plain_key = (_mesh_structure(tp_meshes[0]), ()) if tp_meshes else (dist.get_rank(),)
    keys = []
    for p in params:
        if not isinstance(p, DTensor):
            keys.append(plain_key)
            continue
        coord = p.device_mesh.get_coordinate() or ()
        tp = set(_tp_dims(p))
        sharded = tuple(
            (i, c)
            for i, (c, pl) in enumerate(zip(coord, p.placements))
            if not pl.is_replicate() and i not in tp
        )
        key = (_mesh_structure(p.device_mesh), sharded)
        if tp_sharded(p):
            key = key + (_TP_MARK,) + tuple(coord[i] for i in sorted(tp))
        keys.append(key)
    return keys


def as_param_grad(param, grad: torch.Tensor) -> torch.Tensor:
    """A clipped gradient computed on local tensors, as the gradient ``param`` takes.

    A tensor-parallel parameter (a DTensor on the tp mesh: FSDP2's unsharded parameter, or TP
    alone's) takes a DTensor of its placements whose local tensor is this rank's shard (the
    layer rooms compute exactly that from the local inputs and output gradients); a plain
    parameter takes ``grad`` as it is.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or isinstance(grad, DTensor):
        return grad
    return DTensor.from_local(
        grad.contiguous(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def sequence_group(t):
    """The tp group a DTensor is sharded over along the sequence (dim 1), or None.

    Sequence parallelism (``SequenceParallel``, ``RowwiseParallel(output_layouts=Shard(1))``)
    splits activations over tp along the tokens.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.dim() < 3:  # (batch, features): no sequence
        return None
    for i in _tp_dims(t):
        pl = t.placements[i]
        if isinstance(pl, Shard) and pl.dim in (1, 1 - t.dim()):
            return t.device_mesh.get_group(i)
    return None


def gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    """The full sequence of a tensor sharded over ``group`` along dim 1 (rank order).

    Even shards only: the hooks refuse a sequence length the tp degree does not divide in the
    forward, on every tp rank, before any gather (:mod:`...hooks.tensor_parallel`).
    """
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def sum_sequence_shards(per_sample: torch.Tensor, group) -> torch.Tensor:
    """Per-sample gradients of a tp-replicated parameter summed over its sequence shards."""
    if group is None:
        return per_sample
    total = per_sample.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total


def own_output_features(module: nn.Module, grad: torch.Tensor) -> torch.Tensor:
    """A column-wise layer's output gradient restricted to its shard's output features.

    ``ColwiseParallel(output_layouts=Replicate())`` gathers the output features after the
    layer: its output gradient then covers every feature while the layer holds this rank's
    rows of the weight. Anything else is returned as it is.

    Raises:
        UnsupportedConfigurationError: for an output split the weight's shard does not match.
    """
    from torch.distributed.tensor import DTensor, Shard

    weight = getattr(module, "weight", None)
    if not isinstance(weight, DTensor) or grad.shape[-1] != weight.shape[0]:
        return grad
    dims = [i for i in _tp_dims(weight) if isinstance(weight.placements[i], Shard)]
    if not dims or weight.placements[dims[0]].dim != 0:
        return grad
    rows = weight.to_local().shape[0]
    if rows == weight.shape[0]:
        return grad
    mesh = weight.device_mesh
    # DTensor's Shard splits as torch.chunk: ceil(n / k) rows per rank, the last ones fewer
    step = -(-weight.shape[0] // mesh.size(dims[0]))
    start = min(mesh.get_local_rank(dims[0]) * step, weight.shape[0])
    part = grad.narrow(-1, start, min(rows, grad.shape[-1] - start))
    if part.shape[-1] != rows:
        raise UnsupportedConfigurationError(
            f"{type(module).__name__}: output gradient of {grad.shape[-1]} features does not "
            f"split into this rank's {rows} weight rows"
        )
    return part


def check_secure_mode(tensor_parallel: bool, secure_mode: bool) -> None:
    """Refuses ``secure_mode`` under tensor parallelism.

    Opacus's secure optimizers draw from ``/dev/urandom`` on each rank: the parameters
    replicated over tp would get different noise on each tp rank and the replicas drift apart.

    Raises:
        UnsupportedConfigurationError: with ``secure_mode`` and a tensor-parallel layout.
    """
    if tensor_parallel and secure_mode:
        raise UnsupportedConfigurationError(
            "secure_mode with tensor parallelism: each rank's secure noise would differ on "
            "the parameters replicated over tp. Run without secure_mode, or without "
            "parallelize_module."
        )
