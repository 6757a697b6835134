"""The profiling suite end to end on the tiny preset, 2 CPU ranks; and the 1B preset's size."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opacus_fsdp_sync.bench.provenance import code_version
from opacus_fsdp_sync.distributed.cpu_affinity import rank_cores, read_siblings
from opacus_fsdp_sync.models import LlamaSpec, build_llama, count_parameters
from opacus_fsdp_sync.profiling import PHASE_PARENT
from tests.suite_scripts import load_script

SUITE = Path(__file__).resolve().parents[1] / "memory_test/fsdp_llama3_profiling"


def test_llama32_1b_preset_has_released_parameter_count():
    with torch.device("meta"):
        model = build_llama(LlamaSpec(preset="llama3.2-1b"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(model) == 1_235_814_400
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2048, 8192, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 128256)
    assert cfg.rope_parameters["rope_type"] == "llama3" or cfg.rope_scaling["rope_type"] == "llama3"


def test_bad_spec_is_refused():
    with pytest.raises(ValueError, match="preset='nope'"):
        LlamaSpec(preset="nope")
    with pytest.raises(ValueError, match="task="):
        LlamaSpec(task="translate")


@pytest.mark.distributed
@pytest.mark.slow
def test_suite_end_to_end_on_tiny_preset(tmp_path):
    env = dict(
        os.environ,
        MODEL="tiny",
        NPROC="2",
        SEQ_LENGTHS="32",
        STEPS="2",
        WARMUP="1",
        BATCH_SIZE="2",
        OUT=str(tmp_path),
        MODES="no_dp ghost_fsdp ghost_fsdp_sync ghost_fsdp_parity ghost_fsdp_one_backward",
        CUDA_VISIBLE_DEVICES="",
        PYTHON=sys.executable,  # this interpreter (a venv's), not the first python3 on PATH
    )
    proc = subprocess.run(
        ["bash", str(SUITE / "run_all_experiments.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    assert "experiment 5/5: ghost_fsdp_one_backward_seq32" in proc.stdout
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    siblings = read_siblings(cores)  # whole physical cores per rank, where Linux tells them
    bound = rank_cores(cores, 0, 2, siblings) if len(cores) >= 2 else None
    results = {
        m: json.loads((tmp_path / f"{m}_seq32.json").read_text())
        for m in (
            "no_dp",
            "ghost_fsdp",
            "ghost_fsdp_sync",
            "ghost_fsdp_parity",
            "ghost_fsdp_one_backward",
        )
    }
    for mode, r in results.items():
        assert r["status"] == "ok"
        assert r["environment"]["clock"] == "perf_counter"
        assert r["environment"]["warmup_steps_dropped"] == 1
        assert set(r["step_ms"]) == {"median", "min", "max"}
        assert r["tokens_per_s"] > 0 and r["peak_memory"]["bytes"] > 0
        assert r["allocator_per_step"] == {}  # CUDA's caching-allocator churn; none on CPU
        # rank 0 ran on its own block of the cores (BIND_CPUS defaults to 1 on CPU)
        assert r["environment"]["cpu_cores_bound"] == bound
        assert r["environment"]["cpu_cores_bound_by_rank"] == (
            [bound, rank_cores(cores, 1, 2, siblings)] if bound else [None, None]
        )
        assert r["environment"]["code"] == code_version()  # this checkout, as run
        assert (tmp_path / "logs" / f"{mode}_seq32.log").exists()
        # Global batch per measured step: summed over both ranks (rank 0's local is part of it).
        sizes = r["measured_global_batch_sizes"]
        assert len(sizes) == len(r["measured_step_ms"]) == 2
        assert all(g >= b for g, b in zip(sizes, r["local_batch_sizes"][1:3]))
        if r["sampling"] == "fixed":
            assert sizes == [4, 4]  # BATCH_SIZE 2 x 2 ranks
        assert r["tokens_per_s"] == pytest.approx(
            sum(sizes) * 32 / sum(r["measured_step_ms"]) * 1e3
        )
    for mode in ("ghost_fsdp", "ghost_fsdp_sync", "ghost_fsdp_parity"):
        assert {
            "forward",
            "first_backward",
            "re-enable_sync",
            "second_backward",
            "optimizer_step",
        } <= set(results[mode]["phases_ms"])
    first = {
        m: results[m]["comm_per_step"]["first_backward"] for m in ("ghost_fsdp", "ghost_fsdp_sync")
    }
    assert first["ghost_fsdp"]["reduce_scatter"]["bytes"] > 0
    assert first["ghost_fsdp_sync"].get("reduce_scatter", {}).get("bytes", 0) == 0
    log = (tmp_path / "logs" / "ghost_fsdp_sync_seq32.log").read_text()
    assert "[Ghost] FSDP2 optimization enabled" in log and "[Ghost] first_backward:" in log
    for f in ("summary.md", "summary.csv", "phases.png", "communication.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert "| ghost_fsdp_sync | fsdp2 | no | 32 |" in (tmp_path / "summary.md").read_text()
    # parity: the non-private step's all-gathers and reduce-scatters
    for kind in ("all_gather", "reduce_scatter"):
        counts = [
            sum(p.get(kind, {}).get("count", 0) for p in results[m]["comm_per_step"].values())
            for m in ("no_dp", "ghost_fsdp_parity", "ghost_fsdp_one_backward")
        ]
        assert counts[0] == counts[1] == counts[2] > 0, (kind, counts)
    assert {"first_backward", "weight_grads", "reduce_scatter"} <= set(
        results["ghost_fsdp_one_backward"]["phases_ms"]
    )
    # The plot knows every phase the engine times, and each bar adds up to the measured step.
    for r in results.values():
        assert set(r["phases_ms"]) <= set(PHASE_PARENT), set(r["phases_ms"]) - set(PHASE_PARENT)
    plot = load_script("plot_results")
    bars = plot.bars(list(results.values()))
    assert len(bars) == 5 and plot.off_bars(bars) == [], [
        (b.label, b.total_ms, b.step_ms) for b in bars
    ]
    for b in bars:
        assert "norms" not in b.segments
        assert (b.mode == "no_dp") != ("norms" in b.nested), b


@pytest.mark.slow
def test_experiment_records_each_measured_steps_batch_and_time(tmp_path):
    """One rank: the recorded per-step data are the loop's measured steps, and the committed
    runs' reconstruction (``local_batch_sizes`` in loop order, the log's step lines) agrees."""
    from opacus_fsdp_sync.bench import throughput

    # torchrun's local ranks set: without --no-bind-cpus this rank would be bound to its cores
    env = dict(
        os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )  # fmt: skip
    cmd = [
        sys.executable, str(SUITE / "profile_experiment.py"), "--model", "tiny",
        "--mode", "ghost_fsdp_one_backward", "--seq-length", "16", "--batch-size", "4",
        "--steps", "4", "--warmup", "1", "--out", str(tmp_path), "--op-profile",
        "--no-bind-cpus",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    r = json.loads((tmp_path / "ghost_fsdp_one_backward_seq16.json").read_text())
    sizes, ms = r["measured_global_batch_sizes"], r["measured_step_ms"]
    assert r["sampling"] == "poisson" and len(r["local_batch_sizes"]) == 1 + 4 + 1
    assert sizes == r["local_batch_sizes"][1:5]  # world size 1: local is global
    assert len(ms) == 4 and statistics.median(ms) == r["step_ms"]["median"]
    assert r["tokens_per_s"] == pytest.approx(sum(sizes) * 16 / (sum(ms) / 1e3))
    assert r["ms_per_example"] == throughput.per_example_ms(ms, sizes)
    old = {k: v for k, v in r.items() if k not in ("measured_global_batch_sizes", "ms_per_example")}
    rebuilt = throughput.reconstruct(old, proc.stdout)
    assert rebuilt["global_batch_sizes"] == sizes
    assert rebuilt["step_ms"] == pytest.approx(ms, abs=0.05)
    cpu = r["measured_step_cpu_ms"]  # this rank's CPU time per measured step, by clock
    assert len(cpu["process"]) == len(cpu["main_thread"]) == 4
    assert all(0 < t <= p + 1.0 for t, p in zip(cpu["main_thread"], cpu["process"]))
    # the main thread's CPU time fits in the step's wall time: the span is the step's, not the
    # op profile's export after the last measured step (--op-profile above)
    assert all(t <= w + 1.0 for t, w in zip(cpu["main_thread"], ms))
    assert (tmp_path / "profiles" / "ghost_fsdp_one_backward_seq16.trace.json").is_file()
    assert r["cpu_ms"]["process"]["median"] == statistics.median(cpu["process"])
    assert "[Ghost] CPU time per measured step (rank 0)" in proc.stdout + proc.stderr
    assert r["environment"]["cpu_cores_bound"] is None  # --no-bind-cpus: left to the scheduler


@pytest.mark.slow
def test_no_dp_draws_the_private_rows_poisson_batches(tmp_path):
    """With Poisson sampling ``no_dp`` draws its batches by the private rows' sampler: with the
    same ``--dp-seed`` (the comparison's opt-in) both draw the same batch sizes, an empty draw
    included (run as one stand-in example whose loss is zero), so their costs per example are
    measured on the same draws. Without a seed the draws are not seed 7's."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    runs, logs = {}, {}
    for mode, seed in (("no_dp", "7"), ("ghost_fsdp_one_backward", "7"), ("no_dp", None)):
        name = f"{mode}_{seed}"
        cmd = [
            sys.executable, str(SUITE / "profile_experiment.py"), "--model", "tiny",
            "--mode", mode, "--seq-length", "16", "--batch-size", "2", "--steps", "6",
            "--warmup", "1", "--out", str(tmp_path), "--name", name,
        ]  # fmt: skip
        if seed is not None:
            cmd += ["--dp-seed", seed]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        assert proc.returncode == 0
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
        logs[name] = proc.stdout + proc.stderr
    plain, private, unseeded = (
        runs["no_dp_7"],
        runs["ghost_fsdp_one_backward_7"],
        runs["no_dp_None"],
    )
    assert plain["sampling"] == private["sampling"] == unseeded["sampling"] == "poisson"
    sizes = plain["local_batch_sizes"]
    assert sizes == private["local_batch_sizes"] and len(set(sizes)) > 1, sizes
    assert 0 in sizes  # this seed draws an empty batch: the stand-in ran, its loss zero
    empty = [loss for n, loss in zip(sizes, plain["losses"]) if n == 0]
    assert empty and all(loss == 0.0 for loss in empty), empty
    assert all(loss > 0 for n, loss in zip(sizes, plain["losses"]) if n > 0)
    assert unseeded["config"]["dp_seed"] is None and plain["config"]["dp_seed"] == 7
    # eight Poisson(2) draws agree with seed 7's by chance with probability under 1e-4
    assert unseeded["local_batch_sizes"] != sizes
    # the engine warns that a dp_seed makes the run's privacy rest on it; no_dp has no engine
    assert "privacy rests on" in logs["ghost_fsdp_one_backward_7"]
    assert "privacy rests on" not in logs["no_dp_7"]


@pytest.mark.distributed
def test_optimizer_breakdown_times_every_part():
    """The DP optimizer breakdown runs on 2 CPU ranks and reports each part of the step."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SUITE / "optimizer_breakdown.py"), "--model", "tiny", "--seq-length", "16",
        "--steps", "2", "--warmup", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    lines = {
        line.rsplit(maxsplit=1)[0].strip(): float(line.rsplit(maxsplit=1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("  ")
    }
    parts = ["accumulate", "noise pass", "add_noise", "inner step", "step (total)"]
    assert set(parts) <= set(lines), lines
    assert all(lines[p] > 0 for p in parts), lines
    assert lines["noise pass"] <= lines["add_noise"] <= lines["step (total)"], lines


def test_gram_blocks_benchmark_reports_fewer_flops_and_equal_norms(tmp_path):
    """The Gram-block benchmark times the engine's sampler and checks its norms per block."""
    from opacus_fsdp_sync.layers.linear_grams import flop_fraction

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, str(SUITE / "gram_blocks.py"), "--preset", "tiny",
        "--seq-lengths", "32", "64", "--blocks", "0", "16", "--repeats", "2",
        "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    rows = json.loads((tmp_path / "gram_blocks.json").read_text())["rows"]
    assert [(r["seq"], r["block"]) for r in rows] == [(32, 0), (32, 16), (64, 0), (64, 16)]
    for r in rows:
        assert r["ms"] > 0 and r["max_rel_diff"] <= 1e-5
        # Every Gram (7 output, 4 shared input) shrinks by the block triangle's share, and so
        # does their contraction (batched dots, one multiply-add per Gram entry computed).
        share = flop_fraction(r["seq"], r["block"])
        assert r["flop_ratio"] == pytest.approx(share, rel=1e-9), (r, share)
    assert "| 64 | 16 |" in (tmp_path / "gram_blocks.md").read_text()
    assert (tmp_path / "gram_blocks.png").stat().st_size > 0
