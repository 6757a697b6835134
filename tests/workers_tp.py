"""Rank functions for tensor parallelism: FSDP2 x TP on a (dp 2, tp 2) mesh, and TP alone.

The model reads sequences: ``l1`` (column-wise parallel), a ReLU, ``l2`` (row-wise parallel, its
bias replicated over tp), a residual, then ``l3``, left out of the tp plan (replicated over
tp), and a mean over tokens. Each layout trains it for :data:`STEPS` private steps with Poisson
sampling on (the engine's shared sampler) at an expected global batch of :data:`BATCH`, with
noise 0 and with noise :data:`SIGMA` on the same draws; the parent compares the noise-free
parameters with the clip-each-sample loop over the same global draws and reads the noise off
the difference.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model
from opacus_fsdp_sync.testing import per_sample_clipped_grads

warnings.filterwarnings("ignore")

#: Dataset size, expected global batch, tokens, widths, clipping bound, noise multiplier,
#: learning rate, private steps per run.
N, BATCH, T, D, H, SIGMA, LR, STEPS = 24, 4, 4, 64, 512, 1.0, 0.5, 2
#: Each model's clipping bound: some of the first draw's norms above it, some below.
CLIP = {"seq": 11.0, "sp": 7.0}
#: The runs' ``dp_seed``: its first draws leave one data-parallel share empty on the 2 x 2
#: mesh (the test checks it happened).
DP_SEED = 69
#: Layout -> (dp degree, tp degree, whether fully_shard wraps the model over dp). The
#: ``shard_model_*`` layout comes from ``ShardingConfig(tp_degree=2)``: HSDP x TP on a
#: (dp_replicate 2, dp_shard 1, tp 2) mesh (its FSDP2 x TP mesh is the Llama test's).
LAYOUTS = {
    "fsdp2_tp": (2, 2, True),
    "tp_alone": (1, 2, False),
    "shard_model_hsdp_tp": (2, 2, True),
    "sp_fsdp2_tp": (2, 2, True),  # sequence parallelism (SPNet)
}
#: Layouts also run with two backward passes (``one_backward=False``), noise 0.
TWO_PASS = ("fsdp2_tp", "sp_fsdp2_tp")
#: Each model's parameters sharded over tp, and those replicated over tp.
TP_SHARDED = {
    "seq": ("l1.weight", "l1.bias", "l2.weight"),
    "sp": ("l1.weight", "l1.bias", "l2.weight", "l3.weight", "l3.bias"),
}
TP_REPLICATED = {
    "seq": ("l2.bias", "l3.weight", "l3.bias"),
    "sp": ("inp.weight", "inp.bias", "norm.weight", "l2.bias"),
}


def model_kind(layout: str) -> str:
    """``"sp"`` for the sequence-parallel layouts (:class:`SPNet`), else ``"seq"``."""
    return "sp" if layout.startswith("sp_") else "seq"


class SeqNet(nn.Module):
    """64 -> 512 -> 64 (+ residual) -> 4 on every token, mean over tokens: 66,372 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(x + self.l2(torch.relu(self.l1(x)))).mean(1)


class SPNet(nn.Module):
    """Sequence parallelism: a Linear on every token, then the sequence split over tp
    (``split``), a ``SequenceParallel`` RMSNorm, ``l1`` column-wise from the split sequence,
    ``l2`` row-wise back to it, a residual on the split sequence, and ``l3`` column-wise
    gathering the sequence; 70,596 parameters. Unparallelized, ``split`` passes everything."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.inp, self.split, self.norm = nn.Linear(D, D), nn.Identity(), LlamaRMSNorm(D)
        self.l1, self.l2, self.l3 = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.split(self.inp(x))
        h = h + self.l2(torch.relu(self.l1(self.norm(h))))
        return self.l3(h).mean(1)


def sp_plan() -> dict:
    """:class:`SPNet`'s sequence-parallel plan (torchtitan's styles for a block)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel

    return {
        "split": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "l1": ColwiseParallel(input_layouts=Shard(1)),
        "l2": RowwiseParallel(output_layouts=Shard(1)),
        "l3": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def base(kind: str = "seq") -> nn.Module:
    """The unsharded model every layout starts from (the loop's copy too)."""
    torch.manual_seed(0)
    model = SPNet() if kind == "sp" else SeqNet()
    if kind == "sp":
        with torch.no_grad():  # a non-trivial norm weight
            model.norm.weight.uniform_(0.5, 1.5)
    return model


def sample_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One sample's loss (the loop's)."""
    return nn.functional.cross_entropy(model(x), y)


def dataset() -> TensorDataset:
    """``N`` sequences; per-sample gradient norms of the initial models around their ``CLIP``."""
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        2 * torch.randn(N, T, D, generator=g), torch.randint(0, 4, (N,), generator=g)
    )


def build(layout: str) -> nn.Module:
    """``l1`` column-wise and ``l2`` row-wise over the mesh's ``"tp"`` dimension; FSDP2 over
    ``"dp"`` where the layout says so."""
    dp, tp, fsdp = LAYOUTS[layout]
    model = base(model_kind(layout))
    if layout == "shard_model_hsdp_tp":
        config = ShardingConfig(
            strategy="hybrid_full",
            replicate_degree=2,
            wrap_policy="per_layer",
            tp_degree=tp,
            tp_plan={"l1": ColwiseParallel(), "l2": RowwiseParallel()},
        )
        return shard_model(model, config, device=torch.device("cpu"))
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = (
        sp_plan()
        if model_kind(layout) == "sp"
        else {
            "l1": ColwiseParallel(),
            "l2": RowwiseParallel(),
        }
    )
    parallelize_module(model, mesh["tp"], plan)
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def private_run(layout: str, noise: float, one_backward: bool = True) -> dict:
    """:data:`STEPS` private steps; after each, the full and the local parameters.

    Returns:
        ``full`` / ``local`` parameters per step, this rank's batch sizes, the global draws,
        the expected batch per data-parallel rank the optimizer uses, the sampler's share
        count and this rank's share index, and the per-sample norms of the first step.
    """
    model = build(layout)
    # dp_seed opts in to reproducible DP randomness (never for a release): the parent's loop
    # must replay the very Poisson draws the ranks trained on, and the noisy run must draw what
    # the noise-free run drew, so that their difference after a step is the noise alone.
    engine = PrivacyEngine(dp_seed=DP_SEED, one_backward=one_backward)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(dataset(), batch_size=BATCH),
        noise_multiplier=noise,
        max_grad_norm=CLIP[model_kind(layout)],
        grad_sample_mode="ghost_fsdp",
    )
    out = {"full": [], "local": [], "sizes": [], "norms": None, "asked": one_backward}
    batches = iter(loader)
    for step in range(STEPS):
        xb, yb = next(batches)
        crit(gsm(xb), yb).backward()
        if step == 0 and len(xb):
            out["norms"] = gsm.per_sample_gradient_norms.detach().clone()
        if step == 0 and model_kind(layout) == "sp":  # the norm room's group is the layout's
            group = gsm.sequence_group(model.norm)
            out["norm_group"] = group is not None and group is gsm.layout.sequence_group
        opt.step()
        opt.zero_grad()
        out.setdefault("one_backward", []).append(engine.one_backward)
        out["sizes"].append(len(xb))
        out["full"].append(_full(model))
        out["local"].append(_locals(model))
    sampler = engine.sampler
    out["selections"] = [sampler.global_draw(t).tolist() for t in range(STEPS)]
    out["shares"], out["share"] = sampler.world_size, sampler.rank
    out["expected_batch"] = opt.expected_batch_size
    out["divisor"] = opt.world_size
    out["layout"] = (gsm.layout.dp_degree, gsm.layout.tp_degree, gsm.layout.cp_degree)
    out["added"] = sorted(
        {k for n, m in model.named_modules() for k in set(vars(m)) - before.get(n, set())}
    )
    out["api"] = engine.distributed_api
    p = model.l1.weight
    out["mesh"] = (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape))
    return out


def tensor_parallel(rank: int, world: int, layout: str) -> dict:
    """The noise-free and the noisy run of ``layout`` on this rank."""
    dp, tp, _ = LAYOUTS[layout]
    if world != dp * tp:
        raise ValueError(f"{layout} needs {dp * tp} ranks, got {world}")
    out = {noise: private_run(layout, noise) for noise in (0.0, SIGMA)}
    if layout in TWO_PASS:
        out["two_pass"] = private_run(layout, 0.0, one_backward=False)
    return out


def llama_tp(rank: int, world: int) -> dict:
    """Tiny Llama (GQA: 4 query, 2 key/value heads) with ``ShardingConfig(tp_degree=2)``'s
    Llama plan, on a (dp_shard world/2, tp 2) mesh: one private step against the loop.

    Poisson sampling is off here: one fixed batch, so the loop replays it without the sampler
    (the sampler's part under tensor parallelism is checked by :func:`tensor_parallel`).
    """
    import copy

    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from opacus_fsdp_sync.testing import clip_each_sample_step
    from tests.private import lm_loss, make_private
    from tests.workers_tied import llama_sample_loss

    torch.manual_seed(0)
    base = build_llama(LlamaSpec(preset="tiny"))
    dp, b_local = world // 2, 2
    ids = torch.randint(
        1, base.config.vocab_size, (b_local * dp, 8), generator=torch.Generator().manual_seed(7)
    )
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), llama_sample_loss, ids, ids, 1.0)
    c = norms.median().item()
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, llama_sample_loss, ids, ids, c, LR)
    model = shard_model(
        copy.deepcopy(base), ShardingConfig(tp_degree=2), device=torch.device("cpu")
    )
    p = model.model.layers[0].self_attn.q_proj.weight
    mesh = (p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape))
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(), model, (ids,), b_local * dp, c, "ghost_fsdp", lr=LR
    )
    share = (rank // 2) * b_local  # the tp ranks of one data-parallel group: the same examples
    lm_loss(gsm, crit, ids[share : share + b_local]).backward()
    opt.step()
    full = _full(model)
    diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    sharded = sorted(
        n
        for n, p in model.named_parameters()
        if "tp" in (p.device_mesh.mesh_dim_names or ()) and not p.placements[-1].is_replicate()
    )
    return {
        "diff": diff,
        "clipped": int((norms > c).sum()),
        "n": len(norms),
        "tp_sharded": sharded,
        "mesh": mesh,
    }


def review_cases(rank: int, world: int) -> dict:
    """Cases a review found, on 2 ranks (dp 1 x tp 2 under fully_shard, or TP alone).

    ``frozen``: the tp-sharded layers frozen, only ``l3`` trained: the data-parallel degree
    still comes from the mesh (shares, divisor), the step is the loop's; ``misnamed``: the tp
    mesh dimension named ``"mp"``: refused; ``secure``: ``secure_mode`` under FSDP2 x TP:
    refused; ``mlp_2d``: a (batch, features) model with a row-wise layer (its input is
    ``Shard(1)`` but not a sequence): one step equals the loop's; ``bf16_sum``: 400 bf16 unit
    norms summed over tp in fp32 (norm 20, not bf16's 16). Poisson sampling is off: one fixed
    batch per case (the sampler under TP is checked by :func:`tensor_parallel`).
    """
    import copy

    from opacus_fsdp_sync.distributed.tensor_parallel import tp_group, tp_norm_sum
    from opacus_fsdp_sync.testing import clip_each_sample_step
    from tests.private import make_private

    out = {}
    x, y = dataset().tensors
    xb, yb = x[:4], y[:4]

    def step(model, engine=None, data=(xb, yb), c=CLIP["seq"], loss=sample_loss, ref=None):
        gsm, opt, crit, _ = make_private(
            engine or PrivacyEngine(), model, data, len(data[0]), c, "ghost_fsdp", lr=LR
        )
        crit(gsm(data[0]), data[1]).backward()
        opt.step()
        full = _full(model)
        clip_each_sample_step(ref, loss, data[0], data[1], c, LR)
        diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        return diff, opt.world_size, engine

    # frozen tensor-parallel layers
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = base()
    ref = copy.deepcopy(model)
    for m in (model.l1, model.l2, ref.l1, ref.l2):
        m.requires_grad_(False)
    parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    engine = PrivacyEngine()
    diff, divisor, _ = step(model, engine, ref=ref)
    out["frozen"] = {"diff": diff, "divisor": divisor, "api": engine.distributed_api}
    # a tp dimension not named "tp"; secure_mode (a stand-in for torchcsprng, as the layout
    # tests use, since the refusal comes before any secure draw)
    from tests.workers_layouts import _stand_in_csprng

    _stand_in_csprng()
    for case, names in (("misnamed", ("dp", "mp")), ("secure", ("dp", "tp"))):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=names)
        model = base()
        parallelize_module(model, mesh[names[1]], {"l1": ColwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        try:
            step(model, PrivacyEngine(secure_mode=case == "secure"), ref=base())
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            out[case] = f"{type(err).__name__}: {err}"
        else:
            out[case] = None
    # (batch, features) input through a row-wise layer, TP alone
    from tests.workers_layouts import _base, _sample_loss

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _base()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    g = torch.Generator().manual_seed(3)
    data = (3 * torch.randn(4, 32, generator=g), torch.randint(0, 4, (4,), generator=g))
    out["mlp_2d"] = step(model, data=data, c=1.0, loss=_sample_loss, ref=ref)[0]
    # bf16 norms summed in fp32
    p = next(p for p in build("tp_alone").parameters() if p.requires_grad)
    ones = [torch.ones(3, dtype=torch.bfloat16) for _ in range(400)]
    zero = [torch.zeros(3, dtype=torch.bfloat16)]
    out["bf16_sum"] = tp_norm_sum(tp_group(p))(ones if rank == 0 else zero, []).tolist()
    return out


def agreed_budget(rank: int, world: int) -> list:
    """The one-backward memory budget the tp ranks agree on, from per-rank options."""
    from opacus_fsdp_sync.one_backward.memory import MemoryBudget

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    budget = MemoryBudget(
        1000 * (rank + 1), torch.device("cpu"), distributed=True, tp_group=mesh.get_group(0)
    )
    return [budget.budget(), MemoryBudget(None, torch.device("cpu"), distributed=True).budget()]


def context_parallel_mesh(rank: int, world: int) -> str | None:
    """``fully_shard`` over torchtitan's ``dp_shard_cp`` dimension: the refusal message."""
    from tests.private import make_private

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    model = base()
    fully_shard(model, mesh=mesh)
    x, y = dataset().tensors
    try:
        make_private(PrivacyEngine(), model, (x[:4], y[:4]), 4, 1.0, "ghost_fsdp")
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None
