"""FSDP1 vs FSDP2 parameter and gradient access: the comparison suite.

For each world size, both APIs run the same checks on a tiny Llama: parameter access (initial,
after a forward), gradient access with sync on, with sync off, and per-microbatch gradients,
each against a single-process reference. ``grad_access`` rows use
:mod:`opacus_fsdp_sync.grad_access`; ``raw`` rows read ``param.grad`` as user code did before it
(the regression reported for FSDP2). A check is REGRESSION when FSDP1 passes and FSDP2 does not.

Run ``python -m opacus_fsdp_sync.bench.compare`` (CPU/gloo ranks are spawned per world size), or
under ``torchrun --nproc-per-node N -m opacus_fsdp_sync.bench.compare`` (one world size,
CUDA/NCCL when available); ``opacus-fsdp-sync-compare`` runs the same. Exit code 0 when
``grad_access`` has no regression and passes everything.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..grad_access import clean_name, full_grads, microbatch, sync_disabled, unsynced_grads
from ..models import PRESETS, LlamaSpec, build_llama
from ..sharding import ShardingConfig, shard_model

logger = logging.getLogger(__name__)

APIS = ("fsdp1", "fsdp2")
METHODS = ("grad_access", "raw")
CHECKS = ("param_initial", "param_after_forward", "grad_sync_on", "grad_sync_off", "microbatch")
_B, _T = 2, 8


@dataclass(kw_only=True)
class CompareConfig:
    """What the comparison suite runs."""

    world_sizes: tuple[int, ...] = (1, 2, 4)
    """Numbers of ranks, one configuration each (spawned CPU/gloo ranks)."""
    out: str | None = None
    """Directory for the logs, ``summary.md`` and ``results.json``; None: a new temp dir."""
    preset: str = "tiny"
    """Llama preset (:data:`opacus_fsdp_sync.models.PRESETS`)."""
    microbatches: int = 3
    """Microbatches per rank in the microbatch check."""
    tolerance: float = 1e-5
    """Largest absolute difference from the single-process reference that passes."""
    baseline: bool = True
    """Also measure raw ``param.grad`` access (informational rows)."""
    timeout: float = 600.0
    """Seconds per configuration before its ranks are killed."""

    def __post_init__(self) -> None:
        if not self.world_sizes or any(w < 1 for w in self.world_sizes):
            raise ValueError(f"world_sizes={self.world_sizes}: give one or more integers >= 1")
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: choose one of {', '.join(PRESETS)}")
        for name in ("microbatches", "tolerance", "timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")


def _tally(got: dict, want: dict, tol: float, what: str) -> dict:
    """Passes per parameter: present, same shape, within ``tol`` of the reference."""
    ok, notes = 0, []
    for name, ref in want.items():
        value = got.get(name)
        if value is None:
            notes.append(f"{what}: {name} missing")
        elif isinstance(value, DTensor) or value.shape != ref.shape:
            notes.append(f"{what}: {name} shape {tuple(value.shape)}, expected {tuple(ref.shape)}")
        elif (diff := (value.float() - ref.float()).abs().max().item()) > tol:
            notes.append(f"{what}: {name} differs by {diff:.3g}")
        else:
            ok += 1
    return {"ok": ok, "total": len(want), "notes": notes}


def _merge(parts: list[dict]) -> dict:
    notes = [n for p in parts for n in p["notes"]]
    return {
        "ok": sum(p["ok"] for p in parts),
        "total": sum(p["total"] for p in parts),
        "notes": notes,
    }


def _readable(named: dict, what: str) -> dict:
    """Raw access: a local tensor can be read (``to_local()`` for a DTensor)."""
    got = {n: (t.to_local() if isinstance(t, DTensor) else t) for n, t in named.items()}
    ok = [n for n, t in got.items() if t is not None]
    notes = [f"{what}: {n} is None" for n, t in got.items() if t is None]
    return {"ok": len(ok), "total": len(named), "notes": notes}


class _Checks:
    """One rank's checks for one API (both methods), against a single-process reference."""

    def __init__(self, rank: int, world: int, config: CompareConfig, device: torch.device):
        self.rank, self.world, self.config, self.device = rank, world, config, device
        torch.manual_seed(0)
        self.base = build_llama(LlamaSpec(preset=config.preset)).to(device)
        g = torch.Generator().manual_seed(123)
        vocab = self.base.config.vocab_size
        self.ids = torch.randint(1, vocab, (world, config.microbatches + 3, _B, _T), generator=g)
        self.ids = self.ids.to(device)

    def loss(self, model, r: int, k: int):
        ids = self.ids[r, k]
        return model(input_ids=ids, labels=ids).loss

    def ref(self, items: list[tuple[int, int]], scale: float = 1.0) -> dict:
        model = copy.deepcopy(self.base)
        (sum(self.loss(model, r, k) for r, k in items) * scale).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    def model(self, api: str):
        model = copy.deepcopy(self.base)
        return shard_model(model, ShardingConfig(backend=api), device=self.device)

    def full_params(self, model, api: str) -> dict:
        if api == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, writeback=False):
                return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()
        }

    def grad_access(self, api: str) -> dict:
        tol, world, rank, k_mb = (
            self.config.tolerance,
            self.world,
            self.rank,
            self.config.microbatches,
        )
        params = {n: p.detach() for n, p in self.base.named_parameters()}
        model = self.model(api)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        out = {"param_initial": _tally(self.full_params(model, api), params, tol, "initial")}
        with torch.no_grad():
            self.loss(model, rank, 0)
        out["param_after_forward"] = _tally(self.full_params(model, api), params, tol, "forward")
        self.loss(model, rank, 0).backward()
        want = self.ref([(r, 0) for r in range(world)], 1 / world)
        out["grad_sync_on"] = _tally(full_grads(model), want, tol, "synced")
        opt.zero_grad()
        with sync_disabled(model):
            self.loss(model, rank, 1).backward()
        out["grad_sync_off"] = _tally(unsynced_grads(model), self.ref([(rank, 1)]), tol, "unsynced")
        parts = []
        for k in range(2, 2 + k_mb):
            with microbatch(model) as mb:
                self.loss(model, rank, k).backward()
            parts.append(_tally(mb.grads, self.ref([(rank, k)]), tol, f"microbatch {k - 2}"))
        self.loss(model, rank, 2 + k_mb).backward()
        items = [(r, k) for r in range(world) for k in range(1, 3 + k_mb)]
        parts.append(_tally(full_grads(model), self.ref(items, 1 / world), tol, "accumulated"))
        out["microbatch"] = _merge(parts)
        return out

    def raw(self, api: str) -> dict:
        tol, rank = self.config.tolerance, self.rank
        model = self.model(api)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)

        def named(attr: str) -> dict:
            items = model.named_parameters()
            return {clean_name(n): (p if attr == "param" else p.grad) for n, p in items}

        out = {"param_initial": _readable(named("param"), "initial")}
        loss = self.loss(model, rank, 0)
        out["param_after_forward"] = _readable(named("param"), "forward")
        loss.backward()
        out["grad_sync_on"] = _readable(named("grad"), "synced")
        opt.zero_grad()
        with sync_disabled(model):
            self.loss(model, rank, 1).backward()
        out["grad_sync_off"] = _tally(named("grad"), self.ref([(rank, 1)]), tol, "no sync")
        parts = []
        for k in range(2, 2 + self.config.microbatches):
            opt.zero_grad()
            with sync_disabled(model):
                self.loss(model, rank, k).backward()
            parts.append(_tally(named("grad"), self.ref([(rank, k)]), tol, f"microbatch {k - 2}"))
        out["microbatch"] = _merge(parts)
        return out


def _run_checks(rank: int, world: int, config: CompareConfig, device: torch.device) -> dict:
    warnings.filterwarnings("ignore")
    checks = _Checks(rank, world, config, device)
    results: dict = {}
    for api in APIS:
        for method in METHODS if config.baseline else METHODS[:1]:
            try:
                results[(api, method)] = getattr(checks, method)(api)
            except Exception as err:  # noqa: BLE001 - a failing access path is a result
                note = f"{type(err).__name__}: {err}"
                empty = {"ok": 0, "total": 1, "notes": [note]}
                results[(api, method)] = dict.fromkeys(CHECKS, empty)
            dist.barrier()
    return results


def rank_main(rank: int, world: int, config: CompareConfig) -> dict:
    """One spawned rank: every check on CPU/gloo (see :func:`run_suite`)."""
    return _run_checks(rank, world, config, torch.device("cpu"))


def _aggregate(per_rank: list[dict]) -> dict:
    """Sums the ranks' tallies: ``{(api, method): {check: {ok, total, notes}}}``."""
    out: dict = {}
    for key in per_rank[0]:
        out[key] = {c: _merge([r[key][c] for r in per_rank]) for c in CHECKS}
    return out


def _rate(t: dict) -> float:
    return 100.0 * t["ok"] / t["total"] if t["total"] else 0.0


def _status(a: dict, b: dict) -> str:
    ok1, ok2 = _rate(a) == 100.0, _rate(b) == 100.0
    if ok1 and not ok2:
        return "REGRESSION"
    return "both work" if ok1 and ok2 else ("FSDP2 only" if ok2 else "both fail")


def render(results: dict[int, dict], baseline: bool) -> tuple[str, bool]:
    """The Markdown table and summary; returns ``(markdown, passed)``."""
    head = "| Check | World | FSDP1 | FSDP2 | Status |"
    rule = "|---|---|---|---|---|"
    if baseline:
        head += " FSDP1 raw | FSDP2 raw | Raw status |"
        rule += "---|---|---|"
    lines = [head, rule]
    totals: dict = {}
    passed = True
    for world, res in sorted(results.items()):
        for check in CHECKS:
            a, b = res[("fsdp1", "grad_access")][check], res[("fsdp2", "grad_access")][check]
            status = _status(a, b)
            passed &= status == "both work"
            row = f"| {check} | {world} | {_rate(a):.1f}% | {_rate(b):.1f}% | {status} |"
            if baseline:
                ra, rb = res[("fsdp1", "raw")][check], res[("fsdp2", "raw")][check]
                row += f" {_rate(ra):.1f}% | {_rate(rb):.1f}% | {_status(ra, rb)} |"
            lines.append(row)
            for key, tally in res.items():
                totals.setdefault(key, []).append(tally[check])
    lines.append("")
    for (api, method), tallies in sorted(totals.items()):
        merged = _merge(tallies)
        good = sum(_rate(t) == 100.0 for t in tallies)
        lines.append(
            f"- {api.upper()} ({method}): {_rate(merged):.1f}% of accesses, "
            f"{good}/{len(tallies)} checks at 100%"
        )
    lines.append("")
    lines.append(
        "No regression: grad_access passes every check on FSDP1 and FSDP2."
        if passed
        else "REGRESSION or failure in the grad_access rows (see the logs)."
    )
    if baseline:
        lines.append("Raw columns read plain param.grad, as code written for FSDP1 does.")
    return "\n".join(lines), passed


def _write_logs(out: Path, world: int, res: dict) -> None:
    for api in APIS:
        lines = [f"# world={world} api={api}"]
        for (a, method), tallies in res.items():
            if a != api:
                continue
            for check, t in tallies.items():
                lines.append(f"[{method}] {check}: {t['ok']}/{t['total']} ({_rate(t):.1f}%)")
                lines.extend(f"    {n}" for n in t["notes"][:50])
        (out / f"world{world}_{api}.log").write_text("\n".join(lines) + "\n")


def _failed(error: str) -> dict:
    empty = {"ok": 0, "total": 1, "notes": [error]}
    return {(a, m): dict.fromkeys(CHECKS, empty) for a in APIS for m in METHODS}


def run_suite(config: CompareConfig) -> tuple[str, bool, Path]:
    """Runs every world size on spawned CPU/gloo ranks; writes logs, table and JSON.

    Returns:
        ``(markdown table, passed, output directory)``.
    """
    from ..testing import RankFailure, run_ranks

    out = Path(config.out or tempfile.mkdtemp(prefix="compare_runs_"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for world in config.world_sizes:
        logger.info("[Compare] world size %d: running FSDP1 and FSDP2 checks", world)
        try:
            results[world] = _aggregate(run_ranks(rank_main, world, config, timeout=config.timeout))
        except RankFailure as err:
            results[world] = _failed(str(err))
        _write_logs(out, world, results[world])
    return _finish(out, results, config)


def _finish(out: Path, results: dict, config: CompareConfig) -> tuple[str, bool, Path]:
    table, passed = render(results, config.baseline)
    (out / "summary.md").write_text(table + "\n")
    flat = {
        f"world{w}/{api}/{method}/{check}": t
        for w, res in results.items()
        for (api, method), tallies in res.items()
        for check, t in tallies.items()
    }
    payload = {"config": asdict(config), "passed": passed, "results": flat}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    return table, passed, out


def _under_torchrun(config: CompareConfig) -> tuple[str, bool, Path] | None:
    """Runs this process's rank when launched by torchrun; None on rank > 0."""
    from ..distributed.env import init_distributed

    rank, world, device = init_distributed()
    try:
        res = _run_checks(rank, world, config, device)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(res, gathered, dst=0)
        if rank:
            return None
        out = Path(config.out or tempfile.mkdtemp(prefix="compare_runs_"))
        out.mkdir(parents=True, exist_ok=True)
        results = {world: _aggregate(gathered)}
        _write_logs(out, world, results[world])
        return _finish(out, results, config)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; flags map one-to-one onto :class:`CompareConfig`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="1 2 4", help='e.g. "1 2 4" (spawned mode)')
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    sizes = tuple(int(w) for w in args.world_sizes.replace(",", " ").split())
    config = CompareConfig(
        world_sizes=sizes,
        out=args.out,
        preset=args.preset,
        microbatches=args.microbatches,
        tolerance=args.tolerance,
        baseline=args.baseline,
        timeout=args.timeout,
    )
    if "TORCHELASTIC_RUN_ID" in os.environ:
        done = _under_torchrun(config)
        if done is None:
            return 0
    else:
        done = run_suite(config)
    table, passed, out = done
    print(table)
    print(f"\nLogs, summary.md and results.json in {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
