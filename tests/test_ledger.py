"""The op ledger's accounting: known ops, live bytes, custom ops, and a tiny private step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import register_flop_formula

from opacus_fsdp_sync.bench.accelerator_ops import accelerator_matmuls, has_cpu_kernel
from opacus_fsdp_sync.bench.ledger import LedgerConfig, parse_args
from opacus_fsdp_sync.bench.ledger_report import markdown, ratios
from opacus_fsdp_sync.bench.op_ledger import OpLedger, op_class
from opacus_fsdp_sync.layers import linear_grams
from opacus_fsdp_sync.layers.linear_grams import wide_bmm
from opacus_fsdp_sync.profiling import phase
from opacus_fsdp_sync.testing import run_ranks


@torch.library.custom_op("ledger_test::priced", mutates_args=())
def _priced(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_priced.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


@register_flop_formula(torch.ops.ledger_test.priced)
def _priced_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@torch.library.custom_op("ledger_test::unpriced", mutates_args=())
def _unpriced(a: torch.Tensor) -> torch.Tensor:
    return a * 2


def test_a_known_matmul_copy_and_view():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with OpLedger() as ledger, phase("forward"):
        c = a @ b  # 2 m k n FLOPs; reads both operands, writes the product
        c.t()  # a view: not counted
        c.to(torch.float64)  # a cast: a copy reading 4 and writing 8 bytes per value
    tallies = ledger.by_class["forward"]
    mm = tallies["matmul"]
    assert (mm.ops, mm.flops) == (1, 2 * 8 * 16 * 4)
    assert (mm.bytes_read, mm.bytes_written) == (4 * (8 * 16 + 16 * 4), 4 * 8 * 4)
    cp = tallies["copy"]
    assert (cp.ops, cp.bytes_read, cp.bytes_written, cp.flops) == (1, 4 * 32, 8 * 32, 0)
    assert set(tallies) == {"matmul", "copy"}
    assert op_class(torch.ops.aten.sum.dim_IntList) == "reduction"
    assert op_class(torch.ops.aten.mul.Tensor) == "elementwise"


def test_a_broadcast_operand_counts_its_memory_once_and_in_place_counts_as_written():
    x, row = torch.randn(64, 32), torch.randn(32)
    with OpLedger() as ledger:
        y = x * row.expand(64, 32)  # the expanded view covers 32 values of memory
        y.mul_(2.0)  # reads and writes y
    t = ledger.by_class["other"]["elementwise"]
    assert t.ops == 2
    assert t.bytes_read == 4 * (64 * 32 + 32) + 4 * 64 * 32
    assert t.bytes_written == 2 * 4 * 64 * 32


def test_a_gather_reads_what_it_selects_and_a_foreach_in_place_op_writes():
    src, idx = torch.randn(4, 1000), torch.randint(0, 1000, (4, 3))
    table, ids = torch.randn(1000, 8), torch.randint(0, 1000, (5,))
    logp, target = torch.randn(6, 1000).log_softmax(1), torch.randint(0, 1000, (6,))
    xs, ys = [torch.zeros(10), torch.zeros(20)], [torch.ones(10), torch.ones(20)]
    with OpLedger() as ledger:
        torch.gather(src, 1, idx)
        torch.nn.functional.embedding(ids, table)
        torch.nn.functional.nll_loss(logp, target)
        torch._foreach_add_(xs, ys, alpha=2.0)
    ops = ledger.op_totals()
    assert ops["gather"].bytes_read == 8 * 12 + 4 * 12  # indices, then the 12 selected values
    assert ops["embedding"].bytes_read == 8 * 5 + 4 * 5 * 8
    assert ops["nll_loss_forward"].bytes_read == 8 * 6 + 4 * 6
    t = ops["_foreach_add_"]
    assert (t.bytes_read, t.bytes_written) == (4 * 60, 4 * 30)


def test_live_bytes_follow_tensors_made_inside_and_their_peak():
    x = torch.randn(1000)  # made outside: never counted
    with OpLedger() as ledger:
        with phase("a"):
            y = x * 2
            z = y + 1
            del y
        with phase("b"):
            w = z.view(10, 100)  # a view keeps z's storage alive
            del z
            v = w.sum()
    ledger.finish()
    assert ledger.memory["a"].peak == 2 * 4000
    assert ledger.memory["a"].at_end == 4000  # z, handed to phase b
    assert ledger.memory["b"].at_end == 4000 + 4  # w (z's storage) and the sum
    del w, v
    assert ledger.live_bytes == 0


def test_custom_ops_are_priced_by_their_formula_or_listed():
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    with OpLedger() as ledger:
        torch.ops.ledger_test.priced(a, b)
        torch.ops.ledger_test.unpriced(a)
    assert ledger.by_class["other"]["matmul"].flops == 2 * 4 * 6 * 3
    assert ledger.unpriced == {"ledger_test.unpriced"}


def test_the_accelerator_path_writes_wide_gram_blocks_in_the_matmul_and_only_inside():
    """As on CUDA: one bmm writing fp32 from bf16, no widening copy; nothing left after."""
    a = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    b = torch.randn(2, 16, 8, dtype=torch.bfloat16)
    with OpLedger() as ledger:
        wide_bmm(a, b)
    assert set(ledger.op_totals()) == {"bmm", "_to_copy"}  # the CPU path: bmm, then widen
    with accelerator_matmuls():
        assert has_cpu_kernel("bmm.dtype") and has_cpu_kernel("mm.dtype")
        with OpLedger() as ledger:
            out = wide_bmm(a, b)
        assert linear_grams._OUT_DTYPE[("cpu", torch.bfloat16)]
        assert linear_grams.PRODUCT_CONTRACTION == set()  # Grams contracted by bmm, as on CUDA
        mm = torch.mm(a[0], b[0], out_dtype=torch.float32)
        c = torch.randn(2, 8, 8)
        bad = torch.baddbmm(c, a, b, out_dtype=torch.float32, beta=0.5, alpha=2.0)
    totals = ledger.op_totals()
    assert set(totals) == {"bmm"}  # the kernel's own widening and matmul run below the mode
    t = totals["bmm"]
    assert (t.ops, t.flops) == (1, 2 * 2 * 8 * 16 * 8)
    assert (t.bytes_read, t.bytes_written) == (2 * (2 * 8 * 16) * 2, 4 * 2 * 8 * 8)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.bmm(a.float(), b.float()))
    assert torch.equal(mm, a[0].float() @ b[0].float())
    # fp32 arithmetic on the widened operands: the fp32 baddbmm's numbers (its fused scaling
    # rounds otherwise than a separate product and sum, within fp32 rounding of them)
    assert torch.equal(bad, torch.baddbmm(c, a.float(), b.float(), beta=0.5, alpha=2.0))
    assert torch.allclose(bad, 0.5 * c + 2.0 * torch.bmm(a.float(), b.float()), atol=1e-5)
    # gone on exit: the CPU path again, and the probe learnt afresh
    assert not has_cpu_kernel("bmm.dtype") and not has_cpu_kernel("baddbmm.dtype")
    assert linear_grams._OUT_DTYPE == {}
    assert linear_grams.PRODUCT_CONTRACTION == {"cpu"}
    with pytest.raises(NotImplementedError):
        torch.bmm(a, b, out_dtype=torch.float32)
    with OpLedger() as ledger:
        wide_bmm(a, b)
    assert set(ledger.op_totals()) == {"bmm", "_to_copy"}


def test_importing_the_ledger_registers_nothing():
    code = (
        "import torch, opacus_fsdp_sync.bench.ledger as m;"
        "from opacus_fsdp_sync.bench.accelerator_ops import OVERLOADS, has_cpu_kernel;"
        "print(any(has_cpu_kernel(o) for o in OVERLOADS))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_config_validates_and_maps_flags():
    cfg = parse_args(["--blocks", "2", "--no-accelerator-norms", "--gram-block", "0"])
    assert cfg.blocks == 2 and not cfg.accelerator_norms
    assert not cfg.uses_accelerator_path  # follows the norm strategy unless set
    assert LedgerConfig().uses_accelerator_path
    assert not parse_args(["--no-accelerator-path"]).uses_accelerator_path
    assert parse_args(["--no-accelerator-norms", "--accelerator-path"]).uses_accelerator_path
    assert cfg.engine_options() == {"tune_norms": False, "gram_block": 0}
    assert LedgerConfig(seq_length=256).engine_options()["gram_block"] == 128
    with pytest.raises(ValueError, match="precision"):
        LedgerConfig(precision="fp8")


def _tiny_ledger(rank: int, world: int) -> dict:
    from opacus_fsdp_sync.bench.ledger import run

    cfg = LedgerConfig(preset="tiny", width_divisor=1, blocks=1, batch_size=2, seq_length=8)
    return run(cfg)


@pytest.mark.distributed
def test_a_tiny_private_step_against_the_non_private_one():
    """FSDP2 on one gloo rank: every phase is there, the private step adds the Gram matmuls."""
    (result,) = run_ranks(_tiny_ledger, 1, timeout=300)
    private, plain = result["steps"]["private"], result["steps"]["non_private"]
    for p in ("forward", "first_backward", "norms", "weight_grads", "optimizer_step"):
        assert p in private["phases"], p
    assert {"forward", "backward", "optimizer_step"} <= set(plain["phases"])
    assert private["all"]["flops"] > plain["all"]["flops"] > 0
    assert "matmul" in private["by_phase"]["norms"]  # the Grams
    assert private["unpriced_custom_ops"] == [] and plain["unpriced_custom_ops"] == []
    assert private["peak_live_bytes"] > 0 and plain["peak_live_bytes"] > 0
    assert result["ratios"] == ratios(private, plain)
    assert result["ratios"]["matmul_flops"] > 1.0
    assert result["accelerator_path"]  # bf16 Gram blocks written wide by bmm.dtype, as on CUDA
    table = markdown(result)
    assert "| norms | matmul |" in table and "Largest additions" in table
