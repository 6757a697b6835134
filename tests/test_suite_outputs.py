"""The profiling suite's text outputs: the ``[Ghost]`` result line and the summary tables.

The summary is checked on the committed run ``results/cpu-2cores-small-poisson/`` (real JSON of
three modes at two sequence lengths); the result line on :func:`result_path`'s file, no spawn.
"""

import csv
import re
from pathlib import Path

from tests.suite_scripts import SUITE, load_script

experiment = load_script("profile_experiment")
summarize = load_script("summarize")

POISSON = SUITE / "results" / "cpu-2cores-small-poisson"


def test_result_line_names_the_file_that_was_written(tmp_path):
    cfg = experiment.parse_args(
        ["--mode", "ghost_fsdp", "--seq-length", "64", "--out", str(tmp_path)]
    )
    path = experiment.result_path(cfg)
    assert path == tmp_path / "ghost_fsdp_seq64.json"
    path.write_text("{}")  # what main() does before logging the line
    line = experiment.result_line({"step_ms": {"median": 12.34}, "tokens_per_s": 567.8}, path)
    # The shell launcher copies the line into its own output by this pattern.
    assert re.match(
        r"^\[Ghost\] ghost_fsdp_seq64: step 12\.3 ms \(median\), 568 tokens/s -> ", line
    )
    assert Path(line.rsplit(" -> ", 1)[1]).is_file()


def test_markdown_table_is_short_and_csv_keeps_every_column(tmp_path):
    for p in POISSON.glob("*.json"):
        (tmp_path / p.name).write_text(p.read_text())
    assert summarize.main([str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| mode |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert len(columns) <= 10 and columns == summarize.MD_COLUMNS
    rows = [line for line in md.splitlines() if line.startswith("| ")][2:]
    assert len(rows) == 6 and all(line.count("|") == len(columns) + 1 for line in rows)
    assert "| ghost_fsdp_one_backward | fsdp2 | no | 64 | 314.8 | 1.627 | 0.685 | 1627 |" in md
    assert "| ghost_fsdp | fsdp2 | no | 128 | 671.1 | 1.920 | 1.000 | 1526 | 15 AG / 10 RS |" in md
    # The CSV is the committed one, byte for byte: all 29 columns, the same cells.
    with open(tmp_path / "summary.csv", newline="") as f:
        assert len(next(csv.reader(f))) == len(summarize.COLUMNS) == 29
    assert (tmp_path / "summary.csv").read_text() == (POISSON / "summary.csv").read_text()
