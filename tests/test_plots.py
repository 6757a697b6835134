"""The suite's phase plot tells the truth: every bar adds up to its measured step.

Results are synthesised for every mode of ``MODES`` at two sequence lengths, on FSDP2 and DDP,
with the phases each kind of step times (two passes, one backward with its hand-off, the
non-private backward), nested phases (``norms``, ``tied_norm``), the Poisson draw timed outside
the step, and untimed gaps; per-phase medians over noisy steps, as the harness reports them.
"""

import json
import random
import statistics

import matplotlib
import pytest

from opacus_fsdp_sync.bench import throughput
from opacus_fsdp_sync.bench.modes import DEFAULT_MODE, MODES
from opacus_fsdp_sync.profiling import PHASE_PARENT
from tests.suite_scripts import load_script

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plot = load_script("plot_results")

SEQS = (64, 128)


def _base_phases(mode: str, api: str, rng: random.Random) -> dict[str, float]:
    """Typical timings (ms) of one experiment's step, ``step`` excluded."""
    spec = MODES[mode]
    t = {"forward": rng.uniform(60, 70)}
    if not spec.private:
        t["backward"] = rng.uniform(100, 120)
    else:
        t["first_backward"] = rng.uniform(80, 150)
        t["norms"] = 0.3 * t["first_backward"]
        t["tied_norm"] = 0.05 * t["first_backward"]
        t["re-enable_sync"] = rng.uniform(0.0, 0.2)  # as measured: under 0.2 ms
        if spec.engine_kwargs.get("one_backward", False):
            t["weight_grads"] = rng.uniform(5, 50)
            t["all_reduce" if api == "ddp" else "reduce_scatter"] = rng.uniform(20, 40)
        else:
            t["second_backward"] = rng.uniform(100, 150)
        t["sampling"] = rng.uniform(0.5, 3)
    t["optimizer_step"] = rng.uniform(2, 30)
    return t


def _step(base: dict[str, float], rng: random.Random) -> dict[str, float]:
    """One measured step: a shared slowdown, per-phase noise, untimed gaps between phases."""
    slow = rng.uniform(1.0, 1.15)  # a step slowed by a neighbour on shared cores
    t = {p: ms * slow * rng.uniform(0.93, 1.07) for p, ms in base.items()}
    top = sum(ms for p, ms in t.items() if PHASE_PARENT[p] == "step")
    t["step"] = top * rng.uniform(1.0, 1.04)
    return t


def _result(mode: str, api: str, seq: int, rng: random.Random) -> dict:
    base = _base_phases(mode, api, rng)
    steps = [_step(base, rng) for _ in range(5)]
    summary = {
        p: {
            "median": statistics.median(s[p] for s in steps),
            "min": min(s[p] for s in steps),
            "max": max(s[p] for s in steps),
        }
        for p in steps[0]
    }
    return {
        "config": {"mode": mode, "seq_length": seq, "fsdp_api": api, "name": f"{mode}_{api}"},
        "status": "ok",
        "step_ms": summary.pop("step"),
        "phases_ms": summary,
        "comm_per_step": {
            "forward": {"all_gather": {"count": 5, "bytes": 2**24}},
            "all_reduce" if api == "ddp" else "first_backward": {
                "all_reduce" if api == "ddp" else "reduce_scatter": {"count": 5, "bytes": 2**24}
            },
        },
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    rng = random.Random(0)
    out = [_result(m, "fsdp2", s, rng) for s in SEQS for m in MODES]
    out += [_result(m, "ddp", s, rng) for s in SEQS for m in ("no_dp", "ghost_fsdp_one_backward")]
    out.append({"config": {"mode": "ghost_fsdp", "seq_length": 64}, "status": "failed"})
    return out


def test_every_bar_adds_up_to_its_measured_step(results):
    bars = plot.bars(results)
    assert len(bars) == 2 * (len(MODES) + 2)  # the failed experiment has no bar
    for b in bars:
        assert abs(b.total_ms - b.step_ms) <= 0.05 * b.step_ms, (b.label, b.total_ms, b.step_ms)
        assert b.segments[plot.OTHER] >= 0
    assert plot.off_bars(bars) == []


def test_every_top_level_phase_is_stacked_and_only_those(results):
    for r, b in zip(sorted(results[:-1], key=plot._sort_key), plot.bars(results)):
        top = {p for p in r["phases_ms"] if PHASE_PARENT[p] == "step"}
        assert set(b.segments) == top | {plot.OTHER}, b.label
        assert set(b.outside) == ({"sampling"} & set(r["phases_ms"]))
    one_backward = [b for b in plot.bars(results) if b.mode == "ghost_fsdp_one_backward"]
    for hand_off in ("reduce_scatter", "all_reduce"):  # FSDP2, DDP
        assert any({"weight_grads", hand_off} <= set(b.segments) for b in one_backward)


def test_nested_phases_are_drawn_inside_their_parent(results):
    for b in plot.bars(results):
        if b.mode == "no_dp":
            assert not b.nested
            continue
        assert "norms" not in b.segments and "tied_norm" not in b.segments
        fb_start = sum(ms for p, ms in b.segments.items() if p in ("forward",))
        start, ms, depth, parent = b.nested["norms"]
        assert (start, depth, parent) == (pytest.approx(fb_start), 1, "first_backward")
        assert start + ms <= fb_start + b.segments["first_backward"]
        t_start, t_ms, t_depth, t_parent = b.nested["tied_norm"]
        assert (t_depth, t_parent) == (2, "norms") and start <= t_start <= start + ms - t_ms


def test_unknown_phase_is_stacked_with_a_warning(results, capsys):
    r = json.loads(json.dumps(results[0]))
    r["phases_ms"]["new_phase"] = {"median": 7.0, "min": 7.0, "max": 7.0}
    bar = plot.stack(r)
    assert bar.segments["new_phase"] == 7.0
    assert "'new_phase' is not in PHASE_PARENT" in capsys.readouterr().err


def test_a_nested_phase_without_its_parent_goes_to_the_nearest_ancestor(results):
    r = json.loads(json.dumps(next(x for x in results if x["config"]["mode"] == "ghost_fsdp")))
    del r["phases_ms"]["norms"]  # runs from before the norms timer existed
    assert plot.stack(r).nested["tied_norm"][2:] == (1, "first_backward")


def _overlaps(boxes) -> list:
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)]


def test_labels_stay_readable_with_every_mode(results, tmp_path):
    fig = plot.plot_phases(plot.bars(results), tmp_path / "phases.png")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [t for t in ax.get_yticklabels() if t.get_text()]
        assert len(labels) == len(MODES) + 2
        assert not _overlaps([t.get_window_extent(renderer) for t in labels])
        notes = [t.get_window_extent(renderer) for t in ax.texts]
        assert not _overlaps(notes)
        frame = ax.get_window_extent(renderer)
        assert all(frame.x0 <= n.x0 and n.x1 <= frame.x1 for n in notes)  # inside the panel
        assert max(len(t.get_text()) for t in labels) <= 32
    plt.close(fig)


def test_main_writes_both_plots(results, tmp_path):
    for i, r in enumerate(results):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    assert plot.main([str(tmp_path)]) == 0
    for name in ("phases.png", "communication.png"):
        assert (tmp_path / name).stat().st_size > 0


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_legend_lists_only_phases_visible_in_some_bar(results, tmp_path):
    fig = plot.plot_phases(plot.bars(results), tmp_path / "phases.png")
    names = {label.split(" (")[0] for label in _legend_labels(fig)}
    assert "re-enable_sync" not in names  # under 0.2 ms against bars of several hundred ms
    assert {"forward", "first_backward", "weight_grads", "norms", "measured step"} <= names
    notes = [t.get_text() for t in fig.texts]
    assert len(notes) == 1 and notes[0].endswith(": re-enable_sync")
    plt.close(fig)
    # Visible in one bar only: listed, and no footnote left.
    wide = json.loads(json.dumps(results))
    wide[3]["phases_ms"]["re-enable_sync"] = {"median": 40.0, "min": 40.0, "max": 40.0}
    wide[3]["step_ms"] = {k: v + 40.0 for k, v in wide[3]["step_ms"].items()}
    fig = plot.plot_phases(plot.bars(wide), tmp_path / "phases.png")
    assert "re-enable_sync" in _legend_labels(fig) and not fig.texts
    plt.close(fig)


def _marked(ax) -> list[tuple[str, str]]:
    return [(t.get_text(), t.get_fontweight()) for t in ax.get_yticklabels() if t.get_text()]


def test_default_mode_is_marked_in_both_plots(results, tmp_path):
    assert DEFAULT_MODE == "ghost_fsdp_one_backward" and DEFAULT_MODE in MODES
    for fig in (
        plot.plot_phases(plot.bars(results), tmp_path / "phases.png"),
        plot.plot_communication(results, tmp_path / "communication.png"),
    ):
        for ax in fig.axes:
            marked = [text for text, weight in _marked(ax) if weight == "bold"]
            assert marked and all("one_backward " in t and "(default)" in t for t in marked)
            assert all("(default)" not in t for t, weight in _marked(ax) if weight != "bold")
        plt.close(fig)
    phases = [b.label for b in plot.bars(results) if b.seq == 64 and "(default)" in b.label]
    assert phases == ["one_backward fsdp2 (default)", "one_backward ddp (default)"]


def _panel(ax) -> tuple:
    widths = tuple(round(p.get_width(), 6) for p in ax.patches)
    return tuple(t.get_text() for t in ax.get_yticklabels()), widths


def test_communication_has_one_panel_per_occurring_kind(results, tmp_path):
    fig = plot.plot_communication(results, tmp_path / "communication.png")
    kinds = [ax.get_title().split(":")[0] for ax in fig.axes]
    assert kinds == ["all_gather", "reduce_scatter", "all_reduce"]
    panels = [_panel(ax) for ax in fig.axes]
    assert len(set(panels)) == len(panels)  # never two identical panels
    ticks = [t for t in panels[2][0] if t]
    assert ticks and all(" ddp" in t for t in ticks)  # only DDP all-reduces here
    assert all(t.endswith("seq 64, 128") for t in ticks)  # same bytes at both lengths: one bar
    plt.close(fig)
    fsdp2 = [r for r in results if r["config"].get("fsdp_api") == "fsdp2"]
    fig = plot.plot_communication(fsdp2, tmp_path / "communication.png")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["all_gather", "reduce_scatter"]
    plt.close(fig)


RESULTS = plot.Path(plot.__file__).parent / "results"


@pytest.mark.parametrize(
    "run_dir",
    sorted(p.parent for p in RESULTS.rglob("phases.png")),
    ids=lambda p: str(p.relative_to(RESULTS)),
)
def test_committed_runs_add_up(run_dir):
    """The committed runs' bars end at their measured step too, and name no unknown phase."""
    results = plot.load(run_dir)
    for r in results:
        assert set(r.get("phases_ms", {})) <= set(PHASE_PARENT), run_dir
    assert plot.off_bars(plot.bars(results)) == []


def test_a_run_with_every_steps_phases_draws_its_median_step():
    """Steps of different kinds (a draw whole, a draw in two physical batches): the per-phase
    medians come from different steps and overshoot the median step; the median step's own
    phases add up to it (the mean of the two middle steps for an even count)."""
    steps = [
        {"forward": 30.0, "first_backward": 10.0, "norms": 2.0, "sampling": 0.5, "step": 40.0},
        {"forward": 10.0, "first_backward": 30.0, "norms": 6.0, "sampling": 0.5, "step": 41.0},
        {"forward": 25.0, "first_backward": 25.0, "norms": 5.0, "sampling": 0.5, "step": 50.0},
    ]
    result = {
        "config": {"mode": DEFAULT_MODE, "seq_length": 64},
        "status": "ok",
        "step_ms": {"median": 41.0},
        "phases_ms": {
            p: {"median": statistics.median(s[p] for s in steps)}
            for p in ("forward", "first_backward", "norms", "sampling")
        },
    }
    assert len(plot.off_bars([plot.stack(result)])) == 1  # 25 + 25 ms stacked against 41
    result["measured_step_phases_ms"] = steps
    assert plot.median_step_phases(result) == {
        "forward": 10.0, "first_backward": 30.0, "norms": 6.0, "sampling": 0.5
    }  # fmt: skip
    assert plot.off_bars([plot.stack(result)]) == []
    even = dict(result, measured_step_phases_ms=steps + [dict(steps[0], step=39.0)])
    assert plot.median_step_phases(even)["forward"] == 20.0  # the 40 and 41 ms steps


def _recorded(result: dict, step_ms: list[float], sizes: list[int]) -> dict:
    """``result`` with per-step data of a run that records them (the summary table's fields)."""
    r = json.loads(json.dumps(result))
    r["step_ms"] = {"median": statistics.median(step_ms), "min": min(step_ms), "max": max(step_ms)}
    r["sampling"] = "fixed" if len(set(sizes)) == 1 else "poisson"
    r["measured_global_batch_sizes"] = sizes
    r["ms_per_example"] = throughput.per_example_ms(step_ms, sizes)
    r["tokens_per_s"] = throughput.tokens_per_s(step_ms, sizes, r["config"]["seq_length"])
    return r


def test_bar_note_compares_poisson_rows_per_example_like_the_table(results):
    no_dp_r, private = (
        next(r for r in results if r["config"]["mode"] == m) for m in ("no_dp", "ghost_fsdp")
    )
    floor = _recorded(no_dp_r, [100.0, 99.0, 101.0], [8, 8, 8])
    drawn = [4, 5, 14]
    poisson = _recorded(private, [20.0 + 20.0 * b for b in drawn], drawn)
    bar = plot.stack(poisson, floor)
    per_example = statistics.median(20.0 / b + 20.0 for b in drawn) / 12.5
    assert bar.vs_no_dp == pytest.approx(per_example) and bar.vs_no_dp != pytest.approx(1.2)
    assert plot._bar_note(bar).startswith(f" 120.0 ms, {per_example:.2f}x no_dp per example")
    fixed = _recorded(private, [150.0, 149.0, 152.0], [8, 8, 8])
    bar = plot.stack(fixed, floor)  # a fixed batch: the step ratio, no "per example"
    assert bar.vs_no_dp == pytest.approx(1.5, rel=1e-12)
    assert plot._bar_note(bar).startswith(" 150.0 ms, 1.50x no_dp [")
    old = json.loads(json.dumps(private))  # no per-step data: the median step ratio, as before
    bar = plot.stack(old, floor)
    assert bar.vs_no_dp == old["step_ms"]["median"] / 100.0 and not bar.per_example
