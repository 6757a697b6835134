"""Peak memory of private steps under Poisson sampling, with and without ``BatchMemoryManager``.

Under Poisson sampling a logical batch has no fixed size: with expected size ``B`` it is
Binomial, and its largest draws over a run lie several standard deviations above ``B``. A step
that runs the whole draw in one forward and backward holds activations, output gradients and
the hooks' kept tensors for every drawn example, so its peak follows the draw. Opacus's
``BatchMemoryManager`` (used unchanged; :mod:`opacus_fsdp_sync.sampling.memory` gives every rank
the same count of physical batches) splits each draw into physical batches of at most
``max_physical_batch_size`` examples: each runs forward and backward alone, its clipped
gradients accumulate, and the noise is added once at the logical step's end. The peak is then a
physical batch's step plus the accumulated gradient, whatever the draw.

This module measures that on CPU with the op ledger's live tensor bytes
(:class:`~.op_ledger.OpLedger`: storages made inside a logical step that are alive, followed
op by op), for the ledger's Llama (:func:`.ledger.build_model`, FSDP2 on one gloo rank) in four
runs: the non-private step and the private step on a fixed batch of ``max_physical`` examples,
and private steps under Poisson sampling (expected batch ``expected_batch``) without and with
``BatchMemoryManager(max_physical_batch_size=max_physical)``. Each logical step's peak is
recorded beside its drawn size.

``python -m opacus_fsdp_sync.bench.poisson_memory --out DIR`` writes ``DIR/{name}.json`` and
``.md``. The draws come from OS entropy (``--dp-seed`` pins them for a reproducible table).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..known_warnings import quiet_known_warnings
from ..models import PRESETS
from .ledger import LedgerConfig, build_model, causal_lm_loss, config_from_flags
from .op_ledger import OpLedger
from .results_io import run_and_save

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PoissonMemoryConfig:
    """What the measurement runs. Every field is a CLI flag (``--expected-batch``)."""

    preset: str = "llama3.2-1b"
    """Llama preset (:data:`opacus_fsdp_sync.models.PRESETS`) before scaling."""
    width_divisor: int = 8
    """The preset's width divided by this (:class:`.ledger.LedgerConfig`)."""
    blocks: int = 4
    """Decoder blocks."""
    seq_length: int = 128
    """Tokens per example."""
    precision: str = "bf16"
    """``bf16`` (bf16 parameters, fp32 reduction) or ``fp32``."""
    dataset_size: int = 512
    """Examples in the dataset; the sample rate is ``expected_batch / dataset_size``."""
    expected_batch: int = 16
    """Expected logical batch under Poisson sampling."""
    max_physical: int = 8
    """``BatchMemoryManager``'s ``max_physical_batch_size``, and the fixed batch's size."""
    steps: int = 4
    """Logical steps measured per Poisson run (after one warm-up step)."""
    dp_seed: int | None = None
    """Seed of the draws and the noise (None: OS entropy, as in training)."""
    out: str | None = None
    """Directory for ``{name}.json`` and ``.md``; None: print the table only."""
    name: str = "poisson_memory"
    """File stem."""

    def __post_init__(self) -> None:
        for f in (
            "width_divisor",
            "blocks",
            "seq_length",
            "expected_batch",
            "max_physical",
            "steps",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be at least 1")
        if self.dataset_size < self.expected_batch:
            raise ValueError(
                f"dataset_size={self.dataset_size} is below expected_batch="
                f"{self.expected_batch}: the sample rate would exceed 1"
            )

    def ledger_config(self) -> LedgerConfig:
        """The model's shape, as the op ledger builds it."""
        return LedgerConfig(
            preset=self.preset,
            width_divisor=self.width_divisor,
            blocks=self.blocks,
            seq_length=self.seq_length,
            precision=self.precision,
            batch_size=self.max_physical,
        )


def _setup(cfg: PoissonMemoryConfig, *, private: bool, poisson: bool, device: torch.device):
    from ..privacy_engine import PrivacyEngine
    from ..sharding import ShardingConfig, shard_model

    lcfg = cfg.ledger_config()
    model = build_model(lcfg).to(device)
    model = shard_model(model, ShardingConfig.for_precision(cfg.precision), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    criterion = nn.CrossEntropyLoss()
    vocab = PRESETS[lcfg.preset]["vocab_size"] // cfg.width_divisor
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, vocab, (cfg.dataset_size, cfg.seq_length), generator=g)
    batch = cfg.expected_batch if poisson else cfg.max_physical
    loader = DataLoader(TensorDataset(ids), batch_size=batch)
    if not private:
        return model, optimizer, criterion, loader, None
    engine = PrivacyEngine(dp_seed=cfg.dp_seed)
    model, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=poisson,
        grad_sample_mode="ghost_fsdp",
    )
    return model, optimizer, criterion, loader, engine


def _physical_step(model, optimizer, criterion, ids, private: bool) -> None:
    causal_lm_loss(model, criterion, ids, private).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fixed_batch_peak(cfg: PoissonMemoryConfig, *, private: bool, device) -> int:
    """Peak live bytes of one step on a fixed batch of ``max_physical`` (after a warm-up)."""
    model, optimizer, criterion, loader, _ = _setup(
        cfg, private=private, poisson=False, device=device
    )
    batches = iter(loader)
    _physical_step(model, optimizer, criterion, next(batches)[0].to(device), private)
    ledger = OpLedger()
    with ledger:
        _physical_step(model, optimizer, criterion, next(batches)[0].to(device), private)
    return ledger.peak_bytes


def poisson_peaks(cfg: PoissonMemoryConfig, *, memory_manager: bool, device) -> list[dict]:
    """Per logical step under Poisson sampling: the drawn size, physical batches and peak bytes.

    The first logical step is a warm-up (not reported).
    """
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    model, optimizer, criterion, loader, engine = _setup(
        cfg, private=True, poisson=True, device=device
    )
    steps: list[dict] = []
    current: dict = {"examples": 0, "physical": 0}
    ledger: OpLedger | None = None
    batches = loader
    if memory_manager:
        manager = BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=cfg.max_physical, optimizer=optimizer
        )
        batches = manager.__enter__()
    try:
        for (ids,) in batches:
            if ledger is None:  # a logical step begins
                ledger = OpLedger()
                ledger.__enter__()
            current["examples"] += ids.shape[0]
            current["physical"] += 1
            taken = engine.optimizer_steps
            _physical_step(model, optimizer, criterion, ids.to(device), True)
            if engine.optimizer_steps == taken:
                continue  # a physical batch of a logical step that goes on
            ledger.__exit__(None, None, None)
            steps.append({**current, "peak_bytes": ledger.peak_bytes})
            ledger, current = None, {"examples": 0, "physical": 0}
            if len(steps) > cfg.steps:
                break
    finally:
        if ledger is not None:
            ledger.__exit__(None, None, None)
        if memory_manager:
            manager.__exit__(None, None, None)
    return steps[1:]


def run(cfg: PoissonMemoryConfig) -> dict:
    """The four runs and their summary (JSON-ready)."""
    from ..distributed.env import init_distributed

    _, world, device = init_distributed()
    if world != 1:
        raise ValueError(f"poisson_memory runs on one process (world size {world}): run it bare")
    start = time.perf_counter()
    nodp = fixed_batch_peak(cfg, private=False, device=device)
    fixed = fixed_batch_peak(cfg, private=True, device=device)
    logger.info("[Ghost] poisson memory: fixed batches measured")
    without = poisson_peaks(cfg, memory_manager=False, device=device)
    logger.info("[Ghost] poisson memory: Poisson steps without BatchMemoryManager measured")
    with_bmm = poisson_peaks(cfg, memory_manager=True, device=device)
    return {
        "config": dataclasses.asdict(cfg),
        "environment": {"torch": torch.__version__, "device": str(device)},
        "fixed_batch": {"non_private_peak_bytes": nodp, "private_peak_bytes": fixed},
        "poisson": {"without_memory_manager": without, "with_memory_manager": with_bmm},
        "wall_s": time.perf_counter() - start,
    }


def markdown(result: dict) -> str:
    """The result as a Markdown table."""
    cfg = result["config"]
    mb = 1e6
    fixed = result["fixed_batch"]
    nodp = fixed["non_private_peak_bytes"]
    lines = [
        f"# Peak memory under Poisson sampling: {cfg['preset']} / {cfg['width_divisor']} in width, "
        f"{cfg['blocks']} blocks, seq {cfg['seq_length']}, {cfg['precision']}",
        "",
        f"Expected batch {cfg['expected_batch']} of {cfg['dataset_size']}; "
        f"`max_physical_batch_size` and fixed batch {cfg['max_physical']}; peak of live tensor "
        f"bytes made in a logical step (op ledger); torch {result['environment']['torch']}.",
        "",
        "| run | examples | physical batches | peak MB | / non-private fixed batch |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| non-private, fixed batch | {cfg['max_physical']} | 1 | {nodp / mb:,.1f} | 1.000x |",
        f"| private, fixed batch | {cfg['max_physical']} | 1 | "
        f"{fixed['private_peak_bytes'] / mb:,.1f} | {fixed['private_peak_bytes'] / nodp:.3f}x |",
    ]
    for key, label in (
        ("without_memory_manager", "Poisson, whole draw"),
        ("with_memory_manager", "Poisson, BatchMemoryManager"),
    ):
        for s in result["poisson"][key]:
            lines.append(
                f"| {label} | {s['examples']} | {s['physical']} | {s['peak_bytes'] / mb:,.1f} | "
                f"{s['peak_bytes'] / nodp:.3f}x |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> PoissonMemoryConfig:
    """Maps CLI flags one-to-one onto :class:`PoissonMemoryConfig` fields."""
    return config_from_flags(PoissonMemoryConfig, argv, __doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    """CLI entry: measures, prints the table and writes the files."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    quiet_known_warnings()
    cfg = parse_args(argv)
    return run_and_save(lambda: run(cfg), markdown, cfg.out, cfg.name)


if __name__ == "__main__":
    raise SystemExit(main())
