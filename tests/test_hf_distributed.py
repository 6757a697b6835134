"""``DPTrainer`` on 2 gloo ranks: DDP (accelerate's) and FSDP2 (sharded by the user).

Poisson sampling is on (the shared draw over both ranks). ``dp_seed`` is the explicit opt-in
that lets the one-process reference, and the resumed run, replay the same draws and noise.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import AutoModelForCausalLM, default_data_collator  # noqa: E402

from opacus_fsdp_sync.integrations.transformers import DPArguments, DPTrainer  # noqa: E402
from opacus_fsdp_sync.sharding.dp_state import CheckpointMismatchError  # noqa: E402
from opacus_fsdp_sync.testing import run_ranks  # noqa: E402

from . import workers_hf  # noqa: E402
from .hf_common import records, reference_sgd, tiny_llama, training_arguments  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(("layout", "logical"), [("ddp", 8), ("fsdp2", 2)])
def test_two_ranks_equal_the_clip_each_sample_loop(tmp_path, layout, logical):
    """Noise 0, physical batches of 2 per rank: the oracle over the global draws, 1e-6.

    DDP's checkpoint, resumed on one process, is refused (another noise layout).
    """
    steps = 16 // logical
    result, other = run_ranks(
        workers_hf.trainer_exactness, 2, str(tmp_path), layout, steps, logical, timeout=300
    )
    assert result["api"] == layout
    assert result["steps"] == result["counted"] == steps
    assert result["eval_loss"] == other["eval_loss"] > 0
    if logical == 2:  # some draw leaves a rank without an example (a zero-weighted stand-in)
        assert min(len(d) for d in result["draws"]) < 2, result["draws"]
    ref = tiny_llama(0)
    clipped = reference_sgd(
        ref, records(24), result["draws"], expected=result["expected"], C=0.05, lr=0.5
    )
    assert clipped > 0 and result["expected"] == logical
    before = tiny_llama(0).state_dict()
    err = max((result["state"][k] - v).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((result["state"][k] - v).abs().max().item() for k, v in before.items())
    assert err < 1e-6 < moved * 1e-2, (err, moved)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in result["state"].items())
    assert json.loads((tmp_path / "model" / "privacy.json").read_text())["steps"] == steps

    if layout == "ddp":  # its checkpoint on one process: another layout, refused
        trainer = DPTrainer(
            model=tiny_llama(0),
            args=training_arguments(tmp_path / "one", max_steps=4),
            train_dataset=records(24),
            data_collator=default_data_collator,
            dp_args=DPArguments(
                noise_multiplier=0.0, max_grad_norm=0.05, logical_batch_size=8, dp_seed=3
            ),
        )
        with pytest.raises(CheckpointMismatchError, match="another layout"):
            trainer.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{steps}"))


def test_lora_on_user_built_fsdp2_with_dp_sft_trainer_saves_an_adapter(tmp_path):
    """The docs' Llama recipe in small (tiny preset, 2 ranks): trains, reports, saves."""
    pytest.importorskip("trl", reason="TRL is the [trl] extra")
    peft = pytest.importorskip("peft")
    result = run_ranks(workers_hf.lora_fsdp2_sft, 2, str(tmp_path), timeout=300)[0]
    assert result["api"] == "fsdp2" and 7.0 < result["epsilon"] <= 8.0
    record = json.loads((tmp_path / "adapter" / "privacy.json").read_text())
    assert record["epsilon"] == result["epsilon"] and record["steps"] == 3
    loaded = peft.PeftModel.from_pretrained(tiny_llama(0), tmp_path / "adapter").state_dict()
    lora_b = [v for k, v in loaded.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # trained (LoRA B starts at 0)
