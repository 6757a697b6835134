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


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_two_ranks_equal_the_clip_each_sample_loop(tmp_path, layout):
    """Noise 0, physical batches of 2 per rank: the oracle over the global draws, 1e-6.

    DDP's checkpoint, resumed on one process, is refused (another noise layout).
    """
    result = run_ranks(workers_hf.trainer_exactness, 2, str(tmp_path), layout, 2, timeout=300)[0]
    assert result["api"] == layout
    assert result["steps"] == result["counted"] == 2
    ref = tiny_llama(0)
    clipped = reference_sgd(
        ref, records(24), result["draws"], expected=result["expected"], C=0.05, lr=0.5
    )
    assert clipped > 0 and result["expected"] == 8
    before = tiny_llama(0).state_dict()
    err = max((result["state"][k] - v).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((result["state"][k] - v).abs().max().item() for k, v in before.items())
    assert err < 1e-6 < moved * 1e-2, (err, moved)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in result["state"].items())
    assert json.loads((tmp_path / "model" / "privacy.json").read_text())["steps"] == 2

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
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
