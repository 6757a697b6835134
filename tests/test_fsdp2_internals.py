"""The FSDP2/DTensor accessors fail loudly on what they were not verified for."""

import pytest
import torch

from opacus_fsdp_sync.distributed._fsdp2_internals import FSDPInternalsError, swap_local


def test_swap_local_refuses_a_plain_tensor_with_the_way_out():
    with pytest.raises(FSDPInternalsError, match="_local_tensor.*sync_optimization=False"):
        swap_local(torch.zeros(3), torch.ones(3))


def test_swap_local_refuses_a_mismatched_local_tensor():
    class Fake:  # stands in for a DTensor: only the attribute is read
        _local_tensor = torch.zeros(4, 2)

    with pytest.raises(ValueError, match="does not match"):
        swap_local(Fake(), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="does not match"):
        swap_local(Fake(), torch.zeros(4, 2, dtype=torch.float64))
