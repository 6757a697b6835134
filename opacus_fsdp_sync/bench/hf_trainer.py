"""Step time of ``DPTrainer`` against the package's trainer on the same model, data and draws.

``python -m opacus_fsdp_sync.bench.hf_trainer --out runs/bench_hf`` runs ``python -m
opacus_fsdp_sync.train`` and ``DPTrainer`` on the same preset (the same seed, so the same initial
weights), the same synthetic training set, the same optimizer and the same Poisson draws (one
``dp_seed`` for both: the sampler's seed derives from it), ``repeats`` times each, alternating,
each run in a fresh single process (so that neither inherits the other's process group: one
process trains the plain model on both sides). Each step's time is the wall clock from the end
of the previous step to the end of this one (data, forward, private backward, optimizer step),
as the trainer's ``step_ms`` is; the first ``warmup`` steps of every run are dropped. Reports,
per side, the median over runs of each run's median step, with the runs' min and max, and the
ratio; writes ``bench_hf.json``.

A benchmark client: the core never imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class BenchConfig:
    """One comparison."""

    model: str = "small"
    """Llama preset (``tiny``, ``small``)."""
    seq_length: int = 64
    """Tokens per example."""
    num_examples: int = 256
    """Synthetic examples (10 % held out by the trainer, the same split for both sides)."""
    batch_size: int = 16
    """Expected logical batch."""
    physical_batch_size: int = 8
    """Physical batch limit."""
    steps: int = 12
    """Logical steps per run."""
    warmup: int = 2
    """Steps dropped at the start of each run."""
    repeats: int = 3
    """Runs per side (the reported figure is the median of their medians)."""
    out: str = "runs/bench_hf"
    """Output directory."""
    side: str = "both"
    """``both``: the comparison (each run in its own process); ``dp_trainer``: one DPTrainer run
    in this process, its step times to ``out/steps.json`` (what ``both`` launches)."""

    def __post_init__(self) -> None:
        if self.side not in ("both", "dp_trainer"):
            raise ValueError(f"side={self.side!r}: choose 'both' or 'dp_trainer'")
        if self.steps <= self.warmup:
            raise ValueError(f"steps={self.steps} must exceed warmup={self.warmup}")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: must be >= 1")


#: The draws and the noise must be the same for both sides (a benchmark, not a release).
_DP_SEED = 11


#: Everything a launcher sets that would make a child process join a process group.
_LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def _train_config(cfg: BenchConfig, out: Path):
    from ..train import TrainConfig

    return TrainConfig(
        model=cfg.model,
        num_examples=cfg.num_examples,
        seq_length=cfg.seq_length,
        batch_size=cfg.batch_size,
        physical_batch_size=cfg.physical_batch_size,
        max_steps=cfg.steps,
        epochs=1000.0,
        noise_multiplier=1.0,
        eval_every=cfg.steps,
        optimizer="adamw",
        lr=3e-3,
        dp_seed=_DP_SEED,
        out=str(out),
        overwrite=True,
    )


def _single_process(command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )


def run_trainer(cfg: BenchConfig, out: Path) -> list[float]:
    """``python -m opacus_fsdp_sync.train``'s step times (ms), warm-up dropped."""
    tc = _train_config(cfg, out)
    flags = {
        "model": tc.model, "num-examples": tc.num_examples, "seq-length": tc.seq_length,
        "batch-size": tc.batch_size, "physical-batch-size": tc.physical_batch_size,
        "max-steps": tc.max_steps, "epochs": tc.epochs, "noise-multiplier": tc.noise_multiplier,
        "eval-every": tc.eval_every, "optimizer": tc.optimizer, "lr": tc.lr,
        "dp-seed": tc.dp_seed, "out": tc.out,
    }  # fmt: skip
    command = [sys.executable, "-m", "opacus_fsdp_sync.train", "--overwrite"]
    for name, value in flags.items():
        command += [f"--{name}", str(value)]
    _single_process(command)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_ms"] for r in rows if "step_ms" in r][cfg.warmup :]


def run_dp_trainer_process(cfg: BenchConfig, out: Path) -> list[float]:
    """:func:`run_dp_trainer` in a fresh single process; its step times (ms)."""
    command = [sys.executable, "-m", "opacus_fsdp_sync.bench.hf_trainer", "--side", "dp_trainer"]
    for name, value in asdict(cfg).items():
        if name not in ("side", "out"):
            command += [f"--{name.replace('_', '-')}", str(value)]
    _single_process([*command, "--out", str(out)])
    return json.loads((out / "steps.json").read_text())


def run_dp_trainer(cfg: BenchConfig, out: Path) -> list[float]:
    """``DPTrainer``'s step times (ms) on the trainer's model, split and draws, warm-up dropped."""
    import torch
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    from ..integrations.transformers import DPArguments, DPTrainer
    from ..train.data import split, synthetic_sequences
    from ..train.model import build_model

    tc = _train_config(cfg, out)
    model, _ = build_model(tc)
    data = synthetic_sequences(tc.num_examples, tc.seq_length, tc.seed, tc.task)
    train_set, _ = split(data, tc.heldout_fraction, tc.seed)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(*train_set.tensors)]
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            times.append((now - self.last) * 1e3)
            self.last = now

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.physical_batch_size,
        optim="adamw_torch",
        learning_rate=tc.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=cfg.steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=default_data_collator,
        callbacks=[StepClock()],
        dp_args=DPArguments(
            noise_multiplier=tc.noise_multiplier,
            max_grad_norm=tc.max_grad_norm,
            logical_batch_size=cfg.batch_size,
            max_physical_batch_size=cfg.physical_batch_size,
            dp_seed=_DP_SEED,
        ),
    )
    trainer.train()
    steps = times[cfg.warmup :]
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(steps))
    return steps


def _summary(medians: list[float]) -> dict:
    return {
        "median_of_medians_ms": statistics.median(medians),
        "min_ms": min(medians),
        "max_ms": max(medians),
        "run_medians_ms": medians,
    }


def compare(cfg: BenchConfig) -> dict:
    """Runs both sides ``cfg.repeats`` times, alternating; returns (and writes) the summary."""
    out = Path(cfg.out)
    sides = {"trainer": run_trainer, "dp_trainer": run_dp_trainer_process}
    medians: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(cfg.repeats):
        for name, run in sides.items():
            steps = run(cfg, out / f"{name}-{repeat}")
            medians[name].append(statistics.median(steps))
            logger.info(
                "[Ghost] bench: %s run %d: median step %.1f ms", name, repeat, medians[name][-1]
            )
    result = {
        "config": asdict(cfg),
        "clock": "wall (time.perf_counter), end of one step to the end of the next",
        **{name: _summary(values) for name, values in medians.items()},
    }
    result["ratio_dp_trainer_to_trainer"] = (
        result["dp_trainer"]["median_of_medians_ms"] / result["trainer"]["median_of_medians_ms"]
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hf.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    """CLI: one flag per :class:`BenchConfig` field; prints a Markdown table."""
    from ..known_warnings import quiet_known_warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    cfg = BenchConfig(**vars(parser.parse_args(argv)))
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    quiet_known_warnings()
    if cfg.side == "dp_trainer":
        return {"steps_ms": run_dp_trainer(cfg, Path(cfg.out))}
    result = compare(cfg)
    print("| side | median of 3 medians (ms) | min | max |\n| --- | --- | --- | --- |")
    for name in ("trainer", "dp_trainer"):
        r = result[name]
        print(
            f"| {name} | {r['median_of_medians_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} |"
        )
    print(f"DPTrainer / trainer: {result['ratio_dp_trainer_to_trainer']:.3f}")
    return result


if __name__ == "__main__":
    main()
