"""Rank functions for the Hugging Face DP trainers on several gloo ranks."""

from __future__ import annotations

import warnings

from tests.hf_common import records, tiny_llama, training_arguments

warnings.filterwarnings("ignore")


def _shard(model):
    """FSDP2 as a user builds it: one unit per decoder block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _dp(**overrides):
    from opacus_fsdp_sync.integrations.transformers import DPArguments

    kwargs = dict(
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        logical_batch_size=8,
        max_physical_batch_size=2,
        dp_seed=3,  # the parent's reference replays the trainer's draws
    )
    kwargs.update(overrides)
    return DPArguments(**kwargs)


def trainer_exactness(rank, world, out, layout, steps, logical):
    """Trains ``steps`` noise-free steps, evaluates; returns the weights, draws and divisor."""
    from transformers import default_data_collator

    from opacus_fsdp_sync.integrations.transformers import DPTrainer
    from opacus_fsdp_sync.integrations.transformers.checkpoints import full_state_dict

    model = tiny_llama(0)
    if layout == "fsdp2":
        model = _shard(model)
    # a checkpoint at the last step: the parent checks that another layout is refused
    args = training_arguments(out, max_steps=steps, save_strategy="steps", save_steps=steps)
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=records(24),
        eval_dataset=records(6, seed=9),
        data_collator=default_data_collator,
        dp_args=_dp(logical_batch_size=logical),
    )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]  # a forward outside the private step
    trainer.save_model(f"{out}/model")  # every rank: the shards are gathered to rank 0
    session = trainer.dp_session
    state = full_state_dict(session.module)
    return {
        "api": session.engine.distributed_api,
        "state": {k: v.clone() for k, v in state.items()},
        "draws": [session.sampler.global_draw(t).tolist() for t in range(steps)],
        "expected": session.optimizer.expected_batch_size * world,
        "steps": session.engine.optimizer_steps,
        "counted": session.steps_counted,
        "eval_loss": eval_loss,
    }


def lora_fsdp2_sft(rank, world, out):
    """The docs' recipe in small: LoRA, FSDP2 by the user, DPSFTTrainer, a target epsilon."""
    import json
    from pathlib import Path

    import peft
    from datasets import Dataset
    from torch.distributed.fsdp import fully_shard
    from trl import SFTConfig

    from opacus_fsdp_sync.integrations.transformers import DPArguments, DPSFTTrainer
    from opacus_fsdp_sync.models.tokenizer import char_tokenizer

    model = peft.get_peft_model(
        tiny_llama(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "instruct_tiny.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    config = SFTConfig(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_length=40,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = DPSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=char_tokenizer(),
        dp_args=DPArguments(target_epsilon=8.0, logical_batch_size=8),
    )
    trainer.train()
    trainer.save_model(f"{out}/adapter")
    return {"api": trainer.dp_session.engine.distributed_api, "epsilon": trainer.epsilon}
