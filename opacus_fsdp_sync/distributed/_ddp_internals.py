"""The one place that reads undocumented ``DistributedDataParallel`` state.

Checked by the test-suite (CPU, gloo) on the torch releases in
:data:`~opacus_fsdp_sync.distributed.version_gate.TESTED_TORCH_VERSIONS`.

The one-backward step never lets a parameter gradient reach
DDP's reducer: the activations-only first pass runs no ``AccumulateGrad`` node, so none of DDP's
autograd hooks fires, and the clipped gradients are set on ``p.grad`` directly and all-reduced
here, as DDP's reducer would (each gradient divided by the world size, then summed in buckets).

DDP's forward still arms its reducer (``prepare_for_backward``). Verified over 13 steps with the
default settings, ``find_unused_parameters=True`` and ``gradient_as_bucket_view=True``: when no
hook fires in an iteration, the reducer has nothing to finalise, the next forward re-arms it
without complaint, DDP issues no collective in backward, and a later normal backward still
all-reduces once. ``static_graph=True`` is different: its first backward queues a delayed
all-reduce that marks every parameter unused for good, so the one-backward step steps aside.
"""

from __future__ import annotations

from torch import nn

from . import version_gate
from .version_gate import TorchInternalsError

#: Kept for callers that read it: the releases the whole suite runs on.
VERIFIED_TORCH_VERSIONS = version_gate.TESTED_TORCH_VERSIONS


class DDPInternalsError(TorchInternalsError):
    """Raised when DDP's attributes do not look as the tested torch releases have them."""


def _fail(what: str) -> DDPInternalsError:
    return version_gate.internals_error(
        "the DDP one-backward hand-off",
        what,
        "Pass one_backward=False to PrivacyEngine: DDP then all-reduces in a second backward, as "
        "it does by itself.",
        cls=DDPInternalsError,
    )


def _get(ddp: nn.Module, name: str):
    if not hasattr(ddp, name):
        raise _fail(f"DistributedDataParallel.{name}")
    return getattr(ddp, name)


def static_graph(ddp: nn.Module) -> bool:
    """Whether DDP was built with ``static_graph=True``."""
    return bool(_get(ddp, "static_graph"))


def one_backward_blocker(ddp: nn.Module) -> str | None:
    """Why this DDP module cannot hand clipped gradients to our all-reduce, or None.

    Anything that changes what DDP's reducer does with a gradient (a communication hook, DDP's
    mixed precision, the Python reducer, delayed all-reduce, a static graph, sparse embedding
    gradients) is not emulated: the step then runs two backward passes and DDP reduces the
    second one itself.

    Raises:
        DDPInternalsError: if an attribute read here is missing.
    """
    if static_graph(ddp):
        return "DDP static_graph=True"
    if _get(ddp, "mixed_precision") is not None:
        return "DDP mixed_precision"
    if _get(ddp, "_use_python_reducer"):
        return "DDP Python reducer"
    if _get(ddp, "_delay_all_reduce_all_params") or _get(ddp, "_delay_all_reduce_params"):
        return "DDP delayed all-reduce parameters"
    if _get(ddp, "_comm_hooks"):
        return "a DDP communication hook"
    sparse = (nn.Embedding, nn.EmbeddingBag)
    if any(isinstance(m, sparse) and m.sparse for m in ddp.module.modules()):
        return "a sparse embedding gradient"
    return None


def _same_group(state, ddp_group) -> bool:
    """Whether ``allreduce_hook``'s state reduces over DDP's ranks (None means the world)."""
    import torch.distributed as dist

    group = dist.group.WORLD if state is None else state
    if not isinstance(group, dist.ProcessGroup):
        return False
    return dist.get_process_group_ranks(group) == dist.get_process_group_ranks(ddp_group)


def comm_hook_refusal(ddp: nn.Module) -> tuple[str, str] | None:
    """The DDP communication hook that may not average clipped gradients, and why; or None.

    Passes: no hook, torch's ``default_hooks.allreduce_hook`` (with no state, or DDP's own
    ranks' process group as its state) and the averaging hook DDP
    registers itself for ``mixed_precision``. Everything else is named: the 16-bit compress
    hooks (they round each rank's clipped sum before the noise is added, so the sum of the
    rounded parts can exceed the clipping bound), PowerSGD (its error feedback carries each
    rank's unreleased clipped gradients into later steps' updates), built-in C++ hooks
    (``_register_builtin_comm_hook``, not inspectable) and any other hook (it may sum).

    Returns:
        ``(hook name, why it is refused)``, or None when DDP averages as the optimizer expects.

    Raises:
        DDPInternalsError: if an attribute read here is missing.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, mixed_precision_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    with version_gate.private_access(
        "the check of DDP's communication hook (make_private)",
        "DistributedDataParallel._comm_hooks / _get_ddp_logging_data() and "
        "mixed_precision_hooks._reducer_allreduce_and_upcast_hook",
        "Install a tested torch release; this privacy check cannot be turned off.",
        cls=DDPInternalsError,
    ):
        averaging = (
            default_hooks.allreduce_hook,
            mixed_precision_hooks._reducer_allreduce_and_upcast_hook,
        )
        hooks = list(ddp._comm_hooks)
        builtin = None if hooks else ddp._get_ddp_logging_data().get("comm_hook")
    if builtin is not None:
        return str(builtin), "a built-in (C++) hook, which cannot be inspected"
    for hook, state in hooks:
        name = getattr(hook, "__qualname__", None) or repr(hook)
        if hook is default_hooks.allreduce_hook and not _same_group(state, ddp.process_group):
            return name, (
                "its state is a process group other than DDP's, so it averages over some "
                "ranks only: the ranks' updates differ, and the noise is scaled for all of them"
            )
        if hook in averaging:
            continue
        if hook in (psgd.powerSGD_hook, psgd.batched_powerSGD_hook):
            return name, (
                "PowerSGD: its error feedback carries each rank's unreleased clipped gradients "
                "into later steps' updates, and its low-rank sum is not the clipped sum"
            )
        if hook in (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook) or (
            "compress_wrapper" in name
        ):
            return name, (
                "it rounds each rank's clipped gradient sum to 16 bits before the noise is "
                "added, so the rounded sum can exceed the clipping bound"
            )
        return name, "it may sum, compress or keep state instead of averaging over ranks"
    return None


def reduced_parameters(ddp: nn.Module) -> list[nn.Parameter]:
    """The parameters DDP's reducer averages, in registration order, each once.

    As DDP builds them: every parameter that requires grad, by module, except the names in
    ``parameters_to_ignore`` (set from ``_ddp_params_and_buffers_to_ignore``).
    """
    ignore = _get(ddp, "parameters_to_ignore")
    seen: set[int] = set()
    params = []
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            # DDP's own spelling: a root parameter's name starts with a dot
            if p.requires_grad and f"{module_name}.{name}" not in ignore and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def bucket_bytes_cap(ddp: nn.Module) -> int:
    """DDP's bucket size limit in bytes (``bucket_cap_mb``, 25 MiB by default)."""
    return int(_get(ddp, "bucket_bytes_cap"))


def process_group(ddp: nn.Module):
    """The process group DDP averages over."""
    return _get(ddp, "process_group")
