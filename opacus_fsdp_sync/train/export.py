"""Exports a trained model as Hugging Face directories that ``from_pretrained`` loads.

Every rank takes part in gathering the full weights from the shards
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: rank 0 receives them, on the
CPU); rank 0 then loads them into a plain CPU copy of the model and saves it, with the config,
the tokenizer (when ``--model-path`` has one), the privacy guarantee the weights carry
(``privacy.json``) and the trained model's logits on a fixed, data-free probe batch
(``probe_logits.pt``) against which a load can be checked.

Layout of an export directory:

- full fine-tuning: the model itself (``config.json``, ``model.safetensors``, tokenizer);
- LoRA: ``adapter/`` (peft ``save_pretrained``; load it on top of ``--model-path``, or the
  preset built from ``--seed``) and, with ``--merge-lora``, ``merged/`` (the adapters merged
  into a CPU copy of the base: a plain model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.detect import _unwrap
from .config import TrainConfig
from .model import apply_lora, load_tokenizer

logger = logging.getLogger(__name__)

_README = """# A differentially private fine-tune

Trained by `python -m opacus_fsdp_sync.train` (DP-SGD, ghost clipping). The guarantee the
weights carry is in `privacy.json`: ({epsilon:.4g}, {delta:g})-DP ({accountant} accountant)
for {unit}. It covers these weights, not the training logs (see `not_private` there).
Layout: {layout}
"""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model behind Opacus's GradSampleModule and DDP.

    FSDP roots stay: the state dict API looks through them.
    """
    module = _unwrap(model)
    while isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on the CPU of rank 0; empty on other ranks.

    Every rank must call it (FSDP gathers the shards).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(unwrap(model), options=options)


def probe_ids(vocab: int, seq_length: int) -> torch.Tensor:
    """A fixed batch of two token sequences.

    Independent of the data, so its logits are as public as the weights.
    """
    pos = torch.arange(seq_length)
    return torch.stack([(3 + 7 * pos) % vocab, (5 + 11 * pos) % vocab])


@torch.no_grad()
def probe_logits(model: nn.Module, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The trained model's logits on ``ids``, on the CPU; every rank calls it."""
    was = model.training
    model.eval()
    logits = model(input_ids=ids.to(device)).logits.float().cpu()
    model.train(was)
    return logits


def _plain_copy(cfg: TrainConfig, base_config, state: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU model of the trained architecture (with its LoRA adapters) holding ``state``."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    cls = LlamaForCausalLM if cfg.task == "causal_lm" else LlamaForSequenceClassification
    model = cls(base_config)
    if cfg.lora:
        model = apply_lora(model, cfg)
    model.load_state_dict(state)
    return model.eval()


def _save_tokenizer(cfg: TrainConfig, dirs: list[Path]) -> None:
    tokenizer = load_tokenizer(cfg)
    if tokenizer is not None:
        for d in dirs:
            tokenizer.save_pretrained(d)


def export(
    path: Path,
    model: nn.Module,
    *,
    cfg: TrainConfig,
    base_config,
    privacy: dict,
    device: torch.device,
    rank: int,
) -> None:
    """Writes the export directory ``path``; every rank calls it.

    Args:
        path: The directory to write (created; files in it are replaced).
        model: The trained model as the loop holds it (Opacus's wrapper, sharded or not).
        cfg: The run's configuration (task, LoRA, ``--merge-lora``, ``--model-path``).
        base_config: The base model's ``config`` (see :func:`.model.build_model`).
        privacy: The guarantee the weights carry, written to ``privacy.json``.
        device: Where the model computes (for the probe's logits).
        rank: This process's rank; only rank 0 writes.
    """
    ids = probe_ids(base_config.vocab_size, min(cfg.seq_length, 16))
    logits = probe_logits(model, ids, device)
    state = full_state_dict(model)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        copy = _plain_copy(cfg, base_config, state)
        if cfg.lora:
            dirs = [path / "adapter"]
            copy.save_pretrained(dirs[0])
            if cfg.merge_lora:
                dirs.append(path / "merged")
                copy.merge_and_unload().save_pretrained(dirs[1])
            layout = ", ".join(f"`{d.name}/`" for d in dirs)
        else:
            dirs = [path]
            copy.save_pretrained(path)
            layout = "this directory is the model"
        _save_tokenizer(cfg, dirs)
        torch.save({"input_ids": ids, "logits": logits}, path / "probe_logits.pt")
        (path / "privacy.json").write_text(json.dumps(privacy, indent=2))
        (path / "README.md").write_text(
            _README.format(
                epsilon=privacy["epsilon"],
                delta=privacy["delta"],
                accountant=privacy["accountant"],
                unit=privacy["privacy_unit"],
                layout=layout,
            )
        )
        logger.info("[Ghost] export: %s (epsilon %.4g)", path, privacy["epsilon"])
    if dist.is_initialized():
        dist.barrier()
