"""The differential-privacy state a checkpoint must carry for a resumed run to be the same run.

Model and optimizer state alone restart the accountant (epsilon under-reported from then on),
the noise generators and the sampler. This module gathers, per rank: the accountant's history,
every noise generator's state, the shared Poisson sampler's seed and position, the settings that
change the result, and the layout that shapes the noise streams (distributed API, world size,
optimizer, each trainable parameter's mesh, dimension names and placement); and restores them,
refusing a checkpoint of another configuration.

The rule for noise: a resume on the *same layout* continues the saved streams, which is sound
only because nothing computed after the checkpoint was released (an update, a metric, an export
made after the checkpoint and then discarded saw noise the resumed run draws again: keep such
outputs private, or resume with ``fresh_noise=True``). On another layout the saved streams would
be replayed onto other coordinates (one rank's stream onto another's shard, a DDP stream onto
every FSDP shard), so the load is refused, naming what differs, unless ``fresh_noise=True``:
the accountant and the sampler continue exactly (the draw is global) and every noise generator
restarts from OS entropy (:mod:`..randomness`), on any layout, logged.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._generator_internals import seeded_generator
from ..optimizers.noised_step import FlatNoiseStep
from ..optimizers.ops import optimizer_ops
from ..randomness import os_seed
from ..sampling.ledger import DrawLedger, LedgerPosition

logger = logging.getLogger(__name__)

#: Format of the saved DP state; bumped when its content changes (2: the noise layout, draws
#: handed out).
DP_STATE_VERSION = 2


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
            for k, v in dataclasses.asdict(engine.last_options).items()
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
        # per data-parallel rank x data-parallel ranks (the world size but under tensor
        # parallelism, where the optimizer's world size is the data-parallel degree)
        else round(optimizer.expected_batch_size * _dp_ranks(optimizer), 6),
        "loss_reduction": optimizer.loss_reduction,
    }


def _dp_ranks(optimizer) -> int:
    """The ranks the optimizer's expected batch is per: its ``world_size``, else the world."""
    return getattr(optimizer, "world_size", None) or _rank_world()[1]


def _extra_streams(optimizer) -> list[torch.Generator]:
    """The optimizer's noise streams after its ``generator`` (none but with tensor parallelism)."""
    streams = getattr(optimizer, "streams", None)
    return list(streams.generators[1:]) if streams is not None else []


def _generator_state(optimizer) -> torch.Tensor | None:
    gen = optimizer.generator
    if gen is None:
        return None
    try:
        return gen.get_state()
    except RuntimeError:  # a random-device generator (secure mode) has no state to keep
        return None


def _placement(p: torch.Tensor) -> dict:
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        return {
            "shape": list(p.shape),
            "local_shape": list(p.to_local().shape),
            "mesh": list(mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names or ()),
            "placements": [str(pl) for pl in p.placements],
        }
    return {"shape": list(p.shape), "local_shape": list(p.shape)}


def noise_layout(engine, optimizer) -> dict:
    """What shapes this rank's noise streams: API, world size, optimizer, every placement."""
    rank, world = _rank_world()
    return {
        "api": engine.distributed_api or "single device",
        "world_size": world,
        "rank": rank,
        "optimizer": type(optimizer).__name__,
        # the same generator state gives other noise from the noise kernel than from torch
        "noise_path": optimizer.noise_path() if isinstance(optimizer, FlatNoiseStep) else "torch",
        "parameters": [_placement(p) for p in optimizer.params],
    }


def _layout_difference(saved: dict, now: dict) -> str | None:
    """The first difference between two :func:`noise_layout` records, in words (None: same)."""
    for key in ("api", "world_size", "rank", "optimizer"):
        if saved.get(key) != now.get(key):
            return f"{key}: saved {saved.get(key)!r}, now {now.get(key)!r}"
    path = _noise_path_difference(saved, now)
    if path is not None:
        return path
    saved_params, now_params = saved["parameters"], now["parameters"]
    if len(saved_params) != len(now_params):
        return f"trainable parameters: saved {len(saved_params)}, now {len(now_params)}"
    for i, (a, b) in enumerate(zip(saved_params, now_params)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"trainable parameter {i} {key}: saved {a.get(key)!r}, now {b.get(key)!r}"
    return None


def _noise_path_difference(saved: dict, now: dict) -> str | None:
    """How two records' noise paths differ (None: the same; unrecorded: torch's, the only then)."""
    saved_path = saved.get("noise_path", "torch")
    if saved_path != now.get("noise_path", "torch"):
        return f"noise path: saved {saved_path!r}, now {now.get('noise_path')!r}"
    return None


def dp_state(engine, optimizer) -> dict:
    """This rank's DP state (see the module docstring).

    Args:
        engine: Our :class:`~opacus_fsdp_sync.PrivacyEngine`, after ``make_private``.
        optimizer: The DP optimizer ``make_private`` returned.
    """
    rank, world = _rank_world()
    sampler, gen = engine.sampler, engine.loader_generator
    # a draw ahead in flight would leave the streams' state at whatever point its thread is
    optimizer_ops(optimizer).settle_noise()
    return {
        "version": DP_STATE_VERSION,
        "rank": rank,
        "world_size": world,
        "settings": _settings(engine, optimizer),
        "accountant": engine.accountant.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
        # Opacus's Poisson loader (other modes): this rank's stream of masks
        "loader_generator": None if gen is None else gen.get_state(),
        "noise_generator": _generator_state(optimizer),
        # the further noise streams (tensor parallelism: one for the tp-sharded coordinates)
        "noise_streams": [g.get_state() for g in _extra_streams(optimizer)],
        "layout": noise_layout(engine, optimizer),
        # the line's draw ledger (how far any run resumed from these checkpoints went)
        "ledger": None if engine.draw_ledger is None else engine.draw_ledger.path,
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
    layout_now = noise_layout(engine, optimizer)
    path = _noise_path_difference(state["layout"], layout_now)
    if path is not None and not fresh_noise:
        raise CheckpointMismatchError(
            f"The checkpoint's noise was drawn another way ({path}): the same generator state "
            "gives other noise there, so a run continued past the checkpoint and this resume "
            "would release the same batches with independent noise. Resume on the saved path "
            "(OPACUS_FSDP_SYNC_NOISE_KERNEL=0 for 'torch', auto or 1 for the same kernel "
            "version), or pass fresh_noise=True (from another kernel version, the only way)."
        )
    difference = _layout_difference(state["layout"], layout_now)
    if difference is not None and not fresh_noise:
        raise CheckpointMismatchError(
            f"The checkpoint's noise streams belong to another layout ({difference}): "
            "continuing them here would replay noise onto other coordinates. Resume on the "
            "saved layout (API, world size, mesh, placements) to continue exactly, or pass "
            "fresh_noise=True to keep the accountant and sampler and restart every noise "
            "generator from OS entropy."
        )
    if (engine.sampler is None) != (state["sampler"] is None):
        raise CheckpointMismatchError(
            "The checkpoint and this run disagree on the shared Poisson sampler (one has it, the "
            "other does not): resume with the same poisson_sampling and world layout."
        )
    now_sampler = {} if engine.sampler is None else engine.sampler.state_dict()
    for key in ("num_samples", "sample_rate", "steps") if now_sampler else ():
        if state["sampler"][key] != now_sampler[key]:
            raise CheckpointMismatchError(
                f"The checkpoint's sampler has {key}={state['sampler'][key]}, this run "
                f"{now_sampler[key]}: resume with the data loader (dataset and batch_size) "
                "of the run that saved it."
            )


def restore_dp_state(
    state: dict,
    engine,
    optimizer,
    *,
    fresh_noise: bool = False,
    resume_at: LedgerPosition | None = None,
    ledger: str | None = None,
) -> None:
    """Restores :func:`dp_state`'s output on this rank.

    Args:
        state: What :func:`dp_state` returned on this rank when the checkpoint was saved.
        engine: The engine of the resumed run, after ``make_private`` with the same settings.
        optimizer: Its DP optimizer.
        fresh_noise: Keep the accountant and sampler and restart every noise generator from OS
            entropy (on any layout; on the saved one too, for a resume whose earlier outputs
            may have been seen). Collective: every rank must pass the same value.
        resume_at: With ``fresh_noise``, the line's furthest position
            (:func:`resume_position`): the accountant counts every step up to it and the
            sampler draws on from it.
        ledger: The draw ledger's file, adopted by ``engine`` so that this run's draws and
            steps extend the line's (None: the one the state names, if any).

    Raises:
        CheckpointMismatchError: for a checkpoint of another configuration (names the setting),
            another layout without ``fresh_noise`` (names what differs), or another format
            version.
    """
    check_dp_state(state, engine, optimizer, fresh_noise=fresh_noise)
    # noise drawn ahead from the streams being replaced must not be added after the load
    optimizer_ops(optimizer).drop_noise_ahead()
    engine.accountant.load_state_dict(state["accountant"])
    if engine.draw_account is not None:  # draws of the run before the load: not this line's
        engine.draw_account.reset()
    if engine.sampler is not None:
        engine.sampler.load_state_dict(state["sampler"])
    if resume_at is not None:
        _move_to(engine, resume_at, state)
    ledger = ledger or state.get("ledger")
    if ledger is not None:
        engine.draw_ledger = DrawLedger(ledger, write=_rank_world()[0] == 0)
    same_layout = _layout_difference(state["layout"], noise_layout(engine, optimizer)) is None
    if same_layout:
        # torch's generators carry no DP noise (the engine never draws from them), but dropout
        # and the like continue as in the saved run
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
    _restore_loader_generator(engine, state, fresh=fresh_noise)
    if fresh_noise:
        reseed_noise(engine, optimizer)
        logger.warning(
            "[Ghost] fresh_noise=True: every noise generator restarted from OS entropy; the "
            "accountant and the sampler continue from the checkpoint"
        )
    elif state["noise_generator"] is not None:
        optimizer.generator.set_state(state["noise_generator"])
        streams, saved = _extra_streams(optimizer), state.get("noise_streams", [])
        if len(streams) != len(saved):
            raise CheckpointMismatchError(
                f"the checkpoint holds {len(saved) + 1} noise stream(s), this optimizer has "
                f"{len(streams) + 1}: resume on the same tensor-parallel layout, or pass "
                "fresh_noise=True"
            )
        for gen, saved_state in zip(streams, saved):
            gen.set_state(saved_state)


def _restore_loader_generator(engine, state: dict, *, fresh: bool) -> None:
    """Opacus's Poisson loader goes on from the saved stream, or (``fresh``) a new one.

    Without it a resumed run drew the saved run's first batches again (its generator restarts
    from the engine's seed: the same with ``dp_seed`` or a loader ``generator=``). ``fresh``:
    the saving run may have gone further, or ranks changed; this rank's stream is drawn anew
    from OS entropy (a ``dp_seed`` would give every fresh resume of one checkpoint the same
    masks). Under ``secure_mode`` the engine keeps no loader generator (Opacus's CSPRNG).
    """
    gen, saved = engine.loader_generator, state.get("loader_generator")
    if gen is None:
        return
    if fresh or saved is None:  # OS entropy, as every fresh noise stream (never dp_seed's)
        gen.set_state(seeded_generator(gen.device, os_seed()).get_state())
    else:
        gen.set_state(saved)


def _move_to(engine, position: LedgerPosition, state: dict) -> None:
    """Counts the steps from the checkpoint to ``position`` and draws on from there."""
    history = _history(state["accountant"])
    extra = position.steps - sum(entry[-1] for entry in history)
    engine.accountant.history = [tuple(entry) for entry in position.history]
    if engine.sampler is not None and position.handed_out is not None:
        engine.sampler.completed = max(engine.sampler.handed_out, position.handed_out)
    if extra:
        logger.warning(
            "[Ghost] fresh_noise=True: the run that saved this checkpoint went %d step(s) "
            "further; the accountant counts them and the sampler draws new batches from draw %s",
            extra,
            None if engine.sampler is None else engine.sampler.handed_out,
        )


def _history(accountant_state: dict) -> list:
    return list(accountant_state.get("history", []))


def reseed_noise(engine, optimizer) -> None:
    """Restarts ``optimizer``'s noise from OS entropy (collective; secure noise has no state)."""
    optimizer_ops(optimizer).reseed_noise()


def dp_state_path(path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its DP state inside checkpoint directory ``path``."""
    return os.path.join(path, f"dp_state_rank{rank}.pt")
