"""The profiling suite's text outputs: the ``[Ghost]`` result line, checked on
:func:`result_path`'s file, no spawn."""

import re
from pathlib import Path

from tests.suite_scripts import load_script

experiment = load_script("profile_experiment")


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
