"""Training data: a built-in learnable synthetic task, or a local text / JSONL file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

#: Token ids the synthetic task uses (1..SYNTHETIC_VOCAB; 0 is padding).
SYNTHETIC_VOCAB = 32


def synthetic_sequences(n: int, seq_length: int, seed: int) -> TensorDataset:
    """``n`` arithmetic progressions modulo ``SYNTHETIC_VOCAB`` (start and step 1-3 random).

    Learnable in context (the first two tokens fix the rest), so the held-out loss falls within
    tens of steps. For ``seq_cls`` the label is whether the step is 1.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, SYNTHETIC_VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = 1 + (start + step * torch.arange(seq_length)) % SYNTHETIC_VOCAB
    return TensorDataset(ids, (step == 1).long().flatten())


def _records(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bad = [i for i, r in enumerate(rows) if "text" not in r]
        if bad:
            raise ValueError(f"{path}: line(s) {bad[:5]} have no 'text' field")
        return rows
    return [{"text": line} for line in path.read_text().splitlines() if line.strip()]


def _byte_tokens(text: str, vocab: int) -> list[int]:
    """Bytes folded into ``1..vocab-1``: a tokenizer for presets that have none."""
    return [1 + b % (vocab - 1) for b in text.encode("utf-8")]


def file_dataset(
    path: str, *, task: str, seq_length: int, vocab: int, tokenizer=None
) -> TensorDataset:
    """Examples of ``seq_length`` tokens from a local ``.txt`` or ``.jsonl`` file.

    ``causal_lm``: every text tokenized and concatenated, cut into full-length chunks.
    ``seq_cls``: one example per record (``label`` required), cut or padded with 0.

    Raises:
        ValueError: for a missing file, too little text, or records without labels.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data={path!r}: no such file (give a local .txt or .jsonl file)")
    rows = _records(p)

    def encode(text: str) -> list[int]:
        if tokenizer is not None:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return _byte_tokens(text, vocab)

    if task == "causal_lm":
        stream = [t for r in rows for t in encode(r["text"])]
        n = len(stream) // seq_length
        if n < 4:
            raise ValueError(f"{path}: {len(stream)} tokens make fewer than 4 examples")
        ids = torch.tensor(stream[: n * seq_length]).view(n, seq_length)
        return TensorDataset(ids, torch.zeros(n, dtype=torch.long))
    if any("label" not in r for r in rows):
        raise ValueError(f"{path}: seq_cls needs a 'label' in every record (JSONL)")
    ids = torch.zeros(len(rows), seq_length, dtype=torch.long)
    for i, r in enumerate(rows):
        toks = encode(r["text"])[:seq_length]
        ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    return TensorDataset(ids, torch.tensor([int(r["label"]) for r in rows]))


def split(data: TensorDataset, fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """``(train, held-out)``: a seeded random split, the same on every rank."""
    n = len(data)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, int(round(n * fraction)))
    held, train = perm[:k], perm[k:]
    return (
        TensorDataset(*(t[train] for t in data.tensors)),
        TensorDataset(*(t[held] for t in data.tensors)),
    )
