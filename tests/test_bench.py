"""The benchmark part (``opacus_fsdp_sync.bench``): its modes table, its shims, and the rule that
the core package never imports it."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import opacus_fsdp_sync
from opacus_fsdp_sync.bench import modes as bench_modes

PACKAGE = Path(opacus_fsdp_sync.__file__).resolve().parent
BENCH = "opacus_fsdp_sync.bench"

#: The modes table as it was written out by hand before it was generated (a frozen copy; the
#: reference for the generated table): name -> (private, engine_kwargs, grad_sample_mode,
#: description), in the original order.
FROZEN_MODES = {
    "no_dp": (False, {}, "ghost_fsdp", "non-private FSDP (the floor)"),
    "ghost_fsdp": (
        True,
        {"sync_optimization": False},
        "ghost_fsdp",
        "upstream Opacus ghost clipping (both passes synced)",
    ),
    "ghost_fsdp_sync": (
        True,
        {"restricted_first_pass": False, "keep_unsharded": False, "one_backward": False},
        "ghost_fsdp",
        "ours: first backward without gradient sync",
    ),
    "ghost_fsdp_keep": (
        True,
        {"restricted_first_pass": False, "keep_unsharded": True, "one_backward": False},
        "ghost_fsdp",
        "ours: + parameters kept unsharded between the passes",
    ),
    "ghost_fsdp_restricted": (
        True,
        {"restricted_first_pass": True, "keep_unsharded": False, "one_backward": False},
        "ghost_fsdp",
        "ours: + first backward w.r.t. activations only",
    ),
    "ghost_fsdp_parity": (
        True,
        {"restricted_first_pass": True, "keep_unsharded": True, "one_backward": False},
        "ghost_fsdp",
        "ours: both (the non-private step's collectives)",
    ),
    "ghost_fsdp_one_backward_ghost_norms": (
        True,
        {"restricted_first_pass": True, "one_backward": True, "per_sample_grads": False},
        "ghost_fsdp",
        "ours: one backward, ghost norms for every layer (no per-sample gradients)",
    ),
    "ghost_fsdp_one_backward_full_gram": (
        True,
        {
            "restricted_first_pass": True,
            "one_backward": True,
            "per_sample_grads": False,
            "gram_block": 0,
        },
        "ghost_fsdp",
        "A/B for gram_block: as ..._ghost_norms, with full Gram matrices",
    ),
    "ghost_fsdp_one_backward_per_sample": (
        True,
        {"restricted_first_pass": True, "one_backward": True, "per_sample_grads": True},
        "ghost_fsdp",
        "ours: one backward, per-sample gradients for every sequence Linear layer",
    ),
    "ghost_fsdp_one_backward": (
        True,
        {"restricted_first_pass": True, "one_backward": True},
        "ghost_fsdp",
        "ours (default): one backward, per-sample gradients where cheaper",
    ),
    "ghost_fsdp_one_backward_tuned": (
        True,
        {"restricted_first_pass": True, "one_backward": True, "tune_norms": True},
        "ghost_fsdp",
        "A/B for tune_norms: the default with norm strategies tuned (also on CPU)",
    ),
    "ghost_fsdp_one_backward_untuned": (
        True,
        {"restricted_first_pass": True, "one_backward": True, "tune_norms": False},
        "ghost_fsdp",
        "A/B for tune_norms: the default with the static norm rules (tuning off)",
    ),
    "ghost_fsdp_one_backward_fused_kernels": (
        True,
        {"restricted_first_pass": True, "one_backward": True, "fused_kernels": True},
        "ghost_fsdp",
        "A/B for fused_kernels: the default with the fused Triton kernels for Linear layers",
    ),
}


def test_generated_modes_equal_the_frozen_hand_written_table():
    fields = [f.name for f in dataclasses.fields(bench_modes.ModeSpec)]
    assert fields == ["private", "engine_kwargs", "grad_sample_mode", "description"]
    got = {
        name: (spec.private, spec.engine_kwargs, spec.grad_sample_mode, spec.description)
        for name, spec in bench_modes.MODES.items()
    }
    assert list(got) == list(FROZEN_MODES)  # same names, same order (tables and plots use it)
    assert got == FROZEN_MODES
    for name, (_, kwargs, _, _) in FROZEN_MODES.items():  # and the same key order
        assert list(bench_modes.MODES[name].engine_kwargs) == list(kwargs), name


def test_get_mode_names_the_allowed_modes():
    assert bench_modes.get_mode("ghost_fsdp_parity") is bench_modes.MODES["ghost_fsdp_parity"]
    with pytest.raises(ValueError, match="mode='nope': choose one of no_dp, ghost_fsdp, "):
        bench_modes.get_mode("nope")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_modules() -> dict[str, Path]:
    mods = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    core = {n: p for n, p in mods.items() if not (n + ".").startswith(BENCH + ".")}
    assert "opacus_fsdp_sync.privacy_engine" in core and len(core) > 30  # the walk found them
    return core


def _imported(name: str, path: Path):
    """Yields ``(target module, inside a module-level __getattr__)`` for each import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lazy = {
        id(node)
        for fn in tree.body
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"
        for node in ast.walk(fn)
    }

    def resolve(module: str | None, level: int) -> str:
        if not level:
            return module or ""
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        return f"{base}.{module}" if module else base

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in lazy
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node.module, node.level)
            yield base, id(node) in lazy
            for alias in node.names:  # ``from . import bench`` names a module too
                yield f"{base}.{alias.name}", id(node) in lazy
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            target = node.args[0].value
            dots = len(target) - len(target.lstrip("."))
            yield resolve(target.lstrip(".") or None, dots), id(node) in lazy


def _is_under(target: str, module: str) -> bool:
    return target == module or target.startswith(module + ".")


def test_core_package_never_imports_the_benchmark_part():
    offenders = []
    for name, path in _core_modules().items():
        for target, lazy in _imported(name, path):
            if _is_under(target, BENCH):
                offenders.append(f"{name} imports {target}{' (lazily)' if lazy else ''}")
    assert not offenders, "\n".join(offenders)


def test_importing_the_core_package_loads_no_benchmark_module():
    names = sorted(n for n in _core_modules() if not n.endswith(".__main__"))
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({BENCH!r}))\n"
        "print(len(bad)); print(bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[:2] == ["0", "[]"], proc.stdout


def test_default_mode_runs_the_engines_default_options():
    from opacus_fsdp_sync.options import GhostOptions

    defaults = GhostOptions()
    spec = bench_modes.MODES[bench_modes.DEFAULT_MODE]
    assert spec.private and spec.engine_kwargs
    for name, value in spec.engine_kwargs.items():
        assert getattr(defaults, name) == value, name
