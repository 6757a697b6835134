"""``DPTrainer`` on one process: exactness, noise, epsilon, batch mapping, refusals.

Poisson sampling is on in every test (the DP trainer has no other sampler). Tests that compare
against a reference pass ``dp_seed``, the explicit opt-in to reproducible draws and noise: the
reference must see the same draws (read back from the sampler) as the trainer.
"""

import copy
import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from opacus.accountants import PRVAccountant  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from opacus_fsdp_sync.errors import UnsupportedConfigurationError  # noqa: E402
from opacus_fsdp_sync.integrations.transformers import DPArguments, DPTrainer  # noqa: E402

from .hf_common import records, reference_sgd, tiny_llama, training_arguments  # noqa: E402


def _trainer(tmp_path, dp, model=None, data=None, **overrides):
    return DPTrainer(
        model=model if model is not None else tiny_llama(0),
        args=training_arguments(tmp_path, **overrides),
        train_dataset=data if data is not None else records(24),
        data_collator=default_data_collator,
        dp_args=dp,
    )


def test_update_equals_the_clip_each_sample_loop(tmp_path):
    """Noise 0: two logical steps (physical batches of 3) equal the oracle within 1e-6."""
    model, data = tiny_llama(0), records(24)
    ref = copy.deepcopy(model)
    dp = DPArguments(
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        logical_batch_size=8,
        max_physical_batch_size=3,
        dp_seed=3,  # the reference replays the trainer's draws
    )
    trainer = _trainer(tmp_path, dp, model=model, data=data, max_steps=2)
    trainer.train()
    session = trainer.dp_session
    draws = [session.sampler.global_draw(t).tolist() for t in range(2)]
    assert max(len(d) for d in draws) > 3  # some step ran several physical batches
    expected = session.optimizer.expected_batch_size
    assert expected == 8
    clipped = reference_sgd(ref, data, draws, expected=expected, C=0.05, lr=0.5)
    assert clipped > 0  # clipping bit
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    moved = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), tiny_llama(0).parameters())
    )
    assert err < 1e-6 < moved * 1e-2, (err, moved)
    assert session.engine.optimizer_steps == 2 and session.steps_counted == 2
    with pytest.raises(RuntimeError, match="trains once"):
        trainer.train()


def test_sequence_classification_update_equals_the_clip_each_sample_loop(tmp_path):
    """One loss per example from the class logits (no shift); padding at the end."""
    from opacus_fsdp_sync.models.llama import LlamaSpec, build_llama

    torch.manual_seed(0)
    model = build_llama(LlamaSpec(preset="tiny", task="seq_cls", num_labels=3))
    ref = copy.deepcopy(model)
    data = [dict(r, labels=i % 3) for i, r in enumerate(records(24))]
    dp = DPArguments(
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        logical_batch_size=8,
        max_physical_batch_size=3,
        dp_seed=3,  # the reference replays the trainer's draws
    )
    trainer = _trainer(tmp_path, dp, model=model, data=data, max_steps=2)
    assert not trainer._dp_causal
    trainer.train()
    session = trainer.dp_session
    draws = [session.sampler.global_draw(t).tolist() for t in range(2)]
    expected = session.optimizer.expected_batch_size
    assert reference_sgd(ref, data, draws, expected=expected, C=0.05, lr=0.5) > 0
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    assert err < 1e-6, err


def test_noise_is_calibrated(tmp_path):
    """With C tiny the update is the noise: per-coordinate std of the step is lr sigma C / B."""
    model = tiny_llama(0)
    before = [p.detach().clone() for p in model.parameters()]
    sigma, C, lr = 2.0, 1e-6, 1.0
    dp = DPArguments(noise_multiplier=sigma, max_grad_norm=C, logical_batch_size=8)
    trainer = _trainer(tmp_path, dp, model=model, max_steps=1, learning_rate=lr)
    trainer.train()
    step = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    B = trainer.dp_session.optimizer.expected_batch_size
    ratio = step.std().item() / (lr * sigma * C / B)
    assert step.numel() > 40_000 and 0.98 < ratio < 1.02, ratio
    assert abs(step.mean().item()) < 0.02 * step.std().item()


def test_reported_epsilon_is_the_accountants_for_the_steps_taken(tmp_path):
    dp = DPArguments(target_epsilon=4.0, delta=1e-5, max_grad_norm=1.0, logical_batch_size=8)
    trainer = _trainer(tmp_path, dp, max_steps=3)
    trainer.train()
    session = trainer.dp_session
    hand = PRVAccountant()
    hand.history = [(session.noise_multiplier, 1 / 3, 3)]  # q = 1 / ceil(24 / 8)
    eps = hand.get_epsilon(1e-5)
    logged = [r["epsilon"] for r in trainer.state.log_history if "epsilon" in r]
    assert len(logged) == 4  # every step's log line and the final one
    assert logged[-1] == pytest.approx(eps, rel=1e-9) and eps <= 4.0
    assert trainer.epsilon == pytest.approx(eps, rel=1e-9)
    assert logged[0] < logged[1] < logged[2]


def test_gradient_accumulation_is_folded_into_the_logical_batch(tmp_path):
    dp = DPArguments(noise_multiplier=1.0)
    trainer = _trainer(tmp_path, dp, per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert trainer.dp_batches.logical_batch_size == 6
    assert trainer.dp_batches.max_physical_batch_size == 3
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.args.max_grad_norm == 0
    with pytest.raises(UnsupportedConfigurationError, match="gradient_accumulation_steps=2"):
        _trainer(
            tmp_path,
            DPArguments(noise_multiplier=1.0, logical_batch_size=8),
            gradient_accumulation_steps=2,
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy"),
        ({"train_sampling_strategy": "sequential"}, "train_sampling_strategy"),
        ({"gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),  # batch-coupled noise scale
        ({"push_to_hub": True, "hub_strategy": "checkpoint"}, "hub_strategy"),  # dp/ secrets
        ({"push_to_hub": True, "hub_strategy": "all_checkpoints"}, "hub_strategy"),
    ],
)
def test_refused_arguments(tmp_path, overrides, match):
    with pytest.raises(UnsupportedConfigurationError, match=match):
        _trainer(tmp_path, DPArguments(target_epsilon=8.0), **overrides)


def test_a_flattening_collator_is_refused_before_a_backward(tmp_path):
    """A padding-free collator passed as ``data_collator`` packed each physical batch into one
    row, clipped as one example (the update 4.4e-4 off an oracle update of 9.4e-4)."""
    from transformers import DataCollatorWithFlattening

    trainer = DPTrainer(
        model=tiny_llama(0),
        args=training_arguments(tmp_path, max_steps=1),
        train_dataset=records(24),
        data_collator=DataCollatorWithFlattening(),
        dp_args=DPArguments(noise_multiplier=1.0, logical_batch_size=8),
    )
    with pytest.raises(UnsupportedConfigurationError, match="padding-free"):
        trainer.train()
    assert all(p.grad is None for p in trainer.model.parameters())


def test_refused_samplers_losses_and_data(tmp_path):
    class Reordering(DPTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    with pytest.raises(UnsupportedConfigurationError, match="_get_train_sampler is overridden"):
        Reordering(
            model=tiny_llama(0),
            args=training_arguments(tmp_path),
            train_dataset=records(8),
            data_collator=default_data_collator,
            dp_args=DPArguments(target_epsilon=8.0),
        )
    with pytest.raises(UnsupportedConfigurationError, match="compute_loss_func"):
        DPTrainer(
            model=tiny_llama(0),
            args=training_arguments(tmp_path),
            train_dataset=records(8),
            data_collator=default_data_collator,
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
            dp_args=DPArguments(target_epsilon=8.0),
        )

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(records(8))

    with pytest.raises(UnsupportedConfigurationError, match="iterable training set"):
        _trainer(tmp_path, DPArguments(target_epsilon=8.0), data=Stream())
    with pytest.raises(ValueError, match="exactly one of target_epsilon and noise_multiplier"):
        DPArguments(target_epsilon=8.0, noise_multiplier=1.0)


def _resume_run(out, resume=None, **dp):
    trainer = DPTrainer(
        model=tiny_llama(0),
        # AdamW on a linear schedule: optimizer and schedule state to restore
        args=training_arguments(
            out,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            optim="adamw_torch",
            learning_rate=1e-2,
            lr_scheduler_type="linear",
        ),
        train_dataset=records(24),
        data_collator=default_data_collator,
        dp_args=DPArguments(
            noise_multiplier=1.0,
            max_grad_norm=0.1,
            logical_batch_size=8,
            max_physical_batch_size=3,
            dp_seed=5,  # the resumed run must draw what the uninterrupted one drew
            **dp,
        ),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Noise on, resumed from the step-2 checkpoint of 4 steps (crossing an epoch): bit for bit."""
    straight = _resume_run(tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert (checkpoint / "dp" / "dp_state_rank0.pt").is_file()
    assert (checkpoint / "privacy.json").is_file() and (checkpoint / "model.safetensors").is_file()
    resumed = _resume_run(tmp_path / "b", resume=str(checkpoint))
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    assert resumed.dp_session.steps_counted == straight.dp_session.steps_counted == 4
    assert resumed.epsilon == straight.epsilon > 0

    def losses(trainer):
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    assert losses(resumed) == losses(straight)  # the saved history, then steps 3 and 4


def test_a_fresh_noise_resume_counts_the_steps_taken_after_the_checkpoint(tmp_path, caplog):
    """Resumed from step 2 of a run that went to 4: without fresh noise the log says steps 3-4
    are drawn again; with ``DPArguments(fresh_noise=True)`` the accountant counts them (the
    draw ledger in the first run's ``output_dir``) and the two steps taken again: 6 counted."""
    import logging

    straight = _resume_run(tmp_path / "a")
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    with caplog.at_level(logging.WARNING):
        _resume_run(tmp_path / "b", resume=checkpoint)
    assert "went 2 step(s) further" in caplog.text and "fresh_noise=True" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fresh = _resume_run(tmp_path / "c", resume=checkpoint, fresh_noise=True)
    assert "are drawn again" not in caplog.text
    assert fresh.state.global_step == 4
    assert fresh.dp_session.steps_counted == 6 and fresh.epsilon > straight.epsilon
    with pytest.raises(ValueError, match="with fresh_noise=True"):
        DPArguments(noise_multiplier=1.0, steps_after_checkpoint=2)


def test_the_draw_ledger_outlives_the_checkpoints_save_total_limit_deletes(tmp_path):
    """The run's draw ledger (how far it went, for a fresh-noise resume) lives in the Trainer's
    output folder: in the first checkpoint folder, it went with that folder and the next
    ledger write raised ``FileNotFoundError`` mid-training."""
    from opacus_fsdp_sync.sampling.ledger import read_ledger
    from opacus_fsdp_sync.sharding.dp_state import dp_state_path
    from opacus_fsdp_sync.sharding.resume_position import ledger_file

    trainer = _trainer(
        tmp_path,
        DPArguments(noise_multiplier=1.0, max_grad_norm=1.0, logical_batch_size=8),
        max_steps=3,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
    )
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    ledgers = list(tmp_path.glob("dp_draws_*.json"))
    assert len(ledgers) == 1
    assert read_ledger(str(ledgers[0])).steps == trainer.dp_session.steps_counted == 3
    # a resume finds it from the kept checkpoint
    dp = str(tmp_path / "checkpoint-3" / "dp")
    state = torch.load(dp_state_path(dp, 0), weights_only=False)
    assert ledger_file(state, dp) == str(ledgers[0])


def test_a_ledger_inside_a_checkpoint_folder_moves_to_the_output_dir_on_resume(tmp_path):
    """Earlier releases kept the draw ledger inside the first ``checkpoint-N`` folder; a run
    resumed from such a checkpoint carries on with it in its own ``output_dir``, its furthest
    position copied (so that rotation cannot take it, nor bring the folder back empty)."""
    from opacus_fsdp_sync.sampling.ledger import read_ledger

    _resume_run(tmp_path / "a")
    (ledger,) = (tmp_path / "a").glob("dp_draws_*.json")
    old = tmp_path / "a" / "checkpoint-2" / ledger.name
    ledger.rename(old)  # where an earlier release left it
    resumed = _resume_run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"))
    moved = tmp_path / "b" / ledger.name
    assert resumed.dp_session.engine.draw_ledger.path == str(moved)
    assert read_ledger(str(moved)).steps == 4 == read_ledger(str(old)).steps


def test_save_model_writes_a_from_pretrained_model_and_its_privacy_record(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, DPArguments(target_epsilon=8.0, logical_batch_size=8))
    trainer.train()
    trainer.save_model(str(tmp_path / "model"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    trained = trainer.model.state_dict()
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    record = json.loads((tmp_path / "model" / "privacy.json").read_text())
    assert record["epsilon"] == pytest.approx(trainer.epsilon) and record["epsilon"] <= 8.0
    assert record["steps"] == 2 and record["accountant"] == "prv"


def test_save_model_writes_a_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(tiny_llama(0), config)
    model_before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = DPArguments(noise_multiplier=1.0, max_grad_norm=0.1, logical_batch_size=8)
    trainer = _trainer(tmp_path, dp, model=model, learning_rate=1e-2)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(tiny_llama(0), tmp_path / "adapter").state_dict()
    trained = trainer.model.state_dict()
    lora = [k for k in trained if "lora_" in k]
    assert lora and all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert any(not torch.equal(trained[k], model_before[k]) for k in lora)  # trained


def test_a_one_process_trainer_inside_a_process_group_of_two_is_refused(tmp_path, monkeypatch):
    """torchrun on CPU without use_cpu=True: every rank would train its own model."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(UnsupportedConfigurationError, match="use_cpu=True"):
        _trainer(tmp_path, DPArguments(target_epsilon=8.0))


def test_an_empty_batch_labels_any_length_against_its_stand_in():
    """An empty physical batch's labels keep the length its collator gave them, while its
    forward ran on a stand-in example of another length: the loss takes them (no token, zero
    weight), and non-empty labels of another length are still refused."""
    from opacus_fsdp_sync.integrations.transformers.loss import per_example_loss

    seen = {}

    def criterion(logits, labels, shape=None):
        seen.update(logits=tuple(logits.shape), labels=tuple(labels.shape), shape=tuple(shape))
        return logits.sum()

    logits = torch.randn(1, 37, 11)  # the stand-in's forward
    per_example_loss(criterion, logits, torch.zeros(0, 24, dtype=torch.long), causal=True)
    assert seen == {"logits": (36, 11), "labels": (0,), "shape": (1, 36)}
    with pytest.raises(ValueError, match="one label per token"):
        per_example_loss(criterion, logits, torch.zeros(1, 24, dtype=torch.long), causal=True)
