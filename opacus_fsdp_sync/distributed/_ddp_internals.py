"""The one place that reads undocumented ``DistributedDataParallel`` state.

Verified on torch 2.13.0 (CPU, gloo). The one-backward step never lets a parameter gradient reach
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

import warnings

import torch
from torch import nn

#: torch releases (major.minor) on which these accessors were verified by the test-suite.
VERIFIED_TORCH_VERSIONS = ("2.13",)


class DDPInternalsError(RuntimeError):
    """Raised when DDP's attributes do not look as the verified torch releases have them."""


def _fail(what: str) -> DDPInternalsError:
    return DDPInternalsError(
        f"opacus_fsdp_sync could not find {what} on torch {torch.__version__} (DDP internals "
        f"verified on {', '.join(VERIFIED_TORCH_VERSIONS)}). Pass one_backward=False to "
        "PrivacyEngine: DDP then all-reduces in a second backward, as it does by itself."
    )


def _get(ddp: nn.Module, name: str):
    if not hasattr(ddp, name):
        raise _fail(f"DistributedDataParallel.{name}")
    return getattr(ddp, name)


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


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
    if _torch_minor() not in VERIFIED_TORCH_VERSIONS:
        warnings.warn(
            f"opacus_fsdp_sync: the DDP one-backward hand-off was verified on torch "
            f"{', '.join(VERIFIED_TORCH_VERSIONS)}, this is {torch.__version__}; the attribute "
            "checks passed, but run the DDP exactness tests (or pass one_backward=False) before "
            "trusting results.",
            stacklevel=2,
        )
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
