"""The lean hook lanes change nothing: bit for bit the full chain of mixin hooks, and the loop.

Reference: the same FSDP2 steps with every layer on the full chain (``lean_hooks`` off), and
with the lanes' norms in their hooks instead of deferred to the end of a one-backward first
pass (``defer_norms`` off), which must agree bit for bit, and the clip-each-sample loop.
Clipping is active; batches are fixed (the hook route does not depend on how batches are
drawn, and the loop needs the same samples).
"""

import pytest

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_lean

pytestmark = [pytest.mark.distributed]
TOL = 2e-5


@pytest.mark.parametrize(
    "tie, engine_kwargs",
    [
        (False, {}),  # the default: one backward, per-sample gradients where cheaper
        (True, {"one_backward": False}),  # two passes; the tied embedding and head off the lane
        # Grams in row blocks of 4 tokens: no contraction is batched; each is contracted in its
        # hook and its clamp/sqrt/scale finished with the others' at the end of the pass
        (False, {"gram_block": 4, "per_sample_grads": False}),
    ],
)
def test_lanes_match_the_full_chain_bit_for_bit_and_the_loop(tie, engine_kwargs):
    results = run_ranks(workers_lean.lanes_against_chain, 2, tie, engine_kwargs, timeout=300)
    b = workers_lean.B_LOCAL
    for rank, res in enumerate(results):
        C = res["C"]
        for norms in res["ref_norms"]:
            assert 0 < sum(n > C for n in norms) < len(norms)  # clipping active
        assert res["on_vs_off"] == [0.0, 0.0], res["on_vs_off"]
        assert res["norms_on_vs_off"] == 0.0
        assert max(res["on_vs_loop"]) <= TOL, res["on_vs_loop"]
        for step, ref in enumerate(res["ref_norms"]):
            assert res["on_norms"][step] == pytest.approx(ref[rank * b : (rank + 1) * b], rel=1e-5)
        # every one-output layer takes a lane, but a tied weight's owners
        assert {"Linear", "LlamaRMSNorm"} <= set(res["lane_types"])
        assert ("Embedding" in res["lane_types"]) is not tie
        assert res["lanes"] == res["hooked"] - (2 if tie else 0)
        assert res["lane_calls"] == 2 * res["lanes"]  # each lane layer once per step
        assert res["off_calls"] == 0  # lanes off: every layer took the full chain
        # one backward defers the lanes' batchable Gram contractions (the Linear layers; the
        # RMSNorm and embedding norms stay in their hooks), and finishes the readers of one input
        # together: q/k/v of each block at least (2 blocks, 2 steps; a tiny MLP may take
        # per-sample gradients); two passes defer none. In the hook or deferred, bit for bit.
        one = engine_kwargs.get("one_backward", True)
        blocks = engine_kwargs.get("gram_block", 0)
        if one and not blocks:
            assert 3 * 2 * 2 <= res["batched_on"] <= res["deferred_on"] < res["lane_calls"]
        elif one:  # every Linear (7 a block, 2 blocks, 2 steps) contracted in its hook
            assert res["deferred_on"] == res["batched_on"] == 0
            assert res["tails_on"] >= 7 * 2 * 2, res["tails_on"]
        else:
            assert res["deferred_on"] == res["batched_on"] == res["tails_on"] == 0
        assert res["tails_off"] == 0  # in the hooks, the whole norm
        assert res["deferred_off"] == 0
        assert res["deferred_vs_hooks"] == [0.0, 0.0], res["deferred_vs_hooks"]
        assert res["norms_deferred_vs_hooks"] == 0.0
        assert res["batched_off"] == 0
        # no per-step state left on any layer, either way; eval and hooks off capture nothing
        assert res["left_on"] == [] and res["left_off"] == [], (res["left_on"], res["left_off"])
        assert res["quiet"]


@pytest.mark.parametrize("where", ["batch", "tails"])
def test_a_failure_while_norms_are_deferred_leaves_nothing_behind(where):
    # the batched Gram finish raises at the end of the first step's first pass, or (row blocks
    # of 4 tokens) a layer's contraction raises mid-backward after earlier layers deferred their
    # tails: the error reaches the caller, nothing deferred, kept or cached is left, and the
    # next two steps equal a run that never failed
    results = run_ranks(workers_lean.failure_while_norms_are_deferred, 2, where, timeout=300)
    for res in results:
        expected = "batched finish broke" if where == "batch" else "contraction broke"
        assert res["error"] == expected, res["error"]
        assert res["calls"] > (1 if where == "batch" else 5)  # the later steps ran it too
        empty = {"deferred": 0, "tails": 0, "kept": 0, "grams": 0, "layers": []}
        assert res["left"] == empty, res["left"]
        assert res["after_vs_clean"] == [0.0, 0.0], res["after_vs_clean"]
