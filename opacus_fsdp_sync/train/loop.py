"""The DP fine-tuning loop.

Build, shard, make private, train with Poisson sampling, evaluate, checkpoint (with the DP
state), resume, report.

A thin client of the package: the engine, the sharding config, the checkpoints and the memory
manager are the package's and Opacus's own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..distributed.env import init_distributed
from ..privacy_engine import PrivacyEngine
from ..sharding import load_checkpoint, save_checkpoint
from .config import TrainConfig, check_out
from .data import IGNORE, SYNTHETIC_VOCAB, Examples, file_dataset, split, synthetic_sequences
from .disclosure import NOT_PRIVATE, PRIVACY_NOTE
from .export import export
from .model import base_path, build_model, load_tokenizer, shard
from .optim import build_optimizer, build_scheduler
from .privacy import guarantee, noise_for_target, plan_steps, privacy_unit
from .run_state import load_run_state, prune_checkpoints, save_run_state, truncate_metrics
from .tensorboard import MetricsWriter

logger = logging.getLogger(__name__)


def _datasets(cfg: TrainConfig, vocab: int) -> tuple[TensorDataset, TensorDataset, Examples]:
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


def _loss(cfg: TrainConfig, model, criterion, ids, labels, private: bool = True):
    """The batch's loss; ``causal_lm``: next-token cross-entropy, ``IGNORE`` labels skipped.

    Per example (the DP criterion, given ``shape``), the loss is the mean over the example's
    trained tokens (Opacus divides each row's sum by its count of labels other than the
    criterion's ``ignore_index``), so every example weighs the same before clipping.
    """
    if cfg.task == "seq_cls":
        return criterion(model(input_ids=ids).logits, labels)
    logits = model(input_ids=ids).logits[:, :-1]
    flat = (logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    return criterion(*flat, shape=logits.shape[:2]) if private else criterion(*flat)


@torch.no_grad()
def heldout_loss(cfg: TrainConfig, model, data: TensorDataset, device, batch: int = 32) -> float:
    """Mean held-out loss per trained token (per example for ``seq_cls``).

    Every rank evaluates the whole (small) set, in the same batches.
    """
    was = model.training
    model.eval()
    plain = nn.CrossEntropyLoss(reduction="sum", ignore_index=IGNORE)
    total, count = 0.0, 0
    ids_all, labels_all = data.tensors
    for i in range(0, len(ids_all), batch):
        ids, labels = ids_all[i : i + batch].to(device), labels_all[i : i + batch].to(device)
        if cfg.task == "seq_cls":
            total += plain(model(input_ids=ids).logits.float(), labels).item()
            count += len(ids)
        else:
            logits = model(input_ids=ids).logits[:, :-1].float()
            targets = labels[:, 1:]
            total += plain(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
            count += int((targets != IGNORE).sum())
    model.train(was)
    return total / max(count, 1)


def _steps_taken(engine: PrivacyEngine) -> int:
    """Steps the accountant counted: every Poisson draw handed out (a resume starts there)."""
    return sum(entry[-1] for entry in engine.accountant.history)


def _latest(out: Path) -> Path | None:
    marker = out / "checkpoints" / "latest"
    return out / "checkpoints" / marker.read_text().strip() if marker.exists() else None


def _save(out: Path, step: int, model, optimizer, engine, rank: int) -> None:
    name = f"step{step:06d}"
    save_checkpoint(str(out / "checkpoints" / name), model, optimizer, engine=engine)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (out / "checkpoints" / "latest").write_text(name)


def _retain(cfg: TrainConfig, out: Path, step: int) -> None:
    """Rank 0, once the checkpoint of ``step`` is complete: ``--keep-last`` and the log line."""
    kept = prune_checkpoints(out / "checkpoints", cfg.keep_last)
    logger.info(
        "[Ghost] checkpoint: saved step %d to %s (kept %d)",
        step,
        out / "checkpoints" / f"step{step:06d}",
        len(kept),
    )


def train(cfg: TrainConfig) -> dict:
    """Runs the whole fine-tuning; returns the summary (rank 0 also writes it to ``out``).

    Launch with ``torchrun`` for several ranks, or as one process.
    """
    from tqdm import tqdm

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
    train_set, heldout, examples = _datasets(cfg, base_config.vocab_size)
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
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_class = type(base_model).__name__  # before FSDP2 renames the class
    model = shard(cfg, model, device, world)
    optimizer = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad])
    engine = PrivacyEngine(timing=cfg.timing, dp_seed=cfg.dp_seed)
    data_loader = DataLoader(train_set, batch_size=cfg.batch_size)
    plan = plan_steps(steps_per_epoch=len(data_loader), epochs=cfg.epochs, max_steps=cfg.max_steps)
    total_steps = plan.total_steps
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    noise = cfg.noise_multiplier
    if cfg.target_epsilon is not None:
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
                total_steps,
                plan.sample_rate,
            )
    gsm, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        data_loader=data_loader,
        noise_multiplier=noise,
        max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=cfg.poisson_sampling,
        grad_sample_mode="ghost_fsdp" if world > 1 and cfg.fsdp_api != "ddp" else "ghost",
    )

    def epsilon_now() -> float:
        """The engine's accountant's epsilon: the one the progress bar, metrics and end show."""
        return engine.get_epsilon(cfg.delta) if opt.noise_multiplier > 0 else math.inf

    def save(path: Path, steps: int) -> dict:
        epsilon = epsilon_now()
        record = guarantee(
            cfg,
            epsilon=epsilon,
            accountant=engine.accountant.mechanism(),
            noise=opt.noise_multiplier,
            plan=plan,
            steps=steps,
        )
        export(
            path, gsm, cfg=cfg, base_config=base_config, privacy=record, device=device, rank=rank
        )
        return record

    step, seen_before, wall_before = 0, 0, 0.0
    latest = _latest(out) if cfg.resume else None
    if cfg.resume and latest is None:
        logger.warning("[Ghost] --resume: no checkpoint in %s; starting afresh", out)
    if latest is not None:
        load_checkpoint(str(latest), gsm, opt, engine=engine)
        step = _steps_taken(engine)
        saved = load_run_state(latest, scheduler=scheduler)
        seen_before, wall_before = saved["examples_seen"], saved["wall_s"]
        dropped = truncate_metrics(out / "metrics.jsonl", step) if rank == 0 else 0
        logger.info(
            "[Ghost] resumed from %s at step %d (%d metrics rows after it dropped)",
            latest,
            step,
            dropped,
        )
    if rank == 0:
        logger.info(
            "[Ghost] train: %d logical steps, expected batch %d over %d rank(s), noise %.4g, "
            "C %.4g, %d trainable tensors%s",
            total_steps,
            cfg.batch_size,
            world,
            opt.noise_multiplier,
            cfg.max_grad_norm,
            len(trainable),
            " (LoRA)" if cfg.lora else "",
        )
    metrics = (out / "metrics.jsonl").open("a") if rank == 0 else None
    board = MetricsWriter(out, enabled=cfg.tensorboard and rank == 0)
    # the bar's epsilon and the step it is of: the engine's accountant at the last evaluation
    # (a PRV epsilon takes 0.1-0.3 s, too slow for every step), at the start, or at a resume
    last_epsilon, epsilon_step = (epsilon_now() if step else 0.0), step
    if step == 0:  # where the held-out loss starts
        first = heldout_loss(cfg, gsm, heldout, device)
        if metrics is not None:
            metrics.write(json.dumps({"step": 0, "heldout_loss": first, "epsilon": 0.0}) + "\n")
        board.write({"step": 0, "heldout_loss": first, "epsilon": 0.0})
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, unit="step", dynamic_ncols=True)
    seen = torch.tensor(seen_before if rank == 0 else 0, dtype=torch.long)
    run_loss, run_count, tokens, step_start = 0.0, 0, 0, time.perf_counter()
    last_heldout = None
    while step < total_steps:
        if cfg.physical_batch_size is None:
            batches, manager = loader, None
        else:
            manager = BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=cfg.physical_batch_size, optimizer=opt
            )
            batches = manager.__enter__()
        for ids, labels in batches:
            ids, labels = ids.to(device), labels.to(device)
            loss = _loss(cfg, gsm, crit, ids, labels)
            loss.backward()
            before = engine.optimizer_steps
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen += len(ids)
            tokens += ids.numel()
            if len(ids):
                run_loss, run_count = run_loss + float(loss) * len(ids), run_count + len(ids)
            if engine.optimizer_steps == before:
                continue  # a physical batch inside the logical step
            step += 1
            scheduler.step()
            step_ms = (time.perf_counter() - step_start) * 1e3
            row = {"step": step, "train_loss": run_loss / max(run_count, 1), "step_ms": step_ms}
            if step % cfg.eval_every == 0 or step == total_steps:
                last_heldout = heldout_loss(cfg, gsm, heldout, device)
                row["heldout_loss"] = last_heldout
                row["epsilon"] = last_epsilon = epsilon_now()
                epsilon_step = step
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            board.write(row)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                total_seen = seen.clone()
                if dist.is_initialized():
                    dist.all_reduce(total_seen)
                _save(out, step, gsm, opt, engine, rank)
                if rank == 0:
                    save_run_state(
                        _latest(out),
                        scheduler=scheduler,
                        examples_seen=int(total_seen),
                        wall_s=wall_before + time.perf_counter() - start_time,
                    )
                    _retain(cfg, out, step)
            if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
                save(out / f"model-step{step:06d}", step)
            bar.set_postfix(
                loss=f"{row['train_loss']:.3f}",
                eps=f"{last_epsilon:.2f}@{epsilon_step}",
                tok_s=f"{tokens * world / max(step_ms, 1e-6) * 1e3:.0f}",
                ms=f"{step_ms:.0f}",
            )
            bar.update(1)
            run_loss, run_count, tokens, step_start = 0.0, 0, 0, time.perf_counter()
            if step >= total_steps:
                break
        if manager is not None:
            manager.__exit__(None, None, None)
    bar.close()
    board.close()
    if dist.is_initialized():
        dist.all_reduce(seen)
    record = save(out / "model", step)
    epsilon = record["epsilon"]
    summary = {
        "epsilon": epsilon,
        "delta": cfg.delta,
        "noise_multiplier": opt.noise_multiplier,
        "steps": step,
        "examples_seen": int(seen.item()),
        "heldout_loss": last_heldout,
        "wall_s": wall_before + time.perf_counter() - start_time,
        "world_size": world,
        "trainable": trainable,
        "privacy_unit": privacy_unit(cfg),
        "records": examples.records,
        "records_truncated": examples.truncated,
        "record_kind": examples.kind,
        "not_private": list(NOT_PRIVATE),
        "privacy": record,
        "export": str(out / "model"),
        "model": {
            "class": model_class,
            "source": base_path(cfg) or f"preset {cfg.model} (seed {cfg.seed})",
            "parameters": n_params,
            "trainable_parameters": n_trainable,
        },
        "config": dataclasses.asdict(cfg),
    }
    if rank == 0:
        metrics.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info(
            "[Ghost] done: epsilon %.3f at delta %g, %d steps, %d examples seen, %.1f s",
            epsilon,
            cfg.delta,
            step,
            summary["examples_seen"],
            summary["wall_s"],
        )
        _plot(out)
    return summary


def _plot(out: Path) -> None:
    try:
        from .plot import plot_metrics
    except ImportError:  # matplotlib is the [plot] extra
        logger.info("[Ghost] no plot (pip install -e '.[plot]')")
        return
    plot_metrics(out / "metrics.jsonl", out / "metrics.png")
