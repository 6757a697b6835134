"""The trainer's optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def build_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``--optimizer adamw|sgd`` at ``--lr`` with ``--weight-decay`` (decoupled for AdamW)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(cfg: TrainConfig, total_steps: int, step: int) -> float:
    """The multiple of ``--lr`` for the logical step after ``step`` steps taken.

    A linear warm-up from 0 over ``--warmup-steps``, then ``constant``, ``linear`` decay to 0
    or ``cosine`` decay to 0 at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    progress = min(progress, 1.0)
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`lr_factor`; the loop steps it once per logical step.

    Its state (the steps it has counted) is saved with each checkpoint and restored on resume.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, total_steps, step)
    )
