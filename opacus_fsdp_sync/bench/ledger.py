"""The op ledger: one private step against one non-private step, phase by phase, on CPU.

Both steps run the same Llama (same seed, same batch, same layout) under
:class:`~opacus_fsdp_sync.bench.op_ledger.OpLedger` after one untracked warm-up step each (FSDP's
lazy init, the engine's first-step set-up). The result gives, per phase (forward, first pass,
norms, weight gradients, hand-off, optimizer; the non-private forward, backward, optimizer) and
op class, the ops, bytes read and written and matmul FLOPs; the live tensor bytes each phase
hands to the next and their peak; the ops whose traffic the private step adds most; and the
private step's ratios to the non-private one (:func:`ratios`).

``python -m opacus_fsdp_sync.bench.ledger --out DIR`` runs it (one process, FSDP2 on one gloo
rank; under ``torchrun`` on every rank, rank 0 writing) and writes ``DIR/{name}.json`` and
``DIR/{name}.md`` (:mod:`.ledger_report`). The defaults are Llama-3.2-1B's shape scaled by 1/4
in width, vocabulary and sequence (hidden 512, 16 blocks, vocab 32064, tied, batch 8, seq 256,
bf16 parameters with fp32 reduction; about a minute on two CPU cores), with the accelerator's
norm strategy forced (``per_sample_grads=False``, ``gram_block=seq/2``) and with it the
accelerator's op sequence (``--accelerator-path``, :mod:`.accelerator_ops`: the widening Gram
matmuls as one ``bmm.dtype`` each, as on CUDA, not a CPU ``bmm`` and a widening copy).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..models import PRESETS, LlamaSpec
from ..models.llama import llama_config
from ..profiling.phases import phase
from .accelerator_ops import accelerator_matmuls
from .ledger_report import markdown, ratios, summary
from .op_ledger import OpLedger
from .results_io import run_and_save, save

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LedgerConfig:
    """What the ledger measures. Every field is a CLI flag (``--seq-length`` for ``seq_length``)."""

    preset: str = "llama3.2-1b"
    """Llama preset (:data:`opacus_fsdp_sync.models.PRESETS`) before scaling."""
    width_divisor: int = 4
    """Divides hidden and intermediate size, attention and key-value heads (head size kept)
    and the vocabulary: 4 gives Llama-3.2-1B's shape at 1/4 width (hidden 512, vocab 32064)."""
    blocks: int = 16
    """Decoder blocks (Llama-3.2-1B has 16; fewer for time, every other ratio kept)."""
    batch_size: int = 8
    """Samples per rank."""
    seq_length: int = 256
    """Tokens per sample."""
    precision: str = "bf16"
    """``bf16`` (bf16 parameters, fp32 reduction) or ``fp32``."""
    accelerator_norms: bool = True
    """Force the accelerator's norm strategy on CPU: ghost norms everywhere
    (``per_sample_grads=False``) in Gram row blocks of ``seq_length / 2`` tokens."""
    accelerator_path: bool | None = None
    """Register CPU kernels of the accelerator's widening matmuls (``aten::bmm.dtype`` and its
    kin, :mod:`.accelerator_ops`) in the ledger's process, so the step dispatches the ops of the
    CUDA path (fp32 Gram blocks written by the matmul, no widening copies); None: on exactly
    when ``accelerator_norms`` is."""
    gram_block: int | None = None
    """Gram row block, overriding ``accelerator_norms``'s ``seq_length / 2`` (0: full Grams)."""
    max_grad_norm: float = 1.0
    """Clipping bound (small enough that samples are clipped)."""
    noise_multiplier: float = 1.0
    """Noise multiplier (the noise is part of a private step's optimizer phase)."""
    out: str | None = None
    """Directory for ``{name}.json`` and ``{name}.md``; None: print the table only."""
    name: str | None = None
    """File stem; default ``ledger_{preset}_div{width_divisor}_b{blocks}_n{batch}_t{seq}``."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision={self.precision!r}: choose bf16 or fp32")
        for f in ("width_divisor", "blocks", "batch_size", "seq_length"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)}: must be at least 1")

    @property
    def stem(self) -> str:
        """The result files' stem."""
        return self.name or (
            f"ledger_{self.preset}_div{self.width_divisor}_b{self.blocks}"
            f"_n{self.batch_size}_t{self.seq_length}"
        )

    @property
    def uses_accelerator_path(self) -> bool:
        """Whether the widening matmul kernels are registered while measuring."""
        return self.accelerator_norms if self.accelerator_path is None else self.accelerator_path

    def engine_options(self) -> dict:
        """The :class:`~opacus_fsdp_sync.PrivacyEngine` options of the private step."""
        opts: dict = {"tune_norms": False}
        if self.accelerator_norms:
            opts.update(per_sample_grads=False, gram_block=max(1, self.seq_length // 2))
        if self.gram_block is not None:
            opts["gram_block"] = self.gram_block
        return opts


def build_model(cfg: LedgerConfig) -> nn.Module:
    """The configured Llama (random weights, seed 0, fp32 until sharded)."""
    from transformers import LlamaForCausalLM

    lc = llama_config(LlamaSpec(preset=cfg.preset))
    d = cfg.width_divisor
    lc.hidden_size //= d
    lc.intermediate_size //= d
    lc.num_attention_heads = max(1, lc.num_attention_heads // d)
    lc.num_key_value_heads = max(1, lc.num_key_value_heads // d)
    lc.vocab_size //= d
    lc.num_hidden_layers = cfg.blocks
    torch.manual_seed(0)
    return LlamaForCausalLM(lc)


def causal_lm_loss(model, criterion, ids: torch.Tensor, private: bool) -> torch.Tensor:
    """Next-token loss of ``ids`` (the private criterion takes the batch's shape)."""
    logits = model(input_ids=ids).logits[:, :-1]
    flat = (logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return criterion(*flat, shape=logits.shape[:2]) if private else criterion(*flat)


def _prepare(cfg: LedgerConfig, private: bool, device: torch.device, world: int):
    from ..privacy_engine import PrivacyEngine
    from ..sharding import ShardingConfig, shard_model

    model = build_model(cfg).to(device)
    model = shard_model(model, ShardingConfig.for_precision(cfg.precision), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    criterion = nn.CrossEntropyLoss()
    if not private:
        return model, optimizer, criterion
    n = cfg.batch_size * world
    data = TensorDataset(torch.zeros(n, cfg.seq_length, dtype=torch.long))
    engine = PrivacyEngine(**cfg.engine_options())
    model, optimizer, criterion, _ = engine.make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=DataLoader(data, batch_size=n),
        noise_multiplier=cfg.noise_multiplier,
        max_grad_norm=cfg.max_grad_norm,
        poisson_sampling=False,
        grad_sample_mode="ghost_fsdp",
    )
    return model, optimizer, criterion


def _step(model, optimizer, criterion, ids: torch.Tensor, private: bool) -> None:
    with phase("forward"):
        loss = causal_lm_loss(model, criterion, ids, private)
    if private:
        loss.backward()  # the engine announces its own phases
    else:
        with phase("backward"):
            loss.backward()
    with phase("optimizer_step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def measure(cfg: LedgerConfig, private: bool, device: torch.device, world: int) -> OpLedger:
    """One step of the configured model under an :class:`OpLedger`, after a warm-up step."""
    model, optimizer, criterion = _prepare(cfg, private, device, world)
    vocab = PRESETS[cfg.preset]["vocab_size"] // cfg.width_divisor
    g = torch.Generator().manual_seed(1234 + int(os.environ.get("RANK", "0")))
    ids = torch.randint(1, vocab, (cfg.batch_size, cfg.seq_length), generator=g).to(device)
    # warm-up, untracked: FSDP's lazy init and the engine's first-step set-up, on a short batch
    _step(model, optimizer, criterion, ids[:1, : min(16, cfg.seq_length)], private)
    ledger = OpLedger()
    with ledger:
        _step(model, optimizer, criterion, ids, private)
    ledger.finish()
    return ledger


def run(cfg: LedgerConfig) -> dict:
    """Both steps, their ledgers and the ratios; the result dict (JSON-ready)."""
    from ..distributed.env import init_distributed

    rank, world, device = init_distributed()
    start = time.perf_counter()
    steps = {}
    for private in (False, True):
        tick = time.perf_counter()
        path = accelerator_matmuls() if cfg.uses_accelerator_path else contextlib.nullcontext()
        with path:
            ledger = measure(cfg, private, device, world)
        steps["private" if private else "non_private"] = summary(ledger)
        if rank == 0:
            logger.info(
                "[Ghost] ledger: %s step counted in %.1f s",
                "private" if private else "non-private",
                time.perf_counter() - tick,
            )
    return {
        "config": dataclasses.asdict(cfg),
        "engine_options": cfg.engine_options(),
        "accelerator_path": cfg.uses_accelerator_path,
        "environment": {"torch": torch.__version__, "world_size": world, "device": str(device)},
        "steps": steps,
        "ratios": ratios(steps["private"], steps["non_private"]),
        "wall_s": time.perf_counter() - start,
    }


def config_from_flags(cls: type, argv: list[str] | None, description: str):
    """``cls(**flags)``: one CLI flag per dataclass field (``--seq-length`` for ``seq_length``)."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif kind.startswith("int"):
            parser.add_argument(flag, type=int, default=f.default)
        elif kind == "float":
            parser.add_argument(flag, type=float, default=f.default)
        else:
            parser.add_argument(flag, type=str, default=f.default)
    return cls(**vars(parser.parse_args(argv)))


def parse_args(argv: list[str] | None = None) -> LedgerConfig:
    """Maps CLI flags one-to-one onto :class:`LedgerConfig` fields."""
    return config_from_flags(LedgerConfig, argv, __doc__.splitlines()[0])


def write(result: dict, cfg: LedgerConfig) -> str:
    """Writes ``{out}/{stem}.json`` and ``.md`` when ``cfg.out`` is set; returns the table."""
    table = markdown(result)
    save(cfg.out, cfg.stem, result, table)
    return table


def main(argv: list[str] | None = None) -> int:
    """CLI entry: runs the ledger, prints its table on rank 0 and writes the files."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    for message in ("Secure RNG turned off", "Full backward hook is firing", ".*view tensor"):
        warnings.filterwarnings("ignore", message=message)
    cfg = parse_args(argv)
    return run_and_save(lambda: run(cfg), markdown, cfg.out, cfg.stem)


if __name__ == "__main__":
    sys.exit(main())
