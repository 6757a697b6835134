"""Exact ghost clipping for shared weights (tied embeddings) and padding tokens.

The reference is the explicit clip-each-sample loop, never upstream Opacus (which drops the
cross term of a tied weight under FSDP2 and refuses it on one device).
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.layers.tied import UnsupportedTiedParameterError, find_shared_parameters
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests import workers_tied
from tests.private import lm_loss, make_private

warnings.filterwarnings("ignore")
TOL = 1e-5


def _private(model, x, y, C, batch, **options):
    return make_private(PrivacyEngine(**options), model, (x, y), batch, C, "ghost", lr=0.1)


@pytest.mark.distributed
@pytest.mark.parametrize("tie", [True, False])
def test_llama_tied_and_untied_equal_clip_each_sample_loop(tie):
    results = run_ranks(workers_tied.tied_llama, 2, tie, timeout=300)
    for rank, res in enumerate(results):
        assert res["tied"] is tie
        C = res["C"]
        for norms in res["ref_norms"]:
            assert 0 < sum(n > C for n in norms) < len(norms)  # clipping active
        assert max(res["fsdp_vs_loop"]) <= TOL  # FSDP2, 2 ranks
        assert res["fsdp_per_sample_layers"] > 0  # the per-sample gradient path ran
        assert max(res["blocked_vs_loop"]) <= TOL  # FSDP2, ghost norms in Gram row blocks
        b = workers_tied.B_LOCAL
        for step, ref in enumerate(res["ref_norms"]):
            local = ref[rank * b : (rank + 1) * b]
            assert res["fsdp_norms"][step] == pytest.approx(local, rel=1e-5)
            assert res["blocked_norms"][step] == pytest.approx(local, rel=1e-5)
        if rank == 0:  # one device, ghost
            assert max(res["single_vs_loop"]) <= TOL
            for step, ref in enumerate(res["ref_norms"]):
                assert res["single_norms"][step] == pytest.approx(ref, rel=1e-5)
        if tie:
            # Upstream ghost_fsdp drops the cross term: this test would catch that.
            assert max(res["upstream_vs_loop"]) > 100 * TOL
            assert res["update"] > 1e-2


class _Pairs(nn.Module):
    """Two Embeddings sharing a weight, and two square Linears sharing a weight."""

    def __init__(self):
        super().__init__()
        self.emb_a = nn.Embedding(20, 8, padding_idx=0)
        self.emb_b = nn.Embedding(20, 8)
        self.emb_b.weight = self.emb_a.weight
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8, bias=False)
        self.lin2.weight = self.lin1.weight
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.emb_a(x[:, :5]) + self.emb_b(x[:, 5:])
        h = self.lin2(torch.tanh(self.lin1(h)))
        return self.head(h.mean(1))


def test_embedding_pair_linear_pair_and_padding_norms_equal_loop():
    torch.manual_seed(0)
    base = _Pairs()
    assert len(find_shared_parameters(base)) == 2
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 20, (8, 10), generator=g)
    x[:3, :2] = 0  # padding tokens in the first use
    y = torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m, a, b):
        return nn.functional.cross_entropy(m(a), b)

    grads, norms = per_sample_clipped_grads(copy.deepcopy(base), loss_fn, x, y, 1.0)
    C = norms.median().item()
    ref_grads, _ = per_sample_clipped_grads(copy.deepcopy(base), loss_fn, x, y, C)
    model = copy.deepcopy(base)
    gsm, opt, crit, _ = _private(model, x, y, C, 8)
    crit(gsm(x), y).backward()
    assert gsm.per_sample_gradient_norms == pytest.approx(norms, rel=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad * 1.0, ref_grads[n] * 8, atol=1e-6), n


class _SharedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.LayerNorm(8)
        self.b = nn.LayerNorm(8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_unsupported_shared_pair_is_refused_with_a_way_out():
    model = _SharedNorm()
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedTiedParameterError) as err:
        _private(model, x, y, 1.0, 4)
    msg = str(err.value)
    assert "'a.weight'" in msg and "b.weight" in msg and "LayerNorm" in msg
    assert "Untie" in msg and "tie_word_embeddings=False" in msg


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = (0, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), (str(func), tuple(t.shape)))
        return out


def test_tied_norm_allocates_nothing_vocab_by_hidden_per_sample():
    torch.manual_seed(0)
    model = build_llama(LlamaSpec(preset="tiny", tie_word_embeddings=True))
    V, H = model.config.vocab_size, model.config.hidden_size
    N, T = 6, 12
    ids = torch.randint(1, V, (N, T))
    # The cross term's own memory: without the (budgeted) per-sample gradients of one backward.
    gsm, opt, crit, _ = _private(model, ids, ids, 1.0, N, per_sample_grads=False)
    assert type(gsm).__name__ == "GhostGradSampleModule"
    loss = lm_loss(gsm, crit, ids)
    probe = _LargestTensor()
    with probe:
        loss.backward()
    numel, where = probe.largest
    print("largest tensor in the DP backward:", numel, where)
    assert numel < N * V * H, where  # no per-sample V x H gradient
    assert numel >= V * H  # the probe sees the (non-per-sample) weight gradient itself


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_cross_term_in_narrow_dtypes_matches_the_widened_one(padding_idx):
    """bf16 uses: gathered before widening, mask unwidened, and on the accelerator path the
    partial written fp32 by one narrow-operand matmul: the fp32 reference to fp32 rounding."""
    from opacus_fsdp_sync.bench.accelerator_ops import accelerator_matmuls
    from opacus_fsdp_sync.layers import tied

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 6, 8, generator=g).bfloat16()
    b = torch.randn(2, 6, 11, generator=g).bfloat16()
    e = torch.randn(2, 5, 8, generator=g).bfloat16()
    x = torch.randint(0, 11, (2, 5), generator=g)
    x[0, 1] = 3
    ids = x.unsqueeze(1).expand(-1, 6, -1)
    keep = (x != padding_idx).float() if padding_idx is not None else torch.ones(2, 5)
    part = torch.einsum("nts,nti->nsi", torch.gather(b.float(), 2, ids), a.float())
    want = (part * keep.unsqueeze(-1) * e.float()).sum(dim=(1, 2))
    got = tied.linear_embedding(a, b, x, e, padding_idx)
    assert torch.equal(got, want)  # the CPU path: the same fp32 arithmetic
    with accelerator_matmuls():
        wide = tied.linear_embedding(a, b, x, e, padding_idx)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, want, rtol=1e-6, atol=1e-6)
