"""Quick start: DP fine-tuning of a (tiny) Llama under FSDP2 with Poisson sampling.

Run on CPU or GPUs::

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py

Everything but the import of ``PrivacyEngine`` is what an Opacus user already writes.
"""

import logging
import os

import torch
import torch.distributed as dist
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_fsdp_sync import PrivacyEngine  # was: from opacus import PrivacyEngine
from opacus_fsdp_sync.distributed.env import init_distributed
from opacus_fsdp_sync.known_warnings import quiet_known_warnings
from opacus_fsdp_sync.models import LlamaSpec, build_llama
from opacus_fsdp_sync.sharding import ShardingConfig, shard_model


def main() -> None:
    """Trains a few private steps and prints the privacy spent."""
    rank, world, device = init_distributed()  # gloo on CPU, NCCL on GPUs
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", force=True)  # [Ghost] lines
    quiet_known_warnings()  # three warnings each rank prints, harmless here (logged: which, why)
    torch.manual_seed(0)  # model initialisation only: DP draws and noise come from OS entropy
    model = shard_model(build_llama(LlamaSpec(preset="tiny")), ShardingConfig(), device=device)
    ids = torch.randint(1, 128, (256, 16), generator=torch.Generator().manual_seed(0))
    engine = PrivacyEngine()
    model, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(ids), batch_size=32),  # expected global batch
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost_fsdp",  # Poisson sampling is on (Opacus's default)
    )
    with BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=8, optimizer=optimizer
    ) as batches:
        for (x,) in batches:
            x = x.to(device)
            logits = model(input_ids=x).logits[:, :-1]
            loss = criterion(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), shape=logits.shape[:2]
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        print(f"loss {float(loss):.3f}, epsilon {engine.get_epsilon(1e-5):.2f} at delta 1e-5")
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13 CPU: normal teardown after FSDP use can abort


if __name__ == "__main__":
    main()
