"""Ghost norms of one Llama decoder block's Linear layers: full Grams against Gram row blocks.

Runs the engine's own Linear norm sampler (shared input Grams, fp32 contraction) on random layer
inputs and output gradients of a preset's shapes (q, k, v, o, gate, up, down; q/k/v and gate/up
share their input, as in the model), once per sequence length and ``gram_block``, in one process.
Reports the Gram FLOPs (PyTorch's FLOP counter) and the median time per call (CUDA events on GPU,
``perf_counter`` on CPU), and checks that every block size gives the full Grams' norms.

Example::

    python gram_blocks.py --preset llama3.2-1b --seq-lengths 512 1024 2048 --blocks 0 256 512
    python gram_blocks.py --out results/<folder>   # also gram_blocks.json / .md / .png
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opacus_fsdp_sync.layers.linear import GramCache, make_linear_norm_sampler
from opacus_fsdp_sync.models.llama import PRESETS
from opacus_fsdp_sync.profiling import StepTimer

logger = logging.getLogger("opacus_fsdp_sync.gram_blocks")


def block_layers(preset: str) -> list[tuple[str, int, int, str]]:
    """``(name, d_in, d_out, input)`` of one decoder block's Linear layers, in backward order."""
    cfg = PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return [
        ("down", inter, h, "act"),
        ("up", h, inter, "mlp_in"),
        ("gate", h, inter, "mlp_in"),
        ("o", q, h, "attn"),
        ("v", h, kv, "attn_in"),
        ("k", h, kv, "attn_in"),
        ("q", h, q, "attn_in"),
    ]


def _inputs(layers, batch, t, dtype, device, gen):
    """Shared inputs and per-layer output gradients, scaled like unit-variance activations."""
    dims = {src: d_in for _, d_in, _, src in layers}
    acts = {s: torch.randn(batch, t, d, generator=gen).to(device, dtype) for s, d in dims.items()}
    grads = {
        name: (torch.randn(batch, t, d_out, generator=gen) / t).to(device, dtype)
        for name, _, d_out, _ in layers
    }
    return acts, grads


def _norms_once(sampler, cache, mods, layers, acts, grads) -> list[torch.Tensor]:
    """One backward's worth of norm calls (forward hooks counted first, as in a step)."""
    for *_, src in layers:
        cache.note_input(acts[src])
    return [
        sampler(mods[name], [acts[src]], grads[name])[mods[name].weight]
        for name, _, _, src in layers
    ]


def _time_ms(fn, device, repeats: int) -> float:
    """Median time of ``fn`` over ``repeats`` calls (the engine's StepTimer: CUDA events on GPU)."""
    timer = StepTimer(enabled=True, device=device, log=False)
    times = []
    for _ in range(repeats):
        with timer.phase("call"):
            fn()
        times.append(timer.flush()["call"])
    return statistics.median(times)


def measure(
    preset: str, batch: int, t: int, blocks: list[int], dtype, device, repeats: int
) -> list[dict]:
    """One row per block size at sequence length ``t``; the first block is the reference."""
    layers = block_layers(preset)
    mods = {n: nn.Linear(i, o, bias=False).to(device, dtype) for n, i, o, _ in layers}
    gen = torch.Generator().manual_seed(t)
    acts, grads = _inputs(layers, batch, t, dtype, device, gen)
    rows, ref = [], None
    for block in blocks:
        cache = GramCache(block)
        sampler = make_linear_norm_sampler(cache)
        with FlopCounterMode(display=False) as fc:
            norms = _norms_once(sampler, cache, mods, layers, acts, grads)
        norms = torch.stack(norms).float()
        ref = norms if ref is None else ref
        err = ((norms - ref).abs() / ref.abs()).max().item()
        call = functools.partial(_norms_once, sampler, cache, mods, layers, acts, grads)
        call()  # warm-up
        ms = _time_ms(call, device, repeats)
        rows.append(
            dict(seq=t, block=block, gflop=fc.get_total_flops() / 1e9, ms=ms, max_rel_diff=err)
        )
        logger.info(
            "T=%d block=%d: %.2f GFLOP, %.3f ms (max rel. diff to block %d: %.1e)",
            t, block, rows[-1]["gflop"], ms, blocks[0], err,
        )  # fmt: skip
    base = rows[0]
    for r in rows:
        r["flop_ratio"] = r["gflop"] / base["gflop"]
        r["speedup"] = base["ms"] / r["ms"]
    return rows


def to_markdown(rows: list[dict], header: str) -> str:
    """A results table, one line per (sequence length, block)."""
    lines = [
        header,
        "",
        "| seq | gram_block | Gram GFLOP | FLOPs vs full | ms per block of layers | speed-up | "
        "max rel. diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq']} | {r['block']} | {r['gflop']:.2f} | {r['flop_ratio']:.3f} | "
            f"{r['ms']:.3f} | {r['speedup']:.2f}x | {r['max_rel_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """``gram_blocks.png``: measured speed-up over full Grams, and the FLOP bound, per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    blocks = sorted({r["block"] for r in rows if r["block"]})
    for i, block in enumerate(blocks):
        pts = sorted(
            (r["seq"], r["speedup"], 1 / r["flop_ratio"]) for r in rows if r["block"] == block
        )
        color = f"C{i}"
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{block} tokens"
        )
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=color)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("speed-up over full Gram matrices")
    ax.set_title(title, fontsize=9)
    ax.legend(title="row block (dotted: FLOP ratio)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Measures every (sequence length, block) pair and prints (and optionally writes) a table."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--preset", default="llama3.2-1b" if cuda else "small")
    parser.add_argument("--batch", type=int, default=8 if cuda else 4)
    parser.add_argument(
        "--seq-lengths", type=int, nargs="+", default=[512, 1024] if cuda else [128, 256, 512]
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 64, 128, 256, 512])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16" if cuda else "fp32")
    parser.add_argument("--repeats", type=int, default=10 if cuda else 5)
    parser.add_argument("--out", type=Path, default=None, help="folder for the .json / .md")
    args = parser.parse_args(argv)
    if args.blocks[0] != 0:
        parser.error("--blocks must start with 0 (the full-Gram reference)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hw = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    rows = []
    for t in args.seq_lengths:
        blocks = [0] + [b for b in args.blocks[1:] if 0 < b < t]
        rows += measure(args.preset, args.batch, t, blocks, dtype, device, args.repeats)
    header = (
        f"Ghost norms of one `{args.preset}` decoder block's Linear layers, batch {args.batch}, "
        f"{args.dtype}, {hw}, torch {torch.__version__}; median of {args.repeats} calls."
    )
    table = to_markdown(rows, header)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(vars(args), out=str(args.out), hardware=hw, torch=torch.__version__)
        (args.out / "gram_blocks.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (args.out / "gram_blocks.md").write_text(table)
        title = f"{args.preset} decoder block, batch {args.batch}, {args.dtype}, {hw}"
        plot(rows, args.out / "gram_blocks.png", title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
