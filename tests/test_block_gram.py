"""Upper-block-triangle Gram contractions: equal to the full Gram's, fewer FLOPs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opacus_fsdp_sync.layers.linear import GramCache
from opacus_fsdp_sync.layers.linear_grams import (
    contract_output_grams,
    flop_fraction,
    resolve_block,
    row_blocks,
    upper_gram,
)
from opacus_fsdp_sync.testing import run_ranks
from tests import workers_misc


def _blocked(a, g, block):
    return contract_output_grams(upper_gram(a, block), g, block, bias=True)


@pytest.mark.parametrize("t", [1, 7, 10, 64])
@pytest.mark.parametrize("block", [0, 1, 3, 4, 64])
def test_blocked_contraction_equals_the_full_one(t, block):
    gen = torch.Generator().manual_seed(t * 100 + block)
    a = torch.randn(3, t, 5, dtype=torch.float64, generator=gen)
    g = torch.randn(3, t, 4, dtype=torch.float64, generator=gen)
    full = (torch.bmm(a, a.mT) * torch.bmm(g, g.mT)).sum((1, 2))
    # The per-sample weight-gradient norm the contraction stands for.
    direct = torch.bmm(g.mT, a).pow(2).sum((1, 2))
    torch.testing.assert_close(full, direct)
    total, gsum = _blocked(a, g, block)
    torch.testing.assert_close(total, full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gsum, g.sum(1).pow(2).sum(1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("by_product", [False, True])
def test_row_blocks_hold_the_diagonal_block_and_the_doubled_rest(by_product, monkeypatch):
    """Each row block: its diagonal block as the Gram has it, the rest of its row doubled
    (exactly), so that one dot per row block (the accelerator's row products, or the CPU's
    products and sums) gives the full contraction."""
    from opacus_fsdp_sync.layers import linear_grams

    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", {"cpu"} if by_product else set())
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(3, 10, 5, dtype=torch.float64, generator=gen)
    g = torch.randn(3, 10, 4, dtype=torch.float64, generator=gen)
    full = torch.bmm(a, a.mT)
    got = upper_gram(a, 4)
    assert [t.shape for t in got] == [(3, 4, 10), (3, 4, 6), (3, 2, 2)]
    for row, (s, w) in zip(got, row_blocks(10, 4)):
        plain = torch.bmm(a[:, s : s + w], a[:, s:].mT)  # the same matmul, undoubled
        assert torch.equal(row[:, :, :w], plain[:, :, :w])
        assert torch.equal(row[:, :, w:], 2 * plain[:, :, w:])
        torch.testing.assert_close(plain, full[:, s : s + w, s:], rtol=1e-12, atol=1e-12)
    total, _ = contract_output_grams(got, g, 4, bias=False)
    want = (full * torch.bmm(g, g.mT)).sum((1, 2))
    torch.testing.assert_close(total, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("by_product", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_cached_gram_is_doubled_once_for_all_its_readers(dtype, by_product, monkeypatch):
    """Three layers read one input through the cache, in row blocks of 4 at T = 10: each norm
    is the full contraction's (fp64 reference), so the shared Gram's off-diagonal part was
    doubled exactly once; bf16 inputs take the widened Gram (on CPU a bf16 matmul, widened)."""
    from opacus_fsdp_sync.layers import linear_grams

    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", {"cpu"} if by_product else set())
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(2, 10, 8, generator=gen).to(dtype)
    grads = [torch.randn(2, 10, w, generator=gen).to(dtype) for w in (3, 5, 7)]
    cache = GramCache(4)
    for _ in grads:
        cache.note_input(a)
    rows = []
    for g in grads:
        rows.append(cache.gram(a, 4))
        got, _ = contract_output_grams(rows[-1], g, 4, bias=False)
        want = torch.bmm(g.double().mT, a.double()).pow(2).sum((1, 2))
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert all(r is rows[0] for r in rows)  # one Gram, made (and doubled) once
    assert rows[0][0].dtype == torch.float32 and not cache._grams


@pytest.mark.parametrize("block", [0, 3])
def test_an_empty_batch_gives_empty_norms(block):
    a, g = torch.randn(0, 7, 5), torch.randn(0, 7, 4)
    total, gsum = _blocked(a, g, block)
    assert total.shape == (0,) and gsum.shape == (0,)


def test_blocked_bf16_is_as_accurate_as_the_full_gram():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 96, 32, generator=gen).bfloat16()
    g = torch.randn(4, 96, 48, generator=gen).bfloat16()
    exact = torch.bmm(g.double().mT, a.double()).pow(2).sum((1, 2))
    full, _ = _blocked(a, g, 0)
    blocked, _ = _blocked(a, g, 16)
    err_full = ((full.double() - exact).abs() / exact).max().item()
    err_blocked = ((blocked.double() - exact).abs() / exact).max().item()
    print(f"bf16 relative error: full {err_full:.2e}, blocked {err_blocked:.2e}")
    assert err_blocked <= max(2 * err_full, 1e-3)


def test_row_blocks_cover_every_position_once_and_flops_shrink():
    for t, block in [(10, 4), (1024, 256), (1024, 0), (5, 9), (128, 64)]:
        rows = row_blocks(t, block)
        assert [s for s, _ in rows] == sorted(s for s, _ in rows)
        assert sum(w for _, w in rows) == t and rows[0][0] == 0
        assert all(s + w == rows[i + 1][0] for i, (s, w) in enumerate(rows[:-1]))
    assert flop_fraction(1024, 256) == 5 / 8  # (k + 1) / (2 k) with k = 4 blocks
    assert flop_fraction(128, 64) == 3 / 4
    assert flop_fraction(10, 4) == (4 * 10 + 4 * 6 + 2 * 2) / 100
    assert flop_fraction(1024, 0) == flop_fraction(64, 64) == 1.0


def test_auto_block_by_device():
    assert resolve_block("auto", torch.device("cpu")) == 64
    assert resolve_block("auto", torch.device("cuda", 0)) == 512
    assert resolve_block(0, torch.device("cpu")) == 0
    assert resolve_block(32, torch.device("cuda")) == 32


def test_cache_recomputes_when_a_reader_asks_for_another_block():
    """Three readers of one input asking for blocks 4, 0, 4: each gets matching row blocks."""
    cache = GramCache(4)
    a = torch.randn(2, 10, 3)
    for _ in range(3):
        cache.note_input(a)
    for block in (4, 0, 4):
        got = cache.gram(a, block)
        want = upper_gram(a, block)
        assert [t.shape for t in got] == [t.shape for t in want]
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
    assert not cache._grams and not cache._readers


def test_frozen_weight_gives_only_the_bias_term_without_a_gram():
    g = torch.randn(2, 9, 4, dtype=torch.float64)
    counter = FlopCounterMode(display=False)
    with counter:
        w_sq, b_sq = contract_output_grams(None, g, 4, bias=True)
    assert w_sq is None and counter.get_total_flops() == 0  # no bmm
    full = torch.bmm(g, g.mT).sum((1, 2))
    torch.testing.assert_close(b_sq, full)


@pytest.mark.distributed
def test_dtensor_inputs_fall_back_to_full_grams():
    """Replicated DTensor input and output gradient (one gloo rank): full Grams, exact norms."""
    (res,) = run_ranks(workers_misc.dtensor_linear_norms, 1, timeout=120)
    assert res["block_for"] == 0
    assert res["diff"] <= 1e-5


@pytest.mark.parametrize("block", [0, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_cpu_products_and_accelerator_matmuls_contract_alike(block, n, monkeypatch):
    """The CPU's ``vecdot`` contraction and the accelerator's batched matmul agree to rounding
    (one backward's norms take either by device; the op ledger counts the accelerator's)."""
    from opacus_fsdp_sync.layers import linear_grams

    gen = torch.Generator().manual_seed(block + 10 * n)
    a = torch.randn(n, 10, 5, generator=gen)
    g = torch.randn(n, 10, 4, generator=gen)
    assert "cpu" in linear_grams.PRODUCT_CONTRACTION  # CPU multiplies and sums
    by_product, _ = _blocked(a, g, block)
    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", set())
    by_matmul, _ = _blocked(a, g, block)
    direct = torch.bmm(g.double().mT, a.double()).pow(2).sum((1, 2))
    assert by_product.shape == by_matmul.shape == (n,)
    torch.testing.assert_close(by_product, by_matmul, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_product.double(), direct, rtol=1e-5, atol=1e-5)


def test_accelerator_contracts_a_gram_block_row_by_row(monkeypatch):
    """Off the CPU a Gram block's dot products are one batched matmul of N w row pairs (a
    matrix-vector product per sample over all w K values ran 13x slower on an H100)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opacus_fsdp_sync.layers import linear_grams

    class BmmShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.bmm:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 6, 9, generator=gen)
    b = torch.randn(3, 6, 9, generator=gen)
    exact = (a.double() * b.double()).sum((1, 2))
    monkeypatch.setattr(linear_grams, "PRODUCT_CONTRACTION", set())
    with BmmShapes() as seen:
        got = linear_grams.batched_dot(a, b)
        flat = linear_grams.batched_dot(a.reshape(3, 1, 54), b.reshape(3, 1, 54))
    assert seen.shapes == [(18, 1, 9), (3, 1, 54)]  # rows of the block; one row stays one
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flat.double(), exact, rtol=1e-6, atol=1e-6)
