"""The profiling suite's physical batches: the split ``BatchMemoryManager`` makes, end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opacus_fsdp_sync.bench.physical_batches import add_phases, draw_loss, physical_slices
from opacus_fsdp_sync.sampling.memory import EqualCountSplittingSampler
from opacus_fsdp_sync.sampling.poisson import SharedPoissonSampler
from tests.suite_scripts import load_script

SUITE = Path(__file__).resolve().parents[1] / "memory_test/fsdp_llama3_profiling"


class _Signals:
    """Stands in for the DP optimizer: records each skip signal the splitting sampler sends."""

    def __init__(self) -> None:
        self.skips: list[bool] = []

    def signal_skip_step(self, do_skip: bool) -> None:
        self.skips.append(do_skip)


def _sampler(rank: int, world: int) -> SharedPoissonSampler:
    return SharedPoissonSampler(
        num_samples=120, sample_rate=0.1, steps=30, seed=5, rank=rank, world_size=world
    )


@pytest.mark.parametrize("world,cap", [(1, 4), (3, 2), (3, 5)])
def test_slices_are_the_batch_memory_managers_split_on_every_rank(world, cap):
    """Each rank's slices cut its share where the manager's splitting sampler cuts it, draw by
    draw (including shares smaller than the count, which get empty physical batches)."""
    counts = set()
    for rank in range(world):
        signals = _Signals()
        split = EqualCountSplittingSampler(
            sampler=_sampler(rank, world), max_batch_size=cap, optimizer=signals
        )
        chunks = list(split)
        ends = [i for i, skip in enumerate(signals.skips) if not skip]  # a draw's last batch
        draws = list(_sampler(rank, world).draws())
        assert len(ends) == len(draws)
        begin = 0
        for (local, drawn), end in zip(draws, ends):
            parts = physical_slices(len(local), drawn, world, cap)
            assert [local[s] for s in parts] == chunks[begin : end + 1]
            assert len(parts) == math.ceil(math.ceil(drawn / world) / cap) or (
                drawn == 0 and len(parts) == 1
            )
            counts.add((drawn, len(parts)))
            begin = end + 1
    assert any(n > 1 for _, n in counts)  # some draw is split


def test_without_a_cap_the_draw_runs_whole_and_an_empty_share_gets_empty_batches():
    assert physical_slices(7, 20, 3, None) == [slice(0, 7)]
    parts = physical_slices(0, 5, 4, 1)  # 4 ranks, 5 drawn: the largest share has 2
    assert parts == [slice(0, 0), slice(0, 0)]
    assert physical_slices(5, 9, 2, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_the_draws_loss_weights_private_physical_means_by_their_share():
    halves = [(torch.tensor(2.0), 0.5), (torch.tensor(4.0), 0.5)]
    assert draw_loss(halves, private=True) == pytest.approx(3.0)
    # no_dp's losses arrive scaled by their shares already
    assert draw_loss([(torch.tensor(1.0), 0.5), (torch.tensor(2.0), 0.5)], False) == 3.0
    assert draw_loss([(torch.tensor(7.0), 0.0), (torch.tensor(9.0), 0.0)], True) == 9.0
    phases = {"norms": 1.0}
    add_phases(phases, {"norms": 2.0, "weight_grads": 3.0})
    assert phases == {"norms": 3.0, "weight_grads": 3.0}


def test_a_cap_needs_poisson_sampling_and_a_positive_size():
    config = load_script("profile_experiment").ExperimentConfig
    with pytest.raises(ValueError, match="set --batch-size to the physical batch"):
        config(max_physical_batch_size=2, poisson_sampling=False)
    with pytest.raises(ValueError, match="must be at least 1"):
        config(max_physical_batch_size=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_suite_runs_private_and_plain_rows_on_the_same_physical_batches(tmp_path):
    """Two CPU ranks, Poisson draws of expected 5 a rank capped at 2: both rows draw the same
    batches (the comparison's ``--dp-seed`` opt-in) and split them alike; the engine takes one
    optimizer step per draw (every other physical step skipped); and the first draw's loss,
    before any update, is the whole draw's mean in both rows (each physical batch weighted by
    its share)."""
    env = dict(
        os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"
    )  # fmt: skip
    runs = {}
    for mode, cap in (("no_dp", "2"), ("ghost_fsdp_one_backward", "2"), ("whole", None)):
        name, mode = mode, "ghost_fsdp_one_backward" if mode == "whole" else mode
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(SUITE / "profile_experiment.py"),
            "--model", "tiny", "--mode", mode, "--seq-length", "16", "--batch-size", "5",
            "--steps", "3", "--warmup", "1", "--dp-seed", "11", "--out", str(tmp_path),
            "--name", name, "--no-bind-cpus",
        ]  # fmt: skip
        if cap is not None:
            cmd += ["--max-physical-batch-size", cap]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        assert proc.returncode == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert ("physical batches of at most 2 a rank" in proc.stdout) == (cap is not None)
        assert "requires_grad=True" not in proc.stderr  # losses read detached
    plain, private, whole = runs["no_dp"], runs["ghost_fsdp_one_backward"], runs["whole"]
    assert plain["local_batch_sizes"] == private["local_batch_sizes"]
    assert plain["physical_batches"] == private["physical_batches"]
    loops = 1 + 3 + 1  # warm-up, measured, counted
    assert len(private["physical_batches"]) == loops
    assert max(private["physical_batches"]) > 1
    assert private["optimizer_steps_taken"] == loops and plain["optimizer_steps_taken"] is None
    assert private["physical_batches"][0] > 1  # the first draw is split: its loss weighted
    assert private["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-5)
    # split or whole, the private run trains the same (clipped sums, one noised step per draw;
    # no noise differs: the same seed draws the same noise)
    assert whole["physical_batches"] == [1] * loops
    assert private["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    steps = private["measured_step_phases_ms"]  # each measured step's phases, in loop order
    assert [p["step"] for p in steps] == private["measured_step_ms"]
    assert all("first_backward" in p and "forward" in p for p in steps)
    sizes = private["measured_global_batch_sizes"]
    for global_size, n in zip(sizes, private["physical_batches"][1:4]):
        assert n == max(1, math.ceil(math.ceil(global_size / 2) / 2))
    # the bytes one backward kept: the largest physical batch's over the run (kept tensors
    # grow with the batch: per example, from the whole draws' largest), not the last one's
    per_example, rest = divmod(whole["one_backward_kept_bytes"], max(whole["local_batch_sizes"]))
    assert rest == 0 and per_example > 0
    largest = max(
        math.ceil(n_local / n)
        for n_local, n in zip(private["local_batch_sizes"], private["physical_batches"])
    )
    assert private["one_backward_kept_bytes"] == per_example * largest
