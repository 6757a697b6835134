"""Results name the code that measured them: the checkout's commit and whether it was modified."""

import json
import subprocess

from opacus_fsdp_sync.bench.provenance import code_version
from opacus_fsdp_sync.bench.results_io import save


def _git(root, *args):
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, timeout=30
    ).stdout.strip()


def test_commit_and_modified_follow_the_checkout(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert code_version(repo) == {"commit": head, "modified": False}
    (repo / "results.json").write_text("{}")  # untracked: a result being written
    assert code_version(repo)["modified"] is False
    (repo / "a.py").write_text("x = 2\n")  # a tracked file changed
    assert code_version(repo) == {"commit": head, "modified": True}


def test_outside_a_checkout_or_below_its_top_both_are_unknown(tmp_path):
    assert code_version(tmp_path) == {"commit": None, "modified": None}
    _git(tmp_path, "init", "-q")  # a package installed inside another project's repository
    (tmp_path / "site").mkdir()
    assert code_version(tmp_path / "site") == {"commit": None, "modified": None}


def test_saved_results_carry_the_packages_code_version(tmp_path):
    save(str(tmp_path), "r", {"x": 1}, "table\n")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == {"x": 1, "code": code_version()}
    save(str(tmp_path), "s", {"code": {"commit": "given"}}, "table\n")  # a result's own is kept
    assert json.loads((tmp_path / "s.json").read_text())["code"] == {"commit": "given"}
