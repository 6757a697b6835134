"""Subprocesses start the running interpreter (``sys.executable``, ``$PYTHON``), never a bare
``python3`` from PATH: in a virtual environment that is not activated, PATH's interpreter has
another torch, or none. The suite's shell scripts default to ``PYTHON=${PYTHON:-python3}``, so a
test that starts one must pass ``PYTHON`` in its environment."""

import ast
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


def _starts_a_shell_script(call: ast.Call, assigned: dict[str, ast.AST]) -> bool:
    """``subprocess.*(["bash", ...])`` or a command whose first element names a ``.sh`` file
    (the command may be a name ``assigned`` in the same function)."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return False
    if func.value.id != "subprocess" or not call.args:
        return False
    cmd = call.args[0]
    if isinstance(cmd, ast.Name) and cmd.id in assigned:
        cmd = assigned[cmd.id]
    first = cmd.elts[0] if isinstance(cmd, (ast.List, ast.Tuple)) and cmd.elts else cmd
    text = ast.unparse(first)
    return text.strip("'\"") in ("bash", "sh") or ".sh" in text


def _sets_python(node: ast.AST) -> bool:
    """Whether ``node`` passes ``PYTHON`` on: ``dict(..., PYTHON=...)``, ``{"PYTHON": ...}``,
    ``env["PYTHON"] = ...`` or ``f(..., PYTHON=...)``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.keyword) and sub.arg == "PYTHON":
            return True
        if isinstance(sub, ast.Dict) and any(
            isinstance(k, ast.Constant) and k.value == "PYTHON" for k in sub.keys
        ):
            return True
        if isinstance(sub, ast.Subscript) and ast.unparse(sub.slice).strip("'\"") == "PYTHON":
            return True
    return False


def _scripts_started_without_python(source: str) -> list[str]:
    """Functions that start a shell script without putting ``PYTHON`` into its environment."""
    tree = ast.parse(source)
    bad = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned = {
            target.id: node.value
            for node in ast.walk(fn)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        calls = [
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call) and _starts_a_shell_script(c, assigned)
        ]
        if calls and not _sets_python(fn):
            bad.append(f"{fn.name} (line {calls[0].lineno})")
    return bad


def test_tests_that_start_a_shell_script_pass_their_interpreter():
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for where in _scripts_started_without_python(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}: {where}")
    assert not offenders, "start the script with PYTHON=sys.executable:\n" + "\n".join(offenders)


def test_the_check_catches_a_script_started_without_python():
    before = """
def _run(tmp_path, **env):
    full = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True)
"""
    assert _scripts_started_without_python(before) == ["_run (line 4)"]
    after = before.replace(
        'CUDA_VISIBLE_DEVICES=""', 'CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable'
    )
    assert _scripts_started_without_python(after) == []
    inline = 'def t():\n    subprocess.run([str(ROOT / "scripts/test.sh")], env={"PYTHON": py})\n'
    assert _scripts_started_without_python(inline) == []
    assert _scripts_started_without_python(inline.replace('"PYTHON"', '"OUT"')) == ["t (line 2)"]
    named = 'def t():\n    cmd = ["bash", str(SCRIPT)]\n    subprocess.run(cmd, env=os.environ)\n'
    assert _scripts_started_without_python(named) == ["t (line 3)"]
