"""The one-command GPU campaign: what it runs (dry run) and a tiny CPU smoke run of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "memory_test/fsdp_llama3_profiling/gpu_campaign.sh"
TINY_LEDGER = "--preset tiny --blocks 1 --batch-size 2 --seq-length 32"  # a few seconds on CPU


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
    assert len(cmds) == 9
    suite, poisson, gram, ledger, profile, phases, rows_bench, noise_bench, hf_fsdp = cmds
    for rows in (suite, poisson):
        assert "BATCH_SIZE=8" in rows and "MODEL=llama3.2-1b" in rows
        assert "SEQ_LENGTHS=1024 2048 4096" in rows
        assert (
            "MODES=no_dp ghost_fsdp ghost_fsdp_one_backward ghost_fsdp_one_backward_untuned "
            "ghost_fsdp_one_backward_fused_kernels" in rows
        )
    assert "POISSON=0" in suite and "POISSON=1" in poisson  # fixed batch, then Poisson sampling
    # every Poisson row, no_dp included, draws the same batches; the fixed rows take no seed
    assert "--dp-seed 2026" in poisson and "--dp-seed" not in suite
    assert "gram_blocks.py" in gram and "--seq-lengths 512 1024 2048 4096" in gram
    assert "opacus_fsdp_sync.bench.ledger" in ledger and "--seq-length 1024" in ledger
    assert "--accelerator-norms" in ledger
    assert "EXTRA_ARGS=--op-profile" in profile
    assert "MODES=no_dp ghost_fsdp_one_backward " in profile
    assert "POISSON=0" in profile  # one fixed batch: a draw over it would not fit the card
    assert "bench.trace_phases" in phases and "no_dp_seq1024.trace.json" in phases
    assert "SEQ_LENGTHS=1024 " in profile
    assert "row_kernels_bench.py > " in rows_bench and rows_bench.endswith("rows_bench.txt")
    assert "noise_kernel_bench.py > " in noise_bench and noise_bench.endswith("noise_bench.txt")
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


def _smoke_modes() -> list[str]:
    """The campaign's rows; the fused-kernel row only where triton imports (it opts in, and
    ``fused_kernels=True`` is refused without triton)."""
    from opacus_fsdp_sync.layers.kernels import triton_available

    modes = ["no_dp", "ghost_fsdp", "ghost_fsdp_one_backward", "ghost_fsdp_one_backward_untuned"]
    return modes + ["ghost_fsdp_one_backward_fused_kernels"] * triton_available()


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
        MODES=" ".join(_smoke_modes()),
        GRAM_ARGS="--preset tiny --seq-lengths 64 --blocks 0 32 --repeats 1",
        LEDGER_ARGS=TINY_LEDGER,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    out = tmp_path / "campaign"
    for mode in _smoke_modes():
        assert json.loads((out / "suite" / f"{mode}_seq32.json").read_text())["status"] == "ok"
    assert (out / "gram_blocks" / "gram_blocks.md").exists()
    assert list((out / "ledger").glob("*.md"))
    assert "## Op ledger" in (out / "campaign.md").read_text()
    assert list((out / "op_profile" / "profiles").glob("*.ops.txt"))
    assert len(list((out / "op_profile" / "profiles").glob("*.trace.json.gz"))) == 2
    phases = (out / "op_profile" / "phases.md").read_text()
    assert "| forward |" in phases and "| first_backward |" in phases
    assert "## Op profile by phase" in (out / "campaign.md").read_text()
    summary = (out / "campaign.md").read_text()
    assert "# GPU campaign: cpu-" in summary and "## Suite" in summary and "- gram:" in summary


def _fake_nvidia_smi(tmp_path, name="NVIDIA H100 80GB HBM3", mib=81559):
    """A PATH holding an ``nvidia-smi`` that answers the campaign's two queries."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        "#!/usr/bin/env bash\n"
        f'case "$*" in *memory.total*) echo {mib} ;; *name*) echo "{name}" ;; esac\n'
    )
    tool.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_poisson_rows_run_physical_batches_of_8_on_an_80gb_card(tmp_path):
    """An 80 GB card keeps the expected batch of 8 and runs each draw in physical batches of
    at most 8 (BatchMemoryManager's split, every row alike), rather than a smaller batch."""
    proc = _run(tmp_path, DRY_RUN="1", PATH=_fake_nvidia_smi(tmp_path))
    assert proc.returncode == 0, proc.stderr
    suite, poisson = [line for line in proc.stdout.splitlines() if line.startswith("+ ")][:2]
    assert "BATCH_SIZE=8 " in suite and "POISSON=0" in suite
    assert "--max-physical-batch-size" not in suite
    assert "BATCH_SIZE=8 " in poisson and "POISSON=1" in poisson
    assert "--dp-seed 2026 --max-physical-batch-size 8" in poisson
    assert "physical batches of at most 8: a 81559 MiB card" in proc.stdout
    assert "NVIDIA H100 80GB HBM3" in proc.stdout  # the hardware is named from the same tool


def test_poisson_draws_run_whole_on_a_large_card_or_as_given(tmp_path):
    big = _run(tmp_path, DRY_RUN="1", PATH=_fake_nvidia_smi(tmp_path, "NVIDIA H200", 143771))
    given = _run(tmp_path, DRY_RUN="1", POISSON_BATCH_SIZE="3", POISSON_MAX_PHYSICAL="2")
    for proc, batch, cap in ((big, 8, None), (given, 3, 2)):
        assert proc.returncode == 0, proc.stderr
        poisson = [line for line in proc.stdout.splitlines() if line.startswith("+ ")][1]
        assert f"BATCH_SIZE={batch} " in poisson and "POISSON=1" in poisson
        if cap is None:
            assert "--max-physical-batch-size" not in poisson
        else:
            assert f"--max-physical-batch-size {cap}" in poisson


@pytest.mark.slow
def test_a_failed_part_is_reported_and_the_next_part_runs(tmp_path):
    proc = _run(
        tmp_path,
        PARTS="gram ledger",
        GRAM_ARGS="--no-such-option",
        LEDGER_ARGS=TINY_LEDGER,
    )
    assert proc.returncode == 1
    assert "part gram FAILED" in proc.stdout and "failed parts: gram" in proc.stderr
    out = tmp_path / "campaign"
    assert list((out / "ledger").glob("*.md"))  # the part after the failure ran
    summary = (out / "campaign.md").read_text()
    assert "- gram: " in summary and "(FAILED: see its logs)" in summary
    assert "(FAILED" not in summary.split("- ledger: ")[1].splitlines()[0]
