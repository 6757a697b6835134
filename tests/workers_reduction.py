"""Rank functions for ``tests/test_reduction_checks.py``: reductions that do not average.

Each worker builds one small model per case and calls ``make_private``; a case's result is the
refusal's message (``UnsupportedConfigurationError``), ``"internals: <message>"`` for a
versioned internals error, or None when the call passed.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.distributed import TorchInternalsError
from opacus_fsdp_sync.errors import UnsupportedConfigurationError
from tests.private import make_private

warnings.filterwarnings("ignore")

D = 8


def _make_private(model: nn.Module, mode: str) -> str | None:
    data = (torch.randn(8, D), torch.randint(0, D, (8,)))
    try:
        make_private(PrivacyEngine(), model, data, 8, 1.0, mode, noise=1.0, lr=0.1)
    except UnsupportedConfigurationError as err:
        return str(err)
    except TorchInternalsError as err:
        return f"internals: {err}"
    return None


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.Linear(D, D))


def fsdp2_cases(rank: int, world: int) -> dict:
    """make_private on FSDP2 models with the default reduction and with each override."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opacus_fsdp_sync.distributed import _fsdp2_internals

    mesh = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))

    def sharded(setup=None, device_mesh=mesh):
        model = _blocks()
        fully_shard(model[0], mesh=device_mesh)
        fully_shard(model[2], mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)  # the root unit owns model[3]
        if setup is not None:
            setup(model)
        return model

    def drop_attr(model):
        for group in _fsdp2_internals.iter_param_groups([model]):
            del group.force_sum_reduction_for_comms

    def old_name(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model[2].set_reduce_scatter_divide_factor(float(world))

    cases = {
        "default": lambda: sharded(),
        "hsdp_default": lambda: sharded(device_mesh=hsdp),
        "divide_1": lambda: sharded(lambda m: m.set_gradient_divide_factor(1.0)),
        "force_sum": lambda: sharded(lambda m: m[0].set_force_sum_reduction_for_comms(True)),
        "old_name": lambda: sharded(old_name),
        "missing_attr": lambda: sharded(drop_attr),
    }
    return {name: _make_private(build(), "ghost_fsdp") for name, build in cases.items()}


def _sum_hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def ddp_cases(rank: int, world: int) -> dict:
    """make_private on DDP models without a hook, with torch's averaging hook and others."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def ddp(setup=None):
        model = nn.parallel.DistributedDataParallel(_blocks())
        if setup is not None:
            setup(model)
        return model

    def powersgd(model):
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        model.register_comm_hook(state, psgd.powerSGD_hook)

    def drop_attr(model):
        del model._comm_hooks

    cases = {
        "none": lambda: ddp(),
        "allreduce": lambda: ddp(
            lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook)
        ),
        "sum": lambda: ddp(lambda m: m.register_comm_hook(None, _sum_hook)),
        "powersgd": lambda: ddp(powersgd),
        "fp16": lambda: ddp(lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook)),
        "builtin": lambda: ddp(
            lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        ),
        "missing_attr": lambda: ddp(drop_attr),
    }
    return {name: _make_private(build(), "ghost") for name, build in cases.items()}
