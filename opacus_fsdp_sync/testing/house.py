"""Measures of the package's structure: import circles, contract probes, API switches, sizes.

Read from the source with :mod:`ast` (nothing is imported). ``python -m
opacus_fsdp_sync.testing.house`` prints them; the tests hold the targets (no import circle).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "opacus_fsdp_sync"
#: The names the distributed APIs carry; comparing against them belongs to detection.
API_NAMES = {"fsdp2", "fsdp1", "ddp"}
#: The constants that hold them.
API_CONSTANTS = {"FSDP2", "FSDP1", "DDP"}


def package_root() -> Path:
    """The package's source directory."""
    return Path(__file__).resolve().parents[1]


def modules(root: Path | None = None) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    root = root or package_root()
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"
            ):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def imports(root: Path | None = None) -> dict[str, set[str]]:
    """Each module's imports of other package modules, at any depth of the file (lazy too).

    Imports under ``if TYPE_CHECKING:`` are left out: they never run.
    """
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_package, node)
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def import_circles(root: Path | None = None) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (Tarjan).

    A package importing its own submodules (``__init__`` re-exports) is not counted: a module
    imports its package's ``__init__`` only to reach a sibling, which the graph keeps.
    """
    graph = imports(root)
    for name in graph:  # edges into a parent package's __init__ are how Python finds siblings
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of more than one node that reach each other in ``graph`` (Tarjan)."""
    graph = {v: {w for w in ws if w in graph} for v, ws in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def room(name: str) -> str:
    """A module's room: its folder (sub-package), or itself when it lies loose at the top."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else name


def rooms(root: Path | None = None) -> set[str]:
    """Every room of the package: each sub-package and each loose top-level module."""
    return {room(name) for name in modules(root) if name != PACKAGE}


def folder_circles(root: Path | None = None) -> list[list[str]]:
    """Groups of rooms that import each other around a circle.

    Imports inside functions count: a lazy import that reaches up a floor is still a circle.
    """
    graph: dict[str, set[str]] = {}
    for name, targets in imports(root).items():
        if name == PACKAGE:
            continue
        here = room(name)
        graph.setdefault(here, set()).update(
            room(t) for t in targets if t != PACKAGE and room(t) != here
        )
    return _strongly_connected(graph)


@dataclass(frozen=True)
class HouseCounts:
    """What the restructuring targets, counted."""

    probes: int
    """``getattr``/``hasattr`` calls outside the ``_internals`` modules."""
    api_switches: int
    """Comparisons against an API name string outside detection and the records."""
    circles: int
    """Import circles between modules."""
    longest: tuple[str, int]
    """The longest module and its line count."""
    re_exports: tuple[str, ...] = ()
    """Modules (not packages) that only re-export names defined elsewhere."""
    folder_circles: int = 0
    """Import circles between rooms (folders, loose top-level modules), lazy imports included."""
    rooms: int = 0
    """Rooms: sub-packages and loose top-level modules."""


def _is_probe(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
    )


def _is_api_switch(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    for op in operands:
        if isinstance(op, ast.Constant) and op.value in API_NAMES:
            return True
        elements = op.elts if isinstance(op, (ast.Tuple, ast.Set, ast.List)) else [op]
        for e in elements:
            if isinstance(e, ast.Constant) and e.value in API_NAMES:
                return True
            if isinstance(e, ast.Name) and e.id in API_CONSTANTS:
                return True
    return False


def is_re_export(tree: ast.Module) -> bool:
    """Whether a module's body is only a docstring, imports, ``__all__`` and no definition."""
    body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # docstring
    ]
    imports_only = all(
        isinstance(n, (ast.Import, ast.ImportFrom))
        or (
            isinstance(n, ast.Assign)
            and all(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
        )
        for n in body
    )
    return bool(body) and imports_only


def counts(root: Path | None = None) -> HouseCounts:
    """Counts :class:`HouseCounts` over the package (benchmark clients and train/ included)."""
    probes = switches = 0
    longest = ("", 0)
    re_exports = []
    for name, path in modules(root).items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > longest[1]:
            longest = (name, lines)
        tree = ast.parse(text)
        if path.name != "__init__.py" and is_re_export(tree):
            re_exports.append(name)
        if "_internals" not in name:
            probes += sum(_is_probe(n) for n in ast.walk(tree))
        if not name.endswith(("distributed.detect", "apis.registry")):
            switches += sum(_is_api_switch(n) for n in ast.walk(tree))
    return HouseCounts(
        probes,
        switches,
        len(import_circles(root)),
        longest,
        tuple(re_exports),
        len(folder_circles(root)),
        len(rooms(root)),
    )


def main() -> None:
    """Prints the counts and every import circle."""
    c = counts()
    print(f"getattr/hasattr outside _internals: {c.probes}")
    print(f"API-name comparisons outside detection: {c.api_switches}")
    print(f"import circles: {c.circles}")
    for group in import_circles():
        print("  " + " <-> ".join(group))
    print(f"longest module: {c.longest[0]} ({c.longest[1]} lines)")
    print(f"re-export modules: {len(c.re_exports)} {list(c.re_exports)}")
    print(f"circles between rooms: {c.folder_circles}")
    for group in folder_circles():
        print("  " + " <-> ".join(group))
    print(f"rooms (folders and loose top-level modules): {c.rooms}")


if __name__ == "__main__":
    main()
