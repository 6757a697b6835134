"""Throughput of the profiling suite's measured steps: cost per example and tokens per second.

With Poisson sampling the global batch of each measured step varies (4-14 at an expected 8), so
a ratio of median step times ranks the drawn batch sizes as much as the modes. The suite's
results therefore record, per measured step, the step time and the global batch (the sum of the
ranks' local batches), and compare modes by their cost per example:

- ``ms_per_example``: the median, over the measured steps with a non-empty batch, of the step's
  ms divided by its global batch. With a fixed batch it is the median step divided by the batch,
  so the ratio of two fixed-batch rows at the same batch is exactly their median step ratio.
- ``tokens_per_s``: the tokens processed in the measured steps over their summed time.

:func:`load_run` also reconstructs both for results written before they were recorded, where
that is possible without guessing (:func:`reconstruct`).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

#: ``ratio``'s basis: the rows' cost per example.
PER_EXAMPLE = "per_example"
#: ``ratio``'s basis: the rows' median step times (a result without per-step batch sizes).
MEDIAN_STEP = "median_step"
#: Key under which :func:`load_run` puts the per-step data it reconstructed (in memory only; the
#: JSON files are never rewritten).
RECONSTRUCTED_KEY = "reconstructed_steps"

#: A progress line of ``profile_experiment.py``: ``  step 4/12 (measured): 587.8 ms``.
_STEP_LINE = re.compile(r"^\s*step (\d+)/(\d+) \((warm-up|measured|counted)\): ([0-9.]+) ms\s*$")
#: The log's resolution (one decimal of a millisecond).
_LOG_MS = 0.05


def per_example_ms(step_ms: list[float], global_batch_sizes: list[int]) -> dict | None:
    """Median, min and max of each measured step's ms per example.

    Args:
        step_ms: The measured steps' times, in loop order.
        global_batch_sizes: Their global batch sizes (summed over ranks), in the same order.

    Returns:
        ``{"median", "min", "max"}`` over the steps with a non-empty batch (an empty Poisson
        draw processes no example; its time still counts in :func:`tokens_per_s`), or None when
        every batch was empty.
    """
    if len(step_ms) != len(global_batch_sizes):
        raise ValueError(f"{len(step_ms)} step times for {len(global_batch_sizes)} batch sizes")
    per = [ms / b for ms, b in zip(step_ms, global_batch_sizes) if b > 0]
    if not per:
        return None
    return {"median": statistics.median(per), "min": min(per), "max": max(per)}


def tokens_per_s(step_ms: list[float], global_batch_sizes: list[int], seq_length: int) -> float:
    """Tokens processed in the measured steps over their summed time.

    Args:
        step_ms: The measured steps' times in ms.
        global_batch_sizes: Their global batch sizes (summed over ranks).
        seq_length: Tokens per example.

    Returns:
        Tokens per second.
    """
    return sum(global_batch_sizes) * seq_length / (sum(step_ms) / 1e3)


@dataclass(frozen=True)
class Cost:
    """One experiment's throughput over its measured steps.

    Attributes:
        ms_per_example: Median of the steps' ms per example (:func:`per_example_ms`).
        tokens_per_s: Tokens processed over the summed step time (:func:`tokens_per_s`).
        reconstructed: True when both come from a reconstruction (:func:`reconstruct`), not
            from fields the experiment recorded.
    """

    ms_per_example: float
    tokens_per_s: float
    reconstructed: bool = False


def cost(result: dict) -> Cost | None:
    """The cost per example of a successful result, recorded or reconstructed.

    Args:
        result: One experiment's JSON result, as :func:`load_run` returns it.

    Returns:
        The cost, or None for a result that records no per-step batch sizes and could not be
        reconstructed (or whose batches were all empty).
    """
    if result.get("status") != "ok":
        return None
    if "measured_global_batch_sizes" in result:
        per = result.get("ms_per_example")
        return Cost(per["median"], result["tokens_per_s"]) if per else None
    steps = result.get(RECONSTRUCTED_KEY)
    if not steps:
        return None
    ms, sizes = steps["step_ms"], steps["global_batch_sizes"]
    per = per_example_ms(ms, sizes)
    if per is None:
        return None
    median = per["median"]
    if len(set(sizes)) == 1:  # fixed batch: the recorded median, exact where the log rounds
        median = result["step_ms"]["median"] / sizes[0]
    seq = result["config"]["seq_length"]
    return Cost(median, tokens_per_s(ms, sizes, seq), reconstructed=True)


def ratio(result: dict, reference: dict) -> tuple[float, str]:
    """``result``'s cost over ``reference``'s, and the basis used.

    Args:
        result: A successful experiment's result.
        reference: The successful result it is compared with (``no_dp``, ``ghost_fsdp``).

    Returns:
        ``(ratio, PER_EXAMPLE)`` when both have a :func:`cost` (with a fixed batch on both
        sides, the ratio of median steps), else ``(ratio of median steps, MEDIAN_STEP)``.
    """
    mine, theirs = cost(result), cost(reference)
    if mine is not None and theirs is not None:
        return mine.ms_per_example / theirs.ms_per_example, PER_EXAMPLE
    return result["step_ms"]["median"] / reference["step_ms"]["median"], MEDIAN_STEP


def _tag(i: int, warmup: int, steps: int) -> str:
    """The progress tag of loop step ``i`` (0-based)."""
    if i < warmup:
        return "warm-up"
    return "measured" if i < warmup + steps else "counted"


def reconstruct(result: dict, log_text: str | None) -> dict | None:
    """Per-step batch sizes and step times of a result written before they were recorded.

    Only at world size 1, where rank 0's local batch is the global one: ``local_batch_sizes``
    holds one entry per loop step (warm-up, measured, counted, in that order), and the run's log
    the same steps' progress lines (``step 4/12 (measured): 587.8 ms``, 0.1 ms resolution). The
    reconstruction is refused unless the log has exactly those steps in that order and its
    measured steps give the result's median, min and max to the log's resolution.

    Args:
        result: One experiment's JSON result.
        log_text: Its log (``logs/{name}.log``), or None.

    Returns:
        ``{"step_ms": [...], "global_batch_sizes": [...]}`` of the measured steps, or None.
    """
    cfg, env = result.get("config", {}), result.get("environment", {})
    sizes = result.get("local_batch_sizes")
    if result.get("status") != "ok" or env.get("world_size") != 1 or not sizes or not log_text:
        return None
    if any(k not in cfg for k in ("warmup", "steps", "count_steps")):
        return None
    warmup, steps, counted = cfg["warmup"], cfg["steps"], cfg["count_steps"]
    total = warmup + steps + counted
    if len(sizes) != total:
        return None
    lines = [m.groups() for line in log_text.splitlines() if (m := _STEP_LINE.match(line))]
    expected = [(str(i + 1), str(total), _tag(i, warmup, steps)) for i in range(total)]
    if [g[:3] for g in lines] != expected:
        return None
    ms = [float(g[3]) for g in lines[warmup : warmup + steps]]
    logged = {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}
    if any(abs(logged[k] - result["step_ms"][k]) > _LOG_MS + 1e-9 for k in logged):
        return None
    return {"step_ms": ms, "global_batch_sizes": sizes[warmup : warmup + steps]}


def load_run(run_dir: Path) -> list[dict]:
    """Every experiment JSON of a run, with reconstructed per-step data where possible.

    A result without ``measured_global_batch_sizes`` gets :func:`reconstruct`'s data from
    ``logs/{stem}.log`` under :data:`RECONSTRUCTED_KEY` when that succeeds.

    Args:
        run_dir: The run's directory (``{name}.json`` files, ``logs/{name}.log``).

    Returns:
        The results in file name order (failed experiments included).
    """
    out = []
    for path in sorted(Path(run_dir).glob("*.json")):
        result = json.loads(path.read_text())
        if "measured_global_batch_sizes" not in result:
            log = path.parent / "logs" / f"{path.stem}.log"
            steps = reconstruct(result, log.read_text() if log.is_file() else None)
            if steps is not None:
                result[RECONSTRUCTED_KEY] = steps
        out.append(result)
    return out
