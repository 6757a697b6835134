"""Helpers for users' and our own tests: spawned gloo ranks and reference computations."""

from .reference import clip_each_sample_step, per_sample_clipped_grads
from .spawn import RankFailure, run_ranks

__all__ = ["RankFailure", "clip_each_sample_step", "per_sample_clipped_grads", "run_ranks"]
