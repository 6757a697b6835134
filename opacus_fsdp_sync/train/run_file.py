"""Run files: ``--config run.toml`` (or ``.yaml`` when PyYAML is installed).

A run file holds the fields of the trainer's config dataclass one to one
(``max_grad_norm = 1.0``); the flags given on the command line override it. Relative paths of
the input fields (``data``, ``model_path``, ``init_from``) are read against the run file's
directory, so that a run file and the data shipped beside it work from any working directory;
``out`` stays relative to where the run is launched.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: Fields that name inputs, resolved against the run file's directory when relative.
INPUT_PATHS = ("data", "model_path", "init_from")


def _base_type(field: dataclasses.Field) -> tuple[str, bool]:
    """``(base type name, whether None is allowed)`` from the field's annotation string."""
    kind = str(field.type)
    return kind.split(" ")[0], "None" in kind


def _read(path: Path) -> dict:
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10: the same parser as a package
            try:
                import tomli as tomllib
            except ImportError as err:
                raise ValueError(f"config={str(path)!r}: TOML needs Python 3.11+ or tomli") from err
        try:
            with path.open("rb") as f:
                return tomllib.load(f)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"config={str(path)!r}: {err}") from err
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:
            raise ValueError(f"config={str(path)!r}: a YAML run file needs PyYAML") from err
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"config={str(path)!r}: the file must map field names to values")
        return values
    raise ValueError(f"config={str(path)!r}: give a .toml (or, with PyYAML, .yaml) file")


def load_run_file(path: str, schema: type) -> dict:
    """The values of ``schema``'s fields a run file sets (fields it leaves out are not returned).

    Args:
        path: a ``.toml`` file, or ``.yaml``/``.yml`` with PyYAML installed.
        schema: the config dataclass (``TrainConfig``) whose fields the keys must name.

    Returns:
        ``{field name: value}``, each value of the field's type.

    Raises:
        ValueError: for a missing or unreadable file, a key that is no field (naming it and the
            known fields) or a value of the wrong type (naming the field).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config={path!r}: no such file")
    values = _read(file)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"config={path!r}: unknown key(s) {', '.join(map(repr, unknown))}; the known fields "
            f"are {', '.join(fields)}"
        )
    checked = {}
    for name, value in values.items():
        base, optional = _base_type(fields[name])
        if value is None and optional:
            checked[name] = None
            continue
        if base == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # ``lr = 1`` in TOML is an int
        wanted = {"int": int, "float": float, "bool": bool, "str": str}[base]
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise ValueError(
                f"config={path!r}: {name} = {value!r} is a {type(value).__name__}; the field "
                f"takes a {base}"
            )
        if name in INPUT_PATHS and not Path(value).is_absolute():
            value = str(file.parent / value)
        checked[name] = value
    return checked
