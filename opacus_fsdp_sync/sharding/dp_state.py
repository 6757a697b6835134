"""The differential-privacy state a checkpoint must carry for a resumed run to be the same run.

Model and optimizer state alone restart the accountant (epsilon under-reported from then on),
the noise generators and the sampler. This module gathers, per rank: the accountant's history,
every noise generator's state (the DP optimizer's own generator, and torch's default generator,
which Opacus's optimizers draw from when given none), the shared Poisson sampler's seed and
position, and the settings that change the result; and restores them, refusing a checkpoint of
another configuration.

Resuming on a different world size: the accountant and the sampler continue exactly (the draw is
global), but the noise streams are per rank and shard, so the continuation cannot be the same
run. :func:`restore_dp_state` refuses unless ``fresh_noise=True``, which keeps the accountant and
sampler and lets each rank's noise generator start from a fresh seed (privacy unchanged, the
exact continuation lost).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

#: Format of the saved DP state; bumped when its content changes.
DP_STATE_VERSION = 1


class CheckpointMismatchError(ValueError):
    """A checkpoint's DP state does not belong to the run that loads it."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _settings(engine, optimizer) -> dict:
    """The settings that change the result or the accounting."""
    return {
        "options": {
            k: v
            for k, v in dataclasses.asdict(getattr(engine, "last_options", engine.options)).items()
            if k != "timing"  # the only option that cannot change a bit of the result
        },
        "accountant": engine.accountant.mechanism(),
        "secure_mode": bool(engine.secure_mode),
        "noise_multiplier": float(optimizer.noise_multiplier),
        "max_grad_norm": float(optimizer.max_grad_norm),
        # per rank in Opacus's optimizers: compared over all ranks, so that a resume on another
        # world size is judged by what it is (the noise streams), not by this
        "expected_global_batch": None
        if optimizer.expected_batch_size is None
        else round(optimizer.expected_batch_size * _rank_world()[1], 6),
        "loss_reduction": optimizer.loss_reduction,
    }


def _generator_state(optimizer) -> torch.Tensor | None:
    gen = getattr(optimizer, "generator", None)
    if gen is None or not hasattr(gen, "get_state"):
        return None
    try:
        return gen.get_state()
    except RuntimeError:  # a random-device generator (secure mode) has no state to keep
        return None


def dp_state(engine, optimizer) -> dict:
    """This rank's DP state (see the module docstring).

    Args:
        engine: Our :class:`~opacus_fsdp_sync.PrivacyEngine`, after ``make_private``.
        optimizer: The DP optimizer ``make_private`` returned.
    """
    rank, world = _rank_world()
    sampler = getattr(engine, "sampler", None)
    return {
        "version": DP_STATE_VERSION,
        "rank": rank,
        "world_size": world,
        "settings": _settings(engine, optimizer),
        "accountant": engine.accountant.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
        "noise_generator": _generator_state(optimizer),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def check_dp_state(state: dict, engine, optimizer, *, fresh_noise: bool = False) -> None:
    """Refuses a DP state that :func:`restore_dp_state` could not restore, changing nothing.

    Args and raises: as :func:`restore_dp_state`.
    """
    if state.get("version") != DP_STATE_VERSION:
        raise CheckpointMismatchError(
            f"DP state version {state.get('version')} in the checkpoint, this package reads "
            f"{DP_STATE_VERSION}: resume with the package version that saved it."
        )
    now = _settings(engine, optimizer)
    for key, saved in state["settings"].items():
        if now.get(key) != saved:
            raise CheckpointMismatchError(
                f"The checkpoint was saved with {key}={saved!r}, this run has {now.get(key)!r}: "
                "a checkpoint resumes only the configuration that saved it. Make the engine "
                "and make_private arguments equal to the saved run's."
            )
    _, world = _rank_world()
    if state["world_size"] != world and not fresh_noise:
        raise CheckpointMismatchError(
            f"The checkpoint's DP state was saved on {state['world_size']} rank(s), this run has "
            f"{world}: the per-rank noise streams cannot continue. Resume on "
            f"{state['world_size']} rank(s) to continue exactly, or pass fresh_noise=True to "
            "keep the accountant and sampler and draw the noise from fresh seeds."
        )
    if (getattr(engine, "sampler", None) is None) != (state["sampler"] is None):
        raise CheckpointMismatchError(
            "The checkpoint and this run disagree on the shared Poisson sampler (one has it, the "
            "other does not): resume with the same poisson_sampling and world layout."
        )
    sampler = getattr(engine, "sampler", None)
    for key in ("num_samples", "sample_rate", "steps") if sampler is not None else ():
        if state["sampler"][key] != getattr(sampler, key):
            raise CheckpointMismatchError(
                f"The checkpoint's sampler has {key}={state['sampler'][key]}, this run "
                f"{getattr(sampler, key)}: resume with the data loader (dataset and batch_size) "
                "of the run that saved it."
            )


def restore_dp_state(state: dict, engine, optimizer, *, fresh_noise: bool = False) -> None:
    """Restores :func:`dp_state`'s output on this rank.

    Args:
        state: What :func:`dp_state` returned on this rank when the checkpoint was saved.
        engine: The engine of the resumed run, after ``make_private`` with the same settings.
        optimizer: Its DP optimizer.
        fresh_noise: On a different world size, keep the accountant and sampler and leave the
            noise generators freshly seeded instead of refusing.

    Raises:
        CheckpointMismatchError: for a checkpoint of another configuration (names the setting),
            another world size without ``fresh_noise``, or another format version.
    """
    check_dp_state(state, engine, optimizer, fresh_noise=fresh_noise)
    _, world = _rank_world()
    same_world = state["world_size"] == world
    engine.accountant.load_state_dict(state["accountant"])
    sampler = getattr(engine, "sampler", None)
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    if not same_world:
        return
    if state["noise_generator"] is not None:
        optimizer.generator.set_state(state["noise_generator"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])


def dp_state_path(path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its DP state inside checkpoint directory ``path``."""
    return os.path.join(path, f"dp_state_rank{rank}.pt")
