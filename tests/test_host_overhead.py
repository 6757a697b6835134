"""The host-time bench: its settings, its contraction switch and a tiny timed pair of steps."""

import pytest

from opacus_fsdp_sync.bench.accelerator_ops import accelerator_contraction
from opacus_fsdp_sync.bench.host_overhead import HostOverheadConfig, markdown, parse_args
from opacus_fsdp_sync.bench.results_io import run_and_save, save
from opacus_fsdp_sync.layers import linear_grams
from opacus_fsdp_sync.testing import run_ranks


def test_config_validates_maps_flags_and_takes_the_accelerator_route():
    cfg = parse_args(["--blocks", "2", "--steps", "4", "--width-divisor", "16"])
    assert (cfg.blocks, cfg.steps, cfg.width_divisor) == (2, 4, 16)
    ledger = cfg.ledger_config()
    assert ledger.precision == "fp32" and not ledger.uses_accelerator_path
    assert ledger.engine_options() == {
        "tune_norms": False,
        "per_sample_grads": False,
        "gram_block": 0,
    }
    with pytest.raises(ValueError, match="steps"):
        HostOverheadConfig(steps=0)
    with pytest.raises(ValueError, match="warmup"):
        HostOverheadConfig(warmup=-1)


def test_the_contraction_switch_is_undone_even_on_error():
    assert "cpu" in linear_grams.PRODUCT_CONTRACTION
    with pytest.raises(RuntimeError), accelerator_contraction():
        assert "cpu" not in linear_grams.PRODUCT_CONTRACTION
        raise RuntimeError("inside")
    assert "cpu" in linear_grams.PRODUCT_CONTRACTION


def _tiny(rank: int, world: int) -> dict:
    from opacus_fsdp_sync.bench.host_overhead import run

    cfg = HostOverheadConfig(
        preset="tiny", width_divisor=1, blocks=1, batch_size=2, seq_length=8, steps=2, warmup=1
    )
    return run(cfg)


@pytest.mark.distributed
def test_a_tiny_pair_of_steps_is_timed_and_counted():
    (result,) = run_ranks(_tiny, 1, timeout=300)
    plain, private = result["non_private"], result["private"]
    for r in (plain, private):
        assert len(r["step_ms"]) == 2 and 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert private["ops"] > plain["ops"] > 0  # the norms and the clipped gradients
    assert result["ratio"] == pytest.approx(private["median_ms"] / plain["median_ms"])
    assert result["extra_ops"] == private["ops"] - plain["ops"]
    table = markdown(result)
    assert "| non-private |" in table and "| private |" in table


def test_results_are_written_as_json_and_markdown_or_not_at_all(tmp_path, capsys):
    save(None, "x", {"a": 1}, "| t |\n")  # no folder: nothing written, nothing raised
    assert (
        run_and_save(lambda: {"a": 1}, lambda r: f"| {r['a']} |\n", str(tmp_path / "o"), "r") == 0
    )
    assert (tmp_path / "o" / "r.json").read_text().strip().startswith("{")
    assert (tmp_path / "o" / "r.md").read_text() == "| 1 |\n"
    assert "| 1 |" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="broke"):
        run_and_save(lambda: (_ for _ in ()).throw(RuntimeError("broke")), str, None, "r")
