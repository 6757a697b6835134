"""One profiling experiment (one mode, one sequence length) per process; torchrun-compatible.

A thin client of ``opacus_fsdp_sync``: the engine, the timers, the collective counter, the memory
probe, the mode table and the Llama presets all come from the package. Rank 0 writes one JSON
result and prints progress and ``[Ghost]`` lines.

Example::

    torchrun --standalone --nproc-per-node 2 profile_experiment.py --mode ghost_fsdp_sync
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import opacus
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.bench import throughput
from opacus_fsdp_sync.bench.modes import get_mode
from opacus_fsdp_sync.bench.physical_batches import add_phases, draw_loss, physical_slices
from opacus_fsdp_sync.bench.provenance import code_version
from opacus_fsdp_sync.distributed.cpu_affinity import bind_rank_to_cores
from opacus_fsdp_sync.distributed.env import init_distributed, pick_device_and_backend
from opacus_fsdp_sync.models import LlamaSpec, build_llama, count_parameters
from opacus_fsdp_sync.profiling import (
    CollectiveCounter,
    CpuStopwatch,
    SavedTensorsMeter,
    StepTimer,
    allocator_counts,
    peak_memory,
    phase,
    profiler_ranges,
    reset_peak,
)
from opacus_fsdp_sync.randomness import DPRandomness
from opacus_fsdp_sync.sampling.poisson import SharedPoissonDataLoader
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model

logger = logging.getLogger("opacus_fsdp_sync.profile")


@dataclass(kw_only=True)
class ExperimentConfig:
    """One experiment. Every field is a CLI flag (``--seq-length`` for ``seq_length``)."""

    model: str = "small"
    """Preset name (``tiny``, ``small``, ``llama3.2-1b``)."""
    model_path: str | None = None
    """A local checkpoint directory instead of random weights."""
    task: str = "causal_lm"
    """``causal_lm`` or ``seq_cls``."""
    mode: str = "ghost_fsdp_sync"
    """A row of ``opacus_fsdp_sync.bench.modes.MODES``."""
    fsdp_api: str = "fsdp2"
    """``fsdp2``, ``fsdp1`` (FullyShardedDataParallel, use_orig_params) or ``ddp``."""
    strategy: str = "full"
    """Sharding strategy of ``opacus_fsdp_sync.sharding.ShardingConfig``."""
    wrap_policy: str = "transformer"
    """Wrap policy of ``ShardingConfig`` (``transformer``, ``size_based``, ``per_layer``)."""
    seq_length: int = 128
    """Tokens per sample."""
    batch_size: int = 4
    """Samples per rank per step."""
    steps: int = 5
    """Measured steps."""
    warmup: int = 2
    """Steps run first and dropped."""
    count_steps: int = 1
    """Steps run after the measured ones with the collective counter on (untimed: the counter is
    a Python dispatch mode that sees every op, which would inflate timed steps on a GPU)."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 params/fp32 reduce on GPU, fp32 on CPU), ``bf16`` or ``fp32``."""
    tie_word_embeddings: bool | None = None
    """Force tied (True) or untied (False) input embedding and output head; None: the preset's."""
    max_grad_norm: float = 1.0
    """Clipping bound."""
    noise_multiplier: float = 1.0
    """Noise multiplier (the cost of noise is part of a private step)."""
    lr: float = 1e-4
    """Learning rate (SGD)."""
    poisson_sampling: bool = True
    """Every mode draws each logical batch by the shared Poisson sampler over a synthetic
    dataset of ``16 x batch_size x world`` sequences (the sampling the reported epsilon
    assumes; batch sizes vary around ``batch_size``): the private modes through
    ``make_private``, ``no_dp`` through the same sampler without an engine, so that its cost
    per example is measured on draws like the private rows' (a rank whose share is empty runs
    one stand-in example with its loss times zero, as the engine does for models that cannot run
    zero examples). ``--no-poisson-sampling``: the same fixed batch every step, for fixed-shape
    benchmarking."""
    max_physical_batch_size: int | None = None
    """Poisson sampling only: run each draw as the physical batches of at most this many
    examples that Opacus's ``BatchMemoryManager`` runs, for a card that cannot hold the largest
    draws whole (the same split: :func:`~opacus_fsdp_sync.sampling.poisson.physical_batches`
    on every rank, near-equal chunks, the optimizer told to skip every step but the last).
    ``no_dp`` splits the same draws into the same chunks and accumulates their gradients (each
    chunk's loss times its share of the draw, one optimizer step). Every row reduce-scatters
    after each physical batch, as the private engine hands off each one's clipped gradients.
    A step's time is its physical batches' together. None (the default): each draw runs
    whole."""
    dp_seed: int | None = None
    """Opt-in reproducibility for comparisons (``PrivacyEngine(dp_seed=...)``): the Poisson
    draws and the noise come from this integer, so that runs with the same seed, ``no_dp``
    among them, draw the same batch sizes. None (the default): OS entropy, as a user's run.
    A benchmark's epsilon is no privacy claim, and with a published seed it would not be one."""
    bind_cpus: bool = True
    """On CPU, bind each rank to its own block of the cores before the process group starts,
    as MPI launchers and ``run_cpu`` bind ranks
    (:mod:`opacus_fsdp_sync.distributed.cpu_affinity`; nothing is bound where there are fewer
    cores than ranks). ``--no-bind-cpus`` leaves the ranks to the scheduler: then one rank's
    helper threads (gloo's, the noise draw) run beside another rank's main thread. Rank 0's
    cores are recorded in the result (``environment``). Ignored on GPUs."""
    op_profile: bool = False
    """Also write ``profiles/{name}.ops.txt``, a ``torch.profiler`` table (self CPU/CUDA time
    per op) of rank 0's last measured step, and ``profiles/{name}.trace.json`` (Chrome trace)."""
    out: str = "runs/latest"
    """Directory of the JSON result."""
    name: str | None = None
    """Result file stem; defaults to ``{mode}_seq{seq_length}``."""

    def __post_init__(self) -> None:
        get_mode(self.mode)
        ShardingConfig(strategy=self.strategy, wrap_policy=self.wrap_policy)  # validates both
        if self.fsdp_api not in ("fsdp2", "fsdp1", "ddp"):
            raise ValueError(f"fsdp_api={self.fsdp_api!r}: choose fsdp2, fsdp1 or ddp")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: auto, bf16 or fp32")
        for f in ("seq_length", "batch_size", "steps", "count_steps"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: must be >= 0")
        if self.max_physical_batch_size is not None:
            if self.max_physical_batch_size < 1:
                raise ValueError(
                    f"max_physical_batch_size={self.max_physical_batch_size}: must be at least 1"
                )
            if not self.poisson_sampling:
                raise ValueError(
                    "max_physical_batch_size splits Poisson draws: with --no-poisson-sampling "
                    "set --batch-size to the physical batch instead"
                )


def parse_args(argv: list[str] | None = None) -> ExperimentConfig:
    """Maps CLI flags one-to-one onto :class:`ExperimentConfig` fields."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(ExperimentConfig):
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default)
    return ExperimentConfig(**vars(parser.parse_args(argv)))


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


#: Logical steps per epoch of the synthetic dataset that Poisson sampling draws from.
_EPOCH_STEPS = 16


def _batches(cfg: ExperimentConfig, vocab: int, rank: int):
    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(1, vocab, (cfg.batch_size, cfg.seq_length), generator=g)
    labels = torch.randint(0, 2, (cfg.batch_size,), generator=g)
    return ids, labels


def _dataset(cfg: ExperimentConfig, vocab: int, world: int) -> TensorDataset:
    """The same synthetic sequences on every rank (the shared draw indexes one dataset)."""
    g = torch.Generator().manual_seed(1234)
    n = _EPOCH_STEPS * cfg.batch_size * world
    return TensorDataset(
        torch.randint(1, vocab, (n, cfg.seq_length), generator=g),
        torch.randint(0, 2, (n,), generator=g),
    )


def _plain_poisson_loader(cfg: ExperimentConfig, vocab: int, world: int) -> DataLoader:
    """``no_dp``'s Poisson batches: the private rows' sampler, seeded as their engine seeds it.

    The seed is :meth:`~opacus_fsdp_sync.randomness.DPRandomness.sampler_seed`, the call
    ``make_private`` seeds its sampler with, so that with the same ``dp_seed`` a private run and
    this one draw the same batches; without one, OS entropy (rank 0's, on every rank).
    """
    loader = DataLoader(_dataset(cfg, vocab, world), batch_size=cfg.batch_size * world)
    # no warning: these draws feed no private step (the private rows' engine warns)
    seed = DPRandomness(cfg.dp_seed, warn=False).sampler_seed(
        loader, secure_mode=False, distributed=dist.is_initialized() and world > 1
    )
    return SharedPoissonDataLoader.from_data_loader(loader, seed=seed)


def _cycle(loader):
    """Batches of ``loader`` over as many epochs as asked for."""
    while True:
        yield from loader


def _loss(cfg, model, criterion, ids, labels, private):
    if cfg.task == "seq_cls":
        return criterion(model(input_ids=ids).logits, labels)
    logits = model(input_ids=ids).logits[:, :-1]
    targets = ids[:, 1:]
    flat = (logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return criterion(*flat, shape=logits.shape[:2]) if private else criterion(*flat)


def run(cfg: ExperimentConfig) -> dict:
    """Builds, shards, (makes private,) trains and measures; returns the result dict."""
    cores = None
    if cfg.bind_cpus and pick_device_and_backend()[0] == "cpu":  # before gloo starts threads
        cores = bind_rank_to_cores()
    rank, world, device = init_distributed()
    mode = get_mode(cfg.mode)
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if device.type == "cuda" else "fp32"
    torch.manual_seed(0)
    spec = LlamaSpec(
        preset=cfg.model,
        task=cfg.task,
        model_path=cfg.model_path,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.device(device):
        model = build_llama(spec)
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    n_params = count_parameters(model)
    if rank == 0:
        logger.info(
            "[Ghost] model %s (%s): %s parameters, tied embeddings: %s",
            cfg.model,
            cfg.task,
            f"{n_params:,}",
            tied,
        )
    vocab = model.config.vocab_size
    if cfg.fsdp_api == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model.to(dtype=torch.float32))
    else:
        sharding = ShardingConfig.for_precision(
            mp, strategy=cfg.strategy, wrap_policy=cfg.wrap_policy, backend=cfg.fsdp_api
        )
        model = shard_model(model, sharding, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    criterion = nn.CrossEntropyLoss()
    engine = None
    poisson = cfg.poisson_sampling
    batches = None
    if mode.private:
        engine = PrivacyEngine(timing=True, dp_seed=cfg.dp_seed, **mode.engine_kwargs)
        data = _dataset(cfg, vocab, world)
        model, optimizer, criterion, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=DataLoader(data, batch_size=cfg.batch_size * world),
            noise_multiplier=cfg.noise_multiplier,
            max_grad_norm=cfg.max_grad_norm,
            poisson_sampling=poisson,
            grad_sample_mode=mode.grad_sample_mode,
        )
        if poisson:
            batches = _cycle(loader)
    elif poisson:
        batches = _cycle(_plain_poisson_loader(cfg, vocab, world))
    if rank == 0:
        if poisson:
            how = f"Poisson (shared draw, batch sizes vary around {cfg.batch_size} per rank)" + (
                "" if mode.private else ", non-private: the private rows' sampler, no engine"
            )
            if cfg.max_physical_batch_size is not None:
                how += f", physical batches of at most {cfg.max_physical_batch_size} a rank"
        else:
            how = f"fixed batch of {cfg.batch_size} per rank" + (
                "" if mode.private else ", non-private"
            )
        logger.info("[Ghost] sampling: %s", how)
    fixed_ids, fixed_labels = (t.to(device) for t in _batches(cfg, vocab, rank))
    ids, labels = fixed_ids, fixed_labels
    batch_sizes: list[int] = []  # the local batch of every loop step: warm-up, measured, counted
    timer = StepTimer(enabled=True, device=device)
    counter = CollectiveCounter()
    saved = SavedTensorsMeter()
    per_phase: dict[str, list[float]] = {}
    step_phases: list[dict[str, float]] = []  # each measured step's phases (the step's too)
    host_phase: dict[str, list[float]] = {}  # the host's time in each phase (CUDA: beside events)
    watch, cpu_steps = CpuStopwatch(), []  # each measured step's CPU time (profiling.cpu_time)
    losses = []
    total = cfg.warmup + cfg.steps + cfg.count_steps
    cap = cfg.max_physical_batch_size
    physical_counts: list[int] = []  # physical batches of every loop step
    kept_max = 0  # the most bytes one backward kept, over every physical batch of every step
    for i in range(total):
        measured = cfg.warmup <= i < cfg.warmup + cfg.steps
        counted = i >= cfg.warmup + cfg.steps
        if i == cfg.warmup:
            reset_peak(device)
            alloc_before = allocator_counts(device)
        if i == cfg.warmup + cfg.steps:  # the measured steps are over (the profiled one too)
            alloc_after = allocator_counts(device)
        sampling_ms = None
        if batches is not None:  # the shared draw, split and collate, outside the step's time
            start = time.perf_counter()
            ids, labels = (t.to(device) for t in next(batches))
            sampling_ms = (time.perf_counter() - start) * 1e3
        batch_sizes.append(int(ids.shape[0]))
        drawn = _global_batch_sizes([int(ids.shape[0])], device)[0] if cap is not None else 0
        parts = physical_slices(int(ids.shape[0]), drawn, world, cap)  # untimed, uncounted
        physical_counts.append(len(parts))
        if counted:
            counter.__enter__()
        profiler = None
        if cfg.op_profile and rank == 0 and i == cfg.warmup + cfg.steps - 1:
            profiler = _op_profiler(device)
            profiler.__enter__()
            ranges = profiler_ranges()  # phase::<name> ranges in the trace (bench.trace_phases)
            ranges.__enter__()
        chunk_losses = []  # (loss, weight): each physical batch's share of the draw
        watch.start()
        try:
            with timer.phase("step"):
                for j, part in enumerate(parts):
                    last = j == len(parts) - 1
                    p_ids, p_labels = ids[part], labels[part]
                    share = p_ids.shape[0] / ids.shape[0] if ids.shape[0] else 0.0
                    # no_dp with an empty share: Llama cannot run zero examples; one stand-in,
                    # loss times 0 (this rank's gradients are zero and FSDP's mean over ranks
                    # is smaller that step: the cost is measured, as the engine's stand-in)
                    stand_in = not mode.private and p_ids.shape[0] == 0
                    if stand_in:
                        p_ids, p_labels = fixed_ids[:1], fixed_labels[:1]
                    if engine is not None and len(parts) > 1:  # as BatchMemoryManager signals
                        optimizer.signal_skip_step(do_skip=not last)
                    with phase("forward"), timer.phase("forward"):
                        # counted steps, untimed: autograd's saved bytes of one physical forward
                        with saved if counted and j == 0 else contextlib.nullcontext():
                            loss = _loss(cfg, model, criterion, p_ids, p_labels, mode.private)
                        if stand_in:
                            loss = loss * 0
                        elif not mode.private and len(parts) > 1:
                            loss = loss * share  # the draw's mean loss, accumulated
                    chunk_losses.append((loss.detach() if not mode.private else loss, share))
                    if mode.private:
                        loss.backward()
                        if engine is not None:  # a Python int of this physical batch's step
                            kept_max = max(kept_max, engine.last_step_kept_bytes)
                    else:
                        with phase("backward"), timer.phase("backward"):
                            loss.backward()
                    with phase("optimizer_step"), timer.phase("optimizer_step"):
                        if mode.private or last:  # private: skipped but in the last
                            optimizer.step()
                            optimizer.zero_grad(set_to_none=True)  # Opacus's default zero-fills
            cpu = watch.stop()  # the step's span, not the profiler's export below
        finally:
            if counted:
                counter.__exit__(None, None, None)
            if profiler is not None:
                ranges.__exit__(None, None, None)
                profiler.__exit__(None, None, None)
                _write_op_profile(profiler, cfg, device)
        timings, host = timer.flush(), timer.last_host_step
        if engine is not None:  # the draw's physical batches together (the engine sums them)
            add_phases(timings, engine.last_step_timings)
            add_phases(host, engine.last_step_host_timings)
            for t in (timings, host):
                if "norm_tuning" in t:  # one-off: reported on its own, not in the step
                    t["step"] = max(0.0, t["step"] - t["norm_tuning"])
            if "norm_tuning" in host:  # the tuning's host time, off every clock (it is busy)
                cpu = cpu.minus(host["norm_tuning"])
        if sampling_ms is not None:
            timings["sampling"] = sampling_ms
        losses.append(draw_loss(chunk_losses, mode.private))
        if measured:
            for k, v in timings.items():
                per_phase.setdefault(k, []).append(v)
            step_phases.append(dict(timings))
            for k, v in host.items():
                host_phase.setdefault(k, []).append(v)
            cpu_steps.append(cpu)
        if rank == 0:
            tag = "measured" if measured else ("counted" if counted else "warm-up")
            print(f"  step {i + 1}/{total} ({tag}): {timings['step']:.1f} ms", flush=True)
    allocator = {
        name: (alloc_after[name] - alloc_before[name]) / cfg.steps for name in alloc_before
    }
    if allocator and rank == 0:
        logger.info(
            "[Ghost] CUDA caching allocator per measured step: %.1f retries (each frees the "
            "cache and synchronises), %.1f cudaMalloc, %.1f cudaFree",
            allocator["num_alloc_retries"],
            allocator["num_device_alloc"],
            allocator["num_device_free"],
        )
    step_ms = per_phase.pop("step")
    host_step_ms = host_phase.pop("step")
    if timer.clock == "cuda_event" and rank == 0:
        logger.info(
            "[Ghost] host time per measured step: median %.1f ms against %.1f ms on the device "
            "(host time reaching device time: bound by launches, or a wait inside the step)",
            statistics.median(host_step_ms),
            statistics.median(step_ms),
        )
    cpu_ms = {
        "process": [c.process_ms for c in cpu_steps],
        "main_thread": [c.thread_ms for c in cpu_steps],
    }
    if device.type == "cpu":
        logger.info(
            "[Ghost] CPU time per measured step (rank %d): median %.1f ms in the process, "
            "%.1f ms in the main thread, %.1f ms wall",
            rank,
            statistics.median(cpu_ms["process"]),
            statistics.median(cpu_ms["main_thread"]),
            statistics.median(c.wall_ms for c in cpu_steps),
        )
    comm = {
        p: {
            k: {"count": v["count"] / cfg.count_steps, "bytes": v["bytes"] / cfg.count_steps}
            for k, v in kinds.items()
        }
        for p, kinds in counter.as_dict().items()
    }
    global_sizes = _global_batch_sizes(batch_sizes[cfg.warmup : cfg.warmup + cfg.steps], device)
    return {
        "config": dataclasses.asdict(cfg),
        "mode_description": mode.description,
        "environment": {
            "torch": torch.__version__,
            "opacus": opacus.__version__,
            "python": platform.python_version(),
            "device": _device_name(device),
            "world_size": world,
            "backend": dist.get_backend(),
            "mixed_precision": mp,
            "clock": timer.clock,
            "warmup_steps_dropped": cfg.warmup,
            "measured_steps": cfg.steps,
            "collectives_counted_in_untimed_steps": cfg.count_steps,
            "host": platform.node(),
            "cpu_cores_bound": cores,  # this rank's (rank 0's in the file); None: unbound
            "cpu_cores_bound_by_rank": _every_rank(cores, world),  # rank by rank
            "code": code_version(),  # the checkout's commit, and whether it was modified
        },
        "model": {"parameters": n_params, "tied_embeddings": tied},
        "sync_api": engine.sync_api if engine is not None else None,
        # the optimizer steps the engine took (one per loop step: physical batches but the
        # last are skipped steps); None: no engine
        "optimizer_steps_taken": engine.optimizer_steps if engine is not None else None,
        "phases_ms": {k: _summary(v) for k, v in per_phase.items()},
        # each measured step's phases, in loop order ("step": the step's own time): the plot
        # draws the median step's phases, which add up to it where per-phase medians do not
        "measured_step_phases_ms": step_phases,
        "step_ms": _summary(step_ms),
        "tokens_per_s": throughput.tokens_per_s(step_ms, global_sizes, cfg.seq_length),
        "ms_per_example": throughput.per_example_ms(step_ms, global_sizes),
        "sampling": "poisson" if poisson else "fixed",
        "local_batch_sizes": batch_sizes,
        "physical_batches": physical_counts,  # of every loop step (1: the draw ran whole)
        "measured_step_ms": step_ms,
        # CUDA: the host's time in each phase beside the events' (on CPU the same clock)
        **(
            {
                "host_phases_ms": {k: _summary(v) for k, v in host_phase.items()},
                "measured_step_host_ms": host_step_ms,
            }
            if timer.clock == "cuda_event"
            else {}
        ),
        "measured_global_batch_sizes": global_sizes,
        # this rank's CPU time per measured step: every thread (process) and the main thread
        "cpu_ms": {k: _summary(v) for k, v in cpu_ms.items()},
        "measured_step_cpu_ms": cpu_ms,
        "comm_per_step": comm,
        "peak_memory": peak_memory(device),
        "allocator_per_step": allocator,
        # the largest over every physical batch run (a draw's largest, not its last batch's)
        "one_backward_kept_bytes": kept_max,
        "norm_tuning": _norm_tuning(model),
        "autograd_saved_bytes": saved.bytes,
        "losses": losses,
        "status": "ok",
    }


def _global_batch_sizes(local: list[int], device: torch.device) -> list[int]:
    """The global batch sizes of steps: one all-reduce of the local ones, summed.

    Called where it is neither timed nor seen by the collective counter: after the loop for
    the measured steps, before a step for its draw's size (``--max-physical-batch-size``).

    Args:
        local: This rank's local batch size of each step asked for, in loop order.
        device: The rank's device (NCCL reduces CUDA tensors only).

    Returns:
        The sum over ranks of each step's local batch size.
    """
    sizes = torch.tensor(local, dtype=torch.int64, device=device)
    dist.all_reduce(sizes)
    return [int(b) for b in sizes.tolist()]


def _every_rank(value, world: int) -> list:
    """``value`` of every rank, in rank order (one gather, after the measured steps)."""
    values = [None] * world
    dist.all_gather_object(values, value)
    return values


def _norm_tuning(model) -> dict | None:
    """The tuned norm plan and the time spent tuning it (None: tuning off)."""
    tuner = getattr(model, "norm_tuner", None)
    if tuner is None:
        return None
    return {
        "tuning_ms_total": tuner.tuning_ms,
        "device_name": tuner.name,
        "plan": {str(k): str(c) for k, c in tuner.table.items()},
    }


def _op_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, record_shapes=False)


def _write_op_profile(profiler, cfg: ExperimentConfig, device: torch.device) -> None:
    out = Path(cfg.out) / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    name = cfg.name or f"{cfg.mode}_seq{cfg.seq_length}"
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=key, row_limit=60)
    (out / f"{name}.ops.txt").write_text(table)
    profiler.export_chrome_trace(str(out / f"{name}.trace.json"))
    logger.info("[Ghost] op profile of one measured step -> %s", out / f"{name}.ops.txt")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def result_path(cfg: ExperimentConfig) -> Path:
    """Where rank 0 writes the experiment's JSON result: ``{out}/{name}.json``."""
    name = cfg.name or f"{cfg.mode}_seq{cfg.seq_length}"
    return Path(cfg.out) / f"{name}.json"


def result_line(result: dict, path: Path) -> str:
    """The experiment's ``[Ghost]`` line: its name, median step, throughput and result file.

    Args:
        result: The experiment's result (``step_ms``, ``tokens_per_s``).
        path: The JSON file the result was written to (:func:`result_path`), printed as is so
            that the line names a file that exists.
    """
    return (
        f"[Ghost] {path.stem}: step {result['step_ms']['median']:.1f} ms (median), "
        f"{result['tokens_per_s']:.0f} tokens/s -> {path}"
    )


def main(argv: list[str] | None = None) -> int:
    """Runs one experiment and writes ``{out}/{name}.json`` on rank 0."""
    # Opacus installs a root handler at import time; replace it so [Ghost] lines reach stdout.
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stdout, force=True)
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = parse_args(argv)
    start = time.perf_counter()
    try:
        result = run(cfg)
        if dist.get_rank() == 0:
            path = result_path(cfg)
            path.parent.mkdir(parents=True, exist_ok=True)
            result["wall_s"] = time.perf_counter() - start
            path.write_text(json.dumps(result, indent=2))
            logger.info(result_line(result, path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 CPU: normal teardown after FSDP use can abort


if __name__ == "__main__":
    main()
