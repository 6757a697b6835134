"""API detection, the FSDP1 refusal and the collective counter."""

import pytest

from opacus_fsdp_sync import get_fsdp_root_module
from opacus_fsdp_sync.testing import run_ranks
from tests import workers_misc
from tests.models import ToyNet


def test_bare_model_has_no_api():
    mods, api = get_fsdp_root_module(ToyNet())
    assert api is None and mods == []


def test_rejects_non_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        get_fsdp_root_module(object())


@pytest.mark.distributed
def test_detection_refusal_and_counter():
    res = run_ranks(workers_misc.detection, 2, timeout=200)[0]
    assert res["fsdp2_root"] == ("fsdp2", 1, True)
    assert res["fsdp2_blocks_only"] == ("fsdp2", 3, True)
    assert res["fsdp2_through_gsm"] == ("fsdp2", True)
    assert res["ddp"] == "ddp"
    assert res["fsdp1"] == "fsdp1"
    assert res["fsdp1_error"] is None  # accepted (refusals: tests/test_fsdp1.py)
    assert res["counter"] == {"probe": {"all_reduce": {"count": 1, "bytes": 4000}}}
