"""Rank functions for the version-gate tests: a broken private accessor, a failed recovery."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.distributed import _fsdp2_internals as internals
from tests.models import ToyNet
from tests.private import make_private
from tests.workers_core import B_LOCAL, LR, _data, _shard

warnings.filterwarnings("ignore")


def _private_step(world: int, rank: int, **options):
    torch.manual_seed(0)
    model = _shard(ToyNet(), world, "fp32")
    x, y = _data(world, 3)
    b = B_LOCAL * world
    gsm, opt, crit, _ = make_private(
        PrivacyEngine(**options), model, (x, y), b, 0.5, "ghost_fsdp", lr=LR
    )
    lo, hi = rank * B_LOCAL, (rank + 1) * B_LOCAL

    def step(s: int) -> None:
        crit(gsm(x[s * b : (s + 1) * b][lo:hi]), y[s * b : (s + 1) * b][lo:hi]).backward()
        opt.step()
        opt.zero_grad()

    return model, step


def _describe(err: BaseException) -> dict:
    recorded = getattr(err, "cleanup_errors", [])  # what failed while cleaning up after it
    abort = recorded[-1] if recorded else None
    return {
        "type": type(err).__name__,
        "message": str(err),
        "notes": list(getattr(err, "__notes__", [])),
        "feature": getattr(err, "feature", None),
        "abort_type": type(abort).__name__ if abort is not None else None,
        "abort_message": str(abort) if abort is not None else None,
        "abort_feature": getattr(abort, "feature", None),
    }


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """Replaces (or, with ``value`` None, removes) a class attribute inside the block."""
    orig = owner.__dict__[name]
    if value is None:
        delattr(owner, name)
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def broken_sync_flag_accessor(rank: int, world: int) -> dict:
    """A step on FSDP2 groups whose ``reduce_grads`` flag was removed on purpose."""
    model, step = _private_step(world, rank)
    step(0)  # lazy init; the flags exist
    for group in internals.iter_param_groups([model]):
        del group.reduce_grads
    try:
        step(1)
    except Exception as err:  # noqa: BLE001 - described to the parent
        return _describe(err)
    return {"type": None}


def failed_step_with_failed_recovery(rank: int, world: int) -> dict:
    """A hand-off that raises while ``reset_iter_state`` is missing, then one more step."""

    def failing_post_backward(self, *args):
        raise ValueError("injected hand-off failure")

    _, step = _private_step(world, rank)
    step(0)
    out = {}
    with (
        _patched(FSDPParamGroup, "post_backward", failing_post_backward),
        _patched(FSDPModule, "reset_iter_state", None),
    ):
        try:
            step(1)
        except Exception as err:  # noqa: BLE001 - described to the parent
            out["failed"] = _describe(err)
    try:
        step(2)
    except Exception as err:  # noqa: BLE001 - described to the parent
        out["next"] = _describe(err)
    return out
