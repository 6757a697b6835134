"""Shared pieces of the Hugging Face Trainer tests: tiny Llama, records, the reference step."""

from __future__ import annotations

import torch
from torch import nn

from opacus_fsdp_sync.models.llama import LlamaSpec, build_llama

SEQ = 12
VOCAB = 128


def tiny_llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_llama(LlamaSpec(preset="tiny"))


def records(n: int = 24, seed: int = 1) -> list[dict]:
    """Fixed-length records with a prompt (labels -100) and padding at the end.

    Prompt and padding lengths differ per record, so examples carry different numbers of
    trained tokens (the per-example mean must use each example's own count).
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        prompt = int(torch.randint(1, 5, (1,), generator=g))
        pad = int(torch.randint(0, 4, (1,), generator=g))
        mask = torch.ones(SEQ, dtype=torch.long)
        labels = ids.clone()
        labels[:prompt] = -100
        if pad:
            ids[-pad:] = 0
            mask[-pad:] = 0
            labels[-pad:] = -100
        out.append(
            {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
        )
    return out


def example_loss(model, row: dict) -> torch.Tensor:
    """One record's loss: mean next-token cross-entropy over its trained tokens.

    A record with one class label: the cross-entropy of the sequence's class logits.
    """
    ids = torch.tensor([row["input_ids"]])
    mask = torch.tensor([row["attention_mask"]])
    labels = torch.tensor([row["labels"]])
    if labels.dim() == 1:
        return nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def reference_sgd(
    model, data: list[dict], draws: list[list[int]], *, expected: float, C: float, lr: float
):
    """Noise-free DP-SGD with plain SGD, clipping each example on its own (the oracle).

    Each step: sum over the draw of min(1, C / (norm + 1e-6)) x the example's gradient,
    divided by the expected batch (Opacus's divisor under Poisson sampling).

    Returns:
        The number of examples whose gradient was clipped (to prove clipping bit).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    clipped = 0
    for draw in draws:
        total = [torch.zeros_like(p) for p in params]
        for i in draw:
            grads = torch.autograd.grad(example_loss(model, data[i]), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            coef = (C / (norm + 1e-6)).clamp(max=1.0)
            clipped += int(coef < 1)
            for t, g in zip(total, grads):
                t.add_(coef * g)
        with torch.no_grad():
            for p, t in zip(params, total):
                p.sub_(lr * t / expected)
    return clipped


#: The Trainer arguments every test shares: plain SGD at a constant rate, no logging to
#: services, CPU.
TRAINING_DEFAULTS = dict(
    optim="sgd",
    learning_rate=0.5,
    lr_scheduler_type="constant",
    per_device_train_batch_size=4,
    max_steps=2,
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    weight_decay=0.0,
)


def training_arguments(out, **overrides):
    """:data:`TRAINING_DEFAULTS` as ``TrainingArguments``, with ``overrides``."""
    from transformers import TrainingArguments

    return TrainingArguments(**{**TRAINING_DEFAULTS, "output_dir": str(out), **overrides})
