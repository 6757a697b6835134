"""Book-keeping for a norm-only first backward that differentiates w.r.t. activations only.

The first backward of ghost clipping needs each hooked layer's output gradient, not its weight
gradient. Running it as ``loss.backward(inputs=sources)``, where ``sources`` are the raw outputs
(as a forward hook sees them, before Opacus's backward hook wraps them) of every hooked layer whose
inputs do not require grad, still fires every Opacus norm hook while autograd skips all weight
gradients. A missed hook would silently leave stale norms, so every layer captured in forward
must report in that pass, or the step fails loudly.
"""

from __future__ import annotations

import contextlib

import torch
from opacus.utils.module_utils import requires_grad
from torch import nn

from .._opacus_internals import captured_activations
from .._torch_compat import in_backward
from ..layers.registry import take_per_sample
from ..profiling.timers import step_phase
from .kept import output_meta


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in ``obj``: a tensor, or lists, tuples and dicts of them (nested)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


class MissedHookError(RuntimeError):
    """A hooked layer did not report its output gradient in the restricted first pass."""


class PassTrackingMixin:
    """Records first-pass sources and which hooked layers reported, around Opacus's hooks."""

    #: Set by the fast norms: which ``Linear`` layers take per-sample gradients (one backward).
    per_sample_policy = None

    def _init_pass_tracking(self) -> None:
        self._sources: list[torch.Tensor] = []
        self._captured: dict[int, nn.Module] = {}
        self._reported: set[int] = set()
        #: When True, each layer's inputs and output gradient are kept for the one-backward step.
        self.keep_for_grads = False
        self._kept: list[tuple[nn.Module, list[torch.Tensor], torch.Tensor]] = []
        #: Each captured layer's output shape and dtype (its output gradient's), by ``id``.
        self._outputs: dict[int, tuple] = {}
        self._norm_timer = None

    def time_norms(self, timer) -> None:
        """Times each hooked layer's norm work as the ``norms`` phase of ``timer`` (a StepTimer).

        The phase lies inside the first backward and covers every hooked layer's backward hook
        once: ghost norms, per-sample gradients where taken, direct norms and upstream's
        per-sample-gradient fallback; the shared-weight cross terms (``tied_norm``) are inside.
        """
        self._norm_timer = timer

    def capture_activations_hook(self, module, forward_input, forward_output):
        """Records sources and captured layers, then runs Opacus's capture.

        A forward run inside backward is an activation-checkpointing recomputation: its inputs
        were captured by the original forward, so it is skipped entirely.
        """
        if in_backward():
            return
        if (
            requires_grad(module)
            and module.training
            and torch.is_grad_enabled()
            and self.hooks_enabled
        ):
            self._record_pass_inputs(module, forward_input, forward_output)
        return super().capture_activations_hook(module, forward_input, forward_output)

    def _record_pass_inputs(self, module, forward_input, forward_output) -> None:
        self._captured[id(module)] = module
        self._outputs[id(module)] = output_meta(forward_output)
        if not any(t.requires_grad for t in tensors_in(forward_input)):
            self._sources.extend(t for t in tensors_in(forward_output) if t.requires_grad)

    def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
        """Marks the layer as reported, keeps what one backward needs, runs Opacus's norms."""
        entry = self._report(module, forward_output[0])
        with self._norms_phase():
            result = super().capture_backprops_hook(
                module, forward_input, forward_output, *args, **kwargs
            )
        self._keep(module, entry)
        return result

    def _report(self, module: nn.Module, grad: torch.Tensor):
        """Before the norms: marks the layer as reported; returns its entry to keep, or None.

        The entry (the layer's last captured inputs and its output gradient) is taken before
        Opacus's hook pops the inputs, and only while the first pass keeps them (one backward).
        """
        policy = self.per_sample_policy
        if policy is not None:
            policy.active = self.keep_for_grads  # only the one-backward step uses them
        if not self.hooks_enabled:
            return None
        self._reported.add(id(module))
        if self.keep_for_grads and captured_activations(module):
            return (module, module.activations[-1], grad.detach())
        return None

    def _norms_phase(self) -> contextlib.AbstractContextManager:
        """The ``norms`` phase around a layer's norm work (none with the hooks off).

        Announced for observers (op and FLOP counters) whether or not it is timed; timed where
        :meth:`time_norms` gave a timer.
        """
        if not self.hooks_enabled:
            return contextlib.nullcontext()
        return step_phase("norms", self._norm_timer)

    def _keep(self, module: nn.Module, entry) -> None:
        """After the norms: keeps ``entry`` (from :meth:`_report`), or drops what nobody keeps.

        Per-sample gradients the norm left replace the entry's inputs and output gradient; with
        no entry (a two-pass step) they are dropped here.
        """
        entry = self._kept_entry(module, entry)
        if entry is not None:
            self._kept.append(entry)

    def _kept_entry(self, module: nn.Module, entry):
        """What :meth:`_keep` keeps for ``entry`` (None: nothing), taking any per-sample grads."""
        policy = self.per_sample_policy
        psgs = policy.stash.pop(id(module), None) if policy is not None else None
        kept = take_per_sample(module)  # always taken: a two-pass step drops them here
        psgs = kept if psgs is None else psgs
        if entry is None:
            return None
        # Per-sample gradients replace the inputs and output gradient (see one_backward).
        return entry if psgs is None else (module, None, psgs)

    def take_kept(self) -> list[tuple[nn.Module, list[torch.Tensor], torch.Tensor]]:
        """The kept ``(layer, inputs, output gradient)`` of the last first pass (and forgets)."""
        kept, self._kept = self._kept, []
        return kept

    def take_first_pass_sources(self) -> list[torch.Tensor]:
        """The sources of the last forward (and forgets them); empty when nothing was captured."""
        sources, self._sources = self._sources, []
        self._reported = set()
        policy = self.per_sample_policy
        if policy is not None:
            policy.reset()
        return sources

    def check_all_reported(self) -> None:
        """Raises unless every layer captured in forward reported in the first pass.

        Raises:
            MissedHookError: naming the layers whose norms would be stale.
        """
        missing = [m for k, m in self._captured.items() if k not in self._reported]
        self._captured, self._reported, self._outputs = {}, set(), {}
        if missing:
            names = ", ".join(sorted({type(m).__name__ for m in missing}))
            raise MissedHookError(
                f"{len(missing)} hooked layer(s) ({names}) did not report an output gradient in "
                "the activations-only first backward; their per-sample norms would be stale. "
                "Pass restricted_first_pass=False to PrivacyEngine for this model."
            )

    def forget_pass(self) -> None:
        """Drops what a failed step recorded."""
        self._sources, self._captured, self._reported, self._kept = [], {}, set(), []
        self._outputs = {}
