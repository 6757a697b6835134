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
import time
from pathlib import Path

import torch
import torch.distributed as dist
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import TensorDataset

from ..sharding import save_checkpoint
from .config import TrainConfig
from .data import IGNORE
from .disclosure import NOT_PRIVATE
from .privacy import privacy_unit
from .run_state import prune_checkpoints, save_run_state
from .session import Run, latest_checkpoint, set_up
from .tensorboard import MetricsWriter

logger = logging.getLogger(__name__)


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

    Launch with ``torchrun`` for several ranks, or as one process. Five named phases: set up
    (:func:`set_up`: model, data, engine, resume), the logical steps (:func:`_one_step`), each
    followed by its evaluation (:func:`_evaluate`) and checkpoint (:func:`_checkpoint`), and the
    finish (:func:`_finish`: export and summary).
    """
    run = set_up(cfg)
    progress = _Progress.start(run)
    while run.step < run.plan.total_steps:
        if cfg.physical_batch_size is None:
            batches, manager = run.loader, None
        else:
            manager = BatchMemoryManager(
                data_loader=run.loader,
                max_physical_batch_size=cfg.physical_batch_size,
                optimizer=run.opt,
            )
            batches = manager.__enter__()
        for ids, labels in batches:
            if not _one_step(run, progress, ids, labels):
                continue  # a physical batch inside the logical step
            row = _evaluate(run, progress)
            _checkpoint(run, progress)
            progress.report(run, row)
            if run.step >= run.plan.total_steps:
                break
        if manager is not None:
            manager.__exit__(None, None, None)
    return _finish(run, progress)


@dataclasses.dataclass(kw_only=True)
class _Progress:
    """The running measures between reports: metrics file, board, bar, losses, tokens."""

    metrics: object
    board: MetricsWriter
    bar: object
    seen: torch.Tensor
    #: The bar's epsilon and the step it is of: the engine's accountant at the last evaluation
    #: (a PRV epsilon takes 0.1-0.3 s, too slow for every step), at the start, or at a resume.
    last_epsilon: float = 0.0
    epsilon_step: int = 0
    last_heldout: float | None = None
    run_loss: float = 0.0
    run_count: int = 0
    tokens: int = 0
    step_start: float = 0.0

    @classmethod
    def start(cls, run: Run) -> _Progress:
        """Opens the outputs; at step 0, logs where the held-out loss starts."""
        from tqdm import tqdm

        rank0 = run.rank == 0
        progress = cls(
            metrics=(run.out / "metrics.jsonl").open("a") if rank0 else None,
            board=MetricsWriter(run.out, enabled=run.cfg.tensorboard and rank0),
            bar=tqdm(
                total=run.plan.total_steps,
                initial=run.step,
                disable=not rank0,
                unit="step",
                dynamic_ncols=True,
            ),
            seen=torch.tensor(run.seen_before if rank0 else 0, dtype=torch.long),
            last_epsilon=run.epsilon_now() if run.step else 0.0,
            epsilon_step=run.step,
            step_start=time.perf_counter(),
        )
        if run.step == 0:  # where the held-out loss starts
            first = heldout_loss(run.cfg, run.gsm, run.heldout, run.device)
            progress.write({"step": 0, "heldout_loss": first, "epsilon": 0.0})
        return progress

    def write(self, row: dict) -> None:
        """One metrics row, to ``metrics.jsonl`` (rank 0) and the board."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        self.board.write(row)

    def report(self, run: Run, row: dict) -> None:
        """Writes the step's row and moves the bar; the running measures start again."""
        self.write(row)
        if run.cfg.save_every and run.step % run.cfg.save_every == 0:
            if run.step < run.plan.total_steps:
                run.export(run.out / f"model-step{run.step:06d}")
        self.bar.set_postfix(
            loss=f"{row['train_loss']:.3f}",
            eps=f"{self.last_epsilon:.2f}@{self.epsilon_step}",
            tok_s=f"{self.tokens * run.world / max(row['step_ms'], 1e-6) * 1e3:.0f}",
            ms=f"{row['step_ms']:.0f}",
        )
        self.bar.update(1)
        self.run_loss, self.run_count, self.tokens = 0.0, 0, 0
        self.step_start = time.perf_counter()


def _one_step(run: Run, progress: _Progress, ids, labels) -> bool:
    """One physical batch through the private step; True when it ended a logical step."""
    ids, labels = ids.to(run.device), labels.to(run.device)
    loss = _loss(run.cfg, run.gsm, run.crit, ids, labels)
    loss.backward()
    before = run.engine.optimizer_steps
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    progress.seen += len(ids)
    progress.tokens += ids.numel()
    if len(ids):
        progress.run_loss += float(loss) * len(ids)
        progress.run_count += len(ids)
    if run.engine.optimizer_steps == before:
        return False
    run.step += 1
    run.scheduler.step()
    return True


def _evaluate(run: Run, progress: _Progress) -> dict:
    """The step's metrics row; the held-out loss and epsilon every ``--eval-every`` steps."""
    step_ms = (time.perf_counter() - progress.step_start) * 1e3
    row = {
        "step": run.step,
        "train_loss": progress.run_loss / max(progress.run_count, 1),
        "step_ms": step_ms,
    }
    if run.step % run.cfg.eval_every == 0 or run.step == run.plan.total_steps:
        progress.last_heldout = heldout_loss(run.cfg, run.gsm, run.heldout, run.device)
        row["heldout_loss"] = progress.last_heldout
        row["epsilon"] = progress.last_epsilon = run.epsilon_now()
        progress.epsilon_step = run.step
    return row


def _checkpoint(run: Run, progress: _Progress) -> None:
    """Every ``--checkpoint-every`` steps: model, optimizer, DP state and run state."""
    if not (run.cfg.checkpoint_every and run.step % run.cfg.checkpoint_every == 0):
        return
    total_seen = progress.seen.clone()
    if dist.is_initialized():
        dist.all_reduce(total_seen)
    _save(run.out, run.step, run.gsm, run.opt, run.engine, run.rank)
    if run.rank == 0:
        save_run_state(
            latest_checkpoint(run.out),
            scheduler=run.scheduler,
            examples_seen=int(total_seen),
            wall_s=run.wall_before + time.perf_counter() - run.start_time,
        )
        _retain(run.cfg, run.out, run.step)


def _finish(run: Run, progress: _Progress) -> dict:
    """Exports the model, writes the summary (rank 0) and returns it."""
    progress.bar.close()
    progress.board.close()
    if dist.is_initialized():
        dist.all_reduce(progress.seen)
    record = run.export(run.out / "model")
    cfg = run.cfg
    summary = {
        "epsilon": record["epsilon"],
        "delta": cfg.delta,
        "noise_multiplier": run.opt.noise_multiplier,
        "steps": run.step,
        "examples_seen": int(progress.seen.item()),
        "heldout_loss": progress.last_heldout,
        "wall_s": run.wall_before + time.perf_counter() - run.start_time,
        "world_size": run.world,
        "trainable": run.trainable,
        "privacy_unit": privacy_unit(cfg),
        "records": run.examples.records,
        "records_truncated": run.examples.truncated,
        "record_kind": run.examples.kind,
        "not_private": list(NOT_PRIVATE),
        "privacy": record,
        "export": str(run.out / "model"),
        "model": run.model_info,
        "config": dataclasses.asdict(cfg),
    }
    if run.rank == 0:
        progress.metrics.close()
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.info(
            "[Ghost] done: epsilon %.3f at delta %g, %d steps, %d examples seen, %.1f s",
            summary["epsilon"],
            cfg.delta,
            run.step,
            summary["examples_seen"],
            summary["wall_s"],
        )
        if not cfg.poisson_sampling:
            logger.warning(
                "[Ghost] that epsilon assumes Poisson sampling, which this run turned off "
                "(poisson_sampling=false): it does not hold for this run"
            )
        _plot(run.out)
    return summary


def _plot(out: Path) -> None:
    try:
        from .plot import plot_metrics
    except ImportError:  # matplotlib is the [plot] extra
        logger.info("[Ghost] no plot (pip install -e '.[plot]')")
        return
    plot_metrics(out / "metrics.jsonl", out / "metrics.png")
