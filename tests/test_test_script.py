"""scripts/test.sh installs each run's torch from its requirements file (one source of truth).

A stand-in interpreter records what the script asks of it, so nothing is installed.
"""

import os
import subprocess
from pathlib import Path

from opacus_fsdp_sync.distributed.version_gate import TESTED_TORCH_VERSIONS

ROOT = Path(__file__).resolve().parents[1]


def _pins():
    pins = {}
    for run in ("oldest", "newest"):
        lines = (ROOT / f"requirements/torch-{run}.txt").read_text().splitlines()
        pins[run] = [line.split("==")[1] for line in lines if line.startswith("torch==")]
    return pins


def _run_script(tmp_path, **env):
    fake = tmp_path / "venv/bin/python"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/usr/bin/env bash\necho "CALLED $*" >&2\n')
    fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    full.update(PYTHON=str(fake), NEWEST_VENV=str(tmp_path / "venv"), **env)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/test.sh")], env=full, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "pip install" in line]


def test_requirements_files_pin_the_tested_releases():
    pins = _pins()
    assert all(len(v) == 1 for v in pins.values()), pins
    minors = tuple(".".join(v[0].split(".")[:2]) for v in pins.values())
    assert minors == (TESTED_TORCH_VERSIONS[0], TESTED_TORCH_VERSIONS[-1])


def test_each_run_installs_torch_from_its_requirements_file(tmp_path):
    installs = _run_script(tmp_path)
    torch_lines = [line for line in installs if "-e .[" not in line]
    # The package with the fused kernels' test extra (triton for the CPU interpreter), per run.
    assert sum("-e .[dev,kernels-test]" in line for line in installs) == 2, installs
    assert [line.split("install -q ")[1] for line in torch_lines] == [
        "-r requirements/torch-oldest.txt",
        "-r requirements/torch-newest.txt",
    ]


def test_an_override_installs_that_version(tmp_path):
    installs = _run_script(tmp_path, TORCH_RUNS="newest", TORCH_NEWEST="2.14.1")
    assert installs[0].endswith("pip install -q torch==2.14.1"), installs
