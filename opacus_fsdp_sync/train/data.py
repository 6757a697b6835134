"""Training data: a built-in learnable synthetic task, or local records (one example each).

A record is one privacy unit: it becomes exactly one example (cut or padded to
``--seq-length``), never concatenated with another record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

#: Token ids the synthetic task uses (1..SYNTHETIC_VOCAB; 0 is padding).
SYNTHETIC_VOCAB = 32


def synthetic_sequences(
    n: int, seq_length: int, seed: int, task: str = "causal_lm"
) -> TensorDataset:
    """``n`` arithmetic progressions modulo ``SYNTHETIC_VOCAB`` (start and step 1-3 random).

    Learnable in context (the first two tokens fix the rest), so the held-out loss falls within
    tens of steps. For ``causal_lm`` the labels are the tokens; for ``seq_cls`` whether the
    step is 1.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, SYNTHETIC_VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = 1 + (start + step * torch.arange(seq_length)) % SYNTHETIC_VOCAB
    if task == "causal_lm":
        return TensorDataset(ids, ids.clone())
    return TensorDataset(ids, (step == 1).long().flatten())


#: Label of a position the loss ignores (prompt, padding): ``nn.CrossEntropyLoss``'s default.
IGNORE = -100

_DATASETS_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}


@dataclass(frozen=True)
class Examples:
    """A data set as the trainer uses it: one example per record."""

    data: TensorDataset
    """``(input_ids, labels)``: labels ``(n, seq_length)`` for ``causal_lm`` (``IGNORE`` on
    prompt and padding), ``(n,)`` class labels for ``seq_cls``."""
    records: int
    """Records read (each one example, one privacy unit)."""
    truncated: int
    """Records cut to ``seq_length``."""
    kind: str
    """``text``, ``prompt/completion``, ``messages`` or ``synthetic``."""


def load_records(path: str) -> list[dict]:
    """Records of a local file or Hugging Face data set directory.

    ``.txt`` (one record per non-empty line), ``.jsonl``; through ``datasets`` (extra
    ``[data]``): a directory written by ``Dataset.save_to_disk`` (its ``train`` split if it
    holds several) and ``.parquet``, ``.arrow``, ``.json``, ``.csv`` files.

    Raises:
        ValueError: for a missing path or an unknown file type.
        ImportError: when ``datasets`` is needed and missing.
    """
    p = Path(path)
    if p.suffix == ".jsonl" and p.is_file():
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if p.suffix == ".txt" and p.is_file():
        return [{"text": line} for line in p.read_text().splitlines() if line.strip()]
    if not p.exists():
        raise ValueError(f"data={path!r}: no such file or directory")
    if not p.is_dir() and p.suffix not in _DATASETS_SUFFIXES:
        raise ValueError(
            f"data={path!r}: give .txt, .jsonl, {', '.join(_DATASETS_SUFFIXES)} or a "
            "directory saved by datasets.save_to_disk"
        )
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"data={path!r} needs datasets: pip install -e '.[data]'") from err
    if p.is_dir():
        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    else:
        loaded = datasets.load_dataset(_DATASETS_SUFFIXES[p.suffix], data_files=str(p))["train"]
    return [dict(r) for r in loaded]


def _byte_tokens(text: str, vocab: int) -> list[int]:
    """Bytes folded into ``1..vocab-1``: a tokenizer for presets that have none."""
    return [1 + b % (vocab - 1) for b in text.encode("utf-8")]


def chat_segments(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    """A conversation rendered by the tokenizer's chat template, as ``(text, trained)`` pieces.

    Every assistant turn is trained on (its rendered text, end-of-turn markers included); the
    system and user turns and the template's headers are not.

    Raises:
        ValueError: without a chat template, or one whose renderings are not prefixes of each
            other (the assistant turns could not be located).
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("'messages' records need --model-path with a tokenizer chat template")

    def render(msgs: list[dict], prompt: bool) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (prefix.startswith(done) and through.startswith(prefix)):
            raise ValueError("the chat template does not render the turns as prefixes")
        pieces += [(prefix[len(done) :], False), (through[len(prefix) :], True)]
        done = through
    full = render(messages, False)
    pieces.append((full[len(done) :], False))
    return [(text, trained) for text, trained in pieces if text]


def _pieces(record: dict, tokenizer) -> tuple[str, list[tuple[str, bool]]]:
    """The record's kind and its ``(text, trained)`` pieces."""
    if "messages" in record:
        return "messages", chat_segments(record["messages"], tokenizer)
    if "prompt" in record and "completion" in record:
        return "prompt/completion", [(record["prompt"], False), (record["completion"], True)]
    if "text" in record:
        return "text", [(record["text"], True)]
    raise ValueError(
        f"record with fields {sorted(record)}: causal_lm needs 'text', 'prompt' and "
        "'completion', or 'messages'"
    )


def file_dataset(path: str, *, task: str, seq_length: int, vocab: int, tokenizer=None) -> Examples:
    """One example per record of ``path`` (see :func:`load_records`), never concatenated.

    ``causal_lm``: ``text`` (loss on every token), ``prompt``/``completion`` (loss on the
    completion and, with a tokenizer that has one, the end-of-sequence token after it) or
    ``messages`` (see :func:`chat_segments`). Each record is cut to ``seq_length`` tokens or
    padded (the tokenizer's pad token, else its EOS, else 0) with labels ``IGNORE`` on padding
    and on untrained tokens. ``seq_cls``: ``text`` and ``label``, cut or padded with 0.

    Raises:
        ValueError: for a missing file, fewer than 4 records, or records without the fields.
    """
    rows = load_records(path)
    if len(rows) < 4:
        raise ValueError(f"{path}: {len(rows)} records make fewer than 4 examples")

    def encode(text: str) -> list[int]:
        if tokenizer is not None:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return _byte_tokens(text, vocab)

    pad = 0
    if tokenizer is not None:
        pad = next(
            (t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0
        )
    ids = torch.full((len(rows), seq_length), pad, dtype=torch.long)
    truncated = 0
    if task == "seq_cls":
        if any("label" not in r or "text" not in r for r in rows):
            raise ValueError(f"{path}: seq_cls needs 'text' and 'label' in every record")
        for i, r in enumerate(rows):
            toks = encode(r["text"])
            truncated += len(toks) > seq_length
            ids[i, : min(len(toks), seq_length)] = torch.tensor(toks[:seq_length])
        labels = torch.tensor([int(r["label"]) for r in rows])
        return Examples(TensorDataset(ids, labels), len(rows), truncated, "text")
    labels = torch.full_like(ids, IGNORE)
    kinds = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, r in enumerate(rows):
        kind, pieces = _pieces(r, tokenizer)
        kinds.add(kind)
        toks, targets = [], []
        for text, trained in pieces:
            piece = encode(text)
            toks += piece
            targets += piece if trained else [IGNORE] * len(piece)
        if kind == "prompt/completion" and eos is not None:
            toks, targets = toks + [eos], targets + [eos]
        truncated += len(toks) > seq_length
        n = min(len(toks), seq_length)
        ids[i, :n] = torch.tensor(toks[:n])
        labels[i, :n] = torch.tensor(targets[:n])
    return Examples(TensorDataset(ids, labels), len(rows), truncated, "+".join(sorted(kinds)))


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
