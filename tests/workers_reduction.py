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
    stages = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))

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

    def force_sum_factor(model):
        model[0].set_force_sum_reduction_for_comms(True)
        model[0].set_gradient_divide_factor(float(world))

    def drop_hook_attr(model):
        for group in _fsdp2_internals.iter_param_groups([model]):
            del group._all_reduce_hook

    cases = {
        "default": lambda: sharded(),
        "hsdp_default": lambda: sharded(device_mesh=hsdp),
        "divide_1": lambda: sharded(lambda m: m.set_gradient_divide_factor(1.0)),
        "force_sum": lambda: sharded(lambda m: m[0].set_force_sum_reduction_for_comms(True)),
        "force_sum_factor": lambda: sharded(force_sum_factor),
        "old_name": lambda: sharded(old_name),
        "pg_alloc": lambda: sharded(
            lambda m: m.set_allocate_memory_from_process_group_for_comm(True)
        ),
        "custom_rs": lambda: sharded(lambda m: m[2].set_custom_reduce_scatter(_SummingScatter())),
        "all_reduce_hook": lambda: sharded(lambda m: m[0].set_all_reduce_hook(_double)),
        "missing_attr": lambda: sharded(drop_attr),
        "missing_hook_attr": lambda: sharded(drop_hook_attr),
        # pipeline-like stages: each rank its own 1-rank data-parallel sub-mesh
        "sub_mesh": lambda: sharded(device_mesh=stages["dp"]),
    }
    return {name: _make_private(build(), "ghost_fsdp") for name, build in cases.items()}


def _sharded_blocks(world: int) -> nn.Module:
    """:func:`_blocks` under FSDP2 on a 1-D mesh of every rank: two inner units and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _blocks()
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh)
    return model


def _double(reduced: torch.Tensor) -> None:
    reduced.mul_(2.0)


def _summing_scatter_class():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class _Summing(DefaultReduceScatter):
        """A user's reduce-scatter that sums whatever FSDP2 asks for."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return super().__call__(output_tensor, input_tensor, group, dist.ReduceOp.SUM, async_op)

    return _Summing


def _SummingScatter():  # noqa: N802 (reads as the class it builds)
    return _summing_scatter_class()()


def fsdp2_force_sum_step(rank: int, world: int) -> dict:
    """One noised private step with and without force-sum: the same parameters after it."""
    torch.manual_seed(1)
    data = (torch.randn(8, D), torch.randint(0, D, (8,)))
    out = {}
    for case in ("default", "force_sum"):
        model = _sharded_blocks(world)
        if case == "force_sum":
            for unit in (model[0], model[2], model):
                unit.set_force_sum_reduction_for_comms(True)
        # dp_seed: the two runs must draw the same noise to be compared (a test-only opt-in).
        engine = PrivacyEngine(dp_seed=7)
        gsm, opt, crit, _ = make_private(engine, model, data, 8, 0.05, "ghost_fsdp", noise=1.0)
        x, y = data[0][rank * 4 : rank * 4 + 4], data[1][rank * 4 : rank * 4 + 4]
        opt.zero_grad()
        loss = crit(gsm(x), y)
        loss.backward()
        opt.step()
        out[case] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {
        "max_diff": max((a - b).abs().max().item() for a, b in zip(*out.values(), strict=True)),
        "moved": max(
            (a - b.detach()).abs().max().item()
            for a, b in zip(out["default"], _blocks().parameters(), strict=True)
        ),
    }


def fsdp1_cases(rank: int, world: int) -> dict:
    """make_private on FSDP1 models without a hook, with torch's averaging hook and others."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as hooks
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    def fsdp1(setup=None, strategy=ShardingStrategy.FULL_SHARD):
        model = FullyShardedDataParallel(
            _blocks(),
            device_id=torch.device("cpu"),
            use_orig_params=True,
            sharding_strategy=strategy,
        )
        if setup is not None:
            setup(model)
        return model

    def halved(model):
        state = hooks.DefaultState(model.process_group)
        state.gradient_predivide_factor, state.gradient_postdivide_factor = 1.0, 1.0
        model.register_comm_hook(state, hooks.reduce_scatter_hook)

    def drop_attr(model):
        for m in model.modules():
            if isinstance(m, FullyShardedDataParallel):
                del m._comm_hook

    def default(hook):
        return lambda m: m.register_comm_hook(hooks.DefaultState(m.process_group), hook)

    cases = {
        "none": lambda: fsdp1(),
        "reduce_scatter": lambda: fsdp1(default(hooks.reduce_scatter_hook)),
        "allreduce_no_shard": lambda: fsdp1(
            default(hooks.allreduce_hook), strategy=ShardingStrategy.NO_SHARD
        ),
        "sum": lambda: fsdp1(halved),
        "fp16": lambda: fsdp1(
            lambda m: m.register_comm_hook(
                hooks.LowPrecisionState(m.process_group), hooks.fp16_compress_hook
            )
        ),
        "missing_attr": lambda: fsdp1(drop_attr),
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

    # Every rank creates every subgroup (new_group is collective); each keeps its own.
    own = [dist.new_group([r]) for r in range(world)][rank]

    cases = {
        "none": lambda: ddp(),
        "allreduce": lambda: ddp(
            lambda m: m.register_comm_hook(None, default_hooks.allreduce_hook)
        ),
        "allreduce_world": lambda: ddp(
            lambda m: m.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        ),
        "allreduce_subgroup": lambda: ddp(
            lambda m: m.register_comm_hook(own, default_hooks.allreduce_hook)
        ),
        "ddp_on_subgroup": lambda: nn.parallel.DistributedDataParallel(
            _blocks(), process_group=own
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


def fsdp2_sync_off(rank: int, world: int, setting: str | None) -> dict:
    """A backward with FSDP2's sync turned off by ``setting`` (None: no such backward), then,
    sync on again, one step: the refusal's message and that step's update."""
    torch.manual_seed(1)
    data = (torch.randn(8, D), torch.randint(0, D, (8,)))
    model = _sharded_blocks(world)
    # dp_seed: runs with and without the refused backward are compared (a test-only opt-in).
    gsm, opt, crit, _ = make_private(PrivacyEngine(dp_seed=3), model, data, 8, 0.05, "ghost_fsdp")
    x, y = data[0][rank * 4 : rank * 4 + 4], data[1][rank * 4 : rank * 4 + 4]
    out: dict = {"error": None}
    if setting is not None:
        getattr(model, setting)(False, recurse=True)
        try:
            crit(gsm(x * 0.5), y).backward()
            opt.step()
        except UnsupportedConfigurationError as err:
            out["error"] = str(err)
        opt.zero_grad()
        getattr(model, setting)(True, recurse=True)
    before = [p.full_tensor().detach().clone() for p in model.parameters()]
    crit(gsm(x), y).backward()
    opt.step()
    out["update"] = torch.cat(
        [(b - p.full_tensor().detach()).flatten() for b, p in zip(before, model.parameters())]
    )
    return out
