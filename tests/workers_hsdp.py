"""Rank functions for HSDP on FSDP2: a 2 x 2 mesh (2 replica groups x 2 shards), 4 gloo ranks.

Each layout shards the MLP 32-256-256-4 of :mod:`tests.workers_layouts` (75,268 parameters,
every ``Linear`` its own unit plus the root) over a (replicate, shard) mesh, then trains it for
:data:`STEPS` private steps with Poisson sampling on (the engine's shared sampler, through
``make_private``'s data loader) at an expected global batch of :data:`BATCH` examples, so that
some rank's share of a draw is empty. The parent compares the results with the
clip-each-sample loop over the same global draws.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import CollectiveCounter, PrivacyEngine
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from tests.workers_layouts import _base, _named

warnings.filterwarnings("ignore")

#: Dataset size, expected global batch (the loader's batch size: q = BATCH / N), clipping bound,
#: noise multiplier, learning rate, private steps per run.
N, BATCH, C, SIGMA, LR, STEPS = 24, 4, 10.0, 1.0, 0.5, 2
#: The runs' ``dp_seed``: its first draws include a rank with an empty share (checked by the
#: test, which fails rather than passes vacuously if the sampler ever draws otherwise).
DP_SEED = 0
#: The two ways to build the same HSDP layout.
LAYOUTS = ("shard_model", "manual_2d")
#: ``one_backward`` of each mode: the default step, and the two-pass sync-skipping step.
MODES = {"one_backward": True, "two_pass": False}


def dataset() -> TensorDataset:
    """``N`` examples; per-sample gradient norms of the initial MLP from 6.8 to 17 (``C`` 10)."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        3 * torch.randn(N, 32, generator=g), torch.randint(0, 4, (N,), generator=g)
    )


def build(layout: str) -> nn.Module:
    """The MLP sharded as HSDP on a (2, 2) mesh: by ``shard_model`` or by hand.

    Args:
        layout: ``"shard_model"`` (the project's ``ShardingConfig``, mesh dimensions
            ``("replicate", "shard")``) or ``"manual_2d"`` (``fully_shard`` per layer and on the
            root, mesh dimensions ``("dp_replicate", "dp_shard")``).
    """
    model = _base()
    if layout == "shard_model":
        config = ShardingConfig(strategy="hybrid_full", replicate_degree=2, wrap_policy="per_layer")
        return shard_model(model, config, device=torch.device("cpu"))
    if layout != "manual_2d":
        raise ValueError(layout)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in (model.l1, model.l2, model.l3):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local(model: nn.Module) -> torch.Tensor:
    """This rank's shard of every parameter, flattened (what a replica must hold bit for bit)."""
    parts = [
        (p.to_local() if isinstance(p, DTensor) else p).detach().flatten()
        for p in model.parameters()
    ]
    return torch.cat(parts).clone()


def _counts(counter: CollectiveCounter) -> dict[str, int]:
    """Collectives per kind, over every phase."""
    out: dict[str, int] = {}
    for kinds in counter.as_dict().values():
        for kind, stats in kinds.items():
            out[kind] = out.get(kind, 0) + stats["count"]
    return out


def private_run(layout: str, one_backward: bool, noise: float) -> dict:
    """:data:`STEPS` private steps on ``layout``; after each: full and local parameters.

    Returns:
        ``full`` and ``local`` parameters after each step, each step's collectives per kind,
        this rank's batch sizes, the global selections, the expected batch, and whether each
        step ran one backward.
    """
    model = build(layout)
    # dp_seed opts in to reproducible DP randomness (never for a release): the parent's loop
    # must replay the very Poisson draws the ranks trained on, and the noisy run must draw what
    # the noise-free run drew, so that their difference after a step is the noise alone.
    engine = PrivacyEngine(dp_seed=DP_SEED, one_backward=one_backward)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(dataset(), batch_size=BATCH),
        noise_multiplier=noise,
        max_grad_norm=C,
        grad_sample_mode="ghost_fsdp",
    )
    out = {"full": [], "local": [], "counts": [], "sizes": [], "one_backward": []}
    batches = iter(loader)
    for _ in range(STEPS):
        xb, yb = next(batches)
        with CollectiveCounter() as counter:
            crit(gsm(xb), yb).backward()
            opt.step()
        opt.zero_grad()
        out["counts"].append(_counts(counter))
        out["sizes"].append(len(xb))
        out["one_backward"].append(engine.one_backward)
        out["full"].append(_named(model))
        out["local"].append(_local(model))
    sampler = engine.sampler
    out["selections"] = [sampler.global_draw(t).tolist() for t in range(STEPS)]
    out["expected_batch"] = sampler.sample_rate * sampler.num_samples
    out["world_share"] = sampler.world_size
    p = next(model.parameters())
    mesh = p.device_mesh
    out["mesh"] = (mesh.mesh_dim_names, mesh.get_coordinate(), [repr(pl) for pl in p.placements])
    return out


def non_private_counts(layout: str, rank: int) -> list[dict[str, int]]:
    """Collectives per kind of :data:`STEPS` plain SGD steps on the same layout (the floor)."""
    model = build(layout)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset().tensors
    counts = []
    for step in range(STEPS):
        lo = 2 * (4 * step + rank)
        with CollectiveCounter() as counter:
            F.cross_entropy(model(x[lo : lo + 2]), y[lo : lo + 2]).backward()
            opt.step()
        opt.zero_grad()
        counts.append(_counts(counter))
    return counts


def hsdp(rank: int, world: int) -> dict:
    """For each layout: every mode's noise-free and noisy runs, and the non-private counts."""
    if world != 4:
        raise ValueError(f"the 2 x 2 mesh needs 4 ranks, got {world}")
    out = {}
    for layout in LAYOUTS:
        for mode, one_backward in MODES.items():
            for noise in (0.0, SIGMA):
                out[layout, mode, noise] = private_run(layout, one_backward, noise)
        out[layout, "non_private"] = non_private_counts(layout, rank)
    return out
