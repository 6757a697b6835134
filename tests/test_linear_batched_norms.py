"""Gram jobs finished together: the numbers of the layer-by-layer route, bit for bit."""

import pytest
import torch
from torch import nn

from opacus_fsdp_sync.layers import linear_norms
from opacus_fsdp_sync.layers.linear_norms import GramCache, GramJob, LinearNormSampler

N, T, D = 3, 10, 12


def _readers(cache, a, widths, bias=False):
    """Layers reading ``a`` (counted by the cache, as the forward hooks count them)."""
    layers = [nn.Linear(D, w, bias=bias).to(a.dtype) for w in widths]
    for _ in layers:
        cache.note_input(a)
    return layers


def _jobs(sampler, layers, a, grads):
    jobs = [sampler.route(layer, [a], g) for layer, g in zip(layers, grads)]
    assert all(isinstance(j, GramJob) for j in jobs)
    return jobs


def _one_by_one(layers, a, grads, block, scales):
    cache = GramCache(block)
    for _ in layers:
        cache.note_input(a)
    sampler = LinearNormSampler(cache)
    out = []
    for layer, g, s in zip(layers, grads, scales):
        norms = sampler(layer, [a], g)
        out.append({p: n if s == 1 else n * s for p, n in norms.items()})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_readers_of_one_input_are_finished_together_bit_for_bit(dtype):
    torch.manual_seed(0)
    a = torch.randn(N, T, D, dtype=dtype)
    for bias in (False, True):
        cache = GramCache(0)
        layers = _readers(cache, a, (7, 5, 9), bias=bias)
        grads = [torch.randn(N, T, layer.out_features, dtype=dtype) for layer in layers]
        sampler = LinearNormSampler(cache)
        calls = {"groups": 0}
        group = sampler._finish_group

        def counted(jobs, scale, group=group, calls=calls):
            calls["groups"] += 1
            return group(jobs, scale)

        sampler._finish_group = counted
        got = sampler.finish_batch(_jobs(sampler, layers, a, grads), [4, 4, 4])
        want = _one_by_one(layers, a, grads, 0, [4, 4, 4])
        assert calls["groups"] == 1  # the three readers in one buffer
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for p in g:
                assert torch.equal(g[p], w[p])
        # and against the definition: the per-sample gradient's norm, times the scale
        for layer, g, norms in zip(layers, grads, got):
            psg = torch.einsum("nto,nti->noi", g.double(), a.double())
            ref = psg.flatten(1).norm(dim=1) * 4
            rtol = 1e-10 if dtype == torch.float64 else 1e-5
            assert torch.allclose(norms[layer.weight].double(), ref, rtol=rtol)
        assert not cache._grams and not cache._readers  # every reader released the Gram


def test_what_cannot_be_batched_is_finished_job_by_job():
    torch.manual_seed(1)
    a = torch.randn(N, T, D, dtype=torch.float64)
    b = torch.randn(N, T, D, dtype=torch.float64)
    cache = GramCache(4)  # row blocks of 4 tokens: several blocks at T = 10, never batched
    layers = _readers(cache, a, (6, 8)) + _readers(cache, b, (5,))
    grads = [torch.randn(N, T, layer.out_features, dtype=torch.float64) for layer in layers]
    sampler = LinearNormSampler(cache)
    sampler._finish_group = None  # must not be called
    jobs = [sampler.route(layer, [x], g) for layer, x, g in zip(layers, (a, a, b), grads)]
    got = sampler.finish_batch(jobs, [1, 2, 1])
    cache2 = GramCache(4)
    for x in (a, a, b):
        cache2.note_input(x)
    ref = LinearNormSampler(cache2)
    for layer, x, g, s, norms in zip(layers, (a, a, b), grads, (1, 2, 1), got):
        want = ref(layer, [x], g)[layer.weight]
        assert torch.equal(norms[layer.weight], want if s == 1 else want * s)


def test_a_group_whose_rows_torch_would_sum_otherwise_is_finished_layer_by_layer(monkeypatch):
    # One sample, 2 threads, T^2 over torch's reduction grain: torch splits a lone row's sum
    # between the threads, and not the rows of a batched contraction, so the rounding would
    # differ; and a group over the memory bound. Both are finished layer by layer.
    torch.manual_seed(2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n, t, cap in ((1, 200, None), (3, 10, 1)):
            if cap is not None:
                monkeypatch.setattr(linear_norms, "MAX_GROUP_BYTES", cap)
            a = torch.randn(n, t, D)
            cache = GramCache(0)
            layers = _readers(cache, a, (4, 5, 6))
            grads = [torch.randn(n, t, layer.out_features) for layer in layers]
            sampler = LinearNormSampler(cache)
            jobs = _jobs(sampler, layers, a, grads)
            assert all(sampler.batchable(j) for j in jobs)
            assert not linear_norms._may_batch(jobs)
            sampler._finish_group = None  # must not be called
            got = sampler.finish_batch(jobs, [1, 1, 1])
            cache2 = GramCache(0)
            for _ in layers:
                cache2.note_input(a)
            ref = LinearNormSampler(cache2)
            for layer, g, norms in zip(layers, grads, got):
                assert torch.equal(norms[layer.weight], ref(layer, [a], g)[layer.weight])
    finally:
        torch.set_num_threads(threads)
