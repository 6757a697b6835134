"""What ``make_private`` refuses on FSDP2 before anything runs: layouts that break the noise.

The DP noise is scaled for gradients averaged over every data-parallel rank and drawn from
streams that replicas share: a reduction other than the average, a mesh that leaves ranks out,
trainable parameters no unit manages, or ``secure_mode`` where ranks hold replicas would each
make the released noise other than the accountant's.
"""

from __future__ import annotations

from torch import nn

from ..distributed import _fsdp2_reduction_internals as reduction_internals
from ..distributed.layout import listing, world_size
from ..distributed.tensor_parallel import tp_sharded
from ..errors import UnsupportedConfigurationError


def replicated_parameters(modules: list[nn.Module]) -> list[str]:
    """Trainable parameters that several ranks hold whole: replicated over a mesh dimension.

    HSDP's replicate dimension, a ``(world, 1)`` no-shard mesh, torch's FSDP-based
    ``replicate``: each such coordinate lives on more than one rank.
    """
    from torch.distributed.tensor import DTensor

    seen, out = set(), []
    for unit in modules:
        for name, p in unit.named_parameters():
            if id(p) in seen or not p.requires_grad or not isinstance(p, DTensor):
                continue
            seen.add(id(p))
            mesh = p.device_mesh
            if any(pl.is_replicate() and mesh.size(i) > 1 for i, pl in enumerate(p.placements)):
                out.append(name)
    return out


def refuse_secure_replicas(modules: list[nn.Module]) -> None:
    """Refuses ``secure_mode`` where ranks hold the same coordinates (each would noise its own).

    Opacus's secure optimizer draws from ``/dev/urandom`` on each rank, so the replicas of a
    coordinate would add different noise and drift apart: each next gradient, averaged over
    the replicas, comes from models that differ, which the accountant's one noised update per
    step does not describe.
    """
    replicated = replicated_parameters(modules)
    if replicated:
        raise UnsupportedConfigurationError(
            f"secure_mode with {len(replicated)} trainable parameter(s) replicated over ranks "
            f"({listing(replicated)}): each replica would add its own secure noise, so the "
            "replicas drift apart and the noise is not the accountant's. Shard every "
            'parameter (fully_shard over a 1-D mesh, or strategy="full"), or run without '
            "secure_mode."
        )


def check_reduction(modules: list[nn.Module]) -> None:
    """Refuses FSDP2 units whose gradient reduction may not be FSDP2's default average.

    Every DP optimizer here (and Opacus's) adds noise of std ``sigma * C / B`` to gradients it
    takes as averaged over the data-parallel ranks. ``set_gradient_divide_factor`` (or the older
    ``set_reduce_scatter_divide_factor``) changes that divisor (1.0 on 2 ranks doubles the
    update and halves the effective noise multiplier); ``set_custom_reduce_scatter`` and
    ``set_all_reduce_hook`` run the user's code on the reduction, which cannot be checked to
    average. HSDP's default (2-D mesh) and ``set_force_sum_reduction_for_comms(True)`` alone
    (torch sums, then divides by the data-parallel size) pass. Read at ``make_private`` only:
    changing any of them afterwards is not supported.

    Raises:
        UnsupportedConfigurationError: naming each unit and what is set.
        FSDPInternalsError: if this torch does not have the attributes read.
    """
    overrides = reduction_internals.reduction_overrides(modules)
    if overrides:
        raise UnsupportedConfigurationError(
            "FSDP2 gradient reduction other than the default average on unit(s) "
            f"{listing([f'{name!r} ({how})' for name, how in overrides])}: the DP noise (std "
            "sigma * C / B) is calibrated for gradients averaged over the data-parallel ranks, "
            "so another divisor, or user code on the reduction, changes the effective noise "
            "multiplier silently. Leave FSDP2's default averaging: do not call "
            "set_gradient_divide_factor, set_reduce_scatter_divide_factor, "
            "set_custom_reduce_scatter or set_all_reduce_hook on a unit of a private model (and do "
            "not call them after make_private either, which is not supported)."
        )


def _check_mesh_spans(model: nn.Module) -> None:
    """Refuses, without tensor parallelism, an FSDP2 mesh that leaves some ranks out.

    The noise is scaled for gradients averaged over every rank (``Layout.dp_degree``), and its
    streams are named by mesh shape: a unit on a sub-mesh (``mesh["dp"]`` of a (pp, dp) mesh)
    averages over fewer ranks, and ranks outside the sub-mesh with the same coordinates would
    draw the same noise for other parameters. Under tensor parallelism (a mesh dim named
    ``tp``, or a tp-sharded parameter) each tp rank's data-parallel sub-mesh is expected, and
    this check stands aside.
    """
    from torch.distributed.tensor import DTensor

    world = world_size()
    params = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if any("tp" in (p.device_mesh.mesh_dim_names or ()) or tp_sharded(p) for _, p in params):
        return  # frozen tp layers count too: the trained ones sit on the dp sub-mesh
    short = []
    for name, p in params:
        if p.requires_grad:
            if p.device_mesh.mesh.numel() != world:
                short.append(f"{name} (mesh of {p.device_mesh.mesh.numel()} ranks)")
    if short:
        raise UnsupportedConfigurationError(
            f"FSDP2 units on a mesh that does not span all {world} ranks: {listing(short)}. "
            "The DP noise is scaled for gradients averaged over every rank, and ranks outside "
            "the sub-mesh would share noise streams with it. Shard every unit on a mesh of "
            "all ranks (a 1-D mesh, or HSDP's (replicate, shard) mesh), or name the tensor-"
            "parallel dimension 'tp'."
        )


def check_layout(model: nn.Module, modules: list[nn.Module]) -> None:
    """Refuses trainable parameters no FSDP2 unit manages (each rank would noise its own)."""
    from torch.distributed.tensor import DTensor

    if world_size() <= 1:
        return
    _check_mesh_spans(model)
    plain = [
        n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
    ]
    if plain:
        raise UnsupportedConfigurationError(
            f"{len(plain)} trainable parameter(s) are not managed by FSDP2: "
            f"{listing(plain)}. No rank reduces their gradients and each rank would add its "
            "own noise, so the replicas drift apart and the noise is not the accountant's. "
            "Call fully_shard on the module that owns them (or on the root, after the "
            "blocks: fully_shard(model)), or freeze them (requires_grad_(False))."
        )
