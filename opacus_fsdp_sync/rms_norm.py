"""Moved: the RMSNorm room lives in :mod:`opacus_fsdp_sync.layers.norms` (kept for old imports)."""

from .layers.norms import (
    EPS_ATTRIBUTES,
    PROBE_RTOL,
    epsilon,
    formula_error,
    has_rms_formula,
    is_candidate,
    layer_type,
    normalized,
    per_sample_weight_grads,
    rms_norm_sample,
    rms_norm_samplers,
)

__all__ = [
    "EPS_ATTRIBUTES",
    "PROBE_RTOL",
    "epsilon",
    "formula_error",
    "has_rms_formula",
    "is_candidate",
    "layer_type",
    "normalized",
    "per_sample_weight_grads",
    "rms_norm_sample",
    "rms_norm_samplers",
]
