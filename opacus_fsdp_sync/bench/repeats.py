"""Each private mode against ``no_dp`` over repeated runs of the suite: per run, and the median.

The CPU machine's run-to-run spread (``no_dp`` alone moves by 5-12 % between runs) makes one
run's ratio a weak measurement; the performance bound is read as the median over runs, each
ratio taken within its own run (the two modes measured minutes apart, not across runs). Each
ratio is :func:`~opacus_fsdp_sync.bench.throughput.ratio`'s: cost per example, which with a
fixed batch on both sides is the median step ratio.

Usage: ``python -m opacus_fsdp_sync.bench.repeats RUN_DIR [RUN_DIR ...]`` (the suite's output
folders, e.g. three ``run_all_experiments.sh`` runs) prints a Markdown table; ``--bound 1.15``
adds whether each median is within it. Where the results hold their rank's CPU time per step
(``cpu_ms``, recorded by the suite) and ran one fixed batch, a last column gives the median over
runs of the ratio of process CPU time per step: on a machine with as many ranks as cores that
is the work the ranks compete for, apart from the waiting in wall time
(:mod:`opacus_fsdp_sync.profiling.cpu_time`).
Exit code 2 when a folder has no results or two results of one row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import throughput

#: The reference mode every ratio divides by.
REFERENCE = "no_dp"


@dataclass(frozen=True, order=True)
class RowKey:
    """One table row: a private mode at one length, API and tie variant."""

    mode: str
    seq: int
    api: str
    tied: str


@dataclass
class Row:
    """A row's ratio to ``no_dp`` in each run (None where the run lacks either side)."""

    key: RowKey
    ratios: list[float | None] = field(default_factory=list)
    """Each run's cost ratio (:func:`~opacus_fsdp_sync.bench.throughput.ratio`)."""
    cpu_ratios: list[float | None] = field(default_factory=list)
    """Each run's :func:`cpu_ratio` (None without ``cpu_ms`` or a fixed batch)."""

    @property
    def median(self) -> float | None:
        """The median of the runs' ratios, or None when no run has one."""
        return _median(self.ratios)

    @property
    def cpu_median(self) -> float | None:
        """The median of the runs' CPU time ratios, or None when no run has one."""
        return _median(self.cpu_ratios)


def _median(values: Sequence[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def cpu_ratio(result: dict, reference: dict) -> float | None:
    """Median process CPU time per step of ``result`` over ``reference``'s.

    Per step, so only for one fixed batch on both sides (Poisson rows draw other batches from
    step to step; their cost ratio is per example).

    Args:
        result: A private mode's result.
        reference: The ``no_dp`` result of the same run and row.

    Returns:
        The ratio, or None where either lacks ``cpu_ms`` or was not run on a fixed batch.
    """
    if result.get("sampling") != "fixed" or reference.get("sampling") != "fixed":
        return None
    try:
        return result["cpu_ms"]["process"]["median"] / reference["cpu_ms"]["process"]["median"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _key(result: dict) -> RowKey:
    cfg = result["config"]
    return RowKey(
        mode=cfg["mode"],
        seq=int(cfg["seq_length"]),
        api=cfg.get("fsdp_api", "fsdp2"),
        tied=_TIED.get(cfg.get("tie_word_embeddings"), str(cfg.get("tie_word_embeddings"))),
    )


#: ``tie_word_embeddings`` as the suite's variants name it (None: the preset's own).
_TIED = {None: "preset", True: "tied", False: "untied"}


def run_ratios(results: Sequence[dict]) -> dict[RowKey, tuple[float, float | None]]:
    """Each successful private result's ratio to the ``no_dp`` result of the same run and row.

    Returns:
        By row: the cost ratio and the CPU time ratio (:func:`cpu_ratio`).

    Raises:
        ValueError: for two results of one row in one run (another model, batch or sampling
            under the same mode and length: one folder per configuration).
    """
    ok = [r for r in results if r.get("status") == "ok"]
    seen: dict[RowKey, str] = {}
    for r in ok:
        k, name = _key(r), r["config"].get("name", "?")
        if k in seen:
            raise ValueError(
                f"results {seen[k]!r} and {name!r} are one row ({k.mode}, seq {k.seq}, "
                f"{k.api}, {k.tied}); pass one folder per configuration"
            )
        seen[k] = name
    refs = {}
    for r in ok:
        if r["config"]["mode"] == REFERENCE:
            k = _key(r)
            refs[(k.seq, k.api, k.tied)] = r
    out = {}
    for r in ok:
        k = _key(r)
        ref = refs.get((k.seq, k.api, k.tied))
        if k.mode != REFERENCE and ref is not None:
            out[k] = (throughput.ratio(r, ref)[0], cpu_ratio(r, ref))
    return out


def table(run_dirs: Sequence[Path]) -> list[Row]:
    """One :class:`Row` per private mode and row key found in any run, in key order.

    Raises:
        FileNotFoundError: naming a folder without experiment results.
    """
    per_run = []
    for d in run_dirs:
        results = throughput.load_run(Path(d))
        if not results:
            raise FileNotFoundError(
                f"{d}: no experiment results (*.json); pass the suite's output folders"
            )
        per_run.append(run_ratios(results))
    keys = sorted({k for ratios in per_run for k in ratios})
    rows = []
    for k in keys:
        pairs = [ratios.get(k, (None, None)) for ratios in per_run]
        rows.append(Row(k, [p[0] for p in pairs], [p[1] for p in pairs]))
    return rows


def markdown(rows: Sequence[Row], run_names: Sequence[str], bound: float | None = None) -> str:
    """The rows as a Markdown table: one column per run, then the median (and the bound)."""
    head = ["mode", "seq", "api", "tied", *run_names, "median"]
    if bound is not None:
        head.append(f"<= {bound:g}x")
    cpu = any(r.cpu_median is not None for r in rows)
    if cpu:
        head.append("process CPU time per step, median")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for row in rows:
        med = row.median
        cells = [row.key.mode, str(row.key.seq), row.key.api, row.key.tied]
        cells += ["" if r is None else f"{r:.3f}x" for r in row.ratios]
        cells.append("" if med is None else f"{med:.3f}x")
        if bound is not None:
            cells.append("" if med is None else ("yes" if med <= bound else "no"))
        if cpu:
            cells.append("" if row.cpu_median is None else f"{row.cpu_median:.3f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: prints the table of the given runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the suite's output folders")
    parser.add_argument("--bound", type=float, default=None, help="e.g. 1.15")
    args = parser.parse_args(argv)
    try:
        rows = table(args.runs)
    except (FileNotFoundError, ValueError) as err:
        print(f"repeats: {err}", file=sys.stderr)
        return 2
    print(markdown(rows, [p.name for p in args.runs], args.bound))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
