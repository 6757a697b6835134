"""Tensor parallelism under flat per-sample clipping: exact, calibrated, replicas identical.

FSDP2 x TP on a (dp 2, tp 2) mesh (4 gloo ranks) and TP alone (2 ranks), against the
clip-each-sample loop over the same global Poisson draws with clipping active: parameters
after two steps, the noise's standard deviation ``sigma C / B`` (B the expected global batch),
independent noise on the two tp halves of a sharded weight, identical noise (and parameters)
where a coordinate is replicated over tp, and the data-parallel degree (the sampler's shares,
the expected batch, the gradient divisor) taken from the mesh, not the world size.
"""

from __future__ import annotations

import pytest
import torch

from opacus_fsdp_sync.testing import per_sample_clipped_grads, run_ranks
from tests import workers_tp as wt
from tests import workers_tp_sp as wsp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module", params=list(wt.LAYOUTS))
def layout_results(request):
    layout = request.param
    dp, tp, _ = wt.LAYOUTS[layout]
    return layout, run_ranks(wt.tensor_parallel, dp * tp, layout, timeout=600)


def _loop(selections, kind):
    """The loop's parameters after each step, and the first step's per-sample norms."""
    model = wt.base(kind)
    x, y = wt.dataset().tensors
    params, first_norms = [], None
    for sel in selections:
        idx = torch.tensor(sel, dtype=torch.long)
        grads, norms = per_sample_clipped_grads(
            model, wt.sample_loss, x[idx], y[idx], wt.CLIP[kind], "sum"
        )
        if first_norms is None:
            first_norms = norms
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.sub_(wt.LR * grads[n] / wt.BATCH)  # Opacus divides by the expected batch
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params, first_norms


def test_exact_against_the_clip_each_sample_loop(layout_results):
    layout, results = layout_results
    r0 = results[0][0.0]
    assert r0["api"] == ("fsdp2" if wt.LAYOUTS[layout][2] else "tp")
    if layout == "shard_model_hsdp_tp":  # torchtitan's names, HSDP x TP
        assert r0["mesh"] == (("dp_replicate", "dp_shard", "tp"), (2, 1, 2)), r0["mesh"]
    kind = wt.model_kind(layout)
    start = wt.base(kind).state_dict()
    loop, norms = _loop(r0["selections"], kind)
    c = wt.CLIP[kind]
    assert (norms > c).sum() >= 2 and (norms < c).sum() >= 1, norms  # clipping active
    runs = [res[0.0] for res in results]
    runs += [res["two_pass"] for res in results if "two_pass" in res]
    for run in runs:
        assert run["selections"] == r0["selections"]
        took = [ob for ob, n in zip(run["one_backward"], run["sizes"]) if n]
        assert took and all(ob == run["asked"] for ob in took), (layout, run["one_backward"])
        for step in range(wt.STEPS):
            for n, want in loop[step].items():
                got = run["full"][step][n]
                scale = max(1.0, (want - start[n]).abs().max().item())
                assert (got - want).abs().max().item() <= 1e-6 * scale, (layout, step, n)
        if run["norms"] is not None:  # this rank's share of the first draw, all tp ranks' sum
            local = torch.tensor(r0["selections"][0]).tensor_split(run["shares"])[run["share"]]
            want = norms[[r0["selections"][0].index(i) for i in local.tolist()]]
            assert torch.allclose(run["norms"], want, rtol=1e-5), (run["norms"], want)


def test_data_parallel_degree_comes_from_the_mesh(layout_results):
    layout, results = layout_results
    dp, tp, _ = wt.LAYOUTS[layout]
    for rank, res in enumerate(results):
        run = res[0.0]
        assert run["shares"] == dp and run["divisor"] == dp
        # one Layout value: its dp degree is the optimizer's divisor, its group the norm room's
        assert run["layout"] == (dp, tp, 1)
        assert run.get("norm_group") is (True if wt.model_kind(layout) == "sp" else None)
        # nothing about the composition is left on the user's modules (Opacus's own captures
        # and the rooms' per-sample stash aside)
        composition = [k for k in run["added"] if any(w in k for w in ("tp", "sequence", "layout"))]
        assert composition == [], composition
        assert run["expected_batch"] == pytest.approx(wt.BATCH / dp)
        # the tp ranks of one data-parallel group take the same examples
        partner = results[rank ^ 1][0.0]  # tp is the inner mesh dimension
        assert run["share"] == partner["share"] and run["sizes"] == partner["sizes"]
    if dp > 1:  # Poisson on, with an empty data-parallel share in some step
        assert any(0 in [res[0.0]["sizes"][s] for res in results] for s in range(wt.STEPS))


def test_noise_per_placement(layout_results):
    layout, results = layout_results
    std = wt.SIGMA * wt.CLIP[wt.model_kind(layout)] / wt.BATCH
    noise = {}
    for rank, res in enumerate(results):
        quiet, noisy = res[0.0], res[wt.SIGMA]
        assert noisy["selections"] == quiet["selections"]
        noise[rank] = {
            n: (noisy["local"][0][n] - quiet["local"][0][n]) / wt.LR for n in quiet["local"][0]
        }
    # every coordinate of the global update, once: the full parameters of rank 0
    full = torch.cat(
        [
            ((results[0][wt.SIGMA]["full"][0][n] - results[0][0.0]["full"][0][n]) / wt.LR).flatten()
            for n in results[0][0.0]["full"][0]
        ]
    )
    assert full.numel() >= 20_000
    assert abs(full.std().item() / std - 1.0) < 0.02, full.std().item() / std
    assert abs(full.mean().item()) < 0.02 * std
    kind = wt.model_kind(layout)
    for rank in range(0, len(results), 2):  # each tp pair (tp is the inner dimension)
        a, b = noise[rank], noise[rank + 1]
        for n in wt.TP_REPLICATED[kind]:  # replicated over tp: the same noise, bit for bit
            assert torch.equal(a[n], b[n]), (layout, n)
            assert torch.equal(
                results[rank][wt.SIGMA]["local"][1][n], results[rank + 1][wt.SIGMA]["local"][1][n]
            ), (layout, n)
        halves = [torch.cat([x[n].flatten() for n in wt.TP_SHARDED[kind]]) for x in (a, b)]
        assert halves[0].numel() >= 10_000
        corr = torch.corrcoef(torch.stack(halves))[0, 1].item()
        assert abs(corr) < 0.05, (layout, corr)


def test_llama_with_the_default_tp_plan_is_exact():
    """Hugging Face's Llama (grouped-query attention) under ``ShardingConfig(tp_degree=2)`` on a
    (dp_shard 2, tp 2) mesh."""
    for res in run_ranks(wt.llama_tp, 4, timeout=600):
        assert res["clipped"] >= 1 and res["clipped"] < res["n"], res
        assert res["diff"] < 1e-6, res
        assert res["mesh"] == (("dp_shard", "tp"), (2, 2)), res["mesh"]  # torchtitan's names
        # every attention and MLP projection of both layers is sharded over tp
        assert len([n for n in res["tp_sharded"] if n.endswith("proj.weight")]) == 14, res


def test_tp_degree_is_validated_and_the_llama_plan_names_what_it_needs():
    from opacus_fsdp_sync.sharding import ShardingConfig
    from opacus_fsdp_sync.sharding.tensor_parallel import llama_tp_plan

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="tp_degree"):
            ShardingConfig(tp_degree=bad)
    with pytest.raises(ValueError, match="backend='fsdp2'"):
        ShardingConfig(tp_degree=2, backend="fsdp1")
    with pytest.raises(ValueError, match="tp_plan"):
        llama_tp_plan(wt.base())  # no Llama projections: the error says to pass tp_plan


def test_sequence_parallel_layers_without_an_exact_norm_are_refused():
    """Refused in the forward, before any gradient, with the same message on every rank:
    layers outside the plan fed this rank's tokens as a plain tensor (a Linear, a LayerNorm), a
    LayerNorm under SequenceParallel, and a sequence length the tp degree does not divide."""
    results = run_ranks(wsp.sp_refusals, 2, timeout=300)
    for res in results:
        for case, refusal in res.items():
            assert refusal and "UnsupportedConfigurationError" in refusal["message"], (case, res)
            assert refusal["phase"] == "forward" and not refusal["graded"], (case, refusal)
        head = res["plain_head"]["message"]
        assert "Linear" in head and "fewer tokens" in head, head
        norm = res["layernorm"]["message"]
        assert "LayerNorm" in norm and "SequenceParallel" in norm, norm
        plain = res["plain_layernorm"]["message"]
        assert "'norm' (LayerNorm)" in plain and "fewer tokens" in plain, plain
        uneven = res["uneven"]["message"]
        assert "3 tokens" in uneven and "tp degree 2" in uneven, uneven
        assert res["uneven_later"]["message"] == uneven
    assert results[0] == results[1]


def test_ghost_tp_runs_the_tensor_parallel_path():
    """Upstream's ``grad_sample_mode="ghost_tp"`` on a sequence-parallel TP model: the
    tensor-parallel path, exact against the loop after one step."""
    for res in run_ranks(wsp.ghost_tp, 2, timeout=300):
        assert res["api"] == "tp" and 0 < res["clipped"] < 4, res
        assert res["diff"] < 1e-6, res


def test_cases_a_review_found():
    for rank, res in enumerate(run_ranks(wt.review_cases, 2, timeout=600)):
        frozen = res["frozen"]
        assert frozen["diff"] < 1e-6 and frozen["divisor"] == 1 and frozen["api"] == "fsdp2"
        assert "named 'tp'" in res["misnamed"], res["misnamed"]
        assert "secure_mode" in res["secure"], res["secure"]
        assert res["mlp_2d"] < 1e-6, res["mlp_2d"]
        # rank 0's 400 unit norms as partial norms: sqrt(400) = 20 on both tp ranks
        assert res["bf16_sum"] == [20.0, 20.0, 20.0], (rank, res["bf16_sum"])


def test_tp_ranks_agree_on_the_memory_budget():
    """The smallest budget of the tp group on every tp rank (the same layers kept, the same
    paths to the tp-replicated layers' clipped gradients); no budget on CPU: no collective."""
    assert run_ranks(wt.agreed_budget, 2, timeout=120) == [[1000, None], [1000, None]]


def test_a_context_parallel_mesh_is_refused():
    for message in run_ranks(wt.context_parallel_mesh, 2, timeout=120):
        assert message and "context parallelism is not supported" in message, message
        assert "'dp_shard_cp'" in message and "l1.weight" in message, message
