"""The one place that reads the state Opacus's hooks and optimizers keep on objects.

Opacus's grad-sample hooks keep their per-step state as plain attributes on the user's layers and
parameters (``activations``, ``max_batch_len``, ``_forward_counter``, ``norm_sample``,
``_norm_sample``), and adaptive clipping sets ``_adjusted_noise_multiplier`` on the DP optimizer.
The DP optimizer's virtual steps (``signal_skip_step``, which ``BatchMemoryManager`` sends) live
in its ``_step_skip_queue`` and ``_is_last_step_skipped``.
None of them is declared: each appears once a hook or a clipping step has run, so "absent" is a
normal state here, read as empty, not an error. Checked on opacus 1.6.0 (the release the suite
runs on); a reader who upgrades Opacus checks these names in ``opacus/grad_sample/`` and
``opacus/optimizers/`` first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def captured_activations(module: nn.Module) -> list | None:
    """The inputs Opacus's capture hook keeps on a layer, one entry per forward call.

    Reads ``module.activations`` (set by ``GradSampleModule.capture_activations_hook``).

    Returns:
        The list (possibly empty), or None when the hook never captured on this layer.
    """
    return getattr(module, "activations", None)


def activations_list(module: nn.Module) -> list:
    """``module.activations``, created empty first where the capture hook has not run yet.

    Opacus's own capture hook does the same before appending a forward's inputs.
    """
    if not hasattr(module, "activations"):
        module.activations = []
    return module.activations


def drop_batch_len_when_consumed(module: nn.Module) -> None:
    """Deletes ``module.max_batch_len`` once every captured forward was used by a backward.

    Opacus's backward hook does the same: the next forward measures the batch again.
    """
    if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
        del module.max_batch_len


def forget_step_state(module: nn.Module) -> None:
    """Forgets the activations and forward counters a failed step left on one layer.

    Clears ``activations``, resets ``_forward_counter`` on the layer and on its own parameters
    and deletes ``max_batch_len``, where Opacus's hooks set them.
    """
    if hasattr(module, "activations"):
        module.activations = []
    if hasattr(module, "_forward_counter"):
        module._forward_counter = 0
    if hasattr(module, "max_batch_len"):
        del module.max_batch_len
    for p in module.parameters(recurse=False):
        if hasattr(p, "_forward_counter"):
            p._forward_counter = 0


def count_module_forward(module: nn.Module) -> int:
    """Adds one to a layer's ``_forward_counter`` (from 0 where unset) and returns it.

    Opacus's FSDP capture hook counts a layer's forward calls on the layer itself (its
    parameters are not registered during FSDP1's forward).
    """
    module._forward_counter = getattr(module, "_forward_counter", 0) + 1
    return module._forward_counter


def capture_inputs(module: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    """Opacus's FSDP capture for a layer's first call in a forward, on its ``__dict__``.

    Appends the detached ``inputs`` to ``module.activations`` (created empty first) and sets
    ``_forward_counter`` to 1, as ``GradSampleModuleFastGradientClippingFSDP``'s capture does
    for a call it accepts; the caller has checked the counter is 0 (a second call is refused
    by Opacus's own capture).
    """
    state = module.__dict__
    acts = state.get("activations")
    if acts is None:
        acts = state["activations"] = []
    acts.append([t.detach() for t in inputs])
    state["_forward_counter"] = 1


def take_captured(module: nn.Module) -> tuple[list, int]:
    """Opacus's ``rearrange_grad_samples`` for a batch-first layer, without scaling anything.

    Sets ``module.max_batch_len`` where unset (the largest batch among the captured calls, from
    each call's last input, as Opacus's ``_get_batch_size``), pops the last captured call's
    inputs and counts the call as used (``_forward_counter``).

    Returns:
        The inputs and ``max_batch_len``.
    """
    state = module.__dict__
    acts = state["activations"]
    n = state.get("max_batch_len")
    if n is None:  # one captured call is the common case: no generator for it
        n = acts[0][-1].shape[0] if len(acts) == 1 else max(e[-1].shape[0] for e in acts)
        state["max_batch_len"] = n
    state["_forward_counter"] -= 1
    return acts.pop(), n


def module_norm_samples(module: nn.Module) -> Sequence[torch.Tensor | None]:
    """The per-sample norms Opacus's FSDP hooks stored on a layer, one per trainable parameter.

    Reads ``module.norm_sample`` (``GradSampleModuleFastGradientClippingFSDP`` keeps norms per
    module, with None for a parameter not reported).

    Returns:
        The stored list, or an empty tuple where the layer holds none.
    """
    return getattr(module, "norm_sample", ())


def norm_samples_list(module: nn.Module, parameters: Iterable) -> list:
    """``module.norm_sample``, created first with one None per parameter where none is stored.

    Args:
        module: The layer.
        parameters: Its trainable parameters (only counted when the list is created).
    """
    if not hasattr(module, "norm_sample"):
        module.norm_sample = [None for _ in parameters]
    return module.norm_sample


def param_norm_sample(param: torch.Tensor) -> torch.Tensor | None:
    """The per-sample norm Opacus's ghost hooks stored on a parameter (``param._norm_sample``).

    Returns:
        The norm, or None where no hook reported one for this parameter.
    """
    return getattr(param, "_norm_sample", None)


def noise_multiplier_in_force(optimizer) -> float:
    """The noise multiplier an Opacus DP optimizer draws with now.

    Adaptive clipping sets ``optimizer._adjusted_noise_multiplier`` (and keeps
    ``noise_multiplier`` for accounting); Opacus's fast-gradient-clipping optimizer reads it the
    same way, falling back to ``noise_multiplier``.
    """
    return getattr(optimizer, "_adjusted_noise_multiplier", optimizer.noise_multiplier)


def last_step_skipped(optimizer) -> bool:
    """Whether the DP optimizer's last step was a skipped one (a draw that goes on).

    Reads ``_is_last_step_skipped``, set by ``DPOptimizer.pre_step``: True after a physical batch
    of ``BatchMemoryManager`` that is not its draw's last. False for an optimizer without it.
    """
    return bool(getattr(optimizer, "_is_last_step_skipped", False))


def next_step_skipped(optimizer) -> bool:
    """Whether the DP optimizer's next step will be skipped, without taking the signal.

    Reads the head of ``_step_skip_queue`` (``signal_skip_step`` appends, ``pre_step`` takes).
    False for an empty queue or an optimizer without one.
    """
    queue = getattr(optimizer, "_step_skip_queue", None)
    return bool(queue) and bool(queue[0])


def abandon_step(optimizer) -> None:
    """Forgets a step that failed: the sum it was adding to and its skip signal.

    A backward that raised (an out-of-memory error in a physical batch of
    ``BatchMemoryManager``) never reached ``pre_step``: its signal stays at the head of
    ``_step_skip_queue`` and would pair every later physical batch with its predecessor's
    signal, and a sum kept from the draw's earlier physical batches (``_is_last_step_skipped``)
    would join the next draw's. Neither was released, so both are dropped: the head signal, and
    every ``summed_grad`` (through the optimizer's own ``zero_grad`` once the skip flag is off).
    """
    queue = getattr(optimizer, "_step_skip_queue", None)
    if queue:
        queue.pop(0)
    if last_step_skipped(optimizer):
        optimizer._is_last_step_skipped = False
        optimizer.zero_grad(set_to_none=True)
