"""PNG plots of a run: per-phase time and communication per mode (one panel per sequence length).

Usage: ``python plot_results.py RUN_DIR`` (writes ``phases.png`` and ``communication.png``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from opacus_fsdp_sync.profiling import MODES

PHASES = [
    "forward",
    "backward",
    "first_backward",
    "re-enable_sync",
    "second_backward",
    "optimizer_step",
]


def main(argv: list[str] | None = None) -> int:
    """Reads the run's JSON results and writes the two plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path((argv or sys.argv[1:])[0])
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("*.json"))]
    order = {m: i for i, m in enumerate(MODES)}
    results = [r for r in results if r.get("status") == "ok"]
    results.sort(key=lambda r: order.get(r["config"]["mode"], len(order)))
    if not results:
        print(f"no successful results in {run_dir}", file=sys.stderr)
        return 1
    seqs = sorted({r["config"]["seq_length"] for r in results})

    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs) + 2.5, 4), squeeze=False)
    for ax, seq in zip(axes[0], seqs):
        rs = [r for r in results if r["config"]["seq_length"] == seq]
        names = [r["config"].get("name") or r["config"]["mode"] for r in rs]
        bottom = [0.0] * len(rs)
        for ph in PHASES:
            vals = [r["phases_ms"].get(ph, {}).get("median", 0.0) for r in rs]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=ph)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"seq {seq}: median per phase")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", rotation=20)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(run_dir / "phases.png", dpi=120)

    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs) + 2.5, 4), squeeze=False)
    for ax, seq in zip(axes[0], seqs):
        rs = [r for r in results if r["config"]["seq_length"] == seq]
        names = [r["config"].get("name") or r["config"]["mode"] for r in rs]
        width = 0.38
        xs = range(len(rs))
        for off, kind in ((-width / 2, "all_gather"), (width / 2, "reduce_scatter")):
            by_phase = {}
            for i, r in enumerate(rs):
                for ph, kinds in r["comm_per_step"].items():
                    by_phase.setdefault(ph, [0.0] * len(rs))[i] = (
                        kinds.get(kind, {}).get("bytes", 0.0) / 2**20
                    )
            bottom = [0.0] * len(rs)
            for ph, vals in by_phase.items():
                if any(vals):
                    ax.bar(
                        [x + off for x in xs], vals, width, bottom=bottom, label=f"{kind} / {ph}"
                    )
                    bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_title(f"seq {seq}: MiB per step (left AG, right RS)")
        ax.set_ylabel("MiB")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(run_dir / "communication.png", dpi=120)
    print(f"plots: {run_dir / 'phases.png'}, {run_dir / 'communication.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
