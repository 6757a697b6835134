"""The trainer's data pipeline, in process: one record is one example (one privacy unit).

References: the records' own tokens (byte tokenizer, or a word-level tokenizer saved offline),
and for the loss mask a hand-written mean over the completion tokens of an un-wrapped model.
"""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.train.config import TrainConfig
from opacus_fsdp_sync.train.data import IGNORE, file_dataset, load_records
from opacus_fsdp_sync.train.loop import _loss

VOCAB = 128


def _bytes(text):
    return [1 + b % (VOCAB - 1) for b in text.encode()]


def test_a_plain_text_record_is_one_example_and_no_two_share_a_sequence(tmp_path):
    lines = ["short", "a line longer than the sequence length", "mid length", "x", "yz"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines))
    ex = file_dataset(str(path), task="causal_lm", seq_length=12, vocab=VOCAB)
    ids, labels = ex.data.tensors
    assert ex.records == len(ids) == 5 and ex.truncated == 1 and ex.kind == "text"
    for line, row, target in zip(lines, ids, labels):
        toks = _bytes(line)[:12]
        assert row[: len(toks)].tolist() == toks and target[: len(toks)].tolist() == toks
        assert (row[len(toks) :] == 0).all() and (target[len(toks) :] == IGNORE).all()


def _prompt_completion(tmp_path):
    rows = [{"prompt": f"question {i}?", "completion": f" answer {i}."} for i in range(6)]
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return rows, file_dataset(str(path), task="causal_lm", seq_length=24, vocab=VOCAB)


def _dp_gradient(ids, labels):
    """The gradient ghost clipping hands the optimizer for a batch of one: its per-sample
    gradient (noise 0, a bound it never reaches)."""
    torch.manual_seed(0)
    model = build_llama(LlamaSpec(preset="tiny"))
    model.train()
    gsm, opt, crit, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(ids, labels), batch_size=1),
        noise_multiplier=0.0,
        max_grad_norm=1e9,
        poisson_sampling=False,
        grad_sample_mode="ghost",
    )
    _loss(TrainConfig(), gsm, crit, ids, labels).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_prompt_tokens_get_no_gradient_and_each_example_is_a_mean_over_its_completion(tmp_path):
    rows, ex = _prompt_completion(tmp_path)
    ids, labels = (t[:1] for t in ex.data.tensors)
    n_prompt = len(_bytes(rows[0]["prompt"]))
    n_all = n_prompt + len(_bytes(rows[0]["completion"]))
    assert (labels[0, :n_prompt] == IGNORE).all() and (labels[0, n_prompt:n_all] != IGNORE).all()
    assert ex.kind == "prompt/completion" and ex.truncated == 0
    dp = _dp_gradient(ids, labels)
    # reference: the plain model, the mean over the completion's next-token losses only
    torch.manual_seed(0)
    ref_model = build_llama(LlamaSpec(preset="tiny"))
    logits = ref_model(input_ids=ids).logits[0, n_prompt - 1 : n_all - 1]
    nn.functional.cross_entropy(logits, ids[0, n_prompt:n_all]).backward()
    for got, want in zip(dp, [p.grad for p in ref_model.parameters()]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the mask is what keeps the prompt out: its labels set to its own next tokens change it
    unmasked = labels.clone()
    unmasked[0, :n_prompt] = ids[0, :n_prompt]
    assert any(not torch.allclose(a, b) for a, b in zip(dp, _dp_gradient(ids, unmasked)))


def _word_tokenizer(path, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "user", "assistant", "system", ":"]
    words += [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


#: A minimal template: "role : content [EOS]" per turn, "assistant :" as the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [EOS] {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def test_chat_records_train_on_the_assistant_turns_with_an_offline_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_word_tokenizer(tmp_path / "tok", CHAT_TEMPLATE))
    chat = [
        {"role": "system", "content": "w1"},
        {"role": "user", "content": "w2 w3"},
        {"role": "assistant", "content": "w4 w5"},
        {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": chat}) for _ in range(4)))
    ex = file_dataset(str(path), task="causal_lm", seq_length=40, vocab=64, tokenizer=tok)
    ids, labels = ex.data.tensors
    words = tok.convert_ids_to_tokens(ids[0].tolist())
    trained = [w for w, y in zip(words, labels[0].tolist()) if y != IGNORE]
    assert trained == ["w4", "w5", "[EOS]", "w7", "[EOS]"]  # assistant turns only
    assert (
        words[: words.index("w7") + 2]
        == (
            "system : w1 [EOS] user : w2 w3 [EOS] assistant : w4 w5 [EOS] user : w6 [EOS] "
            "assistant : w7 [EOS]"
        ).split()
    )
    assert ex.kind == "messages" and ex.records == 4
    plain = tmp_path / "plain"
    _word_tokenizer(plain)
    with pytest.raises(ValueError, match="chat template"):
        file_dataset(
            str(path), task="causal_lm", seq_length=40, vocab=64,
            tokenizer=AutoTokenizer.from_pretrained(plain),
        )  # fmt: skip


def test_hugging_face_datasets_saved_to_disk_and_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    data = datasets.Dataset.from_list(rows)
    data.save_to_disk(str(tmp_path / "saved"))
    data.to_parquet(str(tmp_path / "rows.parquet"))
    assert load_records(str(tmp_path / "saved")) == rows
    assert load_records(str(tmp_path / "rows.parquet")) == rows
    ex = file_dataset(str(tmp_path / "saved"), task="causal_lm", seq_length=8, vocab=VOCAB)
    assert ex.records == 5 and ex.kind == "prompt/completion"
    with pytest.raises(ValueError, match="no such file"):
        load_records(str(tmp_path / "missing.parquet"))
