"""The DPTrainer-vs-trainer step-time bench runs and reports both sides (tiny, one repeat)."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from opacus_fsdp_sync.bench.hf_trainer import BenchConfig, compare  # noqa: E402


def test_bench_reports_both_sides_on_the_same_draws(tmp_path):
    cfg = BenchConfig(
        model="tiny", seq_length=16, num_examples=64, batch_size=8, physical_batch_size=4,
        steps=3, warmup=1, repeats=1, out=str(tmp_path),
    )  # fmt: skip
    result = compare(cfg)
    written = json.loads((tmp_path / "bench_hf.json").read_text())
    assert written["ratio_dp_trainer_to_trainer"] == result["ratio_dp_trainer_to_trainer"] > 0
    for side in ("trainer", "dp_trainer"):
        assert len(written[side]["run_medians_ms"]) == 1 and written[side]["min_ms"] > 0
    with pytest.raises(ValueError, match="must exceed warmup"):
        BenchConfig(steps=2, warmup=2)
