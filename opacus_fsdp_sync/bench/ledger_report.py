"""The op ledger's summaries, ratios and Markdown table (see :mod:`.ledger`)."""

from __future__ import annotations

from dataclasses import asdict

from .op_ledger import CLASSES, OpLedger, Tally

#: The ratios the ledger reports, private over non-private: name -> (what, how it is read).
RATIO_NAMES = {
    "non_matmul_bytes": "bytes read and written by every op but matmuls",
    "copy_ops": "copy-class ops (copies, casts, clones, concatenations, gathers)",
    "all_bytes": "bytes read and written by every op",
    "matmul_flops": "matmul FLOPs (torch.utils.flop_counter)",
    "ops": "ops of every class",
    "peak_live_bytes": "peak of live tensor bytes made in the step",
}

#: Ops listed in the table of largest additions.
TOP_OPS = 12


def _t(t: Tally) -> dict:
    return asdict(t)


def summary(ledger: OpLedger) -> dict:
    """One step's ledger as a JSON-ready dict.

    Returns:
        ``phases`` (first-seen order), ``by_phase`` ``{phase: {class: tally}}``, ``totals``
        ``{class: tally}``, ``all`` (every class), ``by_op`` ``{op: tally}`` over the step,
        ``memory`` ``{phase: {peak, at_end}}`` in bytes, ``peak_live_bytes`` and
        ``unpriced_custom_ops``; a tally is ``{ops, bytes_read, bytes_written, flops}``.
    """
    ledger.finish()
    phases = list(dict.fromkeys(ledger.phases))
    totals = ledger.totals()
    every = Tally()
    for t in totals.values():
        every.add(t)
    return {
        "phases": phases,
        "by_phase": {
            p: {c: _t(ledger.by_class[p][c]) for c in CLASSES if c in ledger.by_class[p]}
            for p in phases
        },
        "totals": {c: _t(totals[c]) for c in CLASSES if c in totals},
        "all": _t(every),
        "by_op": {
            name: _t(t)
            for name, t in sorted(ledger.op_totals().items(), key=lambda kv: -kv[1].bytes)
        },
        "memory": {p: asdict(ledger.memory[p]) for p in phases},
        "peak_live_bytes": max((m.peak for m in ledger.memory.values()), default=0),
        "unpriced_custom_ops": sorted(ledger.unpriced),
    }


def _bytes(t: dict) -> int:
    return t["bytes_read"] + t["bytes_written"]


def measures(step: dict) -> dict[str, float]:
    """The step's values behind :data:`RATIO_NAMES`."""
    totals = step["totals"]
    matmul = totals.get("matmul", {"bytes_read": 0, "bytes_written": 0, "flops": 0})
    return {
        "non_matmul_bytes": _bytes(step["all"]) - _bytes(matmul),
        "copy_ops": totals.get("copy", {}).get("ops", 0),
        "all_bytes": _bytes(step["all"]),
        "matmul_flops": step["all"]["flops"],
        "ops": step["all"]["ops"],
        "peak_live_bytes": step["peak_live_bytes"],
    }


def ratios(private: dict, non_private: dict) -> dict[str, float]:
    """Private over non-private for each of :data:`RATIO_NAMES`."""
    mine, theirs = measures(private), measures(non_private)
    return {k: (mine[k] / theirs[k] if theirs[k] else float("inf")) for k in RATIO_NAMES}


def additions(private: dict, non_private: dict) -> list[tuple[str, int, int]]:
    """``(op, extra bytes, extra calls)`` of the ops the private step adds most traffic with."""
    names = set(private["by_op"]) | set(non_private["by_op"])
    zero = {"ops": 0, "bytes_read": 0, "bytes_written": 0}
    rows = []
    for name in names:
        a, b = private["by_op"].get(name, zero), non_private["by_op"].get(name, zero)
        rows.append((name, _bytes(a) - _bytes(b), a["ops"] - b["ops"]))
    return sorted(rows, key=lambda r: -r[1])[:TOP_OPS]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _phase_rows(step: dict) -> list[str]:
    rows = []
    for p in step["phases"]:
        for c, t in step["by_phase"][p].items():
            rows.append(
                f"| {p} | {c} | {t['ops']} | {_mb(t['bytes_read'])} | {_mb(t['bytes_written'])}"
                f" | {t['flops'] / 1e9:,.2f} |"
            )
        mem = step["memory"][p]
        rows.append(
            f"| {p} | *live bytes: peak {_mb(mem['peak'])} MB, kept at end "
            f"{_mb(mem['at_end'])} MB* | | | | |"
        )
    return rows


def markdown(result: dict) -> str:
    """The ledger result as Markdown: ratios, largest additions, then each step by phase."""
    cfg, steps = result["config"], result["steps"]
    private, plain = steps["private"], steps["non_private"]
    lines = [
        f"# Op ledger: {cfg['preset']} / {cfg['width_divisor']} in width, {cfg['blocks']} "
        f"blocks, batch {cfg['batch_size']}, seq {cfg['seq_length']}, {cfg['precision']}",
        "",
        f"Private step options: `{result['engine_options']}`; world size "
        f"{result['environment']['world_size']}, torch {result['environment']['torch']}"
        + ("; accelerator path (`bmm.dtype`)" if result.get("accelerator_path") else "")
        + ".",
        "",
        "| private / non-private | ratio | private | non-private |",
        "| --- | ---: | ---: | ---: |",
    ]
    mine, theirs = measures(private), measures(plain)
    for k, what in RATIO_NAMES.items():
        fmt = (lambda v: f"{v:,}") if k in ("copy_ops", "ops") else _mb
        unit = "" if k in ("copy_ops", "ops") else (" GFLOP" if k == "matmul_flops" else " MB")
        if k == "matmul_flops":
            fmt = lambda v: f"{v / 1e9:,.2f}"  # noqa: E731
        lines.append(
            f"| {what} | {result['ratios'][k]:.3f}x | {fmt(mine[k])}{unit} | "
            f"{fmt(theirs[k])}{unit} |"
        )
    lines += ["", "Largest additions (private minus non-private):", ""]
    lines += ["| op | extra MB | extra calls |", "| --- | ---: | ---: |"]
    lines += [f"| `{n}` | {_mb(b)} | {c:+d} |" for n, b, c in additions(private, plain)]
    header = ["| phase | class | ops | MB read | MB written | GFLOP |", "| --- | --- | ---: |"]
    header[1] += " ---: | ---: | ---: |"
    for name, step in (("Private step", private), ("Non-private step", plain)):
        lines += ["", f"## {name}", "", *header, *_phase_rows(step)]
        lines.append(f"\nPeak live tensor bytes: {_mb(step['peak_live_bytes'])} MB.")
        if step["unpriced_custom_ops"]:
            lines.append(f"Custom ops without a FLOP formula: {step['unpriced_custom_ops']}.")
    return "\n".join(lines) + "\n"
