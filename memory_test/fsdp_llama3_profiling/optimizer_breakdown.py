"""Where the DP optimizer step's time goes, part by part, against the non-private step.

Trains the profiling suite's model for a few steps in one mode and times, on rank 0, each part of
``optimizer.step()`` and ``zero_grad()``: for a DP optimizer ``accumulate``, ``add_noise`` (the
noise pass and the gradient swap) with its ``noise pass`` inside, the wrapped optimizer's own
``step`` and ``zero_grad``; for the non-private step, ``step`` and ``zero_grad``. Medians over the
measured steps, in ms. On CUDA each part is synchronised before and after (a diagnostic: the
parts then do not overlap), so the total is not the suite's ``optimizer_step``.

Example::

    torchrun --standalone --nproc-per-node 2 optimizer_breakdown.py --mode ghost_fsdp_one_backward
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_experiment as pe  # noqa: E402  (the suite's model, data and loss)

from opacus_fsdp_sync import PrivacyEngine  # noqa: E402
from opacus_fsdp_sync.bench.modes import get_mode  # noqa: E402
from opacus_fsdp_sync.distributed.env import init_distributed  # noqa: E402
from opacus_fsdp_sync.models import LlamaSpec, build_llama  # noqa: E402
from opacus_fsdp_sync.optimizers import noised_step  # noqa: E402
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model  # noqa: E402

logger = logging.getLogger("opacus_fsdp_sync.optimizer_breakdown")


class PartTimer:
    """Collects wall-clock times per named part (CUDA-synchronised on GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[str, list[float]] = {}
        self.active = False

    def wrap(self, owner, name: str, label: str) -> None:
        """Replaces ``owner.name`` (an instance, class or module attribute) with a timed call."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.times.setdefault(label, []).append((time.perf_counter() - start) * 1e3)

        setattr(owner, name, timed)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def main(argv: list[str] | None = None) -> int:
    """Runs the breakdown and prints one table on rank 0."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ghost_fsdp_one_backward")
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = pe.ExperimentConfig(
        mode=args.mode, model=args.model, seq_length=args.seq_length, batch_size=args.batch_size
    )
    rank, world, device = init_distributed()
    mode = get_mode(cfg.mode)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_llama(LlamaSpec(preset=cfg.model, task="causal_lm"))
    mp = "bf16" if device.type == "cuda" else "fp32"
    model = shard_model(model, ShardingConfig.for_precision(mp, backend="fsdp2"), device=device)
    vocab = model.config.vocab_size
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    criterion = torch.nn.CrossEntropyLoss()
    timer = PartTimer(device)
    if mode.private:
        engine = PrivacyEngine(**mode.engine_kwargs)
        data = torch.utils.data.TensorDataset(torch.zeros(cfg.batch_size * world, 1))
        model, optimizer, criterion, _ = engine.make_private(
            module=model,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=torch.utils.data.DataLoader(data, batch_size=cfg.batch_size * world),
            noise_multiplier=cfg.noise_multiplier,
            max_grad_norm=cfg.max_grad_norm,
            poisson_sampling=False,
            grad_sample_mode=mode.grad_sample_mode,
        )
        for name in ("accumulate", "add_noise"):
            timer.wrap(optimizer, name, name)
        timer.wrap(noised_step, "add_scaled_into", "  noise pass")
        timer.wrap(optimizer.original_optimizer, "step", "inner step")
        timer.wrap(optimizer.original_optimizer, "zero_grad", "inner zero_grad")
    timer.wrap(optimizer, "step", "step (total)")
    timer.wrap(optimizer, "zero_grad", "zero_grad (total)")
    ids, labels = pe._batches(cfg, vocab, rank)
    ids, labels = ids.to(device), labels.to(device)
    for i in range(args.warmup + args.steps):
        loss = pe._loss(cfg, model, criterion, ids, labels, mode.private)
        loss.backward()  # untimed (the engine's own zero_grad between passes included)
        timer.active = i >= args.warmup
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.active = False
    if rank == 0:
        print(
            f"optimizer breakdown: {cfg.mode}, {cfg.model}, seq {cfg.seq_length}, "
            f"batch {cfg.batch_size} per rank, world {world}, {device.type}; "
            f"median over {args.steps} steps (ms)"
        )
        for label, values in timer.times.items():
            print(f"  {label:<20s} {statistics.median(values):8.3f}")
        sys.stdout.flush()
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    import os

    os._exit(code)  # FSDP teardown can abort on CPU (see the README)
