"""A training run's setup: the model built, sharded and made private, its data, and a resume.

:func:`set_up` returns the :class:`Run` that the loop's phases (:mod:`.loop`) share: the
configuration, the made-private model, optimizer and loader, the step plan, and where the run
stands (the step, examples seen and wall time before a resume).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..distributed.env import init_distributed
from ..privacy_engine import PrivacyEngine
from ..sharding import load_checkpoint
from .config import TrainConfig, check_out
from .data import SYNTHETIC_VOCAB, Examples, file_dataset, split, synthetic_sequences
from .disclosure import PRIVACY_NOTE
from .export import export
from .model import base_path, build_model, load_tokenizer, shard
from .optim import build_optimizer, build_scheduler
from .privacy import (
    count_prior_releases,
    guarantee,
    noise_for_target,
    plan_steps,
    prior_history,
    privacy_unit,
)
from .run_state import checkpoint_step, load_run_state, truncate_metrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class Run:
    """What the phases share: the configuration, the made-private model and where it stands."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    out: Path
    start_time: float
    base_config: object
    examples: Examples
    heldout: TensorDataset
    trainable: list[str]
    model_info: dict
    engine: PrivacyEngine
    gsm: nn.Module
    opt: torch.optim.Optimizer
    crit: nn.Module
    loader: DataLoader
    scheduler: object
    plan: object
    #: Logical steps taken (a resume starts at the checkpoint's).
    step: int = 0
    #: Examples seen and wall time before a resume.
    seen_before: int = 0
    wall_before: float = 0.0

    def epsilon_now(self) -> float:
        """The engine's accountant's epsilon: the one the progress bar, metrics and end show."""
        if self.opt.noise_multiplier > 0:
            return self.engine.get_epsilon(self.cfg.delta)
        return math.inf

    def export(self, path: Path) -> dict:
        """Writes the model and its privacy record to ``path``; returns the record."""
        record = guarantee(
            self.cfg,
            epsilon=self.epsilon_now(),
            accountant=self.engine.accountant.mechanism(),
            noise=self.opt.noise_multiplier,
            plan=self.plan,
            steps=steps_taken(self.engine),  # the accountant's: a fresh-noise resume counts more
            history=[list(entry) for entry in self.engine.accountant.history],
        )
        export(
            path,
            self.gsm,
            cfg=self.cfg,
            base_config=self.base_config,
            privacy=record,
            device=self.device,
            rank=self.rank,
        )
        return record


def set_up(cfg: TrainConfig) -> Run:
    """Builds, shards and makes private the model, its data and optimizer; resumes if asked."""
    check_out(cfg)
    rank, world, device = init_distributed()
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite and not cfg.resume:
            for name in ("metrics.jsonl", "summary.json", "checkpoints/latest"):
                (out / name).unlink(missing_ok=True)
        logger.info("[Ghost] privacy: %s This run's unit: %s.", PRIVACY_NOTE, privacy_unit(cfg))
    start_time = time.perf_counter()
    model, base_config = build_model(cfg)
    train_set, heldout, examples = datasets(cfg, base_config.vocab_size)
    if rank == 0:
        logger.info(
            "[Ghost] data: %d records (%s), one example and one privacy unit each; %d cut to "
            "--seq-length %d; %d train, %d held out",
            examples.records,
            examples.kind,
            examples.truncated,
            cfg.seq_length,
            len(train_set),
            len(heldout),
        )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_info = {
        "class": type(base_model).__name__,  # before FSDP2 renames the class
        "source": base_path(cfg) or f"preset {cfg.model} (seed {cfg.seed})",
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    model = shard(cfg, model, device, world)
    optimizer = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    engine = PrivacyEngine(timing=cfg.timing, dp_seed=cfg.dp_seed)
    data_loader = DataLoader(train_set, batch_size=cfg.batch_size)
    plan = plan_steps(steps_per_epoch=len(data_loader), epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = build_scheduler(cfg, optimizer, plan.total_steps)
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        data_loader=data_loader,
        noise_multiplier=_noise(cfg, plan, engine, rank),
        max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=cfg.poisson_sampling,
        grad_sample_mode="ghost_fsdp" if world > 1 and cfg.fsdp_api != "ddp" else "ghost",
    )
    run = Run(
        cfg=cfg, rank=rank, world=world, device=device, out=out, start_time=start_time,
        base_config=base_config, examples=examples, heldout=heldout, trainable=trainable,
        model_info=model_info, engine=engine, gsm=gsm, opt=opt, crit=crit, loader=loader,
        scheduler=scheduler, plan=plan,
    )  # fmt: skip
    if not resume(run):  # a resumed accountant already holds them
        count_prior_releases(engine, prior_history(cfg.init_from), rank)
    if rank == 0:
        logger.info(
            "[Ghost] train: %d logical steps, expected batch %d over %d rank(s), noise %.4g, "
            "C %.4g, %d trainable tensors%s",
            plan.total_steps,
            cfg.batch_size,
            world,
            opt.noise_multiplier,
            cfg.max_grad_norm,
            len(trainable),
            " (LoRA)" if cfg.lora else "",
        )
    return run


def _noise(cfg: TrainConfig, plan, engine: PrivacyEngine, rank: int) -> float:
    """The noise multiplier: the configured one, or calibrated for the target epsilon."""
    if cfg.target_epsilon is None:
        return cfg.noise_multiplier
    # Calibrated for the steps run: make_private_with_epsilon calibrates for
    # int(epochs / (1 / len(loader))) steps, which float rounding can put one below.
    noise = noise_for_target(
        target_epsilon=cfg.target_epsilon,
        delta=cfg.delta,
        plan=plan,
        accountant=engine.accountant.mechanism(),
    )
    if rank == 0:
        logger.info(
            "[Ghost] noise %.6g: epsilon <= %g at delta %g after %d steps at q = %.6g",
            noise,
            cfg.target_epsilon,
            cfg.delta,
            plan.total_steps,
            plan.sample_rate,
        )
    return noise


def resume(run: Run) -> bool:
    """With ``--resume``: the latest checkpoint's model, optimizer, DP and run state.

    Returns:
        Whether a checkpoint was loaded.
    """
    latest = latest_checkpoint(run.out) if run.cfg.resume else None
    if run.cfg.resume and latest is None:
        logger.warning("[Ghost] --resume: no checkpoint in %s; starting afresh", run.out)
    if latest is None:
        return False
    load_checkpoint(
        str(latest), run.gsm, run.opt, engine=run.engine, fresh_noise=run.cfg.fresh_noise
    )
    # The checkpoint's own step: the accountant may count more (the steps a fresh-noise resume
    # drew anew, the releases an --init-from export carried); the run goes on from here.
    saved_at = checkpoint_step(latest)
    run.step = saved_at if saved_at is not None else steps_taken(run.engine)
    saved = load_run_state(latest, scheduler=run.scheduler)
    run.seen_before, run.wall_before = saved["examples_seen"], saved["wall_s"]
    dropped = truncate_metrics(run.out / "metrics.jsonl", run.step) if run.rank == 0 else 0
    logger.info(
        "[Ghost] resumed from %s at step %d (%d metrics rows after it dropped)",
        latest,
        run.step,
        dropped,
    )
    return True


def datasets(cfg: TrainConfig, vocab: int) -> tuple[TensorDataset, TensorDataset, Examples]:
    """``(train, held-out, all examples)``."""
    if cfg.data is None:
        if vocab <= SYNTHETIC_VOCAB:
            raise ValueError(f"the synthetic task needs a vocabulary above {SYNTHETIC_VOCAB}")
        data = synthetic_sequences(cfg.num_examples, cfg.seq_length, cfg.seed, cfg.task)
        examples = Examples(data, cfg.num_examples, 0, "synthetic")
    else:
        examples = file_dataset(
            cfg.data,
            task=cfg.task,
            seq_length=cfg.seq_length,
            vocab=vocab,
            tokenizer=load_tokenizer(cfg),
        )
    return (*split(examples.data, cfg.heldout_fraction, cfg.seed), examples)


def steps_taken(engine: PrivacyEngine) -> int:
    """Steps the accountant counted: every Poisson draw handed out (a resume starts there)."""
    return sum(entry[-1] for entry in engine.accountant.history)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names under ``out`` (None: none yet)."""
    marker = out / "checkpoints" / "latest"
    return out / "checkpoints" / marker.read_text().strip() if marker.exists() else None
