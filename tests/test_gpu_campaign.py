"""The one-command GPU campaign: what it runs (dry run) and a tiny CPU smoke run of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "memory_test/fsdp_llama3_profiling/gpu_campaign.sh"


def _run(tmp_path, **env):
    full = dict(
        os.environ,
        OUT=str(tmp_path / "campaign"),
        CUDA_VISIBLE_DEVICES="",
        PYTHON=sys.executable,  # this interpreter (a venv's), not the first python3 on PATH
        **env,
    )
    return subprocess.run(
        ["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=900
    )


def test_dry_run_lists_every_part_at_batch_8_and_three_lengths(tmp_path):
    proc = _run(tmp_path, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    cmds = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(cmds) == 6
    suite, poisson, gram, ledger, profile, hf_fsdp = cmds
    for rows in (suite, poisson):
        assert "BATCH_SIZE=8" in rows and "MODEL=llama3.2-1b" in rows
        assert "SEQ_LENGTHS=1024 2048 4096" in rows
        assert (
            "MODES=no_dp ghost_fsdp ghost_fsdp_one_backward ghost_fsdp_one_backward_untuned "
            "ghost_fsdp_one_backward_torch_kernels" in rows
        )
    assert "POISSON=0" in suite and "POISSON=1" in poisson  # fixed batch, then Poisson sampling
    assert "gram_blocks.py" in gram and "--seq-lengths 512 1024 2048 4096" in gram
    assert "opacus_fsdp_sync.bench.ledger" in ledger and "--seq-length 1024" in ledger
    assert "--accelerator-norms" in ledger
    assert "EXTRA_ARGS=--op-profile" in profile and "MODES=ghost_fsdp_one_backward " in profile
    assert "SEQ_LENGTHS=1024 " in profile
    assert "examples/hf_sft.py --fsdp" in hf_fsdp  # accelerate's FSDP2 plugin, GPUs only
    assert not (tmp_path / "campaign").exists()  # nothing run


def test_default_output_folder_names_the_hardware(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=dict(env, DRY_RUN="1", CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0
    assert "-campaign/suite" in proc.stdout and "results/cpu-" in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_cpu_smoke_run_writes_every_part(tmp_path):
    proc = _run(
        tmp_path,
        MODEL="tiny",
        BATCH_SIZE="2",
        SEQ_LENGTHS="32",
        STEPS="1",
        WARMUP="1",
        NPROC="1",
        PROFILE_STEPS="1",
        PARTS="suite gram ledger profile",
        GRAM_ARGS="--preset tiny --seq-lengths 64 --blocks 0 32 --repeats 1",
        LEDGER_ARGS="--preset tiny --blocks 1 --batch-size 2 --seq-length 32",
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    out = tmp_path / "campaign"
    for mode in (
        "no_dp",
        "ghost_fsdp",
        "ghost_fsdp_one_backward",
        "ghost_fsdp_one_backward_untuned",
        "ghost_fsdp_one_backward_torch_kernels",
    ):
        assert json.loads((out / "suite" / f"{mode}_seq32.json").read_text())["status"] == "ok"
    assert (out / "gram_blocks" / "gram_blocks.md").exists()
    assert list((out / "ledger").glob("*.md"))
    assert "## Op ledger" in (out / "campaign.md").read_text()
    assert list((out / "op_profile" / "profiles").glob("*.ops.txt"))
    summary = (out / "campaign.md").read_text()
    assert "# GPU campaign: cpu-" in summary and "## Suite" in summary and "- gram:" in summary
