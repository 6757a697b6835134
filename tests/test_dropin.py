"""Upstream Opacus's own layers and names, as a drop-in: DPLSTM / DPGRU / DPRNN in ghost mode
against the clip-each-sample loop, ``ghost_tp``, a DataLoader's ``generator=``, and the
optimizer's step count after a checkpoint is loaded."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from opacus.layers import DPGRU, DPLSTM, DPRNN
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.testing import clip_each_sample_step, per_sample_clipped_grads
from tests.private import make_private

warnings.filterwarnings("ignore")


class _RNNNet(nn.Module):
    """An Opacus recurrent layer (parameters re-exposed from its RNNLinear cells), then a head."""

    def __init__(self, kind: type) -> None:
        super().__init__()
        self.rnn = kind(6, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("one_backward", [True, False])
@pytest.mark.parametrize("kind", [DPLSTM, DPGRU, DPRNN])
def test_opacus_recurrent_layers_run_in_ghost_mode_exactly(kind, one_backward):
    """Each RNNLinear cell runs once per time step: the norm is of the summed per-sample
    gradient, the clipped gradient the sum over the calls; the RNN re-exposes the cells'
    weights under nn.LSTM's names, which is no tied weight."""
    torch.manual_seed(0)
    model = _RNNNet(kind)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = 3 * torch.randn(8, 5, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    lr = 0.5
    C = per_sample_clipped_grads(ref, _loss, x, y, 1.0)[1].median().item()  # some clipped
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(one_backward=one_backward), model, (x, y), 8, C, "ghost", lr=lr
    )
    for _ in range(2):
        crit(gsm(x), y).backward()
        opt.step()
        opt.zero_grad()
        norms = clip_each_sample_step(ref, _loss, x, y, C, lr)
        assert (norms > C).sum() >= 1 and (norms < C).sum() >= 1, norms  # clipping active
        assert torch.allclose(gsm.per_sample_gradient_norms, norms, rtol=1e-5), (
            gsm.per_sample_gradient_norms,
            norms,
        )
    assert not gsm.shared_weights  # the RNN's names for its cells' weights are no tie
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert diff < 1e-6, diff


def test_ghost_tp_is_upstreams_name_for_the_model_apis_ghost_mode(caplog):
    """``ghost_tp`` (Opacus 1.6's tensor-parallel ghost clipping) runs the ghost mode of the
    model's API: ``ghost`` on one device (as upstream's TP class does without a tp layout), the
    tensor-parallel path on a TP model (``tests/test_tp.py`` runs that path as ``ghost_fsdp``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    C = per_sample_clipped_grads(ref, _loss, x, y, 1.0)[1].median().item()
    with caplog.at_level("INFO", logger="opacus_fsdp_sync"):
        gsm, opt, crit, _ = make_private(PrivacyEngine(), model, (x, y), 6, C, "ghost_tp")
    assert any("grad_sample_mode='ghost_tp'" in r.getMessage() for r in caplog.records)
    crit(gsm(x), y).backward()
    opt.step()
    clip_each_sample_step(ref, _loss, x, y, C, 0.5)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert diff < 1e-6, diff


def _drawn(mode: str, seed: int, caplog) -> list[list[int]]:
    """The examples of 4 Poisson steps over ``range(40)`` from a loader with ``generator=``."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(40).float().unsqueeze(1), torch.zeros(40, dtype=torch.long))
    model = nn.Linear(1, 2)
    loader = DataLoader(data, batch_size=8, generator=torch.Generator().manual_seed(seed))
    with caplog.at_level("WARNING"):
        _, _, *rest = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=mode,
        )
    batches = iter(rest[-1])
    return [next(batches)[0].squeeze(1).long().tolist() for _ in range(4)]


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_a_data_loader_generator_drives_the_poisson_draw(mode, caplog):
    """As upstream: the loader's ``generator=`` is the sampler's source (ours, the shared draw in
    ghost modes; Opacus's loader otherwise), with a warning that the draw is as secret as it."""
    first = _drawn(mode, 7, caplog)
    assert any("generator=" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert _drawn(mode, 7, caplog) == first
    assert _drawn(mode, 8, caplog) != first
    assert sum(map(len, first)) > 0


def test_load_checkpoint_restores_the_engines_step_count(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_fsdp_sync.sharding import load_checkpoint, save_checkpoint

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))

    def private():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        engine = PrivacyEngine()
        made = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(data, batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
        )
        return engine, *made

    engine, gsm, opt, crit, loader = private()
    for _, (x, y) in zip(range(3), loader):
        crit(gsm(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.optimizer_steps == 3
    save_checkpoint(str(tmp_path / "ckpt"), gsm, opt, engine=engine)
    resumed, gsm2, opt2, _, _ = private()
    load_checkpoint(str(tmp_path / "ckpt"), gsm2, opt2, engine=resumed)
    assert resumed.optimizer_steps == 3
