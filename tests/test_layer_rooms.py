"""Every hooked layer type has a room; the engine dispatches through the registry; each room's
norm, per-sample gradient and clipped gradient agree on the same tensors.

References: a room's per-sample gradients are checked against autograd one sample at a time
(fp64, 1e-10), its norm against their norms, its clipped gradient against their weighted sum;
the fake room's step against the clip-each-sample loop (fp32, 1e-6).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers import (
    LayerRoom,
    Unavailable,
    register_layer,
    room_for,
    room_named,
    rooms,
    unregister_layer,
)
from opacus_fsdp_sync.layers.linear_norms import LinearNormSampler
from opacus_fsdp_sync.layers.tied import find_shared_parameters
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")
B, T, D, V = 4, 5, 6, 11
TOL = 1e-6
LR = 0.5
#: The RMSNorm formula, as Llama, takes the variance in fp32: fp64 inputs agree to fp32 rounding.
ROOM_TOL = {"linear": 1e-10, "layer_norm": 1e-10, "rms_norm": 1e-6, "generic": 1e-10}


class RMSNormLike(nn.Module):
    """Llama's RMSNorm: ``w * x / sqrt(mean(x^2) + eps)`` (fp32 variance)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class Gain(nn.Module):
    """``tanh(x) * w``: a layer no room and no Opacus sampler covers (the generic room)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x) * self.weight


class AllKinds(nn.Module):
    """Embedding, Linear, LayerNorm, an RMSNorm-like layer, a generic layer, a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.rms = RMSNormLike(D)
        self.gain = Gain(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.gain(self.rms(self.ln(self.lin(self.emb(ids))))))


def _complete(room: LayerRoom) -> bool:
    """All three present: a function, or an explicit :class:`Unavailable` saying why."""
    parts = (room.norm, room.per_sample_grad, room.clipped_grad)
    return all(callable(p) or (isinstance(p, Unavailable) and p.why) for p in parts)


@pytest.mark.parametrize("fast_norms", [True, False])
def test_every_hooked_layer_type_has_a_complete_room(fast_norms):
    model = AllKinds()
    engine = PrivacyEngine(fast_norms=fast_norms)
    ids = torch.randint(1, V, (B, T))
    gsm, *_ = make_private(engine, model, (ids, ids), B, 1.0, "ghost")
    hooked = list(gsm.iterate_submodules(gsm._module))
    found = {type(m).__name__: room_for(m, gsm.layer_type(m)).name for m in hooked}
    assert found == {
        "Embedding": "embedding",
        "Linear": "linear",
        "LayerNorm": "layer_norm",
        "RMSNormLike": "rms_norm",
        "Gain": "generic",
    }
    assert find_shared_parameters(model)  # the tied head: the tied room's case
    assert {"linear", "embedding", "layer_norm", "rms_norm", "generic", "tied"} <= set(rooms())
    assert all(_complete(room) for room in rooms().values())
    # The hooks' norms are the rooms' (Opacus's own per-sample path for the LayerNorm).
    assert gsm.NORM_SAMPLERS[nn.Embedding] is room_named("embedding").norm
    linear = gsm.NORM_SAMPLERS[nn.Linear]
    if fast_norms:  # the Linear room's Gram-matrix norm (LinearRoom.fast_norm)
        assert isinstance(linear, LinearNormSampler)
    else:
        assert linear is room_named("linear").norm
    assert gsm.NORM_SAMPLERS[RMSNormLike] is room_named("rms_norm").norm
    assert gsm.NORM_SAMPLERS[Gain] is room_named("generic").norm
    assert nn.LayerNorm not in gsm.NORM_SAMPLERS


class Scale(nn.Module):
    """``x * w``, with a room registered by the test below."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.weight


class ScaleRoom(LayerRoom):
    """The test's room for :class:`Scale`: counts its calls."""

    name = "test_scale"
    calls = {"norm": 0, "clipped_grad": 0}
    per_sample_grad = Unavailable("per-sample gradient", "the test's room has none")

    def norm(self, layer, activations, backprops):
        type(self).calls["norm"] += 1
        x, g = activations[0], backprops
        psg = (x * g).reshape(x.shape[0], -1, x.shape[-1]).sum(1)
        return {layer.weight: psg.norm(2, dim=-1)}

    def clipped_grad(self, layer, inputs, grad_out, scale):
        type(self).calls["clipped_grad"] += 1
        x = inputs[0]
        grad_out = grad_out * scale.view(-1, *[1] * (grad_out.dim() - 1))
        return {"weight": (x * grad_out).reshape(-1, x.shape[-1]).sum(0)}


class ScaleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.scale = Scale(D)
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.scale(self.inp(x))))


@pytest.fixture()
def scale_room():
    register_layer(Scale)(ScaleRoom)
    ScaleRoom.calls.update(norm=0, clipped_grad=0)
    try:
        yield ScaleRoom
    finally:
        unregister_layer(Scale)


@pytest.mark.parametrize("one_backward", [True, False])
def test_engine_uses_a_registered_room(scale_room, one_backward):
    torch.manual_seed(0)
    base = ScaleNet()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, T, D, generator=g), torch.randint(0, 3, (B,), generator=g)

    def loss_fn(model, xi, yi):
        return F.cross_entropy(model(xi).sum(1), yi)

    _, norms = per_sample_clipped_grads(copy.deepcopy(base), loss_fn, x, y, 1.0)
    C = norms.median().item()
    ref = copy.deepcopy(base)
    clip_each_sample_step(ref, loss_fn, x, y, C, LR)
    model = copy.deepcopy(base)
    engine = PrivacyEngine(one_backward=one_backward)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost", lr=LR)
    room = room_for(model.scale)
    assert isinstance(room, ScaleRoom) and gsm.NORM_SAMPLERS[Scale] == room.norm
    crit(gsm(x).sum(1), y).backward()
    opt.step()
    assert engine.one_backward is one_backward
    assert scale_room.calls == {"norm": 1, "clipped_grad": 1 if one_backward else 0}
    assert (norms > C).any() and (norms <= C).any()  # clipping active
    moved = {n: p.detach() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        assert (moved[n] - p).abs().max().item() <= TOL, n
    assert (moved["scale.weight"] - base.scale.weight).abs().max().item() > 1e-3


def _psg_by_autograd(layer, x, g):
    """Each sample's gradient of ``<g_n, layer(x_n)>`` by autograd."""
    params = {n: p for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    out = {n: [] for n in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(layer(x[i : i + 1]), list(params.values()), g[i : i + 1])
        for n, gr in zip(params, grads):
            out[n].append(gr)
    return {n: torch.stack(v) for n, v in out.items()}


LAYERS = {
    "linear": lambda: nn.Linear(D, 3),
    "linear_wide": lambda: nn.Linear(D, 3 * D),  # the clipped gradient scales the input
    "layer_norm": lambda: nn.LayerNorm(D),
    "rms_norm": lambda: RMSNormLike(D, eps=0.1),
    "generic": lambda: Gain(D),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_room_norm_and_gradients_from_the_same_tensors(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind]().double()
    room, tol = room_for(layer), ROOM_TOL[kind.removesuffix("_wide")]
    assert room.name == kind.removesuffix("_wide")
    x = torch.randn(B, T, D, dtype=torch.float64)
    g = torch.randn(B, T, layer(x).shape[-1], dtype=torch.float64)
    auto = _psg_by_autograd(layer, x, g)
    psg = room.per_sample_grad(layer, [x], g)
    assert psg.keys() == auto.keys()
    for n in auto:
        assert (psg[n] - auto[n]).abs().max().item() <= tol, n
    if room.norm:
        norms = room.norm(layer, [x], g)
        for n, p in layer.named_parameters():
            expected = auto[n].flatten(1).norm(dim=1)
            assert (norms[p] - expected).abs().max().item() <= tol, n
    else:  # Opacus's per-sample gradients give the norm: ours agree with them
        upstream = GradSampleHooksFastGradientClipping.GRAD_SAMPLERS[type(layer)]
        for p, gs in upstream(layer, [x], g).items():
            n = next(k for k, q in layer.named_parameters() if q is p)
            assert (gs - auto[n]).abs().max().item() <= tol, n
    c = torch.rand(B, dtype=torch.float64)
    clipped = room.clipped_grad(layer, [x], g, c)
    for n in auto:
        expected = (auto[n] * c.view(-1, *[1] * (auto[n].dim() - 1))).sum(0)
        assert (clipped[n] - expected).abs().max().item() <= tol, n


def test_embedding_room_norm_and_clipped_gradient_from_the_same_tensors():
    torch.manual_seed(0)
    layer = nn.Embedding(V, D, padding_idx=0).double()
    room = room_for(layer)
    ids = torch.randint(0, V, (B, T))
    ids[:, 0] = 0  # padding positions get no gradient
    g = torch.randn(B, T, D, dtype=torch.float64)
    auto = _psg_by_autograd(layer, ids, g)["weight"]
    assert not room.per_sample_grad and room.per_sample_grad.why
    norms = room.norm(layer, [ids], g)[layer.weight]
    assert (norms - auto.flatten(1).norm(dim=1)).abs().max().item() <= 1e-10
    c = torch.rand(B, dtype=torch.float64)
    clipped = room.clipped_grad(layer, [ids], g, c)["weight"]
    assert (clipped - (auto * c.view(-1, 1, 1)).sum(0)).abs().max().item() <= 1e-10


def test_embedding_norm_sums_as_opacus_does_and_reads_any_id_layout():
    """Without padding, fp32: Opacus's sampler's values bit for bit (same summation order); ids
    sliced (not contiguous) or int32 give the same norms; an empty batch gives none; bf16
    gradients are summed in fp32."""
    from opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample

    torch.manual_seed(0)
    layer = nn.Embedding(V, D)
    room = room_for(layer)
    ids = torch.randint(0, V, (B, 2 * T))
    ids[:, 1] = ids[:, 3]  # a token repeated within a sample
    g = torch.randn(B, 2 * T, D)
    ours = room.norm(layer, [ids], g)[layer.weight]
    upstream = compute_embedding_norm_sample(layer, [ids], g)[layer.weight]
    assert torch.equal(ours, upstream)
    sliced = ids[:, ::2]
    assert not sliced.is_contiguous()
    expected = room.norm(layer, [sliced.contiguous()], g[:, ::2])[layer.weight]
    assert torch.equal(room.norm(layer, [sliced], g[:, ::2])[layer.weight], expected)
    assert torch.equal(room.norm(layer, [ids.int()], g)[layer.weight], ours)
    empty = room.norm(layer, [ids[:0]], g[:0])[layer.weight]  # an empty local batch
    assert empty.shape == (0,)
    low = room.norm(layer, [ids], g.bfloat16())[layer.weight]
    exact = _psg_by_autograd(layer.double(), ids, g.bfloat16().double())["weight"]
    assert low.dtype == torch.float32
    assert (low.double() - exact.flatten(1).norm(dim=1)).abs().max().item() <= 1e-5


def test_tied_room_cross_term_and_sum():
    torch.manual_seed(0)
    emb, head = nn.Embedding(V, D).double(), nn.Linear(D, V, bias=False).double()
    head.weight = emb.weight
    ids = torch.randint(0, V, (B, T))
    a, e = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64)
    b = torch.randn(B, T, V, dtype=torch.float64)
    g_emb = _psg_by_autograd(emb, ids, e)["weight"]
    g_head = _psg_by_autograd(head, a, b)["weight"]
    tied = room_named("tied")
    cross = tied.norm(tied.Use(head, a, b), tied.Use(emb, ids, e))
    expected = (g_emb * g_head).sum((1, 2))  # formed in fp32: to fp32 rounding of |G1| |G2|
    scale = g_emb.flatten(1).norm(dim=1) * g_head.flatten(1).norm(dim=1)
    assert ((cross - expected).abs() / scale).max().item() <= 1e-6
    assert torch.equal(tied.clipped_grad([g_emb[0], g_head[0]]), g_emb[0] + g_head[0])
    assert not tied.per_sample_grad and tied.per_sample_grad.why


def test_embedding_norm_reads_nothing_back_to_the_host():
    """No op whose output size or value the host must read from the device (a GPU sync in the
    middle of the first pass): no ``unique``, ``nonzero`` or scalar read; padding included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    layer = nn.Embedding(V, D, padding_idx=1)
    ids = torch.randint(0, V, (B, T))
    with Ops() as ops:
        room_for(layer).norm(layer, [ids], torch.randn(B, T, D))
    syncing = {"_unique2", "unique_dim", "unique_consecutive", "nonzero", "_local_scalar_dense"}
    assert not ops.names & syncing, ops.names & syncing
    assert "sort" in ops.names


def test_readers_of_one_input_share_its_scaled_copy_bit_for_bit(monkeypatch):
    """gate and up (inputs narrower than outputs) scale their one input once, the same tensor,
    dropped after its last reader (a whole-step hand-off computes every layer in one call)."""
    import gc
    import weakref

    from opacus_fsdp_sync.layers import linear
    from opacus_fsdp_sync.one_backward.step import clipped_gradients

    torch.manual_seed(0)
    n, t, d = 3, 5, 4
    gate, up, down = nn.Linear(d, 9, bias=False), nn.Linear(d, 9, bias=True), nn.Linear(9, d)
    a = torch.randn(n, t, d)
    hidden = torch.randn(n, t, 9)
    grads = [torch.randn(n, t, 9), torch.randn(n, t, 9), torch.randn(n, t, d)]
    # each layer's captured input is its own detached view of the one tensor
    kept = [(gate, [a.detach()], grads[0]), (up, [a.detach()], grads[1])]
    kept.append((down, [hidden], grads[2]))
    coef = torch.rand(n)
    calls, made = [], []
    scale_rows, clipped = linear.scale_rows, linear.linear_clipped_grad

    def counted(x, scale, dtype=None):
        calls.append(x)
        out = scale_rows(x, scale, dtype)
        made.append(weakref.ref(out))
        return out

    def after_the_last_reader(layer, x, g, scale):
        if layer is down:  # gate and up are done: their shared copy is gone
            gc.collect()
            assert made[0]() is None
        return clipped(layer, x, g, scale)

    monkeypatch.setattr(linear, "scale_rows", counted)
    monkeypatch.setattr(linear, "linear_clipped_grad", after_the_last_reader)
    got = clipped_gradients(kept, coef, "sum", type)
    assert len(calls) == 2  # a once for gate and up, down's output gradient once
    assert calls[0] is kept[0][1][0] and calls[1] is grads[2]
    calls.clear()
    for layer, inputs, g in kept:  # outside the block: each layer scales its own operand
        want = clipped(layer, inputs[0], g, coef)
        for name, w in want.items():
            assert torch.equal(got[(id(layer), name)][2], w)
    assert len(calls) == 3
    ref = torch.einsum("n,nto,nti->oi", coef, grads[1], a)
    assert torch.allclose(got[(id(up), "weight")][2], ref, atol=1e-6)
