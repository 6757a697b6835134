"""Seed 002's sequential, layer-selective unlearning loop, ported to FSDP2.

The FSDP1 version read and wrote ``param.grad`` directly; under FSDP2 those are sharded DTensors
(or None while sync is off), so every step below goes through :mod:`opacus_fsdp_sync.grad_access`,
which works on each rank's local shard and gives the same result as one device.

    torchrun --nproc-per-node 2 examples/port_seed002_fsdp2.py --steps 4

Runs on CPU (gloo) or CUDA (NCCL), with random token ids and a tiny Llama.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

from opacus_fsdp_sync.distributed.env import init_distributed
from opacus_fsdp_sync.grad_access import (
    add_grads,
    freeze_outside,
    layer_grad_norms,
    load_grads,
    local_grads,
    same_sign_filter,
    save_grads,
)
from opacus_fsdp_sync.models import LlamaSpec, build_llama, decoder_layers
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model

logger = logging.getLogger("port_seed002")


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a causal LM."""
    return model(input_ids=ids, labels=ids).loss


def main() -> None:
    """Trains one target layer per step, last layer first, as seed 002's trainer does."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--retain-weight", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    rank, world, device = init_distributed()
    try:
        torch.manual_seed(0)
        model = build_llama(LlamaSpec(preset="tiny")).to(device)
        n_layers = len(decoder_layers(model))
        model = shard_model(model, ShardingConfig(backend="fsdp2"), device=device)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(1 + rank)  # each rank its own data
        vocab = model.config.vocab_size
        for step in range(args.steps):
            phase = step % n_layers
            target = f"model.layers.{n_layers - 1 - phase}"
            retain_ids, forget_ids = torch.randint(1, vocab, (2, 2, 16), generator=g).to(device)

            opt.zero_grad()
            retain_loss = lm_loss(model, retain_ids)
            retain_loss.backward()
            retain = save_grads(model, [target])  # local shards, no collective
            retain_norm = layer_grad_norms(model, [target]).per_layer[target]

            opt.zero_grad()
            forget_loss = lm_loss(model, forget_ids)
            (-forget_loss).backward()  # gradient ascent on the forget data
            forget = save_grads(model, [target])
            forget_norm = layer_grad_norms(model, [target]).per_layer[target]

            # Keep forget directions the retain gradient agrees with, then add the retain term.
            load_grads(model, same_sign_filter(forget, retain))
            add_grads(model, retain, weight=args.retain_weight)
            frozen = freeze_outside(model, [target])
            with_grad = len(local_grads(model))
            opt.step()
            if rank == 0:
                logger.info(
                    "step %d | layer %s (phase %d/%d) | retain_loss: %.4f | forget_loss: %.4f | "
                    "retain_grad_norm: %.4f | forget_grad_norm: %.4f | params with grad: %d | "
                    "frozen: %d",
                    step,
                    target.rsplit(".", 1)[1],
                    phase + 1,
                    n_layers,
                    retain_loss.item(),
                    forget_loss.item(),
                    retain_norm,
                    forget_norm,
                    with_grad,
                    frozen,
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
