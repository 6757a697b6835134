"""``examples/hf_sft.py`` runs as shipped (fewer steps), with Poisson sampling as shipped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is the [trl] extra")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_sft.py"


def test_hf_sft_example_learns_within_the_target_epsilon(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--max-steps", "12"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 12
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert 7.0 < summary["epsilon"] <= 8.0  # calibrated for the 12 steps taken
    record = json.loads((tmp_path / "privacy.json").read_text())
    assert record["epsilon"] == summary["epsilon"] and record["steps"] == 12
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert "activation checkpointing off" in proc.stderr + proc.stdout
