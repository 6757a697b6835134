"""The profiling suite's text outputs: the ``[Ghost]`` result line and the summary tables.

The summary is checked on the committed run ``results/cpu-2cores-small-poisson/`` (real JSON of
three modes at two sequence lengths); the result line on :func:`result_path`'s file, no spawn.
The ratios' basis (cost per example, or the median step for results without per-step batch
sizes) on synthetic results and on the committed H200 Poisson run, redrawn from its JSON.
"""

import csv
import re
import statistics
from pathlib import Path

import pytest

from opacus_fsdp_sync.bench import throughput
from tests.suite_scripts import SUITE, load_script

experiment = load_script("profile_experiment")
summarize = load_script("summarize")

POISSON = SUITE / "results" / "cpu-2cores-small-poisson"


def test_result_line_names_the_file_that_was_written(tmp_path):
    cfg = experiment.parse_args(
        ["--mode", "ghost_fsdp", "--seq-length", "64", "--out", str(tmp_path)]
    )
    path = experiment.result_path(cfg)
    assert path == tmp_path / "ghost_fsdp_seq64.json"
    path.write_text("{}")  # what main() does before logging the line
    line = experiment.result_line({"step_ms": {"median": 12.34}, "tokens_per_s": 567.8}, path)
    # The shell launcher copies the line into its own output by this pattern.
    assert re.match(
        r"^\[Ghost\] ghost_fsdp_seq64: step 12\.3 ms \(median\), 568 tokens/s -> ", line
    )
    assert Path(line.rsplit(" -> ", 1)[1]).is_file()


def test_markdown_table_is_short_and_csv_keeps_every_column(tmp_path):
    for p in POISSON.glob("*.json"):
        (tmp_path / p.name).write_text(p.read_text())
    assert summarize.main([str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| mode |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert len(columns) <= 10 and columns == summarize.MD_COLUMNS
    rows = [line for line in md.splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 6 and all(line.count("|") == len(columns) + 1 for line in rows)
    assert "| ghost_fsdp_one_backward | fsdp2 | no | 64 | 314.8 | 1.627 | 0.685 | 1627 |" in md
    assert "| ghost_fsdp | fsdp2 | no | 128 | 671.1 | 1.920 | 1.000 | 1526 | 15 AG / 10 RS |" in md
    # The CSV is the committed one, byte for byte: all 31 columns, the same cells.
    with open(tmp_path / "summary.csv", newline="") as f:
        assert len(next(csv.reader(f))) == len(summarize.COLUMNS) == 31
    assert (tmp_path / "summary.csv").read_text() == (POISSON / "summary.csv").read_text()


# -- Cost per example: Poisson rows are compared per example, not by their drawn steps. --------

H200_POISSON = SUITE / "results" / "gpu-h200-campaign" / "poisson" / "suite"


def _result(mode: str, step_ms: list[float], sizes: list[int], *, recorded: bool = True) -> dict:
    """A successful result of ``mode`` at seq 64, world size 1; ``recorded``: the new fields."""
    seq = 64
    r = {
        "config": {"mode": mode, "seq_length": seq, "fsdp_api": "fsdp2", "name": f"{mode}_seq64"},
        "status": "ok",
        "model": {"tied_embeddings": False},
        "environment": {"world_size": 1},
        "step_ms": {"median": statistics.median(step_ms), "min": min(step_ms), "max": max(step_ms)},
        "phases_ms": {},
        "peak_memory": {"bytes": 0},
        "sampling": "fixed" if len(set(sizes)) == 1 else "poisson",
        "tokens_per_s": 8 * seq / (statistics.median(step_ms) / 1e3),  # the old, nominal one
    }
    if recorded:
        r.update(
            tokens_per_s=throughput.tokens_per_s(step_ms, sizes, seq),
            ms_per_example=throughput.per_example_ms(step_ms, sizes),
            measured_step_ms=step_ms,
            measured_global_batch_sizes=sizes,
        )
    return r


#: A fixed batch of 8: 100 ms a step, 12.5 ms an example.
NO_DP = ([100.0, 101.0, 99.0, 100.0, 102.0, 98.0], [8] * 6)
#: Poisson draws, 20 ms + 20 ms per example: small batches make the median step short.
DRAWN = [4, 5, 14, 4, 12, 5]
DRAWN_STEPS = ([20.0 + 20.0 * b for b in DRAWN], DRAWN)


def _row(table: list[dict], mode: str) -> dict:
    return next(r for r in table if r["mode"] == mode)


def test_poisson_rows_are_compared_per_example_not_by_median_step():
    table = summarize.rows([_result("no_dp", *NO_DP), _result("ghost_fsdp", *DRAWN_STEPS)])
    row = _row(table, "ghost_fsdp")
    per_example = statistics.median((20.0 + 20.0 * b) / b for b in DRAWN) / 12.5
    step_ratio = statistics.median(DRAWN_STEPS[0]) / statistics.median(NO_DP[0])
    assert f"{per_example:.3f}" != f"{step_ratio:.3f}"  # the case the fix is for: 1.92 vs 1.20
    assert row["vs_no_dp"] == f"{per_example:.3f}" and row["ratio_basis"] == "per_example"
    assert _row(table, "no_dp")["vs_ghost_fsdp"] == f"{1 / per_example:.3f}"
    # Tokens actually processed over the time taken, not the nominal batch over the median step.
    assert row["tokens_per_s"] == f"{sum(DRAWN) * 64 / (sum(DRAWN_STEPS[0]) / 1e3):.0f}"
    assert row["ms_per_example"] == f"{per_example * 12.5:.2f}"
    md = summarize.markdown(table, [])
    assert "Ratios: cost per example in every row." in md


def test_fixed_batch_rows_keep_the_median_step_ratio_exactly():
    # An even number of steps: the median averages two steps, per example and per step alike.
    other = ([130.0, 128.5, 131.25, 127.0, 140.0, 129.0], [8] * 6)
    old = summarize.rows(
        [_result(m, *s, recorded=False) for m, s in (("no_dp", NO_DP), ("ghost_fsdp", other))]
    )
    new = summarize.rows([_result("no_dp", *NO_DP), _result("ghost_fsdp", *other)])
    ratio, basis = throughput.ratio(_result("ghost_fsdp", *other), _result("no_dp", *NO_DP))
    assert basis == throughput.PER_EXAMPLE
    assert ratio == pytest.approx(
        statistics.median(other[0]) / statistics.median(NO_DP[0]), rel=1e-12
    )
    for mode in ("no_dp", "ghost_fsdp"):
        for col in ("vs_no_dp", "vs_ghost_fsdp", "step_ms_median"):
            assert _row(new, mode)[col] == _row(old, mode)[col], (mode, col)
        assert (_row(old, mode)["ratio_basis"], _row(new, mode)["ratio_basis"]) == (
            "median_step",
            "per_example",
        )


def test_old_results_keep_the_median_step_ratio_and_say_so():
    old = [
        _result("no_dp", *NO_DP, recorded=False),
        _result("ghost_fsdp", *DRAWN_STEPS, recorded=False),
    ]
    table = summarize.rows(old)
    step_ratio = statistics.median(DRAWN_STEPS[0]) / statistics.median(NO_DP[0])
    assert _row(table, "ghost_fsdp")["vs_no_dp"] == f"{step_ratio:.3f}"
    assert {r["ratio_basis"] for r in table} == {"median_step"}
    assert {r["ms_per_example"] for r in table} == {""}
    assert _row(table, "ghost_fsdp")["tokens_per_s"] == f"{old[1]['tokens_per_s']:.0f}"
    assert "Ratios: median step times in every row" in summarize.markdown(table, [])
    # One side without per-step batch sizes: that comparison falls back to median steps.
    mixed = [old[0], _result("ghost_fsdp", *DRAWN_STEPS)]
    table = summarize.rows(mixed)
    row = _row(table, "ghost_fsdp")
    assert row["vs_no_dp"] == f"{step_ratio:.3f}"
    assert row["ratio_basis"] == "vs_no_dp: median_step; vs_ghost_fsdp: per_example"
    md = summarize.markdown(table, [])
    assert "Ratios: cost per example, except median step times (`ratio_basis` in the CSV) in " in md
    assert "`ghost_fsdp` (seq 64, fsdp2)" in md and "every row" not in md


def test_per_example_cost_skips_empty_draws_and_checks_lengths():
    assert throughput.per_example_ms([10.0, 40.0, 30.0], [0, 4, 2]) == {
        "median": 12.5,
        "min": 10.0,
        "max": 15.0,
    }
    assert throughput.per_example_ms([10.0], [0]) is None
    with pytest.raises(ValueError, match="2 step times for 3 batch sizes"):
        throughput.per_example_ms([1.0, 2.0], [1, 2, 3])


def _log(result: dict, measured_ms: list[float]) -> str:
    cfg = result["config"]
    total = cfg["warmup"] + cfg["steps"] + cfg["count_steps"]
    ms = [500.0] * cfg["warmup"] + measured_ms + [300.0] * cfg["count_steps"]
    tags = ["warm-up"] * cfg["warmup"] + ["measured"] * cfg["steps"] + ["counted"]
    return "\n".join(
        f"  step {i + 1}/{total} ({tag}): {m:.1f} ms" for i, (tag, m) in enumerate(zip(tags, ms))
    )


def test_reconstruction_pairs_the_log_with_local_batch_sizes_at_world_size_1_only():
    r = _result("ghost_fsdp", *DRAWN_STEPS, recorded=False)
    r["config"].update(warmup=2, steps=len(DRAWN), count_steps=1)
    r["local_batch_sizes"] = [9, 3, *DRAWN, 7]
    log = _log(r, DRAWN_STEPS[0])
    assert throughput.reconstruct(r, log) == {
        "step_ms": DRAWN_STEPS[0],
        "global_batch_sizes": DRAWN,
    }
    assert throughput.reconstruct(dict(r, environment={"world_size": 2}), log) is None
    assert throughput.reconstruct(r, log.replace("(counted)", "(measured)")) is None
    assert (
        throughput.reconstruct(r, _log(r, [m + 1.0 for m in DRAWN_STEPS[0]])) is None
    )  # not its log
    assert throughput.reconstruct(dict(r, local_batch_sizes=DRAWN), log) is None
    assert throughput.reconstruct(r, None) is None


def test_committed_h200_poisson_run_is_redrawn_per_example(tmp_path):
    """The H200 Poisson suite's committed tables are the fixed scripts' output from its JSON."""
    for p in [*H200_POISSON.glob("*.json"), *H200_POISSON.glob("logs/*.log")]:
        (tmp_path / p.relative_to(H200_POISSON)).parent.mkdir(exist_ok=True)
        (tmp_path / p.relative_to(H200_POISSON)).write_text(p.read_text())
    assert summarize.main([str(tmp_path)]) == 0
    for name in ("summary.md", "summary.csv"):
        assert (tmp_path / name).read_text() == (H200_POISSON / name).read_text(), name
    table = {r["mode"]: r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    assert {m: r["ratio_basis"] for m, r in table.items()} == dict.fromkeys(table, "per_example")
    # The same code at a fixed batch: 348.8 vs 348.5 ms; the Poisson medians were 440.9 / 317.2.
    assert table["ghost_fsdp_one_backward"]["step_ms_median"] == "440.9"
    assert table["ghost_fsdp_one_backward"]["vs_no_dp"] == "1.393"
    assert table["ghost_fsdp_one_backward_untuned"]["vs_no_dp"] == "1.496"
    assert table["ghost_fsdp"]["vs_no_dp"] == "2.182"
    assert "Reconstructed (results written before" in (tmp_path / "summary.md").read_text()


def test_allocator_counts_read_the_cuda_counters(monkeypatch):
    """The suite's allocator churn per step comes from these counters (none on CPU)."""
    import torch

    from opacus_fsdp_sync.profiling import allocator_counts

    assert allocator_counts(torch.device("cpu")) == {}
    stats = {"num_alloc_retries": 2, "num_device_alloc": 40, "num_device_free": 33, "other": 9}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert allocator_counts(torch.device("cuda", 0)) == {
        "num_alloc_retries": 2,
        "num_device_alloc": 40,
        "num_device_free": 33,
    }


def test_allocator_watch_warns_once_then_logs_at_debug(monkeypatch, caplog):
    """The engine's per-step check (CUDA only) of the caching allocator's retries."""
    import logging

    import torch

    from opacus_fsdp_sync.profiling import AllocatorWatch

    counts = iter(
        [
            {"num_alloc_retries": 1, "num_device_alloc": 10, "num_device_free": 0},
            {"num_alloc_retries": 1, "num_device_alloc": 10, "num_device_free": 0},
            {"num_alloc_retries": 3, "num_device_alloc": 12, "num_device_free": 32},
            {"num_alloc_retries": 4, "num_device_alloc": 13, "num_device_free": 40},
        ]
    )
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: next(counts))
    watch = AllocatorWatch(torch.device("cuda", 0))
    with caplog.at_level(logging.DEBUG, logger="opacus_fsdp_sync"):
        assert [watch.check() for _ in range(4)] == [0, 0, 2, 1]  # the first reading: a baseline
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "allocator" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.WARNING, logging.DEBUG]
    assert "retried 2 allocation(s)" in lines[0][1] and "32 cudaFree, 2 cudaMalloc" in lines[0][1]
    assert watch.retries == 3
    assert AllocatorWatch(torch.device("cpu")).check() == 0  # no counters off CUDA
