"""One ``make_private`` call for the test workers: fixed batches, no Poisson sampling."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_private(
    engine,
    model,
    data,
    batch,
    C,
    mode,
    *,
    noise=0.0,
    lr=0.5,
    optimizer=None,
    criterion=None,
    shuffle=False,
    **kwargs,
):
    """``engine.make_private`` with SGD (or ``optimizer``) and a loader of ``batch`` samples.

    Opacus's expected batch per rank is the loader's batch divided by the world size when the
    model is distributed, so ``batch`` is the global batch. ``shuffle``: a sampler with a
    generator, which ``secure_mode`` replaces (the tests feed batches themselves).
    """
    return engine.make_private(
        module=model,
        optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=lr),
        criterion=criterion or nn.CrossEntropyLoss(),
        data_loader=DataLoader(TensorDataset(*data), batch_size=batch, shuffle=shuffle),
        noise_multiplier=noise,
        max_grad_norm=C,
        poisson_sampling=False,
        grad_sample_mode=mode,
        **kwargs,
    )


def lm_loss(model, criterion, ids):
    """The private criterion's next-token loss of a causal LM on ``ids`` (per sequence)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return criterion(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), shape=logits.shape[:2]
    )


def capture_ghost_log() -> list[str]:
    """Collects the ``opacus_fsdp_sync`` logger's messages (INFO and up) into the returned list."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("opacus_fsdp_sync")
    log.setLevel(logging.INFO)
    log.addHandler(_Keep())
    return records
