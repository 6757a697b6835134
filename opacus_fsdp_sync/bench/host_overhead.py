"""Host time of a private step against a non-private one, on CPU, where the GPU would starve.

On a GPU the host launches every op; when a step's host work outlasts its GPU work the GPU
waits, and the step takes the host's time. That happens to the private step first: on an H100
at a Poisson batch of 4 the private step barely shrank with its batch while the non-private
step did (``results/gpu-h100-campaign/late-noise/``). This measures that host work without a
GPU: the Llama of the op ledger (:mod:`.ledger`, Llama-3.2-1B's block structure and tied head)
at a width so small that the arithmetic is negligible, so the wall time of a step is its
dispatch and Python. The private step takes the accelerator's route (ghost norms from full
Grams, contracted by batched matmuls as on CUDA, fp32 so that each widening matmul is one op as
``bmm.dtype`` is there), so it runs the ops the GPU's host launches.

``python -m opacus_fsdp_sync.bench.host_overhead --out DIR`` (one process, FSDP2 on one gloo
rank) writes ``DIR/{name}.json`` and ``DIR/{name}.md``: per step kind, the median host time
over the measured steps and its spread, and the aten ops of one more step (counted by
:class:`~.op_ledger.OpLedger`, untimed), with the private step's extra time and ops.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..known_warnings import quiet_known_warnings
from .accelerator_ops import accelerator_contraction
from .ledger import LedgerConfig, _prepare, _step, config_from_flags
from .op_ledger import OpLedger
from .results_io import run_and_save

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class HostOverheadConfig:
    """What is timed. Every field is a CLI flag (``--width-divisor`` for ``width_divisor``)."""

    preset: str = "llama3.2-1b"
    """Llama preset whose block structure is kept."""
    width_divisor: int = 32
    """Divides widths, heads and vocabulary (:class:`.ledger.LedgerConfig`): 32 leaves hidden
    64, one attention head of 64, vocabulary 4008, so the arithmetic is negligible."""
    blocks: int = 16
    """Decoder blocks (Llama-3.2-1B's 16: host work scales with the layers)."""
    batch_size: int = 2
    """Samples per step."""
    seq_length: int = 32
    """Tokens per sample."""
    steps: int = 15
    """Measured steps per kind."""
    warmup: int = 3
    """Steps run before measuring."""
    threads: int = 1
    """``torch.set_num_threads`` (1: one host thread, as a GPU's launching thread)."""
    out: str | None = None
    """Directory for ``{name}.json`` and ``{name}.md``; None: print the table only."""
    name: str = "host_overhead"
    """File stem."""

    def __post_init__(self) -> None:
        for f in ("width_divisor", "blocks", "batch_size", "seq_length", "steps", "threads"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: must be at least 0")

    def ledger_config(self) -> LedgerConfig:
        """The model and private-step options (full Grams, ghost norms, fp32)."""
        return LedgerConfig(
            preset=self.preset,
            width_divisor=self.width_divisor,
            blocks=self.blocks,
            batch_size=self.batch_size,
            seq_length=self.seq_length,
            precision="fp32",
            accelerator_norms=True,
            accelerator_path=False,
            gram_block=0,
        )


def _vocab(cfg: LedgerConfig) -> int:
    from ..models import PRESETS

    return PRESETS[cfg.preset]["vocab_size"] // cfg.width_divisor


def time_steps(cfg: HostOverheadConfig, private: bool, device, world: int) -> dict:
    """Median, min and max host ms per step over ``cfg.steps``, and one step's aten ops."""
    lcfg = cfg.ledger_config()
    model, optimizer, criterion = _prepare(lcfg, private, device, world)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, _vocab(lcfg), (cfg.batch_size, cfg.seq_length), generator=g)
    ids = ids.to(device)
    for _ in range(cfg.warmup):
        _step(model, optimizer, criterion, ids, private)
    times = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        _step(model, optimizer, criterion, ids, private)
        times.append((time.perf_counter() - start) * 1e3)
    ledger = OpLedger()
    with ledger:
        _step(model, optimizer, criterion, ids, private)
    ledger.finish()
    ops = sum(t.ops for t in ledger.totals().values())
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "step_ms": times,
        "ops": ops,
    }


def run(cfg: HostOverheadConfig) -> dict:
    """Both step kinds, timed; the result dict (JSON-ready)."""
    from ..distributed.env import init_distributed

    _, world, device = init_distributed()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        with accelerator_contraction():
            plain = time_steps(cfg, False, device, world)
            private = time_steps(cfg, True, device, world)
    finally:
        torch.set_num_threads(threads)
    return {
        "config": asdict(cfg),
        "environment": {"torch": torch.__version__, "world_size": world, "device": str(device)},
        "non_private": plain,
        "private": private,
        "extra_ms": private["median_ms"] - plain["median_ms"],
        "ratio": private["median_ms"] / plain["median_ms"],
        "extra_ops": private["ops"] - plain["ops"],
    }


def markdown(result: dict) -> str:
    """The result as a Markdown table with its settings."""
    c = result["config"]
    lines = [
        f"Host time per step: {c['preset']} / {c['width_divisor']} in width, {c['blocks']} blocks,"
        f" batch {c['batch_size']}, seq {c['seq_length']}, {c['threads']} thread(s), median of"
        f" {c['steps']} steps after {c['warmup']} (torch {result['environment']['torch']}).",
        "",
        "| step | median ms | min ms | max ms | aten ops |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind in ("non_private", "private"):
        r = result[kind]
        lines.append(
            f"| {kind.replace('_', '-')} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | "
            f"{r['max_ms']:.1f} | {r['ops']} |"
        )
    lines += [
        "",
        f"The private step: {result['ratio']:.3f}x, {result['extra_ms']:+.1f} ms and "
        f"{result['extra_ops']:+d} ops per step.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> HostOverheadConfig:
    """Maps CLI flags one-to-one onto :class:`HostOverheadConfig` fields."""
    return config_from_flags(HostOverheadConfig, argv, __doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    """CLI entry: times both steps, prints the table and writes the files."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    quiet_known_warnings()
    cfg = parse_args(argv)
    return run_and_save(lambda: run(cfg), markdown, cfg.out, cfg.name)


if __name__ == "__main__":
    sys.exit(main())
