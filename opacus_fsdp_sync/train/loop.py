"""The DP fine-tuning loop.

Build, shard, make private, train with Poisson sampling, evaluate, checkpoint (with the DP
state), resume, report.

A thin client of the package: the engine, the sharding config, the checkpoints and the memory
manager are the package's and Opacus's own.
"""

from __future__ import annotations

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
from ..models import LlamaSpec, build_llama
from ..privacy_engine import PrivacyEngine
from ..sharding import ShardingConfig, load_checkpoint, save_checkpoint, shard_model
from .config import TrainConfig
from .data import SYNTHETIC_VOCAB, file_dataset, split, synthetic_sequences
from .privacy import NOT_PRIVATE, PRIVACY_NOTE, noise_for_target, plan_steps, privacy_unit

logger = logging.getLogger(__name__)

_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def apply_lora(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """LoRA adapters (peft) on every attention and MLP projection; the base weights frozen.

    Raises:
        ImportError: without peft (``pip install -e .[lora]``).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("--lora needs peft: pip install -e '.[lora]'") from err
    task = "CAUSAL_LM" if cfg.task == "causal_lm" else "SEQ_CLS"
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=_LORA_TARGETS,
        task_type=task,
    )
    return get_peft_model(model, lora)


def _tokenizer(cfg: TrainConfig):
    if cfg.model_path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model_path, local_files_only=True)


def _datasets(cfg: TrainConfig, vocab: int) -> tuple[TensorDataset, TensorDataset]:
    if cfg.data is None:
        if vocab <= SYNTHETIC_VOCAB:
            raise ValueError(f"the synthetic task needs a vocabulary above {SYNTHETIC_VOCAB}")
        data = synthetic_sequences(cfg.num_examples, cfg.seq_length, cfg.seed)
    else:
        data = file_dataset(
            cfg.data,
            task=cfg.task,
            seq_length=cfg.seq_length,
            vocab=vocab,
            tokenizer=_tokenizer(cfg),
        )
    return split(data, cfg.heldout_fraction, cfg.seed)


def _loss(cfg: TrainConfig, model, criterion, ids, labels, private: bool = True):
    if cfg.task == "seq_cls":
        return criterion(model(input_ids=ids).logits, labels)
    logits = model(input_ids=ids).logits[:, :-1]
    flat = (logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return criterion(*flat, shape=logits.shape[:2]) if private else criterion(*flat)


@torch.no_grad()
def heldout_loss(cfg: TrainConfig, model, data: TensorDataset, device, batch: int = 32) -> float:
    """Mean held-out loss; every rank evaluates the whole (small) set, in the same batches."""
    was = model.training
    model.eval()
    plain = nn.CrossEntropyLoss(reduction="sum")
    total, count = 0.0, 0
    ids_all, labels_all = data.tensors
    for i in range(0, len(ids_all), batch):
        ids, labels = ids_all[i : i + batch].to(device), labels_all[i : i + batch].to(device)
        if cfg.task == "seq_cls":
            total += plain(model(input_ids=ids).logits.float(), labels).item()
            count += len(ids)
        else:
            logits = model(input_ids=ids).logits[:, :-1].float()
            total += plain(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
            count += ids[:, 1:].numel()
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


def _build(cfg: TrainConfig, device: torch.device):
    spec = LlamaSpec(preset=cfg.model, task=cfg.task, model_path=cfg.model_path)
    torch.manual_seed(cfg.seed)
    model = build_llama(spec)
    model.train()  # from_pretrained returns it in eval mode, which Opacus refuses
    if cfg.lora:
        model = apply_lora(model, cfg)
    return model


def _shard(cfg: TrainConfig, model: nn.Module, device: torch.device, world: int) -> nn.Module:
    """The model sharded (or replicated) across ranks; on one process, as it is."""
    if world == 1:
        return model.to(device)
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if cfg.fsdp_api == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(device)
        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    sharding = ShardingConfig.for_precision(precision, strategy=cfg.strategy, backend=cfg.fsdp_api)
    return shard_model(model, sharding, device=device)


def train(cfg: TrainConfig) -> dict:
    """Runs the whole fine-tuning; returns the summary (rank 0 also writes it to ``out``).

    Launch with ``torchrun`` for several ranks, or as one process.
    """
    from tqdm import tqdm

    rank, world, device = init_distributed()
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        logger.info("[Ghost] privacy: %s This run's unit: %s.", PRIVACY_NOTE, privacy_unit(cfg))
    start_time = time.perf_counter()
    model = _build(cfg, device)
    train_set, heldout = _datasets(cfg, model.config.vocab_size)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    model = _shard(cfg, model, device, world)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    engine = PrivacyEngine(timing=cfg.timing, dp_seed=cfg.dp_seed)
    data_loader = DataLoader(train_set, batch_size=cfg.batch_size)
    plan = plan_steps(steps_per_epoch=len(data_loader), epochs=cfg.epochs, max_steps=cfg.max_steps)
    total_steps = plan.total_steps
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
    step = 0
    latest = _latest(out) if cfg.resume else None
    if cfg.resume and latest is None:
        logger.warning("[Ghost] --resume: no checkpoint in %s; starting afresh", out)
    if latest is not None:
        load_checkpoint(str(latest), gsm, opt, engine=engine)
        step = _steps_taken(engine)
        logger.info("[Ghost] resumed from %s at step %d", latest, step)
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
    last_epsilon = float("nan")
    if step == 0:  # where the held-out loss starts
        first = heldout_loss(cfg, gsm, heldout, device)
        if metrics is not None:
            metrics.write(json.dumps({"step": 0, "heldout_loss": first, "epsilon": 0.0}) + "\n")
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, unit="step", dynamic_ncols=True)
    seen = torch.zeros((), dtype=torch.long)
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
            step_ms = (time.perf_counter() - step_start) * 1e3
            row = {"step": step, "train_loss": run_loss / max(run_count, 1), "step_ms": step_ms}
            if step % cfg.eval_every == 0 or step == total_steps:
                last_heldout = heldout_loss(cfg, gsm, heldout, device)
                row["heldout_loss"] = last_heldout
                row["epsilon"] = last_epsilon = engine.get_epsilon(cfg.delta)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                _save(out, step, gsm, opt, engine, rank)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.set_postfix(
                loss=f"{row['train_loss']:.3f}",
                eps=f"{last_epsilon:.2f}",
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
    if dist.is_initialized():
        dist.all_reduce(seen)
    epsilon = engine.get_epsilon(cfg.delta) if opt.noise_multiplier > 0 else math.inf
    summary = {
        "epsilon": epsilon,
        "delta": cfg.delta,
        "noise_multiplier": opt.noise_multiplier,
        "steps": step,
        "examples_seen": int(seen.item()),
        "heldout_loss": last_heldout,
        "wall_s": time.perf_counter() - start_time,
        "world_size": world,
        "trainable": trainable,
        "privacy_unit": privacy_unit(cfg),
        "not_private": list(NOT_PRIVATE),
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
