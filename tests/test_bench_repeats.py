"""The repeated-runs table: per-run ratios to ``no_dp`` and their median."""

import json

import pytest

from opacus_fsdp_sync.bench import repeats


def _result(run, mode, seq, median, *, status="ok", tied=None, cpu=None):
    cfg = {"mode": mode, "seq_length": seq, "fsdp_api": "fsdp2", "tie_word_embeddings": tied}
    body = {"config": cfg, "status": status, "step_ms": {"median": median}, "sampling": "fixed"}
    if cpu is not None:
        body["cpu_ms"] = {"process": {"median": cpu}, "main_thread": {"median": cpu / 2}}
    (run / f"{mode}_seq{seq}.json").write_text(json.dumps(body))


def _runs(tmp_path, steps):
    dirs = []
    for i, (base, private) in enumerate(steps):
        run = tmp_path / f"run{i + 1}"
        run.mkdir()
        _result(run, "no_dp", 64, base)
        _result(run, "ghost_fsdp_one_backward", 64, private)
        dirs.append(run)
    return dirs


def test_each_run_is_divided_by_its_own_no_dp_and_the_median_is_taken(tmp_path):
    # across runs the reference moves; a pooled ratio (median private / median no_dp) would be
    # 120 / 100 = 1.2, the per-run ratios' median is 1.3
    dirs = _runs(tmp_path, [(100.0, 130.0), (80.0, 120.0), (120.0, 132.0)])
    (row,) = repeats.table(dirs)
    assert row.key == repeats.RowKey("ghost_fsdp_one_backward", 64, "fsdp2", "preset")
    assert row.ratios == pytest.approx([1.3, 1.5, 1.1])
    assert row.median == pytest.approx(1.3)
    text = repeats.markdown([row], ["run1", "run2", "run3"], bound=1.15)
    cells = "ghost_fsdp_one_backward | 64 | fsdp2 | preset | 1.300x | 1.500x | 1.100x | 1.300x | no"
    assert f"| {cells} |" in text


def test_a_run_without_its_reference_or_with_a_failure_leaves_a_gap(tmp_path):
    dirs = _runs(tmp_path, [(100.0, 110.0), (100.0, 140.0), (100.0, 120.0)])
    (dirs[1] / "no_dp_seq64.json").unlink()
    _result(dirs[2], "ghost_fsdp_one_backward", 64, 999.0, status="failed")
    (row,) = repeats.table(dirs)
    assert row.ratios == pytest.approx([1.1, None, None])
    assert row.median == pytest.approx(1.1)


def test_an_empty_folder_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert repeats.main([str(tmp_path / "empty")]) == 2
    assert "empty: no experiment results" in capsys.readouterr().err


def test_the_command_prints_the_table(tmp_path, capsys):
    dirs = _runs(tmp_path, [(100.0, 110.0)])
    assert repeats.main([str(d) for d in dirs]) == 0
    out = capsys.readouterr().out
    assert "| ghost_fsdp_one_backward | 64 | fsdp2 | preset | 1.100x | 1.100x |" in out


def test_two_results_of_one_row_in_one_run_are_refused_by_name(tmp_path, capsys):
    (run,) = _runs(tmp_path, [(100.0, 110.0)])
    body = json.loads((run / "ghost_fsdp_one_backward_seq64.json").read_text())
    body["config"]["name"] = "other_model"
    (run / "other.json").write_text(json.dumps(body))
    assert repeats.main([str(run)]) == 2
    assert "'other_model'" in capsys.readouterr().err


def test_the_process_cpu_time_ratio_gets_its_own_column_where_recorded(tmp_path):
    # wall 1.1x in each run, CPU 1.2x / 1.4x / (not recorded in the third run's private row)
    dirs = _runs(tmp_path, [(100.0, 110.0), (100.0, 110.0), (100.0, 110.0)])
    for run, (base, private) in zip(dirs, [(100.0, 120.0), (50.0, 70.0), (80.0, None)]):
        _result(run, "no_dp", 64, 100.0, cpu=base)
        _result(run, "ghost_fsdp_one_backward", 64, 110.0, cpu=private)
    (row,) = repeats.table(dirs)
    assert row.cpu_ratios == pytest.approx([1.2, 1.4, None])
    assert row.cpu_median == pytest.approx(1.3)
    text = repeats.markdown([row], ["r1", "r2", "r3"], bound=1.15)
    assert text.splitlines()[0].endswith("| process CPU time per step, median |")
    assert text.splitlines()[2].endswith("| 1.100x | yes | 1.300x |")


def test_without_cpu_times_the_table_has_no_cpu_column(tmp_path):
    dirs = _runs(tmp_path, [(100.0, 110.0)])
    assert "CPU" not in repeats.markdown(repeats.table(dirs), ["r1"])


def test_a_poisson_row_has_no_per_step_cpu_ratio(tmp_path):
    # Poisson rows draw other batches each step: their ratio is per example, CPU time per step
    # is not comparable across the two sides
    (run,) = _runs(tmp_path, [(100.0, 110.0)])
    for mode, cpu in (("no_dp", 100.0), ("ghost_fsdp_one_backward", 150.0)):
        _result(run, mode, 64, 100.0, cpu=cpu)
    assert repeats.table([run])[0].cpu_ratios == pytest.approx([1.5])
    for mode in ("no_dp", "ghost_fsdp_one_backward"):
        path = run / f"{mode}_seq64.json"
        path.write_text(path.read_text().replace('"fixed"', '"poisson"'))
    assert repeats.table([run])[0].cpu_ratios == [None]
