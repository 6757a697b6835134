"""The package's structure: one record per distributed API with every contract method, and no
import circle. Nothing distributed runs here."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from opacus_fsdp_sync.apis import ddp, fsdp1, fsdp2, single
from opacus_fsdp_sync.apis.api import GHOST_MODES, ApiRecord, GradientHandoff, StepController
from opacus_fsdp_sync.apis.registry import RECORDS, record_for
from opacus_fsdp_sync.optimizers import (
    FSDP1DPOptimizer,
    ShardedNoiseFSDPOptimizer,
    SharedNoiseDPOptimizer,
)
from opacus_fsdp_sync.optimizers.ops import DPOptimizerOps, OpacusOptimizerOps
from opacus_fsdp_sync.testing import house

#: Every class that plays a contract's part, by contract.
IMPLEMENTERS = {
    StepController: [
        single.NullController,
        ddp.DDPController,
        fsdp1.FSDP1Controller,
        fsdp2.FSDP2Controller,
    ],
    GradientHandoff: [
        single.SingleDeviceHandoff,
        ddp.DDPHandoff,
        fsdp1.FSDP1Handoff,
        fsdp2.FSDP2Handoff,
    ],
    DPOptimizerOps: [
        OpacusOptimizerOps,
        SharedNoiseDPOptimizer,
        ShardedNoiseFSDPOptimizer,
        FSDP1DPOptimizer,
    ],
}


def _members(protocol: type) -> set[str]:
    """A protocol's attributes and methods (what every implementer must have)."""
    names = set(protocol.__annotations__)
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return names


def test_every_api_has_a_record_with_every_builder():
    assert set(RECORDS) == {None, "ddp", "fsdp1", "fsdp2", "tp"}
    for name, record in RECORDS.items():
        assert isinstance(record, ApiRecord) and record.name == name
        assert record_for(name) is record
        for field in ("make_controller", "make_handoff", "plan_optimizer", "check_layout"):
            assert callable(getattr(record, field)), (name, field)
        assert (record.unsharded_bytes is not None) == record.capabilities.keep_unsharded
        modes = record.capabilities.ghost_modes
        assert modes and set(modes) <= set(GHOST_MODES), (name, modes)
    # Opacus's "ghost" hooks crash on FSDP parameters: the engine refuses it by this capability
    assert RECORDS["fsdp2"].capabilities.ghost_modes == ("ghost_fsdp",)
    assert RECORDS["fsdp1"].capabilities.ghost_modes == ("ghost_fsdp",)
    with pytest.raises(KeyError, match="unknown distributed API 'fsdp3'"):
        record_for("fsdp3")


@pytest.mark.parametrize("protocol", list(IMPLEMENTERS), ids=lambda p: p.__name__)
def test_every_implementer_has_every_contract_member(protocol):
    members = _members(protocol)
    assert members, protocol
    for cls in IMPLEMENTERS[protocol]:
        missing = [m for m in sorted(members) if not hasattr(cls, m)]
        assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"


def test_the_contract_test_sees_a_missing_method():
    class Incomplete:
        api = None
        requires_restricted = False
        enabled_message = ""

        def begin_first_pass(self) -> None:
            pass

    members = _members(StepController)
    assert {"end_first_pass", "abort"} <= {m for m in members if not hasattr(Incomplete, m)}


def test_the_package_has_no_import_circle():
    circles = house.import_circles()
    assert circles == [], circles


def test_the_circle_finder_finds_a_circle(tmp_path: Path):
    pkg = tmp_path / "opacus_fsdp_sync"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ..c import C  # annotations only: not a circle
            def later():
                from .. import a  # a lazy import still closes the circle
            """
        )
    )
    (pkg / "c.py").write_text("from .sub.b import later\n")
    assert house.import_circles(pkg) == [["opacus_fsdp_sync.a", "opacus_fsdp_sync.sub.b"]]


def test_the_engine_dispatches_through_records_not_api_names():
    """The engine, the step, the one-backward path and the DP state compare no API name."""
    import ast

    for name, path in house.modules().items():
        if name.endswith(("privacy_engine", "backward", "dp_state")) or ".one_backward" in name:
            switches = [n.lineno for n in ast.walk(ast.parse(path.read_text()))
                        if house._is_api_switch(n)]  # fmt: skip
            assert not switches, (name, switches)


def test_the_switch_counter_sees_a_switch():
    import ast

    tree = ast.parse('if api == "fsdp2" or root.api in (FSDP1, None): pass')
    assert sum(house._is_api_switch(n) for n in ast.walk(tree)) == 2


def test_the_module_map_is_generated_from_the_tree():
    """docs/layout.md is what the tree's docstrings say: a row per module, none for a module
    that is gone (regenerate with ``python -m opacus_fsdp_sync.testing.module_map``)."""
    import re

    from opacus_fsdp_sync.testing import module_map

    root = house.package_root()
    committed = (root.parent / module_map.MAP_PATH).read_text(encoding="utf-8")
    rows = set()
    folder = None
    for line in committed.splitlines():
        if m := re.match(r"## `(.+)/`$", line):
            folder = m.group(1)
        elif (m := re.match(r"\| `([\w.]+\.py)` \|", line)) and folder:
            rows.add(f"{folder}/{m.group(1)}")
    on_disk = {
        p.relative_to(root.parent).as_posix()
        for p in root.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert not on_disk - rows, f"modules without a row: {sorted(on_disk - rows)}"
    assert not rows - on_disk, f"rows for missing modules: {sorted(rows - on_disk)}"
    assert committed == module_map.render(root), "docs/layout.md is stale: regenerate it"


def test_no_module_only_re_exports_another():
    """Code that moved leaves no shim behind (a shim doubles the boxes a reader must open)."""
    assert house.counts().re_exports == ()
    shim = ast.parse('"""Moved."""\nfrom .a import b\n__all__ = ["b"]\n')
    assert house.is_re_export(shim) and not house.is_re_export(ast.parse("def f():\n    pass\n"))


def test_modules_stay_short_and_foreign_attributes_stay_in_the_internals():
    """Every module reads as one job (at most 420 lines), and attribute probes
    (``getattr``/``hasattr``) of Opacus's, Hugging Face's and torch's objects live in the
    ``_internals`` modules: at most 40 elsewhere."""
    c = house.counts()
    assert c.longest[1] <= 420, c.longest
    assert c.probes <= 40, c.probes


def test_no_two_rooms_import_each_other():
    """Folders (and loose top-level modules) form no circle, imports inside functions included:
    mechanics below the records, the records below the step."""
    assert house.folder_circles() == []


def test_the_room_circle_finder_sees_a_lazy_import_up_a_floor(tmp_path: Path):
    pkg = tmp_path / "opacus_fsdp_sync"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("def later():\n    from ..high import a\n")
    (pkg / "low" / "c.py").write_text("from . import b\n")  # same room: no circle
    assert house.folder_circles(pkg) == [["opacus_fsdp_sync.high", "opacus_fsdp_sync.low"]]
