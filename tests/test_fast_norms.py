"""Fast Linear norms: shared input Gram matrices, exact to fp32 rounding, fewer matmuls."""

import copy
import warnings

import opacus
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers.linear import GramCache
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.models import SharedInputSeqNet, seq_sample_loss
from tests.private import capture_ghost_log, make_private

warnings.filterwarnings("ignore")
B, T, D = 6, 10, 16


class _CountBmm(TorchDispatchMode):
    """Counts Gram matmuls (``bmm``) apart from the batched dots that contract them."""

    def __init__(self):
        super().__init__()
        self.bmm = 0
        self.dots = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bmm.default:
            if out.shape[1:] == (1, 1):
                self.dots += 1
            else:
                self.bmm += 1
        return out


@pytest.fixture()
def setup():
    torch.manual_seed(0)
    base = SharedInputSeqNet(D)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2 * B, T, D, generator=g), torch.randint(0, 8, (2 * B, T), generator=g)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), seq_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    return base, x, y, C


def _train(engine, base, x, y, C, counter=None, steps=2):
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    for s in range(steps):
        xs, ys = x[s * B : (s + 1) * B], y[s * B : (s + 1) * B]
        logits = gsm(xs)
        loss = crit(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1), shape=(B, T))
        if counter is not None and s == 0:
            with counter:
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, gsm


def _loop(base, x, y, C, steps=2):
    """Parameters after ``steps`` steps of the clip-each-sample loop (lr 0.5, as ``_train``)."""
    ref = copy.deepcopy(base)
    for s in range(steps):
        sl = slice(s * B, (s + 1) * B)
        clip_each_sample_step(ref, seq_sample_loss, x[sl], y[sl], C, 0.5)
    return {n: p.detach() for n, p in ref.named_parameters()}


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "one_backward,per_sample,gram_block",
    [(True, True, "auto"), (True, False, "auto"), (False, False, "auto"), (True, False, 4)]
    + [(False, False, 4), (True, False, 3)],
)
def test_fast_norms_equal_upstream_and_loop(setup, one_backward, per_sample, gram_block):
    """Gram blocks of 4 (or 3) tokens: T = 10 splits into 4 + 4 + 2 (3 + 3 + 3 + 1) rows."""
    base, x, y, C = setup
    engine = PrivacyEngine(
        one_backward=one_backward, per_sample_grads=per_sample, gram_block=gram_block
    )
    ours, gsm = _train(engine, base, x, y, C)
    assert gsm.gram_cache is not None
    upstream, _ = _train(opacus.PrivacyEngine(), base, x, y, C)
    loop = _loop(base, x, y, C)
    assert _diff(ours, upstream) <= 1e-6
    assert _diff(ours, loop) <= 1e-6
    assert _diff(ours, {n: p for n, p in base.named_parameters()}) > 1e-3


def test_shared_inputs_take_one_gram_each(setup):
    """Six Linear layers read three distinct inputs: 6 output Grams + 3 input Grams."""
    base, x, y, C = setup
    fast, slow = _CountBmm(), _CountBmm()
    _train(PrivacyEngine(one_backward=False), base, x, y, C, counter=fast)
    _train(PrivacyEngine(one_backward=False, fast_norms=False), base, x, y, C, counter=slow)
    print(f"bmm calls per backward: fast {fast.bmm}, upstream kernels {slow.bmm}")
    assert fast.bmm == 6 + 3
    assert slow.bmm > fast.bmm


def test_gram_cache_releases_after_last_reader():
    cache = GramCache()
    a = torch.randn(2, 5, 3)
    cache.note_input(a)
    cache.note_input(a)
    first = cache.gram(a, 0)
    assert cache._grams  # kept for the second reader
    assert cache.gram(a, 0) is first
    assert not cache._grams and not cache._readers
    (full,) = first
    torch.testing.assert_close(full, a @ a.transpose(1, 2))
    cache.note_input(a)
    cache.note_input(a)
    cache.gram(a, 0)
    cache.clear()
    assert not cache._grams and not cache._readers


def test_fast_norms_option_is_validated():
    with pytest.raises(ValueError, match="fast_norms"):
        PrivacyEngine(fast_norms="yes")
    for bad in (-1, "big", True, 2.5):
        with pytest.raises(ValueError, match="gram_block"):
            PrivacyEngine(gram_block=bad)


@pytest.mark.parametrize("by_product", [False, True])
@pytest.mark.parametrize("per_sample,gram_block", [(False, 0), (False, 4), (True, 0)])
def test_one_backward_step_flops_are_the_non_private_step_plus_the_norms(
    setup, per_sample, gram_block, by_product, monkeypatch
):
    """Counted: the one-backward step runs the non-private step's matmuls plus, with ghost norms,
    the Gram matrices (6 output Grams + 3 shared input Grams; with row blocks of 4 tokens, their
    upper block triangles: 68 of 100 entries at T = 10) and their contraction (the accelerator's
    batched dots of ``2 N`` FLOPs per entry and layer, each entry dotted once; the CPU's products
    and sums, no matmul), or, with per-sample gradients, one weighted sum per parameter
    (``2 N d_in d_out``): nothing else."""
    from torch import nn

    from opacus_fsdp_sync.layers import linear_grams
    from opacus_fsdp_sync.profiling import PhaseFlopCounter

    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", {"cpu"} if by_product else set())

    base, x, y, C = setup
    xs, ys = x[:B], y[:B]
    plain = copy.deepcopy(base)
    with PhaseFlopCounter() as nodp:
        logits = plain(xs)
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)).backward()
    engine = PrivacyEngine(per_sample_grads=per_sample, gram_block=gram_block)
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = make_private(engine, model, (x, y), B, C, "ghost")
    assert engine.one_backward
    bmm = _CountBmm()
    with PhaseFlopCounter() as ours, bmm:
        logits = gsm(xs)
        crit(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1), shape=(B, T)).backward()
        opt.step()
    layers = (base.q, base.k, base.v, base.gate, base.up, base.down)
    if per_sample:
        assert gsm.per_sample_policy.taken == len(layers)
        extra = sum(2 * B * p.numel() for m in layers for p in m.parameters())
    else:
        outs = [m.out_features for m in layers]
        ins = [base.q.in_features, base.gate.in_features, base.down.in_features]
        entries = {0: T * T, 4: 4 * 10 + 4 * 6 + 2 * 2}[gram_block]
        # each Gram element is dotted once
        extra = 2 * B * entries * (sum(outs) + sum(ins))
        extra += 0 if by_product else 2 * B * entries * len(layers)
        blocks = 3 if gram_block else 1
        assert bmm.bmm == (6 + 3) * blocks  # one bmm per row block
        # one dot per layer and row block: the input Gram's off-diagonal part is doubled where
        # it is made (upper_gram), not dotted apart from the diagonal block
        assert bmm.dots == (0 if by_product else 6 * blocks)
    total_nodp, total_ours = sum(nodp.flops.values()), sum(ours.flops.values())
    print(f"FLOPs: non-private {total_nodp}, one backward {total_ours}, extra {extra}")
    assert total_ours == total_nodp + extra
    assert "second_backward" not in ours.flops


@pytest.mark.parametrize("budget_layers,gram_block", [(0, "auto"), (2, "auto"), (2, 4)])
def test_per_sample_budget_mixes_paths_and_stays_exact(setup, budget_layers, gram_block):
    """A budget for only some layers: those take per-sample gradients, the rest ghost norms
    (with row blocks of 4 tokens: the shared input Grams cached in blocks, some readers skip)."""
    base, x, y, C = setup
    one_layer = B * base.down.in_features * base.down.out_features * 4  # down: first in backward
    budget = one_layer * budget_layers
    engine = PrivacyEngine(
        per_sample_grads=True, per_sample_grads_budget_bytes=budget, gram_block=gram_block
    )
    records = capture_ghost_log()
    ours, gsm = _train(engine, base, x, y, C)
    policy = gsm.per_sample_policy
    assert policy.used_bytes <= budget
    assert (policy.taken > 0) is (budget_layers > 0) and policy.declined > 0
    split = f"({policy.taken} layers from per-sample gradients, {6 - policy.taken} from their"
    assert sum(split in r for r in records) == 1, records  # logged once, on the first step
    ghost, _ = _train(PrivacyEngine(per_sample_grads=False), base, x, y, C)
    assert _diff(ours, ghost) <= 1e-6
    assert _diff(ours, _loop(base, x, y, C)) <= 1e-6


def test_per_sample_grads_option_is_validated():
    with pytest.raises(ValueError, match="per_sample_grads"):
        PrivacyEngine(per_sample_grads="sometimes")
    with pytest.raises(ValueError, match="per_sample_grads_budget_bytes"):
        PrivacyEngine(per_sample_grads_budget_bytes=-1)


def test_per_sample_cost_rule_follows_the_machine_balance():
    from opacus_fsdp_sync.layers.linear_policy import PerSampleGradPolicy, machine_balance

    cpu_dev, cuda_dev = torch.device("cpu"), torch.device("cuda")  # device objects only
    cpu = PerSampleGradPolicy(1, flops_per_byte=machine_balance(cpu_dev))
    gpu = PerSampleGradPolicy(1, flops_per_byte=machine_balance(cuda_dev))
    assert cpu.cheaper(128, 256, 688, 4, cpu_dev)  # the small preset's MLP at seq 128
    assert not cpu.cheaper(10, 16, 12, 4, cpu_dev)  # short sequences, tiny layers: ghost norms
    # The upper block triangle (9/16 of the Gram FLOPs at 8 blocks) tips the same layer to ghost.
    blocked = PerSampleGradPolicy(1, flops_per_byte=cpu.flops_per_byte, gram_block=16)
    assert not blocked.cheaper(128, 256, 688, 4, cpu_dev)
    assert not gpu.cheaper(1024, 2048, 8192, 2, cuda_dev)  # Llama-3.2-1B MLP at T = 1024: ghost
    assert gpu.cheaper(8192, 2048, 2048, 2, cuda_dev)  # long sequences: per-sample
    # Unset balance and "auto" blocks resolve by the device. CPU: 64-token blocks (3/4 of the
    # FLOPs at T = 128) tip a 450 x 450 layer to ghost norms; full Grams would not.
    full, auto_policy = (
        PerSampleGradPolicy(1, gram_block=0),
        PerSampleGradPolicy(1, gram_block="auto"),
    )
    assert full.cheaper(128, 450, 450, 4, cpu_dev)
    assert not auto_policy.cheaper(128, 450, 450, 4, cpu_dev)
    assert auto_policy.cheaper(128, 450, 450, 4, cpu_dev, blocked=False)  # DTensor: full Grams
    # CUDA: balance 400 and 512-token blocks (5/8 of the FLOPs at T = 2048) tip a 5000 x 5000
    # bf16 layer; with the CPU balance both would take per-sample gradients.
    assert full.cheaper(2048, 5000, 5000, 2, cuda_dev)
    assert not auto_policy.cheaper(2048, 5000, 5000, 2, cuda_dev)
    auto = PrivacyEngine()
    model = copy.deepcopy(SharedInputSeqNet(D))
    x, y = torch.randn(B, T, D), torch.randint(0, 8, (B, T))
    gsm, opt, crit, _ = make_private(auto, model, (x, y), B, 1.0, "ghost")
    logits = gsm(x)
    crit(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=(B, T)).backward()
    assert gsm.per_sample_policy.taken == 0  # "auto" on CPU: this model is cheaper with ghost
    assert gsm.per_sample_policy.gram_block == gsm.gram_cache.block == "auto"
    blocks4 = PrivacyEngine(gram_block=4)
    gsm4, *_ = make_private(blocks4, SharedInputSeqNet(D), (x, y), B, 1.0, "ghost")
    assert gsm4.per_sample_policy.gram_block == gsm4.gram_cache.block == 4


@pytest.mark.parametrize("gram_block", [0, 4])
def test_frozen_weights_with_trainable_biases_are_exact(setup, gram_block):
    """q and up train only their bias: their norms come from the bias term alone, and the input
    Grams they share with k/v and gate are counted for the weight readers only."""
    base, x, y, C = setup
    base = copy.deepcopy(base)
    base.q.weight.requires_grad_(False)
    base.up.weight.requires_grad_(False)
    _, norms = per_sample_clipped_grads(copy.deepcopy(base), seq_sample_loss, x[:B], y[:B], 1.0)
    C = norms.median().item()
    assert 0 < (norms > C).sum() < B  # clipping active
    engine = PrivacyEngine(per_sample_grads=False, gram_block=gram_block)
    ours, gsm = _train(engine, base, x, y, C)
    assert not gsm.gram_cache._grams and not gsm.gram_cache._readers  # nothing left behind
    upstream, _ = _train(opacus.PrivacyEngine(), base, x, y, C)
    loop = _loop(base, x, y, C)
    assert _diff(ours, upstream) <= 1e-6
    assert _diff(ours, loop) <= 1e-6
    assert (ours["q.weight"] == base.q.weight).all()  # frozen
    assert (ours["q.bias"] - base.q.bias).abs().max() > 1e-3  # trained
