"""Drop-in ``PrivacyEngine``: Opacus's engine whose ghost-clipping loss runs our backward.

Only wiring lives here: which controller (from the detected API), which timer, which options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import opacus
import torch
from opacus.grad_sample.gsm_base import AbstractGradSampleHooks
from opacus.optimizers import DPOptimizer

from .apis.api import GHOST_MODES
from .apis.plan import CallPlan, per_sample_policy, plan_call, plan_handoff
from .apis.registry import detect_api, resolve_ghost_mode
from .backward import GhostStepContext, SyncDPLoss
from .distributed.detect import _unwrap
from .distributed.layout import world_size
from .empty_batch import EmptyBatchStandIn
from .hooks import ghost_class
from .hooks.ghost import step_hooks
from .layers.kernels import describe as describe_kernels
from .layers.kernels.rows import describe as describe_row_kernels
from .layers.linear_grams import describe_block
from .one_backward.memory import MemoryBudget, MemoryPlan
from .optimizers.noise_kernel import describe as describe_noise_kernel
from .optimizers.ops import optimizer_ops
from .options import GhostOptions, decide_keep_unsharded, split_options
from .profiling.memory import AllocatorWatch
from .profiling.timers import StepTimer, timing_enabled_from_env
from .randomness import DPRandomness
from .sampling import SharedPoissonSampler
from .sampling.accounting import account_draws, count_steps, track_progress
from .sampling.ledger import DrawLedger, LedgerPosition
from .sampling.loaders import dp_data_loader, loader_generator
from .tuning import make_norm_tuner

logger = logging.getLogger("opacus_fsdp_sync")


def _first_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class PrivacyEngine(opacus.PrivacyEngine):
    """``opacus.PrivacyEngine`` whose ghost clipping skips the first backward's waste.

    Use it exactly like Opacus's engine. With ``grad_sample_mode="ghost_fsdp"`` (FSDP2) or
    ``"ghost"`` (one device or DDP), the criterion returned by :meth:`make_private` produces
    losses whose ``backward()`` runs the norm-only first pass without gradient synchronisation
    (and, by default, without weight gradients and keeping parameters unsharded when they fit),
    then the clipped second pass as upstream does. The result is upstream Opacus's (bit for bit
    where upstream is right; exact where it is not: tied weights, padding tokens).

    Args:
        accountant: As in Opacus (``"prv"``, ``"rdp"``, ``"gdp"``).
        secure_mode: As in Opacus: noise and Poisson draws from the OS CSPRNG itself.
        dp_seed: None (the default): the Poisson sampler's and every noise generator's seed
            come from OS entropy, independent of ``torch.manual_seed`` and of every other run.
            An integer: the only way to make the draws and the noise reproducible (tests,
            benchmarks); logged as a warning, since the run's privacy then rests on the seed
            staying secret. Not with ``secure_mode``. See :mod:`opacus_fsdp_sync.randomness`.
        **options: Fields of :class:`~opacus_fsdp_sync.options.GhostOptions`
            (``sync_optimization``, ``restricted_first_pass``, ``keep_unsharded``,
            ``keep_unsharded_budget_bytes``, ``one_backward``, ``fast_norms``, ``gram_block``,
            ``per_sample_grads``, ``per_sample_grads_budget_bytes``, ``tune_norms``,
            ``tune_norms_cache``, ``one_backward_memory_budget``, ``tune_norms_memory_budget``,
            ``timing``).
    """

    def __init__(
        self,
        *,
        accountant: str = "prv",
        secure_mode: bool = False,
        dp_seed: int | None = None,
        **options,
    ):
        if secure_mode and dp_seed is not None:
            raise ValueError(
                "secure_mode=True draws from the OS CSPRNG and cannot follow dp_seed; pass one "
                "of them (dp_seed=None for secure_mode)."
            )
        self.options = GhostOptions(**options)
        super().__init__(accountant=accountant, secure_mode=secure_mode)
        #: The one source of this engine's DP seeds (see :mod:`.randomness`).
        self.randomness = DPRandomness(dp_seed)
        #: Optimizer steps taken (not skipped) by the models this engine made private.
        self.optimizer_steps = 0
        #: The distributed API of the last model made private (``"fsdp2"``, ``"fsdp1"``,
        #: ``"ddp"``; None on one device).
        self.distributed_api: str | None = None
        self._call_overrides: dict = {}
        self._context: GhostStepContext | None = None
        self.sync_api: str | None = None
        self.keep_unsharded: bool = False
        self._one_backward_planned = False
        self._plan = CallPlan()
        #: The options the last model made private runs with (engine's and the call's).
        self.last_options: GhostOptions = self.options.effective
        #: The shared Poisson sampler of the last model made private (None: Opacus's loader).
        self.sampler: SharedPoissonSampler | None = None
        #: The generator of Opacus's Poisson loader (other modes; None: none, or secure_mode's).
        self.loader_generator: torch.Generator | None = None
        self.draw_account = None  #: counts the shared sampler's draws (.sampling.accounting)
        #: How far this line of runs went (:mod:`.sampling.ledger`): started by the first
        #: checkpoint saved with this engine, or adopted from the checkpoint it resumed.
        self.draw_ledger: DrawLedger | None = None

    @property
    def sync_optimization(self) -> bool:
        """Whether the optimisations are on for models made private from now on."""
        return self.options.sync_optimization

    @property
    def timing(self) -> bool:
        """Whether ``[Ghost]`` step timings are on (the option, or the environment)."""
        return timing_enabled_from_env() if self.options.timing is None else self.options.timing

    @contextlib.contextmanager
    def _call_options(self, overrides: dict) -> Iterator[None]:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(GhostOptions)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}")
        saved = self._call_overrides
        self._call_overrides = {**saved, **{k: v for k, v in overrides.items() if v is not None}}
        try:
            yield
        finally:
            self._call_overrides = saved

    def _options_now(self) -> GhostOptions:
        return dataclasses.replace(self.options, **self._call_overrides).effective

    def make_private(self, **kwargs):
        """Same as :meth:`opacus.PrivacyEngine.make_private`, plus per-model options.

        Args:
            **kwargs: Every argument of Opacus's ``make_private``, and any field of
                :class:`GhostOptions` (``one_backward=False``, ...) to override for this model
                (None: keep the engine's).

        Returns:
            ``(module, optimizer, criterion, data_loader)`` for ghost modes, as Opacus does.

        Raises:
            UnsupportedConfigurationError: for what the sync-skipping step cannot do (FSDP1
                layouts, DDP ``static_graph=True``); the message names the way out.
        """
        with self._call_options(split_options(kwargs)):
            opts = self._options_now()  # validates the overrides before anything is wrapped
            describe_row_kernels()  # and OPACUS_FSDP_SYNC_ROW_KERNELS
            describe_noise_kernel()  # and OPACUS_FSDP_SYNC_NOISE_KERNEL
            describe_kernels(opts.fused_kernels, torch.device("cpu"))  # triton for True
            if "module" in kwargs and "grad_sample_mode" in kwargs:  # upstream's aliases
                mode = resolve_ghost_mode(kwargs["grad_sample_mode"], kwargs["module"])
                kwargs["grad_sample_mode"] = mode
            self._plan = plan_call(kwargs, opts, secure_mode=self.secure_mode)
            #: The options the last model made private runs with (engine's and the call's).
            self.last_options = opts
            try:
                made = super().make_private(**kwargs)
            finally:
                self._plan = CallPlan()
        sampler = made[-1].batch_sampler
        if isinstance(sampler, SharedPoissonSampler):
            self.draw_account = account_draws(self.accountant, made[1], sampler, self._step_taken)
        else:
            count_steps(made[1], self._step_taken)
            self.draw_account = None
        self.distributed_api = detect_api(made[0]).record.name
        if isinstance(made[2], SyncDPLoss) and kwargs.get("poisson_sampling", True):
            made[2].stand_in = EmptyBatchStandIn(_unwrap(made[0]))
        self.sampler = sampler if isinstance(sampler, SharedPoissonSampler) else None
        self.loader_generator = None if self.secure_mode else loader_generator(made[-1])
        track_progress(made[1], self.sampler, self.record_progress)
        return made

    def record_progress(self) -> None:
        """Writes how far this run went to :attr:`draw_ledger` (no-op without a ledger)."""
        if self.draw_ledger is not None:
            self.draw_ledger.record(LedgerPosition.of(self.accountant, self.sampler))

    def _step_taken(self) -> None:
        self.optimizer_steps += 1

    def make_private_with_epsilon(self, **kwargs):
        """Same as :meth:`opacus.PrivacyEngine.make_private_with_epsilon`, plus our options.

        Args:
            **kwargs: Every argument of Opacus's ``make_private_with_epsilon``, and the
                per-model options of :meth:`make_private`.
        """
        with self._call_options(split_options(kwargs)):
            return super().make_private_with_epsilon(**kwargs)

    def _prepare_data_loader(
        self, data_loader, *, poisson_sampling, distributed, batch_first=True, rand_on_empty=False
    ):
        """The data loader, its Poisson draws seeded from :attr:`randomness`.

        See :func:`.sampling.loaders.dp_data_loader`; Opacus's own where it returns None.
        """
        distributed = distributed or self._plan.missed_distributed
        loader = dp_data_loader(
            data_loader,
            ghost=self._plan.ghost,
            layout=self._plan.layout,
            randomness=self.randomness,
            secure_mode=self.secure_mode,
            poisson_sampling=poisson_sampling,
            distributed=distributed,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
        )
        if loader is None:
            return super()._prepare_data_loader(
                data_loader,
                poisson_sampling=poisson_sampling,
                distributed=distributed,
                batch_first=batch_first,
                rand_on_empty=rand_on_empty,
            )
        if self.dataset is None:
            self.dataset = data_loader.dataset
        return loader

    def _prepare_optimizer(self, *, optimizer, **kwargs):
        """Opacus's optimizer, or the API record's where the API already reduced gradients.

        DDP and FSDP1 ``NO_SHARD``: gradients arrive averaged, no second all-reduce, one noise
        draw shared by all ranks. FSDP1: per-rank batch and sharded gradients. FSDP2: noise
        drawn per local shard; under tensor parallelism the record's optimizer divides by the
        layout's data-parallel degree. The noise generator is
        :meth:`.DPRandomness.noise_generator`'s.
        """
        if self._plan.missed_distributed and not kwargs.get("distributed"):
            # Opacus judged the wrapper's type, not the layout: the batch per rank it expects
            # is the global one, which would scale gradient and noise by 1 / world size.
            kwargs["expected_batch_size"] /= world_size()
            kwargs["distributed"] = True
        if self._plan.layout.tensor_parallel:  # Opacus divided by the world size
            kwargs["expected_batch_size"] *= world_size() / self._plan.layout.dp_degree
        factory = self._plan.optimizer
        inner = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
        generator = self.randomness.noise_generator(
            inner,
            kwargs.get("noise_generator"),
            secure_rng=self.secure_rng if self.secure_mode else None,
            distributed=bool(kwargs.get("distributed")),
        )
        if factory is None or kwargs.get("clipping") != "flat":
            kwargs["noise_generator"] = None if self.secure_mode else generator
            return super()._prepare_optimizer(optimizer=optimizer, **kwargs)
        for name in ("distributed", "clipping", "grad_sample_mode", "noise_generator"):
            kwargs.pop(name, None)
        return factory(inner, generator=generator, secure_mode=self.secure_mode, **kwargs)

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

        See :mod:`opacus_fsdp_sync.layers.tied`.
        """
        if grad_sample_mode in GHOST_MODES and not isinstance(module, AbstractGradSampleHooks):
            self.validate(module=module, optimizer=None, data_loader=None)
            hooks = ghost_class(grad_sample_mode, wrap_model)(
                module,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                max_grad_norm=max_grad_norm,
                layout=self._plan.layout,
            )
            if hooks.shared_weights:
                logger.info(
                    "[Ghost] shared weights: %s; per-sample norms include their cross terms",
                    "; ".join(" + ".join(o[0] for o in s.owners) for s in hooks.shared_weights),
                )
            return hooks
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
        opts = self._options_now()
        timing = timing_enabled_from_env() if opts.timing is None else opts.timing
        found = detect_api(module)
        record = found.record
        device = _first_device(_unwrap(module))
        logger.info(
            "[Ghost] Linear kernels: %s; %s; %s",
            describe_kernels(opts.fused_kernels, device),
            describe_row_kernels(),
            describe_noise_kernel(),
        )
        handoff = plan_handoff(module, found, opts)
        keep = False
        if record.capabilities.keep_unsharded and opts.sync_optimization:
            keep = decide_keep_unsharded(
                opts,
                record.unsharded_bytes(found.modules),
                device,
                one_backward=handoff is not None,
            )
        controller = record.make_controller(
            found.modules,
            enabled=opts.sync_optimization,
            keep_unsharded=keep,
            restricted=opts.restricted_first_pass,
        )
        if record.capabilities.distributed and not opts.sync_optimization:
            logger.info("[Ghost] sync optimization off (sync_optimization=False): upstream passes")
        elif controller.enabled_message:
            logger.info(controller.enabled_message)
        if opts.restricted_first_pass:
            logger.info("[Ghost] first backward w.r.t. activations only (no weight gradients)")
        self.sync_api, self.keep_unsharded = controller.api, keep
        self._one_backward_planned = handoff is not None
        self._context = GhostStepContext(
            controller=controller,
            timer=StepTimer(enabled=timing, device=device),
            restricted_first_pass=opts.restricted_first_pass,
            handoff=handoff,
            fused_kernels=opts.fused_kernels,
            optimizer_ops=optimizer_ops(optimizer),
            allocator_watch=AllocatorWatch(device) if device.type == "cuda" else None,
            memory=None
            if handoff is None
            else MemoryBudget(
                opts.one_backward_memory_budget,
                device,
                distributed=record.capabilities.distributed and world_size() > 1,
                tp_group=self._plan.layout.tp_group,
            ),
        )
        hooks = step_hooks(module)
        hooks.use_timer(self._context.timer, norms=timing)
        if opts.fast_norms:
            policy = per_sample_policy(opts, device) if handoff is not None else None
            tuner = make_norm_tuner(
                option=opts.tune_norms,
                cache_path=opts.tune_norms_cache,
                device=device,
                gram_block=opts.gram_block,
                distributed=record.capabilities.distributed,
                timer=self._context.timer,
                memory_budget=opts.tune_norms_memory_budget,
            )
            if hooks.configure_norms(
                policy=policy,
                gram_block=opts.gram_block,
                tuner=tuner,
                fused_kernels=opts.fused_kernels,
            ):
                logger.info(
                    "[Ghost] Linear norms: shared input Gram matrices (fast_norms=True), %s",
                    describe_block(opts.gram_block, device),
                )
        return SyncDPLoss(module, optimizer, criterion, loss_reduction, context=self._context)

    @property
    def one_backward(self) -> bool:
        """Whether the last model made private runs one backward per step.

        After a step: whether that step did (a step falls back to two passes, logged, when its
        loss has no first-pass source or adds a term outside the hooked layers); before any
        step: the plan.
        """
        ran = None if self._context is None else self._context.last_step_one_backward
        return self._one_backward_planned if ran is None else ran

    @property
    def last_step_kept_bytes(self) -> int:
        """One backward: bytes held from the first pass to the gradient phase in the last step."""
        return 0 if self._context is None else self._context.kept_bytes

    @property
    def last_step_memory(self) -> MemoryPlan | None:
        """One backward under a budget: the last step's plan (bytes needed, budget, choice)."""
        memory = None if self._context is None else self._context.memory
        return None if memory is None else memory.last

    @property
    def last_step_timings(self) -> dict[str, float]:
        """Milliseconds per phase of the last step of the last model made private (if timed).

        Under ``BatchMemoryManager`` the last draw's physical batches together (each phase
        summed over them), once the draw's last backward has run.
        """
        return {} if self._context is None else self._context.timer.last_step

    @property
    def last_step_host_timings(self) -> dict[str, float]:
        """The host's milliseconds in each of those phases (``StepTimer.last_host_step``)."""
        return {} if self._context is None else self._context.timer.last_host_step
