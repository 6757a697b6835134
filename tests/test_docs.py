"""README.md stays one screen long, and no relative link in it or in docs/ is dead."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 160
#: ``[text](target)``; the target ends at the first space or closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _relative_links(path: Path) -> list[str]:
    links = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL (http:, mailto:, ...) or an anchor in the same page
        links.append(target.split("#", 1)[0])
    return links


def test_readme_fits_one_screen():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_every_relative_link_points_to_an_existing_file():
    assert DOCS, "no docs/*.md found"
    dead = []
    checked = 0
    for page in [README, *DOCS]:
        for target in _relative_links(page):
            checked += 1
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)
    assert checked >= len(DOCS)  # the pattern found the links


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in _relative_links(README)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def test_dead_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](gone.md) [b](https://example.org/x) [c](#top) [d](page.md#top)\n")
    assert _relative_links(page) == ["gone.md", "page.md"]
    assert not (tmp_path / "gone.md").exists() and (tmp_path / "page.md").exists()
