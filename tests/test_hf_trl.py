"""``DPSFTTrainer`` (TRL) on one process: completion-only records, exactness, refusals.

Poisson sampling is on; ``dp_seed`` is the explicit opt-in that lets the reference replay the
trainer's draws. ``bf16=False``: TRL turns bf16 autocast on by default, and the oracle is fp32.
"""

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is the [trl] extra")
datasets = pytest.importorskip("datasets")

from trl import SFTConfig  # noqa: E402

from opacus_fsdp_sync.errors import UnsupportedConfigurationError  # noqa: E402
from opacus_fsdp_sync.integrations.transformers import DPArguments, DPSFTTrainer  # noqa: E402
from opacus_fsdp_sync.models.tokenizer import char_tokenizer  # noqa: E402

from .hf_common import TRAINING_DEFAULTS, reference_sgd, tiny_llama  # noqa: E402

RECORDS = Path(__file__).parent.parent / "examples" / "data" / "instruct_tiny.jsonl"


def _records():
    rows = [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_list(rows)


def _config(out, **overrides):
    kwargs = {**TRAINING_DEFAULTS, "output_dir": str(out), "max_length": 40, "bf16": False}
    return SFTConfig(**{**kwargs, **overrides})


def _dp(**overrides):
    kwargs = dict(
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        logical_batch_size=8,
        max_physical_batch_size=3,
        dp_seed=3,  # the reference replays the trainer's draws
    )
    kwargs.update(overrides)
    return DPArguments(**kwargs)


def _exact(trainer, model, ref):
    """Trains 2 steps; the update equals the oracle on the rows TRL prepared (1e-6)."""
    rows = list(trainer.train_dataset)
    trainer.train()
    session = trainer.dp_session
    draws = [session.sampler.global_draw(t).tolist() for t in range(2)]
    assert max(len(d) for d in draws) > 3  # several physical batches in a step
    data = [
        {
            "input_ids": r["input_ids"],
            "attention_mask": [1] * len(r["input_ids"]),
            "labels": r["labels"],
        }
        for r in rows
    ]
    clipped = reference_sgd(
        ref, data, draws, expected=session.optimizer.expected_batch_size, C=0.05, lr=0.5
    )
    assert clipped > 0
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert err < 1e-6, err


def test_completion_only_update_equals_the_clip_each_sample_loop(tmp_path):
    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    trainer = DPSFTTrainer(
        model=model,
        args=_config(tmp_path),
        train_dataset=_records(),
        processing_class=char_tokenizer(),
        dp_args=_dp(),
    )
    assert not trainer.args.gradient_checkpointing  # TRL's default, turned off
    row = trainer.train_dataset[0]
    prompt_tokens = len(char_tokenizer()(row["prompt"])["input_ids"])
    assert row["labels"][:prompt_tokens] == [-100] * prompt_tokens  # completion only
    assert all(t != -100 for t in row["labels"][prompt_tokens:])
    _exact(trainer, model, ref)
    assert [r["epsilon"] for r in trainer.state.log_history][-1] == float("inf")


#: A chat template that marks the assistant's turns for TRL's assistant-only labels.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A: ' }}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}"
    "{{ 'U: ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)


def test_assistant_only_update_equals_the_clip_each_sample_loop(tmp_path):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i}"},
                {"role": "assistant", "content": str(2 * i)},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(20)
    ]
    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    trainer = DPSFTTrainer(
        model=model,
        args=_config(tmp_path, assistant_only_loss=True, max_length=60),
        train_dataset=datasets.Dataset.from_list(chats),
        processing_class=tokenizer,
        dp_args=_dp(),
    )
    row = trainer.train_dataset[0]
    trained = tokenizer.decode([t for t in row["labels"] if t != -100])
    assert trained == "0[EOS]ok[EOS]"  # both assistant turns, no user turn, no header
    _exact(trainer, model, ref)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"packing": True}, "packing=True: packing concatenates several records"),
        ({"padding_free": True, "max_length": None}, "padding_free=True"),
        ({"loss_type": "dft"}, "loss_type='dft'"),
    ],
)
def test_refused_sft_settings(tmp_path, overrides, match):
    with pytest.raises(UnsupportedConfigurationError, match=match):
        DPSFTTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path, **overrides),
            train_dataset=_records(),
            processing_class=char_tokenizer(),
            dp_args=DPArguments(target_epsilon=8.0),
        )
