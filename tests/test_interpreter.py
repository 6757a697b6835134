"""Subprocesses start the running interpreter (``sys.executable``, ``$PYTHON``), never a bare
``python3`` from PATH: in a virtual environment that is not activated, PATH's interpreter has
another torch, or none."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Python: the interpreter's bare name as a whole string (an argv element or a shell line).
_BARE_PY = re.compile(r"""["']python3?(\s[^"']*)?["'](?!\s*:)""")
#: Shell: the bare name as the command of a line or of a pipeline part.
_BARE_SH = re.compile(r"""(^|[;&|(]|\bexec)\s*python3?\s""")


def _sources():
    for folder in ("opacus_fsdp_sync", "tests", "memory_test", "examples", "scripts", ".ci"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".sh", "") and path.is_file() and path.name != "__pycache__":
                yield path


def test_no_subprocess_starts_a_bare_python():
    offenders = []
    for path in _sources():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            bare = _BARE_PY if path.suffix == ".py" else _BARE_SH
            if bare.search(code) and "PYTHON:-python3" not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_check_catches_a_bare_python():
    bare = "python" + "3"  # spelled so that this file does not trip the project's own grep
    assert _BARE_PY.search(f'cmd = ["{bare}", "-m", "pytest"]')
    assert _BARE_PY.search(f"subprocess.run('{bare} x.py', shell=True)")
    assert not _BARE_PY.search("cmd = [sys.executable, '-m', 'pytest']")
    assert not _BARE_PY.search('{"python": platform.python_version()}')
    assert _BARE_SH.search(f"{bare} memory_test/x.py --out y")
    assert _BARE_SH.search("cd x && python -m pytest")
    assert not _BARE_SH.search('"$PYTHON" -m pytest')
