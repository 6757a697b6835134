"""The step talks to the hooks through one named contract (``hooks.contract.StepHooks``).

Every hooks class implements every call of the contract, and a private step makes exactly the
contract's calls, in its order (one backward and two passes).
"""

import inspect
import warnings

import pytest
import torch
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.hooks import ghost
from opacus_fsdp_sync.hooks.contract import OpacusStepHooks, StepHooks
from tests.private import make_private

warnings.filterwarnings("ignore")
B, T, D = 4, 5, 6
CALLS = [
    name
    for name, member in vars(StepHooks).items()
    if inspect.isfunction(member) and not name.startswith("_")
]


@pytest.mark.parametrize(
    "cls",
    [
        ghost.GhostGradSampleModule,
        ghost.GhostGradSampleHooks,
        ghost.GhostFSDPGradSampleModule,
        ghost.GhostFSDPGradSampleHooks,
        OpacusStepHooks,
    ],
)
def test_every_hooks_class_implements_the_whole_contract(cls):
    assert len(CALLS) == 15  # two setup calls (the engine), thirteen step calls
    for name in CALLS:
        assert callable(getattr(cls, name, None)), name
        ours = inspect.signature(getattr(cls, name)).parameters
        theirs = inspect.signature(getattr(StepHooks, name)).parameters
        assert list(ours) == list(theirs), name


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, D)
        self.out = nn.Linear(D, 3)

    def forward(self, ids):
        return self.out(self.emb(ids)).sum(1)


@pytest.mark.parametrize("one_backward", [True, False])
def test_the_step_makes_the_contracts_calls_in_order(one_backward):
    torch.manual_seed(0)
    ids, y = torch.randint(0, 9, (B, T)), torch.randint(0, 3, (B,))
    engine = PrivacyEngine(one_backward=one_backward)
    gsm, opt, crit, _ = make_private(engine, Net(), (ids, y), B, 1.0, "ghost")
    made = []
    for name in CALLS:
        method = getattr(gsm, name)

        def spy(*args, _name=name, _method=method, **kwargs):
            made.append(_name)
            return _method(*args, **kwargs)

        object.__setattr__(gsm, name, spy)
    crit(gsm(ids), y).backward()
    opt.step()
    steps = ["begin_step", "begin_first_pass", "finish_norms", "check_all_reported"]
    steps += ["end_first_pass"]
    steps += ["get_clipping_coef", "disable_hooks"]
    steps += ["take_kept", "layer_type", "layer_type"] if one_backward else []  # 2 layers
    assert made == [*steps, "enable_hooks"]
