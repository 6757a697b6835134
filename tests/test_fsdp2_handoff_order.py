"""The FSDP2 hand-off's order, with FSDP2's internals replaced by recorders (no process group).

Each kept entry's clipped gradients are computed with the first of its parameter groups visited
(the last in module order), every gradient reaches its own group before that group's
post-backward, a shared weight's uses add up first, and an entry without a trainable parameter
goes with the first group visited.
"""

import contextlib

import pytest
import torch
from torch import nn

from opacus_fsdp_sync.apis import fsdp2


class _FP:
    """Stands in for an ``FSDPParam``: the unsharded parameter and what it received."""

    def __init__(self, param: nn.Parameter):
        self.param = param
        self.received = None


@pytest.fixture
def recorded(monkeypatch):
    """Three groups; modules owning parameters in groups {0}, {2}, {1, 2}, {1} and none."""
    a, b, c, d = (nn.Linear(2, 2, bias=False) for _ in range(4))
    c.extra = nn.Parameter(torch.zeros(2))  # c owns parameters in groups 1 and 2
    frozen = nn.Linear(2, 2, bias=False).requires_grad_(False)
    owner = {id(a.weight): 0, id(b.weight): 2, id(c.weight): 1, id(c.extra): 2, id(d.weight): 1}
    params = [a.weight, b.weight, c.weight, c.extra, d.weight]
    fps = {id(p): _FP(p) for p in params}
    index = {id(p): (owner[id(p)], fps[id(p)]) for p in params}
    groups = ["g0", "g1", "g2"]
    log = []
    monkeypatch.setattr(
        fsdp2.handoff_internals, "param_group_index", lambda modules: (groups, index)
    )
    monkeypatch.setattr(fsdp2.internals, "unsharded_param", lambda fp: fp.param)
    monkeypatch.setattr(fsdp2, "as_param_grad", lambda param, grad: grad)

    def deliver_grad(fp, grad):
        fp.received = grad
        log.append(("grad", owner[id(fp.param)], id(fp.param)))

    monkeypatch.setattr(fsdp2.handoff_internals, "set_unsharded_grad", deliver_grad)
    monkeypatch.setattr(
        fsdp2.handoff_internals,
        "group_post_backward",
        lambda group: log.append(("post_backward", groups.index(group))),
    )
    monkeypatch.setattr(
        fsdp2.handoff_internals, "finish_backward", lambda modules: log.append(("finish",))
    )
    # a second module using b's weight (group 2): a shared weight whose uses add up
    shared = nn.Linear(2, 2, bias=False)
    shared.weight = b.weight
    owner_modules = {"a": a, "b": b, "c": c, "d": d, "frozen": frozen, "shared": shared}
    return owner_modules, fps, log


def test_entries_go_with_the_first_of_their_groups_visited(recorded):
    modules, fps, log = recorded
    names = ["d", "frozen", "c", "a", "b", "shared"]
    # kept entries as the first pass leaves them: the module first (here a name and a value)
    entries = [(modules[n], n, float(i + 1)) for i, n in enumerate(names)]

    def compute(items):
        """Each trainable parameter's clipped gradient: its entry's value everywhere."""
        log.append(("compute", [name for _, name, _ in items]))
        out = {}
        for module, _, value in items:
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    out[(id(module), pname)] = (module, pname, torch.full_like(p, value))
        return out

    fsdp2.FSDP2Handoff([]).deliver(entries, compute, contextlib.nullcontext)
    assert entries == []  # emptied as used
    steps = [e for e in log if e[0] in ("compute", "post_backward", "finish")]
    # group 2 first (backward order): c (groups 1 and 2), b, shared (b's weight), and frozen
    # (no trainable parameter: the first group visited); then group 1: d; then group 0: a
    assert steps == [
        ("compute", ["frozen", "c", "b", "shared"]),
        ("post_backward", 2),
        ("compute", ["d"]),
        ("post_backward", 1),
        ("compute", ["a"]),
        ("post_backward", 0),
        ("finish",),
    ]
    # every gradient reached its group before that group's post-backward
    for i, event in enumerate(log):
        if event[0] == "grad":
            assert ("post_backward", event[1]) in log[i + 1 :]
    a, b, c, d = (modules[n] for n in "abcd")
    assert torch.equal(fps[id(c.weight)].received, torch.full((2, 2), 3.0))  # c's value
    assert torch.equal(fps[id(c.extra)].received, torch.full((2,), 3.0))
    assert torch.equal(fps[id(b.weight)].received, torch.full((2, 2), 5.0 + 6.0))  # shared
    assert torch.equal(fps[id(d.weight)].received, torch.full((2, 2), 1.0))
    assert torch.equal(fps[id(a.weight)].received, torch.full((2, 2), 4.0))
