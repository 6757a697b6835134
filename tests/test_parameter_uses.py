"""Trainable parameters used outside their owning layer's hooked call: refused, never clipped wrong.

The per-sample norms come from hooks on the layers; a parameter read any other way was missing
from the norm and the one backward dropped its gradient, silently (peft LoRA on an embedding:
every update about 35x too large). Refused at ``make_private`` where the owner cannot be hooked,
at the first step where the graph shows a use no hooked call covers. What is supported (tied
embeddings, LoRA on q/v, gradient checkpointing) still matches the clip-each-sample loop.

One device, fixed batches, fp64.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.errors import UnsupportedConfigurationError
from opacus_fsdp_sync.layers.ownership import ParameterUseError
from opacus_fsdp_sync.models.llama import LlamaSpec, build_llama
from opacus_fsdp_sync.testing import per_sample_clipped_grads
from tests.private import make_private

B, T, V, D, C = 3, 6, 20, 8, 1e-4
OPTIONS = [{}, {"one_backward": False}, {"sync_optimization": False}]
OPTION_IDS = ["one", "two_pass", "upstream"]


class ParamDictModel(nn.Module):
    """peft's LoRA ``Embedding`` layout: factors in ``ParameterDict``s read by the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.o = nn.Embedding(V, D), nn.Linear(D, V)
        self.A = nn.ParameterDict({"default": nn.Parameter(torch.randn(4, V) * 0.3)})
        self.Bm = nn.ParameterList([nn.Parameter(torch.randn(D, 4) * 0.3)])

    def forward(self, x):
        e = self.wte(x) + nn.functional.embedding(x, self.A["default"].T) @ self.Bm[0].T
        return self.o(torch.tanh(e))


class Scaled(nn.Module):
    """A layer with a parameter of its own (replayed whole) around a trainable child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.lin = nn.Parameter(torch.ones(D)), nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x) * self.scale


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.a, self.o = nn.Embedding(V, D), Scaled(), nn.Linear(D, V)

    def forward(self, x):
        return self.o(torch.tanh(self.a(self.wte(x))))


class FunctionalHead(nn.Module):
    """nanoGPT-style weight reuse: the embedding's weight as the head, through ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.h = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.h(self.wte(x))), self.wte.weight)


class Sibling(nn.Module):
    """A sibling's weight read directly; the sibling is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.o = nn.Embedding(V, D), nn.Linear(D, V)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.o(torch.tanh(nn.functional.linear(self.wte(x), self.proj.weight)))


def _data():
    torch.manual_seed(1)
    return torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


@pytest.mark.parametrize(
    "model_cls, match",
    [
        (ParamDictModel, r"A\.default: owned directly by a ParameterDict.*Bm\.0: owned directly"),
        (Nested, r"a\.lin\.weight: owned by Linear 'a\.lin', inside a layer .* replayed"),
    ],
    ids=["parameter_dict_and_list", "inside_a_replayed_layer"],
)
def test_a_parameter_no_hooked_call_owns_is_refused_at_make_private(model_cls, match):
    """Their norms counted as zero: the update was many times too large (ParameterDict) or the
    nested layer's gradient dropped (one backward: 100 % off), without an error."""
    torch.manual_seed(0)
    model = model_cls()
    x, y = _data()
    with pytest.raises(UnsupportedConfigurationError, match=match):
        make_private(PrivacyEngine(), model, (x, y), B, C, "ghost")
    assert not any(m._forward_hooks for m in model.modules())


def _tiny_llama(tied: bool, checkpointing: bool = False):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    spec = LlamaSpec(preset="tiny", tie_word_embeddings=tied, dtype=torch.float64)
    model = build_llama(spec)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _lora(model, targets):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets
    )
    return peft.get_peft_model(model, config).double()


def test_peft_lora_on_the_embedding_is_refused_naming_the_way_out():
    """lora_embedding_A/B are ParameterDicts read by lora.Embedding's forward: the update was
    about 35x too large (rel err 34 against the loop) on a tiny Llama, silently."""
    model = _lora(_tiny_llama(False), ["q_proj", "v_proj", "embed_tokens"])
    x, y = _data()
    with pytest.raises(UnsupportedConfigurationError, match=r"lora_embedding_A.*modules_to_save"):
        make_private(PrivacyEngine(), model, (x, y), B, C, "ghost")


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize(
    "model_cls, match",
    [
        (FunctionalHead, r"wte\.weight: used 2 times but its layer \(wte\) ran 1 time"),
        (Sibling, r"proj\.weight: read without calling its layer \(proj\)"),
    ],
    ids=["functional_reuse", "sibling_weight"],
)
@pytest.mark.parametrize("combined", [False, True], ids=["plain", "two_losses"])
def test_a_use_outside_the_hooked_call_raises_at_the_first_step(
    model_cls, match, options, combined
):
    """Every path, upstream's too, missed these uses in the norm without an error; the first
    step now names the parameter and the pattern and leaves no gradient behind. The check
    walks each loss of the private criterion that the backward's loss combines."""
    torch.manual_seed(0)
    model = model_cls().double()
    x, y = _data()
    gsm, _, crit, _ = make_private(PrivacyEngine(**options), model, (x, y), B, C, "ghost")
    out = gsm(x).reshape(-1, V)
    loss = crit(out, y.reshape(-1), shape=(B, T))
    if combined:
        loss = -(loss + crit(out, x.reshape(-1), shape=(B, T))) / 2
    with pytest.raises(ParameterUseError, match=match):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_step_that_raised_is_checked_again():
    """The model was marked checked before its check ran: a caught error let the next step
    through unchecked, with the sibling's read missing from its norms."""
    torch.manual_seed(0)
    model = Sibling().double()
    x, y = _data()
    gsm, _, crit, _ = make_private(PrivacyEngine(), model, (x, y), B, C, "ghost")
    for _ in range(2):
        loss = crit(gsm(x).reshape(-1, V), y.reshape(-1), shape=(B, T))
        with pytest.raises(ParameterUseError, match=r"proj\.weight"):
            loss.backward()


def _lm_sample_loss(model, ids, labels):
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize("options", OPTIONS[:2], ids=OPTION_IDS[:2])
@pytest.mark.parametrize("variant", ["tied", "tied_checkpointing", "lora_qv"], ids=lambda v: v)
def test_tied_llama_and_lora_on_q_v_still_match_the_clip_each_sample_loop(variant, options):
    """No false alarm where the hooks do see every use: a tied head and embedding (two hooked
    layers, one weight), non-reentrant gradient checkpointing, peft LoRA on q and v. Two steps:
    the graph is checked once, on the first."""
    model = _tiny_llama(variant != "lora_qv", checkpointing=variant == "tied_checkpointing")
    if variant == "lora_qv":
        model = _lora(model, ["q_proj", "v_proj"])
    x, y = _data()
    reference = copy.deepcopy(model)  # plain, stepped by the loop's gradients
    params = [p for p in model.parameters() if p.requires_grad]
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(**options),
        model,
        (x, y),
        B,
        C,
        "ghost",
        optimizer=torch.optim.SGD(params, lr=1.0),
    )
    for _ in range(2):
        ref, norms = per_sample_clipped_grads(reference, _lm_sample_loss, x, y, C)
        assert (norms > C).all()  # clipping active for every sample
        logits = gsm(input_ids=x).logits
        crit(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=(B, T)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                if n in ref:
                    p -= ref[n]
        expected = dict(reference.named_parameters())
        for n, p in model.named_parameters():
            if n in ref:
                torch.testing.assert_close(p.detach(), expected[n].detach(), rtol=1e-6, atol=1e-10)


@pytest.mark.distributed
def test_fsdp1_reads_outside_the_hooked_call_raise_and_frozen_reads_do_not():
    """FSDP1 (use_orig_params=True) reads each parameter through a view of its flat parameter,
    which the graph walk took for no parameter: these models stepped without an error, the
    sibling's gradient dropped (one backward) or clipped with norms that missed it (two passes).
    Two ranks, each strategy and path, alignment padding before the read; under NO_SHARD also a
    later unit's bias read as the original parameter before that unit ran. No false alarm for a
    frozen weight read anyhow, or a weight with transposed storage (viewed by ``as_strided``)."""
    from opacus_fsdp_sync.testing import run_ranks
    from tests import workers_parameter_uses as w

    res = run_ranks(w.fsdp1_uses, 2, timeout=300)
    for rank_res in res:
        for (model, strategy, path), r in rank_res.items():
            case = (model, strategy, path)
            if model in ("frozen_sibling", "transposed"):
                assert "error" not in r, (case, r)
                assert r["clipped"], case
                assert r["update"] > 1e-5 and r["vs_loop"] <= 1e-6 * r["update"], (case, r)
                continue
            expected = {
                "sibling": r"proj\.weight: read without calling its layer \(proj\)",
                "functional_head": r"wte\.weight: used 2 times but its layer \(wte\) ran 1 time",
                "late_bias": r"late\.bias: used 2 times but its layer \(late\) ran 1 time",
            }[model]
            assert re.search(expected, r.get("error", "")), (case, r)
            assert "_fsdp_wrapped_module" not in r["error"], case
            assert not r["grads_left"], case


def test_fsdp1_views_map_to_their_split_index_and_other_reads_fail_loudly():
    """The walk's FSDP1 rule on a hand-built graph: a split piece's view is one read of that
    piece; a flat parameter reached any other way (another torch release's views) raises the
    versioned internals error instead of passing the check unseen."""
    from opacus_fsdp_sync.distributed._fsdp2_internals import FSDPInternalsError
    from opacus_fsdp_sync.layers.ownership import _accumulate_edges

    flat = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    flats = {id(flat): {}}
    piece = flat.split([4, 2])[1].view(1, 2)
    edges = _accumulate_edges([(piece * 3).sum() + piece.t().sum()], flats)
    assert edges == {(id(flat), 1): 2}
    with pytest.raises(FSDPInternalsError, match="parameter-use check under FSDP1"):
        _accumulate_edges([(piece * 3).sum() + (flat[:4] ** 2).sum()], flats)
