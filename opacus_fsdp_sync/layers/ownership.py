"""Trainable parameters that no hooked layer call covers: refused, never clipped wrong.

Per-sample norms come from hooks on the layers that own trainable parameters (Opacus's
``iterate_submodules``): a parameter counts only where its owning layer is called and its hooks
see the call. A parameter used any other way is missing from the norm, and the one-backward step
drops its gradient, silently (peft's LoRA ``Embedding``: every update about 35x too large).

Two checks:

- :func:`ownership_refusals` (at ``make_private``): trainable parameters whose owner cannot be
  hooked, owned directly by a module without a forward of its own (``nn.ParameterDict``,
  ``nn.ParameterList``, a bare ``nn.Module`` holder), or by a module inside a layer replayed as
  a whole (a layer with parameters of its own and no Opacus sampler: the replay differentiates
  its own parameters only).
- :func:`check_parameter_uses` (once per model, at its first private step): walks the autograd
  graph from the criterion's per-sample losses (under FSDP1, through each original parameter's
  view of its flat parameter) and raises when a trainable parameter is reached but no hooked
  call of its layer ran (a sibling's weight read without calling the sibling), or is reached
  more often than its layers' calls use it (a functional reuse, ``F.linear(h, self.wte.weight)``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from opacus.grad_sample.grad_sample_module import GradSampleModule
from opacus.layers import DPGRU, DPLSTM, DPRNN
from torch import nn

from ..distributed._fsdp1_uses_internals import (
    flat_pieces,
    module_names,
    piece_keys,
    piece_read,
    unrecognized_reads,
)
from .registry import layer_type, room_for

#: Layers Opacus recurses into even though they own parameters (``iterate_submodules``).
_RECURSED = (DPRNN, DPLSTM, DPGRU)

_PEFT_HINT = (
    " For peft LoRA on an embedding (lora_embedding_A/B are ParameterDicts), leave "
    "'embed_tokens' (the embedding) out of target_modules, or list it in modules_to_save."
)


class ParameterUseError(RuntimeError):
    """A trainable parameter was used outside its hooked layer's call (found at the step)."""


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (``ParameterDict`` and friends do not)."""
    return type(module).forward is not nn.Module.forward


def _trainable_own(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def hooked_layers(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """The layers Opacus hooks in ``model``, by ``id``: ``(qualified name, module)``.

    Mirrors Opacus's ``iterate_submodules``: every module with trainable parameters of its own;
    no recursion below one that Opacus has no per-sample sampler for (it is replayed whole).
    """
    out: dict[int, tuple[str, nn.Module]] = {}

    def walk(name: str, module: nn.Module) -> None:
        trainable = bool(_trainable_own(module))
        if trainable:
            out[id(module)] = (name, module)
            if type(module) not in GradSampleModule.GRAD_SAMPLERS and not isinstance(
                module, _RECURSED
            ):
                return
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", model)
    return out


def ownership_refusals(model: nn.Module) -> list[str]:
    """``"name: why"`` for each trainable parameter whose owning module cannot be hooked.

    Args:
        model: The user's model (unwrapped).

    Returns:
        One entry per refused parameter (empty: every trainable parameter has a hooked owner).
    """
    hooked = hooked_layers(model)
    out = []
    for mname, module in model.named_modules():
        own = _trainable_own(module)
        if not own:
            continue
        for pname, _ in own:
            full = f"{mname}.{pname}" if mname else pname
            kind = type(module).__name__
            if id(module) not in hooked:
                out.append(
                    f"{full}: owned by {kind} {mname!r}, inside a layer with parameters of its "
                    "own that is replayed as a whole (no per-sample room): the replay "
                    "differentiates that layer's own parameters only. Move the parameters of "
                    "the outer layer into a child module of their own"
                )
            elif not _has_forward(module):
                out.append(
                    f"{full}: owned directly by a {kind}, which is never called, so no hook sees "
                    "its uses; hold it in a module that computes with it in its own forward "
                    "(e.g. an nn.Linear / nn.Embedding called by the parent), or freeze it."
                    + _PEFT_HINT
                )
    return out


#: Hooks objects already checked (one check per model).
_CHECKED: weakref.WeakSet = weakref.WeakSet()


def _accumulate_edges(losses: Sequence[torch.Tensor], flats: dict) -> dict[object, int]:
    """Incoming edges of every parameter the graph of ``losses`` reaches (one walk).

    Keys: ``id(leaf)`` for a leaf read as itself; ``(id(flat parameter), split index)`` for an
    FSDP1 original parameter read through its view (``flats``: :func:`flat_pieces`).

    Raises:
        FSDPInternalsError: when an FSDP1 flat parameter is reached another way.
    """
    out: dict[object, int] = {}
    originals = piece_keys(flats)
    stack = list({t.grad_fn for t in losses if t.grad_fn is not None})
    seen = set(stack)
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None:
                continue
            try:
                key = id(node.variable)  # AccumulateGrad
                key = originals.get(key, key)  # an FSDP1 original parameter read as itself
            except AttributeError:
                key = piece_read(node, flats) if flats else None
                if key is None:
                    if node not in seen:
                        seen.add(node)
                        stack.append(node)
                    continue
            out[key] = out.get(key, 0) + 1
    unrecognized_reads({k for k in out if isinstance(k, int)}, flats)
    return out


def _fsdp2_locations(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """``{id(unsharded parameter): (module, name)}`` for FSDP2 modules in ``model`` (or none)."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return {}
    from ..distributed._fsdp2_internals import (
        fsdp_params,
        iter_param_groups,
        param_location,
        unsharded_param,
    )

    out = {}
    for group in iter_param_groups([model]):
        for fp in fsdp_params(group):
            full = unsharded_param(fp)
            if full is not None:
                out[id(full)] = param_location(fp)
    return out


def _owners(
    model: nn.Module, layers: list[nn.Module], flats: dict
) -> tuple[dict[object, list[nn.Module]], dict[object, str]]:
    """Which hooked layers hold each parameter, and each trainable one's name.

    Keyed as :func:`_accumulate_edges` keys the graph's reads.
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    owners: dict[int, list[nn.Module]] = {}
    for layer in layers:
        for _, p in _trainable_own(layer):
            owners.setdefault(id(p), []).append(layer)
    qualified = {id(m): n for n, m in model.named_modules()}
    for key, (module, pname) in _fsdp2_locations(model).items():
        names.setdefault(key, f"{qualified.get(id(module), '?')}.{pname}".lstrip("."))
        # Registered now (sharded or not): every owner of a tied weight registers the same one.
        registered = module._parameters.get(pname)
        held = owners.get(id(registered), []) if key != id(registered) else []
        owners.setdefault(key, []).extend(held)
    hooked = {id(m) for m in layers}
    for flat, pieces in flats.items():
        for index, piece in pieces.items():
            if piece.param.requires_grad:
                names[(flat, index)] = piece.name
                owners[(flat, index)] = [m for m in piece.owners if id(m) in hooked]
    return owners, names


def _problems(hooks, losses: Sequence[torch.Tensor], captured: dict) -> list[str]:
    model = hooks._module
    layers = list(hooks.iterate_submodules(model))
    flats = flat_pieces(model)
    owners, names = _owners(model, layers, flats)
    qualified = module_names(model)
    label = {id(m): qualified[id(m)] or type(m).__name__ for m in model.modules()}
    out = []
    for key, edges in _accumulate_edges(losses, flats).items():
        if key not in names:
            continue  # not a trainable parameter of the model (an input leaf, a frozen weight)
        held = owners.get(key, [])
        ran = [m for m in held if id(m) in captured]
        who = ", ".join(label.get(id(m), type(m).__name__) for m in held)
        if not held:
            out.append(f"{names[key]}: belongs to no hooked layer")
        elif not ran:
            out.append(
                f"{names[key]}: read without calling its layer ({who}) in this forward, e.g. a "
                "sibling's weight used as F.linear(h, self.proj.weight); call the layer instead"
            )
        elif edges > len(ran) and all(room_for(m, layer_type(m)).direct for m in held):
            out.append(
                f"{names[key]}: used {edges} times but its layer ({who}) ran {len(ran)} time(s); "
                "a functional reuse such as F.linear(h, self.wte.weight) is invisible to the "
                "hooks. Use a separate layer sharing the weight (e.g. lm_head.weight = "
                "wte.weight), which is supported"
            )
    return out


def check_parameter_uses(loss, hooks) -> None:
    """Once per model, before its first private backward: every trainable use is hooked.

    Walks the graph of the criterion's per-sample losses that ``loss`` combines (terms that
    need gradients are refused when combined: :class:`~..backward.SyncDPTensor`). A step that
    raises, here or in the walk, is cleaned up as any failed step and checked again next time.
    Skipped for hooks that keep no record of captured layers (Opacus's own classes).

    Args:
        loss: The :class:`~..backward.SyncDPTensor` whose backward is starting.
        hooks: Its step hooks.

    Raises:
        ParameterUseError: naming each parameter and the pattern, after the step's state is
            cleaned up as for any failed step.
    """
    captured = vars(hooks).get("_captured")
    if captured is None or hooks in _CHECKED:
        return
    try:
        problems = _problems(hooks, loss.sample_losses, captured)
        if problems:
            raise ParameterUseError(
                "opacus_fsdp_sync: trainable parameters used outside their hooked layer's "
                "call; their per-sample norms would be missing and their gradients wrong: "
                + "; ".join(problems)
            )
    except BaseException as error:  # the step's state goes back as for any failed step
        loss._clean_up_failed_step(error, hooks)
        raise
    _CHECKED.add(hooks)  # checked clean: a step that raised is checked again next time
