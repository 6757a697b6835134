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
