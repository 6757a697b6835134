"""PNG plots of a run: where each step's time goes, and what it communicates.

One horizontal bar per experiment (short mode name and API on the left, one panel per sequence
length), so that ten modes stay readable:

- ``phases.png``: the top-level phases of the median step, stacked in step order (runs that
  record each step's phases: the middle step by time, the mean of the two middle ones for an
  even count, :func:`median_step_phases`; older runs: the median of every phase), then
  ``other``, the measured step minus those phases (the untimed gaps; clipped at zero, since
  per-phase medians need not add up). A bar ends at the measured step (the black tick)
  within a few per cent. Phases timed inside another (``norms`` inside ``first_backward``)
  are drawn hatched inside their parent, not on top of it; phases timed outside the step
  (``sampling``) are not stacked and are written after the bar. Which phase is which comes
  from :data:`opacus_fsdp_sync.profiling.PHASE_PARENT`; a phase missing there is stacked (with
  a warning), never dropped. The legend lists the phases visible in at least one bar; those
  narrower than :data:`LEGEND_MIN` of the widest bar everywhere are named in a footnote.
- ``communication.png``: one panel per collective kind that occurs (all-gather, reduce-scatter,
  all-reduce, ...): MiB per step of each experiment, stacked by the phase that issued them;
  sequence lengths with the same bytes share one bar.

The default mode (:data:`opacus_fsdp_sync.bench.modes.DEFAULT_MODE`) is labelled in bold with a
``(default)`` suffix. Each bar's note gives its ratio to ``no_dp`` as the summary table does
(:func:`opacus_fsdp_sync.bench.throughput.ratio`): the cost per example where both results have
one (``per example`` in the note where the row's batch was drawn by Poisson sampling, since the
ratio then differs from the steps drawn), else the median step ratio.

Usage: ``python plot_results.py RUN_DIR``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from opacus_fsdp_sync.bench import throughput
from opacus_fsdp_sync.bench.modes import DEFAULT_MODE, MODES
from opacus_fsdp_sync.profiling import PHASE_PARENT

#: The remainder segment: the measured step minus its timed top-level phases.
OTHER = "other"
#: Largest gap between a stacked bar and the measured step that the plot accepts silently.
TOLERANCE = 0.05
#: Collective kinds in the order their thin bars are drawn.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
#: A phase narrower than this fraction of the widest bar in every bar is left out of the legend
#: (its colour could not be found in any bar) and named in the footnote instead.
LEGEND_MIN = 0.005
#: Suffix of the default mode's axis label.
DEFAULT_SUFFIX = " (default)"


@dataclass
class Bar:
    """One experiment's bar.

    Attributes:
        label: Short mode name, API (and tied/untied variant) for the axis.
        mode: The mode (a row of ``MODES``).
        seq: Sequence length (the panel).
        step_ms: Median measured step.
        segments: Top-level phases in stacking order, then :data:`OTHER`; their sum is the bar.
        nested: Phases timed inside another: ``name -> (start_ms, width_ms, depth, parent)``,
            drawn over their parent's segment.
        outside: Phases timed outside the step (not stacked), median ms.
        vs_no_dp: Ratio to ``no_dp`` of the same length and variant, if that ran
            (:func:`opacus_fsdp_sync.bench.throughput.ratio`).
        per_example: Whether ``vs_no_dp`` compares costs per example of a Poisson-sampled row
            (which then differs from the step ratio), for the note.
    """

    label: str
    mode: str
    seq: int
    step_ms: float
    segments: dict[str, float] = field(default_factory=dict)
    nested: dict[str, tuple[float, float, int, str]] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)
    vs_no_dp: float | None = None
    per_example: bool = False

    @property
    def total_ms(self) -> float:
        """Length of the stacked bar."""
        return sum(self.segments.values())


def short_name(mode: str) -> str:
    """``ghost_fsdp_one_backward`` -> ``one_backward``; ``ghost_fsdp`` and ``no_dp`` stay."""
    return mode.removeprefix("ghost_fsdp_")


def _variant(result: dict) -> tuple[str, str]:
    """API and tied/untied variant of an experiment ("" for the preset's tying)."""
    cfg = result["config"]
    tie = cfg.get("tie_word_embeddings")
    return cfg.get("fsdp_api", "fsdp2"), {True: "tied", False: "untied"}.get(tie, "")


def label(result: dict) -> str:
    """Axis label: mode, API, forced tied/untied variant; the default mode gets its suffix."""
    api, tie = _variant(result)
    mode = result["config"]["mode"]
    text = " ".join(p for p in (short_name(mode), api, tie) if p)
    return text + (DEFAULT_SUFFIX if mode == DEFAULT_MODE else "")


def _mark_default(ax, modes: list[str]) -> None:
    """Bold tick labels for the rows of the default mode (``modes``: one per row, in order)."""
    for tick, mode in zip(ax.get_yticklabels(), modes):
        if mode == DEFAULT_MODE:
            tick.set_fontweight("bold")


def _placement(name: str, present: dict[str, float]) -> str | None:
    """Where phase ``name`` goes: ``"step"`` (stacked), a present parent's name, or None.

    A nested phase whose parent did not run is placed in the nearest ancestor that did, or
    stacked. A phase missing from ``PHASE_PARENT`` is stacked, with a warning.
    """
    if name not in PHASE_PARENT:
        print(
            f"plot_results: phase {name!r} is not in PHASE_PARENT "
            "(opacus_fsdp_sync/profiling/phases.py): stacked as a top-level phase",
            file=sys.stderr,
        )
        return "step"
    parent = PHASE_PARENT[name]
    while parent not in (None, "step") and parent not in present:
        parent = PHASE_PARENT.get(parent, "step")
    return parent


def _order(names) -> list[str]:
    """Phase names in ``PHASE_PARENT`` order, unknown ones last (alphabetically)."""
    rank = {p: i for i, p in enumerate(PHASE_PARENT)}
    return sorted(names, key=lambda p: (rank.get(p, len(rank)), p))


def stack(result: dict, no_dp: dict | None = None) -> Bar:
    """The bar of one successful experiment.

    Args:
        result: One experiment's JSON result (``status == "ok"``).
        no_dp: ``no_dp``'s result at the same length and variant, if that ran.

    Returns:
        The stacked top-level phases and ``other``, the nested phases placed inside their parent,
        the phases timed outside the step.
    """
    present = median_step_phases(result)
    step = result["step_ms"]["median"]
    cfg = result["config"]
    bar = Bar(label=label(result), mode=cfg["mode"], seq=cfg["seq_length"], step_ms=step)
    where = {p: _placement(p, present) for p in _order(present)}
    for p, parent in where.items():
        if parent == "step":
            bar.segments[p] = present[p]
        elif parent is None:
            bar.outside[p] = present[p]
    bar.segments[OTHER] = max(step - sum(bar.segments.values()), 0.0)
    _place_nested(bar, present, where)
    if no_dp is not None:
        bar.vs_no_dp, basis = throughput.ratio(result, no_dp)
        bar.per_example = basis == throughput.PER_EXAMPLE and result.get("sampling") == "poisson"
    return bar


def median_step_phases(result: dict) -> dict[str, float]:
    """The phases a bar stacks: those of the median step where the run records every step's.

    A run that records each measured step's phases (``measured_step_phases_ms``) gives the
    phases of its middle step by step time (the mean of the two middle steps for an even
    count), which add up to the median step. Per-phase medians need not: where steps differ in
    kind (a Poisson draw run whole or in two physical batches) the median of each phase comes
    from a different step. Older runs give their per-phase medians.
    """
    steps = result.get("measured_step_phases_ms")
    if not steps:
        return {p: s["median"] for p, s in result["phases_ms"].items()}
    order = sorted(range(len(steps)), key=lambda i: steps[i]["step"])
    mid = order[(len(order) - 1) // 2 : len(order) // 2 + 1]
    names = {p for i in mid for p in steps[i] if p != "step"}
    return {p: sum(steps[i].get(p, 0.0) for i in mid) / len(mid) for p in names}


def _place_nested(bar: Bar, present: dict[str, float], where: dict[str, str | None]) -> None:
    """Puts each nested phase at the start of its parent, after earlier siblings."""
    start, depth, used = {}, {}, {}
    x = 0.0
    for p, ms in bar.segments.items():
        start[p], depth[p], used[p] = x, 0, 0.0
        x += ms
    for p, parent in where.items():  # PHASE_PARENT order: parents before their children
        if parent in (None, "step"):
            continue
        s = start[parent] + used[parent]
        used[parent] += present[p]
        start[p], depth[p], used[p] = s, depth[parent] + 1, 0.0
        bar.nested[p] = (s, present[p], depth[p], parent)


def _sort_key(result: dict) -> tuple:
    """Sequence length, API (FSDP2, FSDP1, DDP), tied variant, then the mode table's order."""
    modes = {m: i for i, m in enumerate(MODES)}
    apis = {a: i for i, a in enumerate(("fsdp2", "fsdp1", "ddp"))}
    mode = result["config"]["mode"]
    api, tie = _variant(result)
    return (
        result["config"]["seq_length"],
        apis.get(api, len(apis)),
        api,
        tie,
        modes.get(mode, len(modes)),
        mode,
    )


def bars(results: list[dict]) -> list[Bar]:
    """One bar per successful experiment, by sequence length, variant, then mode table order."""
    ok = sorted((r for r in results if r.get("status") == "ok"), key=_sort_key)
    floor = {
        (r["config"]["seq_length"], _variant(r)): r for r in ok if r["config"]["mode"] == "no_dp"
    }
    return [stack(r, floor.get((r["config"]["seq_length"], _variant(r)))) for r in ok]


def off_bars(all_bars: list[Bar], tolerance: float = TOLERANCE) -> list[Bar]:
    """The bars whose stack differs from their measured step by more than ``tolerance``."""
    return [b for b in all_bars if abs(b.total_ms - b.step_ms) > tolerance * b.step_ms]


def load(run_dir: Path) -> list[dict]:
    """Every experiment JSON of a run, with reconstructed per-step data where possible.

    The same results as the summary table's (:func:`opacus_fsdp_sync.bench.throughput.load_run`).
    """
    return throughput.load_run(run_dir)


def colors(names) -> dict[str, object]:
    """A fixed colour per phase name, whatever the run: ``PHASE_PARENT`` order, grey ``other``.

    Top-level phases take the saturated colours of ``tab10`` (its grey left for ``other``),
    nested and unknown phases the light ones of ``tab20``.
    """
    import matplotlib

    strong = [matplotlib.colormaps["tab10"](i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    light = [matplotlib.colormaps["tab20"](i) for i in (9, 19, 17, 13, 11, 3, 1, 5, 7)]
    top = [p for p, parent in PHASE_PARENT.items() if parent == "step"]
    rest = [p for p in PHASE_PARENT if p not in top] + [
        p for p in _order(names) if p not in PHASE_PARENT and p != OTHER
    ]
    out = {p: strong[i % len(strong)] for i, p in enumerate(top)}
    out[OTHER] = "0.8"
    out.update({p: light[i % len(light)] for i, p in enumerate(rest)})
    return out


def _panels(n_rows: list[int], width: float):
    """A figure with one panel per sequence length, heights by their number of bars."""
    import matplotlib.pyplot as plt

    height = sum(0.34 * n + 0.9 for n in n_rows) + 0.8
    return plt.subplots(
        len(n_rows),
        1,
        figsize=(width, height),
        squeeze=False,
        gridspec_kw={"height_ratios": [n + 1.5 for n in n_rows]},
    )


def _by_seq(items, seq_of) -> dict[int, list]:
    out: dict[int, list] = {}
    for it in items:
        out.setdefault(seq_of(it), []).append(it)
    return out


def _bar_note(bar: Bar) -> str:
    """The measured step, its ratio to ``no_dp``, and the phases timed outside it, in brackets."""
    note = f" {bar.step_ms:.1f} ms"
    if bar.vs_no_dp is not None and bar.mode != "no_dp":
        note += f", {bar.vs_no_dp:.2f}x no_dp" + (" per example" if bar.per_example else "")
    outside = ", ".join(f"{p} {ms:.1f}" for p, ms in bar.outside.items())
    return note + (f" [{outside}]" if outside else "")


def _draw_phase_panel(ax, panel: list[Bar], color: dict) -> None:
    for y, bar in enumerate(panel):
        left = 0.0
        for p, ms in bar.segments.items():
            ax.barh(y, ms, left=left, height=0.8, color=color[p], label=p)
            left += ms
        for p, (start, ms, depth, parent) in bar.nested.items():
            ax.barh(
                y,
                ms,
                left=start,
                height=0.8 * 0.5**depth,
                color=color[p],
                hatch="///",
                edgecolor="0.2",
                linewidth=0.5,
                label=f"{p} (inside {parent})",
            )
        ax.plot([bar.step_ms] * 2, [y - 0.45, y + 0.45], color="k", linewidth=1.5)
        ax.text(max(bar.total_ms, bar.step_ms), y, _bar_note(bar), va="center", fontsize=7)
    ax.set_yticks(range(len(panel)), [b.label for b in panel], fontsize=8)
    _mark_default(ax, [b.mode for b in panel])
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(b.total_ms, b.step_ms) for b in panel) * 1.5)


def tiny_phases(all_bars: list[Bar], fraction: float = LEGEND_MIN) -> list[str]:
    """The phases drawn narrower than ``fraction`` of the widest bar in every bar.

    Returns:
        Their names in ``PHASE_PARENT`` order (``other`` last), for the footnote.
    """
    widest = max(max(b.total_ms, b.step_ms) for b in all_bars)
    width: dict[str, float] = {}
    for b in all_bars:
        drawn = {**b.segments, **{p: ms for p, (_, ms, _, _) in b.nested.items()}}
        for p, ms in drawn.items():
            width[p] = max(width.get(p, 0.0), ms)
    return _order(p for p, w in width.items() if w < fraction * widest)


def _legend(fig, axes, columns: int = 5, hidden=(), note: str = "") -> None:
    """One legend for all panels, under them, and a footnote under it; lays the figure out.

    Args:
        fig: The figure.
        axes: Its panels, whose labelled artists make the legend.
        columns: Legend columns.
        hidden: Phase names left out of the legend.
        note: A line under the legend (which phases were left out), or empty.
    """
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if name.split(" (")[0] not in hidden:
                seen.setdefault(name, handle)
    rank = {p: i for i, p in enumerate(colors(()))}
    seen = dict(sorted(seen.items(), key=lambda kv: rank.get(kv[0].split(" (")[0], len(rank))))
    height = fig.get_figheight()
    below = 0.25 / height if note else 0.0  # room for the footnote, in figure coordinates
    if note:
        fig.text(0.5, 0.06 / height, note, ha="center", va="bottom", fontsize=7, style="italic")
    if seen:
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="lower center",
            bbox_to_anchor=(0.5, below),
            ncol=columns,
            fontsize=7,
        )
    rows = -(-len(seen) // columns)
    fig.tight_layout(rect=(0, below + (0.2 + 0.17 * rows) / height, 1, 1))


def plot_phases(all_bars: list[Bar], path: Path):
    """Writes the stacked phase bars (one panel per sequence length) to ``path``.

    Returns:
        The matplotlib figure (for the caller to inspect or close).
    """
    panels = _by_seq(all_bars, lambda b: b.seq)
    names = {p for b in all_bars for p in [*b.segments, *b.nested]}
    color = colors(names)
    fig, axes = _panels([len(v) for v in panels.values()], width=11)
    for ax, (seq, panel) in zip(axes[:, 0], panels.items()):
        _draw_phase_panel(ax, panel, color)
        ax.set_title(
            f"seq {seq}: median ms per phase; tick: measured step (median); "
            "[ms timed outside the step, not stacked]",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel("ms per step")
    axes[0, 0].plot([], [], color="k", marker="|", linestyle="", label="measured step")
    tiny = tiny_phases(all_bars)
    note = (
        f"Not in the legend (narrower than {LEGEND_MIN:.1%} of the widest bar in every bar): "
        + ", ".join(tiny)
        if tiny
        else ""
    )
    _legend(fig, axes[:, 0], hidden=tiny, note=note)
    fig.savefig(path, dpi=120)
    return fig


def _comm_mib(result: dict, kind: str) -> dict[str, float]:
    """MiB per step of one collective kind, by the phase that issued it."""
    return {
        p: kinds[kind]["bytes"] / 2**20
        for p, kinds in result.get("comm_per_step", {}).items()
        if kinds.get(kind, {}).get("bytes")
    }


def _comm_kinds(results: list[dict]) -> list[str]:
    seen = {k for r in results for kinds in r.get("comm_per_step", {}).values() for k in kinds}
    return [k for k in COLLECTIVES if k in seen] + sorted(seen - set(COLLECTIVES))


def comm_rows(results: list[dict], kind: str) -> list[tuple[str, str, dict[str, float], float]]:
    """The bars of one collective kind's panel: experiments that issued it, in plot order.

    Sequence lengths of the same experiment with the same bytes and calls share one bar.

    Returns:
        ``(label, mode, MiB by issuing phase, calls per step)`` per bar.
    """
    shared: dict[tuple, list[int]] = {}
    for r in sorted(results, key=lambda r: (_sort_key(r)[1:], _sort_key(r)[0])):
        mib = _comm_mib(r, kind)
        if mib:
            calls = sum(k.get(kind, {}).get("count", 0) for k in r["comm_per_step"].values())
            key = (label(r), r["config"]["mode"], tuple(mib.items()), calls)
            shared.setdefault(key, []).append(r["config"]["seq_length"])
    return [
        (f"{text}, seq {', '.join(map(str, seqs))}", mode, dict(mib), calls)
        for (text, mode, mib, calls), seqs in shared.items()
    ]


def _draw_comm_panel(ax, rows: list[tuple], color: dict) -> None:
    for y, (_, _, mib, calls) in enumerate(rows):
        left = 0.0
        for p, width in mib.items():
            ax.barh(y, width, left=left, height=0.8, color=color[p], label=p)
            left += width
        ax.text(left, y, f" {left:.3g} MiB, {calls:g} calls", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [row[0] for row in rows], fontsize=8)
    _mark_default(ax, [row[1] for row in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(sum(row[2].values()) for row in rows) * 1.3)


def plot_communication(results: list[dict], path: Path):
    """Writes MiB per step, one panel per collective kind that occurs, to ``path``.

    Returns:
        The matplotlib figure (for the caller to inspect or close).
    """
    ok = [r for r in results if r.get("status") == "ok"]
    panels = {k: rows for k in _comm_kinds(ok) if (rows := comm_rows(ok, k))}
    names = {p for r in ok for p in r.get("comm_per_step", {})}
    color = colors(names)
    fig, axes = _panels([len(v) for v in panels.values()] or [1], width=10)
    for ax, (kind, rows) in zip(axes[:, 0], panels.items()):
        _draw_comm_panel(ax, rows, color)
        ax.set_title(f"{kind}: MiB per step, coloured by issuing phase", fontsize=9)
    if not panels:
        axes[0, 0].text(0.5, 0.5, "no collectives counted", ha="center")
    axes[-1, 0].set_xlabel("MiB per step (counted in an untimed step)")
    _legend(fig, axes[:, 0])
    fig.savefig(path, dpi=120)
    return fig


def main(argv: list[str] | None = None) -> int:
    """Reads a run's JSON results and writes ``phases.png`` and ``communication.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path((argv or sys.argv[1:])[0])
    results = load(run_dir)
    all_bars = bars(results)
    if not all_bars:
        print(f"no successful results in {run_dir}", file=sys.stderr)
        return 1
    for b in off_bars(all_bars):
        print(
            f"plot_results: seq {b.seq} {b.label}: stacked {b.total_ms:.1f} ms against a "
            f"measured step of {b.step_ms:.1f} ms (more than {TOLERANCE:.0%} apart)",
            file=sys.stderr,
        )
    plt.close(plot_phases(all_bars, run_dir / "phases.png"))
    plt.close(plot_communication(results, run_dir / "communication.png"))
    print(f"plots: {run_dir / 'phases.png'}, {run_dir / 'communication.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
