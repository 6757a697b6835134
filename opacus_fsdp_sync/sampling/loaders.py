"""Which Poisson data loader a ``make_private`` call gets, its draws seeded from the engine.

Ghost modes with Poisson sampling get the shared draw (:mod:`.poisson`) on any number of ranks:
every rank the same logical and physical steps, the global batch a single-process Poisson
sample, every draw handed out once and counted by the accountant as it is; the ranks of one
data-parallel group (the tp ranks, :class:`~..distributed.layout.Layout`) take the same share.
Other modes get Opacus's Poisson loader, its generator from the engine's
:class:`~..randomness.DPRandomness` (Opacus would draw from torch's global generator): on
several ranks one stream per rank (:meth:`~..randomness.DPRandomness.rank_generator`), since
each rank draws its own records' mask and a shared stream would draw the same positions on every
rank. The log says which.
"""

from __future__ import annotations

import logging

from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader

from ..distributed.layout import Layout, rank
from ..randomness import DPRandomness
from .poisson import SharedPoissonDataLoader

logger = logging.getLogger("opacus_fsdp_sync")


def dp_data_loader(
    data_loader: DataLoader,
    *,
    ghost: bool,
    layout: Layout,
    randomness: DPRandomness,
    secure_mode: bool,
    poisson_sampling: bool,
    distributed: bool,
    batch_first: bool = True,
    rand_on_empty: bool = False,
) -> DataLoader | None:
    """The call's Poisson data loader, or None where Opacus's own preparation applies.

    Args:
        data_loader: The user's loader.
        ghost: Whether the call is in a ghost mode.
        layout: The call's layout (its data-parallel rank and degree are the sampler's shares).
        randomness: The engine's source of DP seeds.
        secure_mode: The engine's.
        poisson_sampling: As in Opacus's ``make_private``.
        distributed: Whether the layout is distributed.
        batch_first: As in Opacus's ``make_private``.
        rand_on_empty: As in Opacus's ``make_private``.
    """
    if poisson_sampling and ghost:
        return SharedPoissonDataLoader.from_data_loader(
            data_loader,
            seed=randomness.sampler_seed(
                data_loader, secure_mode=secure_mode, distributed=distributed
            ),
            rank=layout.dp_rank if distributed else 0,
            world_size=layout.dp_degree if distributed else 1,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
        )
    if ghost:  # a warning: the accountant still reports an epsilon for this run
        logger.warning(
            "[Ghost] sampling: fixed batches (poisson_sampling=False): the reported epsilon "
            "assumes Poisson sampling and does not hold for this run"
        )
    if poisson_sampling and not secure_mode:
        return DPDataLoader.from_data_loader(
            data_loader,
            generator=randomness.sampler_generator(
                data_loader, secure_mode=secure_mode, rank=rank() if distributed else 0
            ),
            distributed=distributed,
            batch_first=batch_first,
            rand_on_empty=rand_on_empty,
        )
    return None


def loader_generator(data_loader: DataLoader):
    """The generator of Opacus's Poisson loader ``data_loader`` draws from (None: another loader).

    Its state is part of a checkpoint's DP state: a resumed run continues the stream rather than
    drawing the first batches again.
    """
    if not isinstance(data_loader, DPDataLoader):
        return None
    return vars(data_loader.batch_sampler).get("generator")
