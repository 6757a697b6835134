"""One torch version gate: the warning for an untested torch, versioned errors, clean failures."""

import json
import subprocess
import sys

import pytest
import torch

from opacus_fsdp_sync.distributed import version_gate
from opacus_fsdp_sync.distributed._ddp_internals import DDPInternalsError
from opacus_fsdp_sync.distributed._fsdp2_internals import FSDPInternalsError
from opacus_fsdp_sync.testing import run_ranks
from tests import workers_version_gate as w

#: Imports the package fresh under a faked torch version; prints the gate's warnings as JSON.
_IMPORT_UNDER = """
import json, sys, warnings
import torch
torch.__version__ = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import opacus_fsdp_sync
    from opacus_fsdp_sync.distributed import _ddp_internals, _fsdp1_internals, _fsdp2_internals
    from opacus_fsdp_sync.distributed import version_gate
    again = version_gate.warn_if_untested()
ours = [w for w in caught if "opacus_fsdp_sync was tested" in str(w.message)]
print(json.dumps({
    "messages": [str(w.message) for w in ours],
    "categories": [w.category.__name__ for w in ours],
    "again": again,
}))
"""


def _import_under(version: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_UNDER, version],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_untested_torch_warns_once_at_import_naming_both_versions():
    res = _import_under("2.99.0+cu999")
    assert len(res["messages"]) == 1, res  # one warning, however many internals modules load
    message = res["messages"][0]
    assert "torch 2.99.0+cu999" in message, message
    for tested in version_gate.TESTED_TORCH_VERSIONS:
        assert tested in message, message
    assert res["categories"] == ["UserWarning"]
    assert res["again"] is False  # a later check stays silent


def test_tested_torch_imports_silently():
    assert _import_under(f"{version_gate.TESTED_TORCH_VERSIONS[0]}.0+cpu")["messages"] == []


def test_tested_versions_parse_as_major_minor():
    assert version_gate.torch_minor("2.15.0+cu132") == "2.15"
    assert version_gate.is_tested("2.13.0+cpu") == ("2.13" in version_gate.TESTED_TORCH_VERSIONS)
    assert not version_gate.is_tested("2.99.1")


def test_setup_py_admits_exactly_the_tested_range():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    lo, hi = version_gate.TESTED_TORCH_VERSIONS[0], version_gate.TESTED_TORCH_VERSIONS[-1]
    major, minor = hi.split(".")
    assert f'"torch>={lo},<{major}.{int(minor) + 1}"' in setup


def test_internals_errors_share_one_base_and_name_version_and_feature():
    assert issubclass(FSDPInternalsError, version_gate.TorchInternalsError)
    assert issubclass(DDPInternalsError, version_gate.TorchInternalsError)
    with pytest.raises(FSDPInternalsError) as info:
        with version_gate.private_access(
            "the feature", "Owner._attr", "The remedy.", cls=FSDPInternalsError
        ):
            object()._attr  # noqa: B018 - the failing private access
    err = info.value
    assert f"torch {torch.__version__}" in str(err)
    assert "the feature needs Owner._attr" in str(err)
    assert version_gate.tested_versions_text() in str(err)
    assert "The remedy." in str(err)
    assert err.feature == "the feature" and err.torch_version == torch.__version__
    assert isinstance(err.__cause__, AttributeError)


@pytest.mark.distributed
def test_broken_private_accessor_raises_versioned_error_naming_the_feature():
    """FSDP2 groups without ``reduce_grads``: the step fails with the torch version and the
    feature, not a bare AttributeError (the engine's cleanup after it does not mask it)."""
    for res in run_ranks(w.broken_sync_flag_accessor, 2, timeout=300):
        assert res["type"] == "FSDPInternalsError", res
        assert f"torch {torch.__version__}" in res["message"], res
        assert "the FSDP2 sync-skipping step" in res["message"], res
        assert "FSDPParamGroup.reduce_grads" in res["message"], res
        assert res["feature"] == "the FSDP2 sync-skipping step", res


@pytest.mark.distributed
def test_failed_recovery_never_masks_the_step_error():
    """A step fails and its recovery fails too (no ``reset_iter_state``): the user gets the
    step's own error with the recovery error attached, and the next step refuses to run."""
    for res in run_ranks(w.failed_step_with_failed_recovery, 2, timeout=300):
        failed = res["failed"]
        assert failed["type"] == "ValueError", res
        assert failed["message"] == "injected hand-off failure", res
        assert failed["abort_type"] == "FSDPInternalsError", res
        assert failed["abort_feature"] == "recovering FSDP2 after a failed step", res
        assert f"torch {torch.__version__}" in failed["abort_message"], res
        assert "reset_iter_state" in failed["abort_message"], res
        if sys.version_info >= (3, 11):
            assert any(failed["abort_message"] in note for note in failed["notes"]), res
        nxt = res["next"]
        assert nxt["type"] == "FSDPInternalsError", res
        assert "earlier step failed" in nxt["message"], res
        assert "reset_iter_state" in nxt["message"], res
