"""The module map (``docs/layout.md``), generated from the modules' own docstrings.

Each folder of the package is a section headed by its ``__init__`` docstring's first line; each
module is a row with the first line of its docstring. Read with :mod:`ast` (nothing is
imported). ``python -m opacus_fsdp_sync.testing.module_map`` rewrites the file; a test fails
when the committed map differs from the tree (a module without its row, a row for a module that
is gone, a docstring that changed).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from .house import PACKAGE, package_root

#: Where the map lives, relative to the repository root.
MAP_PATH = Path("docs") / "layout.md"

_HEADER = """# Module map

Generated from the modules' docstrings by `python -m {package}.testing.module_map`; do not
edit by hand (a test compares it with the tree). One section per folder, one row per module,
with the first line of its docstring. The tour of one private step is in the README; how the
pieces work together is in [how_it_works.md](how_it_works.md).
"""


def first_line(path: Path) -> str:
    """The first line of a module's docstring ("(no docstring)" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        return "(no docstring)"
    return doc.strip().splitlines()[0].strip().replace("|", "\\|")


def render(root: Path | None = None) -> str:
    """The module map of the package under ``root`` (default: this package), as Markdown."""
    root = root or package_root()
    folders: dict[Path, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        folders.setdefault(path.parent, []).append(path)
    out = [_HEADER.format(package=PACKAGE)]
    for folder in sorted(folders, key=lambda f: (f != root, str(f))):
        rel = folder.relative_to(root.parent).as_posix()
        init = folder / "__init__.py"
        title = first_line(init) if init.exists() else ""
        out.append(f"## `{rel}/`\n\n{title}\n\n| module | what it is |\n| --- | --- |")
        for path in folders[folder]:
            if path.name == "__init__.py":
                continue
            out.append(f"| `{path.name}` | {first_line(path)} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Writes (or, with ``--check``, compares) the module map."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=package_root().parent / MAP_PATH)
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="exit 1 when the file differs from the tree instead of writing it",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{args.out} is stale: run python -m {PACKAGE}.testing.module_map")
        return
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
