"""The FSDP2/DTensor accessors fail loudly on what they were not verified for."""

import pytest
import torch

from opacus_fsdp_sync.distributed._fsdp2_internals import FSDPInternalsError, dtensor_like


def test_dtensor_like_refuses_a_plain_tensor_with_the_way_out():
    with pytest.raises(FSDPInternalsError, match="DTensor._spec.*sync_optimization=False"):
        dtensor_like(torch.zeros(3), torch.ones(3))
