"""Where each API keeps a parameter's gradient, and one microbatch's gradients by name.

FSDP2 leaves the sharded ``param.grad`` as None while gradient sync is off: the full, unsharded
gradient lives on the ``FSDPParam``, in a place that changed in torch 2.15 (see
:mod:`opacus_fsdp_sync.distributed._fsdp2_internals`, which hides it).
FSDP1 (``use_orig_params=True``) exposes it as views into the flat parameter's unsharded
gradient, DDP and a single device as ``param.grad``. This module hides the difference: names are
the user's own parameter names (wrapper prefixes removed), the same on every API.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..apis.api import DDP, FSDP1, FSDP2, ApiRecord
from ..apis.registry import detect_api
from ..distributed import _fsdp1_internals as fsdp1
from ..distributed import _fsdp2_internals as internals
from ..distributed.detect import _unwrap

logger = logging.getLogger(__name__)

#: Prefixes wrappers add to parameter names (FSDP1, activation checkpointing, torch.compile).
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """The user's parameter or module name, without the prefixes wrappers insert."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass
class GradLayout:
    """A model as gradient access sees it.

    Attributes:
        record: The distributed API's record (:mod:`opacus_fsdp_sync.apis.api`).
        model: The user's model (Opacus and DDP wrappers removed).
        roots: The outermost FSDP modules, or the DDP module (empty for a single device).
        params: Registered parameters by clean name (for FSDP: the sharded ones at rest).
    """

    record: ApiRecord
    model: nn.Module
    roots: list[nn.Module]
    params: dict[str, nn.Parameter] = field(default_factory=dict)

    @property
    def api(self) -> str | None:
        """The record's name: ``"fsdp2"``, ``"fsdp1"``, ``"ddp"`` or None (single device)."""
        return self.record.name

    def module_names(self) -> dict[int, str]:
        """Clean name of every module, by ``id``."""
        names: dict[int, str] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            names.setdefault(id(module), clean_name(name))
        return names


def resolve(model: nn.Module) -> GradLayout:
    """Detects the API wrapping ``model`` and lists its parameters by clean name.

    Args:
        model: A bare model, an FSDP2 or FSDP1 (``use_orig_params=True``) model, a
            ``DistributedDataParallel`` module, or an Opacus module wrapping one of these.

    Raises:
        TypeError: when ``model`` is not a module.
    """
    found = detect_api(model)
    user = _unwrap(model)
    if isinstance(user, DistributedDataParallel):
        user = user.module
    params: dict[str, nn.Parameter] = {}
    for name, param in user.named_parameters():
        params.setdefault(clean_name(name), param)
    return GradLayout(record=found.record, model=user, roots=list(found.modules), params=params)


def _fsdp2_slots(layout: GradLayout) -> dict[str, object]:
    """Each FSDP2-managed parameter's ``FSDPParam``, by clean name."""
    module_names = layout.module_names()
    slots: dict[str, object] = {}
    for group in internals.iter_param_groups(layout.roots):
        for fsdp_param in internals.fsdp_params(group):
            module, param_name = internals.param_location(fsdp_param)
            prefix = module_names.get(id(module))
            if prefix is None:
                raise internals.FSDPInternalsError(
                    f"An FSDP2 parameter ({param_name}) belongs to a module outside the model "
                    "passed in; pass the model on which fully_shard was called."
                )
            slots[f"{prefix}.{param_name}" if prefix else param_name] = fsdp_param
    return slots


def _fsdp1_owned(layout: GradLayout) -> dict[int, object]:
    """FSDP1 handle owning each original parameter, by the parameter's ``id``."""
    return {
        id(p): handle for handle in fsdp1.handles(layout.model) for p in fsdp1.orig_params(handle)
    }


def _fsdp2_unsynced(layout: GradLayout, out: dict) -> set[str]:
    """FSDP2: the unsharded gradient kept on each ``FSDPParam``; returns the managed names."""
    managed = set()
    for name, fsdp_param in _fsdp2_slots(layout).items():
        managed.add(name)
        grad = internals.unsynced_grad(fsdp_param)
        if grad is not None:
            out[name] = grad
    return managed


def _fsdp1_unsynced(layout: GradLayout, out: dict) -> set[str]:
    """FSDP1: views into each handle's unsharded flat gradient; returns the managed names."""
    managed = set()
    owned = _fsdp1_owned(layout)
    for name, param in layout.params.items():
        handle = owned.get(id(param))
        if handle is None:
            continue
        managed.add(name)
        flat_grad = handle.flat_param.grad
        if flat_grad is not None and flat_grad.numel() == fsdp1.unsharded_numel(handle):
            if param.grad is not None:
                out[name] = param.grad
    return managed


#: Where each API keeps unsynchronised gradients other than ``param.grad``.
_UNSYNCED = {FSDP2: _fsdp2_unsynced, FSDP1: _fsdp1_unsynced}


def unsynced_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's unsynchronised (unsharded, accumulated) gradient of each parameter.

    Read after one or more backward passes with sync disabled (:func:`sync_disabled`, FSDP1's or
    DDP's ``no_sync()``, or FSDP2's ``set_requires_gradient_sync(False)``). The tensors are the
    ones the API holds (no copy): treat them as read-only, or clone them. On a single device and
    under DDP this is ``param.grad``.

    Args:
        model: See :func:`resolve`.

    Returns:
        Full-shape gradients by parameter name. Parameters without an unsynchronised gradient
        (never reached by a backward, or already reduced) are absent.
    """
    layout = resolve(model)
    out: dict[str, torch.Tensor] = {}
    read = _UNSYNCED.get(layout.api)
    managed = read(layout, out) if read is not None else set()
    for name, param in layout.params.items():
        if name not in managed and param.grad is not None:
            out[name] = param.grad
    return out


def _fsdp2_no_sync(layout: GradLayout, stack: contextlib.ExitStack) -> None:
    """FSDP2: sync off on every module; each group's own flags restored on exit."""
    groups = list(internals.iter_param_groups(layout.roots))
    saved = [(g, internals.get_sync_flags(g)) for g in groups]

    def restore() -> None:
        for group, flags in saved:
            internals.set_sync_flags(group, flags)

    stack.callback(restore)
    for root in layout.roots:
        root.set_requires_gradient_sync(False, recurse=True)


def _roots_no_sync(layout: GradLayout, stack: contextlib.ExitStack) -> None:
    """FSDP1 and DDP: each root's own ``no_sync()``; one device has no root."""
    for root in layout.roots:
        stack.enter_context(root.no_sync())


#: How each API turns gradient sync off (others: :func:`_roots_no_sync`).
_NO_SYNC = {FSDP2: _fsdp2_no_sync}


@contextlib.contextmanager
def sync_disabled(model: nn.Module) -> Iterator[None]:
    """Turns gradient synchronisation off inside the block, on any API.

    FSDP2: ``set_requires_gradient_sync(False)`` on every FSDP module, then the user's own
    per-group settings are restored; FSDP1 and DDP: ``no_sync()`` on the root(s); a single
    device: nothing. Under DDP the forward must run inside the block too.

    Args:
        model: See :func:`resolve`.
    """
    layout = resolve(model)
    with contextlib.ExitStack() as stack:
        _NO_SYNC.get(layout.api, _roots_no_sync)(layout, stack)
        yield


def _combine(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """``old + new`` for training; never returns ``new`` itself (the caller hands it out)."""
    if new is None:
        return old
    if old is None:
        return new.clone()
    return old.add_(new.to(old.dtype))


class _PlainStash:
    """``param.grad`` moved aside (single device, DDP, parameters no FSDP manages)."""

    def __init__(self, params: dict[str, nn.Parameter]):
        self.params = params
        self.old: dict[str, torch.Tensor | None] = {}

    def take(self) -> None:
        for name, param in self.params.items():
            self.old[name], param.grad = param.grad, None

    def finish(self, accumulate: bool) -> dict[str, torch.Tensor]:
        new = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        for name, param in self.params.items():
            param.grad = _combine(self.old[name], new.get(name)) if accumulate else self.old[name]
        return new

    def abort(self) -> None:
        for name, param in self.params.items():
            param.grad = self.old.get(name)


class _FSDP2Stash:
    """FSDP2's unsharded gradients, as the opaque pairs of ``take_unsharded_grads``."""

    def __init__(self, layout: GradLayout):
        self.slots = _fsdp2_slots(layout)
        rest = {n: p for n, p in layout.params.items() if n not in self.slots}
        self.plain = _PlainStash(rest)
        self.old: dict[str, tuple] = {}

    def take(self) -> None:
        self.old = {n: internals.take_unsharded_grads(fp) for n, fp in self.slots.items()}
        self.plain.take()

    def finish(self, accumulate: bool) -> dict[str, torch.Tensor]:
        new: dict[str, torch.Tensor] = {}
        for name, fsdp_param in self.slots.items():
            grad, acc = internals.take_unsharded_grads(fsdp_param)
            merged = internals.merge_unsharded_grads((grad, acc))
            if merged is not None:
                new[name] = merged
            old_grad, old_acc = self.old[name]
            if accumulate:
                old_grad, old_acc = _combine(old_grad, grad), _combine(old_acc, acc)
            internals.put_unsharded_grads(fsdp_param, (old_grad, old_acc))
        new.update(self.plain.finish(accumulate))
        return new

    def abort(self) -> None:
        for name, fsdp_param in self.slots.items():
            internals.take_unsharded_grads(fsdp_param)
            internals.put_unsharded_grads(fsdp_param, self.old.get(name, (None, None)))
        self.plain.abort()


class _FSDP1Stash:
    """FSDP1's unsharded flat gradients (``no_sync``), one per ``FlatParamHandle``."""

    def __init__(self, layout: GradLayout):
        owned = _fsdp1_owned(layout)
        self.handles = list({id(h): h for h in owned.values()}.values())
        self.names = {n: p for n, p in layout.params.items() if id(p) in owned}
        self.plain = _PlainStash({n: p for n, p in layout.params.items() if id(p) not in owned})
        self.old: list[torch.Tensor | None] = []

    def take(self) -> None:
        for handle in self.handles:
            grad = handle.flat_param.grad
            if grad is not None and grad.numel() != fsdp1.unsharded_numel(handle):
                raise RuntimeError(
                    "FSDP1 holds a synced (sharded) gradient, so microbatch gradients cannot be "
                    "separated from it: call optimizer.zero_grad() before the microbatches, and "
                    "run the synced backward after them."
                )
        self.old = [fsdp1.take_flat_grad(h) for h in self.handles]
        self.plain.take()

    def finish(self, accumulate: bool) -> dict[str, torch.Tensor]:
        new = {n: p.grad for n, p in self.names.items() if p.grad is not None}
        for handle, old in zip(self.handles, self.old):
            flat = fsdp1.take_flat_grad(handle)
            fsdp1.put_flat_grad(handle, _combine(old, flat) if accumulate else old)
        new.update(self.plain.finish(accumulate))
        return new

    def abort(self) -> None:
        for handle, old in zip(self.handles, self.old):
            fsdp1.take_flat_grad(handle)
            fsdp1.put_flat_grad(handle, old)
        self.plain.abort()


_STASHES = {
    FSDP2: _FSDP2Stash,
    FSDP1: _FSDP1Stash,
    DDP: lambda layout: _PlainStash(layout.params),
    None: lambda layout: _PlainStash(layout.params),
}


@dataclass
class MicrobatchGrads:
    """What :func:`microbatch` yields; ``grads`` is filled when the block exits.

    Attributes:
        api: The API detected (``"fsdp2"``, ``"fsdp1"``, ``"ddp"`` or None).
        grads: This microbatch's full, unsynchronised gradient of each parameter on this rank,
            by name (parameters the backward did not reach are absent). They never alias the
            training gradients.
    """

    api: str | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def microbatch(model: nn.Module, *, accumulate: bool = True) -> Iterator[MicrobatchGrads]:
    """Runs one microbatch with sync off and yields its gradients alone (not the running sum).

    On entry the gradients accumulated so far are moved aside and sync is disabled
    (:func:`sync_disabled`); run the microbatch's forward and backward inside the block. On exit
    the microbatch's gradients are read into the yielded object's ``grads`` and the training
    gradients become ``accumulated + microbatch`` (or stay ``accumulated`` when ``accumulate`` is
    False), so training is unaffected. If the block raises, the accumulated gradients are put
    back unchanged.

    Example::

        for x in microbatches:
            with microbatch(model) as mb:
                model(x).loss.backward()
            analyse(mb.grads)
        model(last).loss.backward()  # synced: reduces the sum of all microbatches
        optimizer.step()

    Args:
        model: See :func:`resolve`. FSDP1 needs ``use_orig_params=True``.
        accumulate: Add the microbatch's gradients to the training gradients (one copy when
            nothing was accumulated yet); False leaves them out of training (no copy).

    Raises:
        RuntimeError: under FSDP1 while a synced (sharded) gradient is pending.
    """
    layout = resolve(model)
    stash = _STASHES[layout.api](layout)
    result = MicrobatchGrads(api=layout.api)
    stash.take()
    try:
        with sync_disabled(model):
            yield result
    except BaseException:
        stash.abort()
        raise
    result.grads = stash.finish(accumulate)
    logger.debug("[GradAccess] microbatch: %d gradients (%s)", len(result.grads), layout.api)
