"""DP state in Hugging Face checkpoints, and models that ``from_pretrained`` loads.

A Trainer checkpoint (``checkpoint-N/``) keeps what the Trainer writes (trainer state, learning
rate schedule, RNG states, the model for ``from_pretrained``) and adds ``dp/``: the model and
optimizer shards and each rank's DP state (accountant, sampler, noise generators, layout), as
:func:`opacus_fsdp_sync.sharding.save_checkpoint` writes them. Resuming loads ``dp/`` after the
model is made private, under the rules of :mod:`opacus_fsdp_sync.sharding.dp_state`: the same
layout continues every stream exactly; another layout, or a checkpoint without DP state, is
refused before anything is loaded.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from ...distributed.detect import _unwrap
from ...sharding import load_checkpoint, save_checkpoint
from .session import DPSession

#: The folder inside a Trainer checkpoint that holds the shards and the DP state.
DP_FOLDER = "dp"
#: The privacy record written beside every saved model.
PRIVACY_FILE = "privacy.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def user_model(model: nn.Module) -> nn.Module:
    """The user's model behind Opacus's wrapper and DDP (FSDP2 roots stay)."""
    module = _unwrap(model)
    while isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, on the CPU of rank 0; every rank must call it.

    Other ranks get an empty dict when distributed.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = user_model(model)
    if not _distributed():
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)


def save_dp_checkpoint(output_dir: str, session: DPSession) -> None:
    """Writes ``output_dir/dp``: shards of model and optimizer, each rank's DP state.

    Collective. The DP state holds the sampler's seed and the noise generators' states: keep
    checkpoints as private as the data. The run's draw ledger goes to the folder that holds
    ``output_dir`` (the Trainer's own ``output_dir``), not into a checkpoint folder that
    ``save_total_limit`` deletes.
    """
    save_checkpoint(
        os.path.join(output_dir, DP_FOLDER),
        session.module,
        session.optimizer,
        engine=session.engine,
        ledger_folder=os.path.dirname(os.path.abspath(output_dir)),
    )


def load_dp_checkpoint(
    checkpoint: str,
    session: DPSession,
    *,
    fresh_noise: bool = False,
    steps_after_checkpoint: int | None = None,
    ledger_folder: str | None = None,
) -> None:
    """Restores ``checkpoint/dp`` into the private model, optimizer and engine; collective.

    ``fresh_noise``, ``steps_after_checkpoint`` and ``ledger_folder`` (the Trainer's
    ``output_dir``, beside the ``checkpoint-N`` folders ``save_total_limit`` deletes): as
    :func:`~opacus_fsdp_sync.sharding.load_checkpoint` takes them.

    Raises:
        CheckpointMismatchError: the checkpoint has no DP state, or belongs to another
            configuration or layout (nothing is loaded then).
    """
    load_checkpoint(
        os.path.join(checkpoint, DP_FOLDER),
        session.module,
        session.optimizer,
        engine=session.engine,
        fresh_noise=fresh_noise,
        steps_after_checkpoint=steps_after_checkpoint,
        ledger_folder=ledger_folder,
    )


def write_privacy_record(output_dir: str, session: DPSession) -> None:
    """Writes the run's privacy record beside a saved model (call on the writing rank)."""
    record = session.record()
    if math.isinf(record["epsilon"]):
        record["epsilon"] = "inf"
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, PRIVACY_FILE), "w") as f:
        json.dump(record, f, indent=2)
