"""Summary table of a run: Markdown and CSV from the experiments' JSON results.

Each mode is compared with ``ghost_fsdp`` (upstream) and ``no_dp`` (the non-private floor) at the
same sequence length and variant by its cost per example
(:mod:`opacus_fsdp_sync.bench.throughput`): the median over the measured steps of the step's ms
over its global batch. With Poisson sampling the batch varies from step to step, so the median
step would rank the drawn batch sizes; with a fixed batch on both sides the ratio is the median
step ratio. Results that record no per-step batch sizes, and cannot be reconstructed from the
run's log (world size 1 only), are compared by median step, as before; the Markdown table's
footnote says which basis each ratio used.

Usage: ``python summarize.py RUN_DIR`` (writes ``summary.md`` and ``summary.csv`` there and prints
the Markdown table). The Markdown table keeps a few columns (:data:`MD_COLUMNS`); the CSV has
every one (:data:`COLUMNS`).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from opacus_fsdp_sync.bench import throughput
from opacus_fsdp_sync.bench.modes import MODES

COLUMNS = [
    "mode",
    "api",
    "tied",
    "seq",
    "step_ms_median",
    "step_ms_min",
    "step_ms_max",
    "vs_ghost_fsdp",
    "vs_no_dp",
    "tokens_per_s",
    "ms_per_example",
    "ratio_basis",
    "first_backward_ms",
    "norms_ms",
    "second_backward_ms",
    "tied_norm_ms",
    "norm_tuning_ms",
    "rs_MiB_first_backward",
    "rs_MiB_per_step",
    "ag_MiB_per_step",
    "rs_per_step",
    "ag_per_step",
    "ar_per_step",
    "ar_MiB_per_step",
    "kept_MiB",
    "autograd_saved_MiB",
    "optimizer_ms",
    "sampling",
    "sampling_ms",
    "peak_mem_MiB",
    "status",
]
#: The Markdown table's columns: what a reader compares at a glance. ``summary.csv`` keeps every
#: column of :data:`COLUMNS` (min/max, phases, bytes, memory).
MD_COLUMNS = [
    "mode",
    "api",
    "tied",
    "seq",
    "step_ms_median",
    "vs_no_dp",
    "vs_ghost_fsdp",
    "tokens_per_s",
    "collectives_per_step",
    "status",
]


def collectives(row: dict) -> str:
    """Collectives per step of a row, e.g. ``10 AG / 5 RS`` (kinds that ran), or empty."""
    kinds = (("ag_per_step", "AG"), ("rs_per_step", "RS"), ("ar_per_step", "AR"))
    return " / ".join(f"{row[c]} {k}" for c, k in kinds if row.get(c) not in (None, "", "0"))


def _phase_median(phases: dict, name: str) -> str:
    """A phase's median in ms (one decimal), or empty when the mode has no such phase."""
    return f"{phases[name]['median']:.1f}" if name in phases else ""


def _tuning(result: dict) -> str:
    """The one-off norm tuning of the run in ms (outside every step median), or empty."""
    tuning = result.get("norm_tuning")
    return f"{tuning['tuning_ms_total']:.1f}" if tuning else ""


def _comm(result: dict, kind: str, phase: str | None = None, field: str = "bytes") -> float:
    phases = result.get("comm_per_step", {})
    keys = [phase] if phase else list(phases)
    return sum(phases.get(p, {}).get(kind, {}).get(field, 0.0) for p in keys)


def _variant(r: dict):
    cfg = r["config"]
    return cfg.get("tie_word_embeddings"), cfg.get("fsdp_api", "fsdp2")


def load(run_dir: Path) -> list[dict]:
    """Loads every experiment JSON of a run (failed experiments included).

    Results written before per-step batch sizes were recorded get them reconstructed where that
    is exact (:func:`opacus_fsdp_sync.bench.throughput.load_run`).
    """
    return throughput.load_run(run_dir)


def _basis(bases: dict[str, str]) -> str:
    """The ``ratio_basis`` cell: the one basis of a row's ratios, or each ratio's."""
    if len(set(bases.values())) == 1:
        return next(iter(bases.values()))
    return "; ".join(f"{col}: {b}" for col, b in bases.items())


def rows(results: list[dict]) -> list[dict]:
    """One row per experiment, with ratios to the baselines of the same sequence length."""
    base = {}
    for r in results:
        if r.get("status") == "ok":
            base[(r["config"]["mode"], r["config"]["seq_length"], _variant(r))] = r
    out = []
    order = {m: i for i, m in enumerate(MODES)}

    def key(r: dict) -> tuple:
        return (
            r["config"]["seq_length"],
            str(_variant(r)),
            order.get(r["config"]["mode"], len(order)),
        )

    for r in sorted(results, key=key):
        cfg = r["config"]
        row = {
            "mode": cfg["mode"],
            "seq": cfg["seq_length"],
            "status": r.get("status", "?"),
            "api": cfg.get("fsdp_api", "fsdp2"),
        }
        if "model" in r:
            row["tied"] = "yes" if r["model"]["tied_embeddings"] else "no"
        if r.get("status") == "ok":
            med = r["step_ms"]["median"]
            ph = r["phases_ms"]
            up = base.get(("ghost_fsdp", cfg["seq_length"], _variant(r)))
            floor = base.get(("no_dp", cfg["seq_length"], _variant(r)))
            ratios = {
                col: throughput.ratio(r, ref)
                for col, ref in (("vs_no_dp", floor), ("vs_ghost_fsdp", up))
                if ref is not None
            }
            cost = throughput.cost(r)
            row.update(
                step_ms_median=f"{med:.1f}",
                step_ms_min=f"{r['step_ms']['min']:.1f}",
                step_ms_max=f"{r['step_ms']['max']:.1f}",
                vs_ghost_fsdp=f"{ratios['vs_ghost_fsdp'][0]:.3f}" if up else "",
                vs_no_dp=f"{ratios['vs_no_dp'][0]:.3f}" if floor else "",
                tokens_per_s=f"{cost.tokens_per_s if cost else r['tokens_per_s']:.0f}",
                ms_per_example=f"{cost.ms_per_example:.2f}" if cost else "",
                ratio_basis=_basis({c: b for c, (_, b) in ratios.items()}) if ratios else "",
                first_backward_ms=_phase_median(ph, "first_backward"),
                norms_ms=_phase_median(ph, "norms"),
                second_backward_ms=_phase_median(ph, "second_backward"),
                tied_norm_ms=_phase_median(ph, "tied_norm"),
                norm_tuning_ms=_tuning(r),
                rs_MiB_first_backward=f"{_comm(r, 'reduce_scatter', 'first_backward') / 2**20:.2f}",
                rs_MiB_per_step=f"{_comm(r, 'reduce_scatter') / 2**20:.2f}",
                ag_MiB_per_step=f"{_comm(r, 'all_gather') / 2**20:.2f}",
                rs_per_step=f"{_comm(r, 'reduce_scatter', field='count'):g}",
                ag_per_step=f"{_comm(r, 'all_gather', field='count'):g}",
                ar_per_step=f"{_comm(r, 'all_reduce', field='count'):g}",
                ar_MiB_per_step=f"{_comm(r, 'all_reduce') / 2**20:.2f}",
                kept_MiB=f"{r.get('one_backward_kept_bytes', 0) / 2**20:.1f}",
                autograd_saved_MiB=f"{r['autograd_saved_bytes'] / 2**20:.1f}"
                if "autograd_saved_bytes" in r
                else "",
                optimizer_ms=_phase_median(ph, "optimizer_step"),
                sampling=r.get("sampling", "fixed"),
                sampling_ms=_phase_median(ph, "sampling"),
                peak_mem_MiB=f"{r['peak_memory']['bytes'] / 2**20:.0f}",
            )
        out.append(row)
    return out


def markdown(table: list[dict], results: list[dict]) -> str:
    """The table as Markdown, headed by the environment of the first result."""
    lines = []
    ok = [r for r in results if r.get("status") == "ok"]
    if ok:
        env, model = ok[0]["environment"], ok[0]["model"]
        cfg = ok[0]["config"]
        mem_kind = ok[0]["peak_memory"]["kind"]
        lines += [
            f"Device: {env['device']}, world size {env['world_size']} ({env['backend']}), "
            f"torch {env['torch']}, opacus {env['opacus']}, {env['mixed_precision']}.",
            f"Model: {cfg['model']} ({cfg['task']}), {model['parameters']:,} parameters, "
            f"tied embeddings: {model['tied_embeddings']}; batch {cfg['batch_size']} per rank.",
            f"Clock: {env['clock']}; {env['warmup_steps_dropped']} warm-up steps dropped, "
            f"median/min/max over {env['measured_steps']} steps; memory: {mem_kind}.",
            "Sampling: `poisson` rows draw each batch by the shared Poisson sampler (local sizes "
            "vary around the batch; `sampling_ms`, outside the step, is the draw, split and "
            "collate); `fixed` rows reuse one batch.",
            "Columns: `vs_no_dp` / `vs_ghost_fsdp` divide the row's cost per example (median "
            "over the measured steps of step ms / global batch, `ms_per_example` in the CSV) by "
            "that of `no_dp` / `ghost_fsdp` at the same length and variant (with a fixed batch "
            "on both sides: the median step ratio); `tokens_per_s`: tokens processed in the "
            "measured steps / their summed time.",
            "",
        ]
    lines.append("| " + " | ".join(MD_COLUMNS) + " |")
    lines.append("| " + " | ".join("---" for _ in MD_COLUMNS) + " |")
    for row in table:
        cells = dict(row, collectives_per_step=collectives(row))
        lines.append("| " + " | ".join(str(cells.get(c, "")) for c in MD_COLUMNS) + " |")
    for note in footnotes(table, results):
        lines += ["", note]
    lines += ["", "Every column (min/max, phases, bytes, memory): `summary.csv`."]
    return "\n".join(lines) + "\n"


def _names(rows: list[dict]) -> str:
    return ", ".join(f"`{r['mode']}` (seq {r['seq']}, {r['api']})" for r in rows)


def footnotes(table: list[dict], results: list[dict]) -> list[str]:
    """The lines under the table: which basis the ratios used, and what was reconstructed.

    Args:
        table: The rows of :func:`rows`.
        results: The results they were made from (:func:`load`).

    Returns:
        One paragraph (a line) per fact; none for a table without ratios.
    """
    compared = [r for r in table if r.get("ratio_basis")]
    by_median = [r for r in compared if throughput.MEDIAN_STEP in r["ratio_basis"]]
    lines = []
    if compared and not by_median:
        lines.append("Ratios: cost per example in every row.")
    elif by_median and all(r["ratio_basis"] == throughput.MEDIAN_STEP for r in compared):
        lines.append(
            "Ratios: median step times in every row (these results record no per-step batch "
            "sizes; with Poisson sampling a median step ranks the drawn batch sizes too); "
            "`tokens_per_s`: nominal batch x seq / median step."
        )
    elif by_median:
        lines.append(
            "Ratios: cost per example, except median step times (`ratio_basis` in the CSV) in "
            f"{_names(by_median)}; where a row records no per-step batch sizes, its "
            "`tokens_per_s` is the nominal batch x seq / median step."
        )
    rebuilt = [r for r in results if (c := throughput.cost(r)) is not None and c.reconstructed]
    if rebuilt:
        lines.append(
            "Reconstructed (results written before per-step batch sizes were recorded; world "
            "size 1, so the local batch is the global one): the measured steps' batch sizes "
            "from `local_batch_sizes` (warm-up, measured, counted steps in loop order), their "
            "times from `logs/{name}.log` (0.1 ms; a fixed batch keeps the recorded median), for "
            + ", ".join(f"`{r['config'].get('name') or r['config']['mode']}`" for r in rebuilt)
            + "."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Writes ``summary.md`` and ``summary.csv`` into the run directory and prints the table."""
    run_dir = Path((argv or sys.argv[1:])[0])
    results = load(run_dir)
    if not results:
        print(f"no results in {run_dir}", file=sys.stderr)
        return 1
    table = rows(results)
    md = markdown(table, results)
    (run_dir / "summary.md").write_text(md)
    with open(run_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
