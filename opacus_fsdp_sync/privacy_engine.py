"""Drop-in ``PrivacyEngine``: Opacus's engine whose ghost-clipping loss runs our backward.

Only wiring lives here: which controller (from the detected API), which timer, which options.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import opacus
import torch

from .backward import GhostStepContext, SyncDPLoss
from .distributed.controllers import make_controller
from .distributed.detect import FSDP1, get_fsdp_root_module
from .profiling.timers import StepTimer, timing_enabled_from_env
from .tied import find_shared_parameters, tied_class

logger = logging.getLogger("opacus_fsdp_sync")

_GHOST_MODES = ("ghost", "ghost_fsdp")


def _first_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class PrivacyEngine(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` whose ghost clipping skips gradient sync in the first backward.

    Use it exactly like Opacus's engine. With ``grad_sample_mode="ghost_fsdp"`` (FSDP2) or
    ``"ghost"`` (one device or DDP), the criterion returned by :meth:`make_private` produces
    losses whose ``backward()`` runs the norm-only first pass without gradient synchronisation,
    drops its gradients, and runs the clipped second pass as upstream does. The result is the
    same as upstream Opacus bit for bit.

    Args:
        accountant: As in Opacus (``"prv"``, ``"rdp"``, ``"gdp"``).
        secure_mode: As in Opacus.
        sync_optimization: False runs upstream's backward unchanged (for A/B comparisons).
        timing: Log ``[Ghost]`` per-phase timings each step. None reads the environment
            variable ``OPACUS_FSDP_SYNC_TIMING``.
    """

    def __init__(
        self,
        *,
        accountant: str = "prv",
        secure_mode: bool = False,
        sync_optimization: bool = True,
        timing: bool | None = None,
    ):
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        self.sync_optimization = bool(sync_optimization)
        self.timing = timing_enabled_from_env() if timing is None else bool(timing)
        self._call_sync: bool | None = None
        self._call_timing: bool | None = None
        self._context: GhostStepContext | None = None
        self.sync_api: str | None = None

    @contextlib.contextmanager
    def _call_options(self, sync: bool | None, timing: bool | None) -> Iterator[None]:
        saved = (self._call_sync, self._call_timing)
        if sync is not None:
            self._call_sync = bool(sync)
        if timing is not None:
            self._call_timing = bool(timing)
        try:
            yield
        finally:
            self._call_sync, self._call_timing = saved

    def make_private(
        self, *, sync_optimization: bool | None = None, timing: bool | None = None, **kwargs
    ):
        """Same as :meth:`opacus.PrivacyEngine.make_private`, plus two keywords.

        Args:
            sync_optimization: Overrides the engine's setting for this model.
            timing: Overrides the engine's timing setting for this model.
            **kwargs: Every argument of Opacus's ``make_private``.

        Returns:
            ``(module, optimizer, criterion, data_loader)`` for ghost modes, as Opacus does.

        Raises:
            UnsupportedConfigurationError: for ghost clipping on FSDP1.
        """
        with self._call_options(sync_optimization, timing):
            if kwargs.get("grad_sample_mode") in _GHOST_MODES and "module" in kwargs:
                if get_fsdp_root_module(kwargs["module"]).api == FSDP1:
                    make_controller(get_fsdp_root_module(kwargs["module"]), enabled=True)
            return super().make_private(**kwargs)

    def make_private_with_epsilon(
        self, *, sync_optimization: bool | None = None, timing: bool | None = None, **kwargs
    ):
        """Same as :meth:`opacus.PrivacyEngine.make_private_with_epsilon`, plus our keywords.

        Args:
            sync_optimization: See :meth:`make_private`.
            timing: See :meth:`make_private`.
            **kwargs: Every argument of Opacus's ``make_private_with_epsilon``.
        """
        with self._call_options(sync_optimization, timing):
            return super().make_private_with_epsilon(**kwargs)

    def _prepare_model(
        self,
        module,
        *,
        batch_first=True,
        max_grad_norm=1.0,
        loss_reduction="mean",
        grad_sample_mode="hooks",
        wrap_model=True,
    ):
        """Opacus's model preparation; ghost modes get exact shared-weight and padding norms.

        See :mod:`opacus_fsdp_sync.tied`.
        """
        from opacus.grad_sample.gsm_base import AbstractGradSampleHooks

        if grad_sample_mode in _GHOST_MODES and not isinstance(module, AbstractGradSampleHooks):
            self.validate(module=module, optimizer=None, data_loader=None)
            shared = find_shared_parameters(module)
            if shared:
                logger.info(
                    "[Ghost] shared weights: %s; per-sample norms include their cross terms",
                    "; ".join(" + ".join(o[0] for o in s.owners) for s in shared),
                )
            return tied_class(grad_sample_mode, wrap_model)(
                module,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                max_grad_norm=max_grad_norm,
            )
        return super()._prepare_model(
            module,
            batch_first=batch_first,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
        )

    def _prepare_criterion(
        self, *, module, optimizer, criterion, loss_reduction="mean", **kwargs
    ) -> SyncDPLoss:
        sync = self.sync_optimization if self._call_sync is None else self._call_sync
        timing = self.timing if self._call_timing is None else self._call_timing
        root = get_fsdp_root_module(module)
        controller = make_controller(root, enabled=sync)
        if root.api is not None and not sync:
            logger.info("[Ghost] sync optimization off (sync_optimization=False): upstream passes")
        elif controller.enabled_message:
            logger.info(controller.enabled_message)
        self.sync_api = controller.api
        device = _first_device(getattr(module, "_module", module))
        self._context = GhostStepContext(
            controller=controller, timer=StepTimer(enabled=timing, device=device)
        )
        if getattr(module, "_tied", None):
            module.tied_timer = self._context.timer
        return SyncDPLoss(module, optimizer, criterion, loss_reduction, context=self._context)

    @property
    def last_step_timings(self) -> dict[str, float]:
        """Milliseconds per phase of the last step of the last model made private (if timed)."""
        return {} if self._context is None else self._context.timer.last_step
