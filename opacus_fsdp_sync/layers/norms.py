"""The norm-layer rooms: ``nn.LayerNorm``, and RMSNorm-like layers found by what they compute.

``nn.LayerNorm``: its norm is Opacus's (from Opacus's per-sample gradient sampler); its
per-sample and clipped gradients are sums of the output gradient times the normalised input
``xhat`` (:class:`LayerNormRoom`).

RMSNorm-like layers (:class:`RMSNormRoom`): a direct per-sample norm, chosen by what the layer
computes (no functorch).

Opacus has no norm sampler for Hugging Face RMSNorm layers (``LlamaRMSNorm`` and its copies) and
falls back to functorch, which re-runs the layer per sample, deep-copies it (impossible for an
FSDP unit) and reads ``layer.parameters()`` (empty under FSDP1 during backward). For
``y = w * xhat`` with ``xhat`` the normalised input (fp32 variance, cast back to the input dtype,
as Llama computes it), sample n's weight gradient is ``sum_t dy_t * xhat_t``.

Which layers take the formula is not read from their class name: a layer type Opacus has no
sampler for, whose only trainable parameter is a 1-D ``weight`` and which holds a float
``variance_epsilon`` (or ``eps``), is a candidate; the formula is then checked once per type
against autograd through the type's own forward on a small probe (three samples, rows at several
scales, one of them at the size of ``eps``, a random weight). A type whose per-sample weight
gradients differ (a forward that ignores ``eps``, normalises otherwise, or is replaced per
instance) keeps Opacus's generic per-sample gradients, and the one-backward step its generic
path; a warning names it. A forward whose weight gradient is the same, such as Gemma's
``(1 + w) * xhat``, rightly keeps the formula.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
import torch.nn.functional as F
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
    GradSampleHooksFastGradientClipping,
)
from torch import nn

from .._torch_compat import saved_operands
from ..distributed.tensor_parallel import sum_sequence_shards
from .registry import (
    LayerRoom,
    Unavailable,
    keep_per_sample,
    layer_type,
    register_layer,
    room_named,
    scale_rows,
)

logger = logging.getLogger(__name__)

#: Attributes holding the epsilon the formula adds to the variance, in the order looked up.
EPS_ATTRIBUTES = ("variance_epsilon", "eps")
#: Relative tolerance of the probe, run in the weight's dtype (Llama's forward and the formula
#: perform the same operations: bit-equal in fp64, fp32, bf16 and fp16).
PROBE_RTOL = 1e-5

_VERDICTS: dict[type, bool] = {}
#: Per verified type: whether its forward's last node saves exactly :func:`normalized` of its
#: input (checked on the same probe), so that the norm can read it instead of renormalising.
_SAVES_XHAT: dict[type, bool] = {}
#: The normalised inputs taken from forward graphs (:func:`saved_normalized`), by memory address.
_NORMALIZED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def epsilon(layer: nn.Module) -> float | None:
    """The layer's float epsilon (:data:`EPS_ATTRIBUTES`), or None."""
    for name in EPS_ATTRIBUTES:
        eps = getattr(layer, name, None)
        if isinstance(eps, float):
            return eps
    return None


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension in fp32, cast to ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def graph_normalized(
    output, x: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The one operand of ``output``'s multiplication node shaped like ``x``, or None.

    For ``y = w * xhat`` it is ``xhat``, which autograd keeps for the weight's gradient. None
    where ``output`` is not a plain tensor made by a multiplication, where the operand is held
    by saved-tensor hooks (:func:`.._torch_compat.saved_operands`), and where not exactly one
    saved operand has ``x``'s shape and dtype without sharing ``weight``'s memory (an expanded
    weight is not the normalised input).
    """
    node = output.grad_fn if type(output) is torch.Tensor else None
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    found = [
        t
        for t in saved_operands(node)
        if type(t) is torch.Tensor
        and t.shape == x.shape
        and t.dtype == x.dtype
        and not _shares_memory(t, weight)
    ]
    return found[0] if len(found) == 1 else None


def _shares_memory(t: torch.Tensor, other: torch.Tensor | None) -> bool:
    if other is None:
        return False
    return t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def saved_normalized(layer: nn.Module, x, output) -> torch.Tensor | None:
    """The layer's normalised input as its forward saved it, or None; marked as normalised.

    Only for a type whose probe showed the saved operand to be bit for bit :func:`normalized`
    of the input (with the input requiring gradients, as in training), and not for a layer
    whose forward was replaced on the instance. The room's norm and gradient read a marked
    tensor (or a view of it with the same elements, as Opacus's ``batch_first=False``
    permutation makes) as ``xhat`` instead of renormalising (the fp32 widening, square, mean,
    product and narrowing: about 16 passes over the input's bytes), and the hooks keep it
    instead of the input (autograd holds it anyway).

    Args:
        layer: A hooked layer.
        x: Its input, as captured.
        output: Its output.
    """
    if (
        type(x) is not torch.Tensor
        or not _SAVES_XHAT.get(layer_type(layer), False)
        or "forward" in vars(layer)
    ):
        return None
    saved = graph_normalized(output, x, layer.weight)
    if saved is None:
        return None
    xhat = saved.detach()
    _NORMALIZED[xhat.data_ptr()] = xhat
    return xhat


def is_marked(x: torch.Tensor) -> bool:
    """Whether ``x`` holds exactly the elements of a tensor :func:`saved_normalized` marked.

    ``x`` may be that tensor or a view with its dimensions permuted, the features last in both
    (its memory, shapes and strides say so).
    """
    marked = _NORMALIZED.get(x.data_ptr())
    if marked is None or marked.dtype != x.dtype or marked.dim() != x.dim():
        return False
    if marked is x:
        return True
    same_memory = _shares_memory(x, marked)
    last = (x.shape[-1], x.stride(-1)) == (marked.shape[-1], marked.stride(-1))
    layout = sorted(zip(x.shape, x.stride())) == sorted(zip(marked.shape, marked.stride()))
    return same_memory and last and layout


def _xhat(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` itself when marked (:func:`is_marked`), else :func:`normalized`."""
    return x if is_marked(x) else normalized(x, eps)


def per_sample_weight_grads(x: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """``(N, H)``: sample n's weight gradient ``sum_t dy_t * xhat_t`` (batch first).

    ``x`` is the layer's input, or its normalised input marked by :func:`saved_normalized`.
    """
    xhat = _xhat(x, eps)
    tokens = math.prod(dy.shape[1:-1])  # not -1: a batch may be empty
    wide = torch.promote_types(dy.dtype, xhat.dtype)  # as autograd's product for the weight
    prod = dy.to(wide) * xhat.to(wide)
    return prod.reshape(dy.shape[0], tokens, dy.shape[-1]).sum(dim=1)


def rms_norm_sample(layer: nn.Module, activations, backprops, sequence_group=None) -> dict:
    """Per-sample gradient norm of an RMSNorm weight (Opacus's norm-sampler signature).

    ``sequence_group``: the group the layer's input is split over along the tokens (the
    hooks pass the layout's under sequence parallelism), or None.

    The per-sample gradients (``N x H``) are left on the layer (:func:`.registry.keep_per_sample`):
    the one-backward step's clipped gradient is their weighted sum, so the normalised input is
    computed once per step.
    """
    g = per_sample_weight_grads(activations[0], backprops, epsilon(layer))
    # sequence parallelism: this rank's tokens only; the sum over tp comes before the norm
    g = sum_sequence_shards(g, sequence_group).float()
    keep_per_sample(layer, {"weight": g})  # fp32 (N x H): its weighted sum is one matvec
    return {layer.weight: torch.linalg.vector_norm(g, 2, dim=-1)}  # Tensor.norm, less Python


#: The hooks accept this sampler on sequence-sharded inputs (it sums them over tp).
rms_norm_sample.sums_sequence_shards = True


def _opacus_handles(cls: type) -> bool:
    hooks = GradSampleHooksFastGradientClipping
    return cls in hooks.NORM_SAMPLERS or cls in hooks.GRAD_SAMPLERS


def is_candidate(module: nn.Module, cls: type) -> bool:
    """Whether ``module`` looks like an RMSNorm: one 1-D trainable ``weight`` and a float eps."""
    if _opacus_handles(cls) or epsilon(module) is None or "forward" in vars(module):
        return False
    weight = getattr(module, "weight", None)
    trainable = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and trainable in ([], ["weight"])


def _probe_layer(module: nn.Module, cls: type, weight: torch.Tensor) -> nn.Module:
    """A fresh, hook-free ``cls`` with ``module``'s plain attributes and ``weight``."""
    probe = cls.__new__(cls)
    nn.Module.__init__(probe)
    for name, value in vars(module).items():
        if not name.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module)):
            probe.__dict__[name] = value
    probe.weight = nn.Parameter(weight)
    return probe


def formula_error(module: nn.Module, cls: type, hidden: int = 8) -> float:
    """Largest relative error of the formula's per-sample weight gradients on a probe.

    The probe runs ``cls``'s forward (not ``module``'s hooks) in the weight's dtype on three
    samples of four tokens, rows scaled from ``sqrt(eps)`` to 30, with a random weight, and takes
    each sample's weight gradient by autograd. Its random numbers come from a private generator.
    """
    return _probe(module, cls, hidden)[0]


def _probe(module: nn.Module, cls: type, hidden: int = 8) -> tuple[float, bool]:
    """:func:`formula_error`, and whether every probe forward saved exactly ``xhat``."""
    eps = epsilon(module)
    weight = module.weight
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    gen = torch.Generator().manual_seed(0)
    small = eps**0.5 if eps > 0 else 1e-3  # a row where eps matters
    scales = torch.tensor([small, 1e-3, 1.0, 30.0]).view(1, 4, 1)
    w = torch.rand(hidden, generator=gen) + 0.5
    x = torch.randn(3, 4, hidden, generator=gen) * scales
    dy = torch.randn(3, 4, hidden, generator=gen)
    w, x, dy = (t.to(device=device, dtype=dtype) for t in (w, x, dy))
    probe = _probe_layer(module, cls, w)
    saves_xhat = True
    with torch.enable_grad():
        grads = []
        for n in range(x.shape[0]):
            xs = x[n : n + 1].clone().requires_grad_()  # as in training: both operands saved
            out = probe(xs)
            saves_xhat &= _saves_normalized(out, xs, probe.weight, eps)
            (g,) = torch.autograd.grad(out, probe.weight, dy[n : n + 1])
            grads.append(g)
    auto = torch.stack(grads).float()
    ours = per_sample_weight_grads(x, dy, eps).float()  # x: not marked, renormalised
    err = ((ours - auto).abs().max() / auto.abs().max().clamp(min=1e-30)).item()
    return (err if err == err else float("inf")), saves_xhat  # NaN: not verified


def _saves_normalized(out, xs: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Whether the probe forward's product saved exactly :func:`normalized` of its input.

    False, not an error, where the saved tensors cannot be read: the formula still holds, the
    norm then renormalises the input.
    """
    try:
        saved = graph_normalized(out, xs, weight)
    except Exception as exc:  # noqa: BLE001 - any failure means: renormalise
        logger.info("[Ghost] RMSNorm: the forward's saved input is not read (%s)", exc)
        return False
    return saved is not None and torch.equal(saved, normalized(xs.detach(), eps))


def has_rms_formula(module: nn.Module, cls: type | None = None) -> bool:
    """Whether the RMSNorm formula gives ``module``'s weight gradients (checked once per type).

    Args:
        module: A hooked layer.
        cls: Its own class (:func:`layer_type` when None).
    """
    cls = layer_type(module) if cls is None else cls
    if cls in _VERDICTS:
        return _VERDICTS[cls] and "forward" not in vars(module)
    if not is_candidate(module, cls):
        return False
    try:
        err, saves_xhat = _probe(module, cls)
        why = f"max relative error {err:.2e} on a probe"
    except Exception as exc:  # noqa: BLE001 - any failure means: not verified
        err, saves_xhat = float("inf"), False
        why = f"the probe failed: {type(exc).__name__}: {exc}"
    ok = err <= PROBE_RTOL
    _VERDICTS[cls] = ok
    _SAVES_XHAT[cls] = ok and saves_xhat
    if ok:
        source = (
            "the normalised input its forward saves"
            if saves_xhat
            else "its input, normalised again"
        )
        msg = "[Ghost] %s: direct RMSNorm weight-gradient formula (%s), from %s"
        logger.info(msg, cls.__name__, why, source)
    else:
        logger.warning(
            "[Ghost] %s has an RMSNorm-like weight and epsilon but its forward's weight "
            "gradient is not the RMSNorm formula's (%s): its norms come from Opacus's generic "
            "per-sample gradients and its clipped gradient from its own autograd",
            cls.__name__,
            why,
        )
    return ok


def rms_norm_types(model: nn.Module) -> set[type]:
    """Every layer type in ``model`` that passes the check (and FSDP2's ``FSDP<Class>`` too).

    A type with an instance whose forward was replaced on the instance is left out.
    """
    passed: dict[type, set[type]] = {}
    blocked: set[type] = set()
    for m in model.modules():
        cls = layer_type(m)
        if "forward" in vars(m):
            blocked.add(cls)
        elif has_rms_formula(m, cls):
            passed.setdefault(cls, set()).update({cls, type(m)})
    return {c for cls, cs in passed.items() if cls not in blocked for c in cs}


def rms_norm_samplers(model: nn.Module) -> dict[type, object]:
    """``{class: the RMSNorm room's norm}`` for every type of :func:`rms_norm_types`."""
    room = room_named("rms_norm")
    return {c: room.norm for c in rms_norm_types(model)}


def _sum_but_batch(t: torch.Tensor, trailing: int) -> torch.Tensor:
    dims = tuple(range(1, t.dim() - trailing))
    return t.sum(dims) if dims else t  # t.sum(()) would sum every dimension


@register_layer(nn.LayerNorm)
class LayerNormRoom(LayerRoom):
    """``nn.LayerNorm``: ``y = w * xhat + b``, weight gradient ``dy * xhat``, bias ``dy``."""

    name = "layer_norm"
    norm = Unavailable(
        "norm of its own",
        "Opacus computes a LayerNorm's norm from its registered per-sample gradient sampler",
    )

    def per_sample_grad(self, layer, activations, backprops):
        """Per-sample sums over the positions of ``dy * xhat`` (weight) and ``dy`` (bias)."""
        xhat = F.layer_norm(activations[0], layer.normalized_shape, None, None, layer.eps)
        trailing = len(layer.normalized_shape)
        out = {}
        if layer.weight is not None and layer.weight.requires_grad:
            out["weight"] = _sum_but_batch(backprops * xhat, trailing)
        if layer.bias is not None and layer.bias.requires_grad:
            out["bias"] = _sum_but_batch(backprops, trailing)
        return out

    def clipped_grad(self, layer, inputs, grad_out, scale):
        """The same sums over the batch too, of the scaled output gradient."""
        grad_out = scale_rows(grad_out, scale)
        x = inputs[0]
        xhat = F.layer_norm(x, layer.normalized_shape, None, None, layer.eps)
        dims = tuple(range(grad_out.dim() - len(layer.normalized_shape)))
        out = {}
        if layer.weight is not None:
            out["weight"] = (grad_out * xhat).sum(dims)
        if layer.bias is not None:
            out["bias"] = grad_out.sum(dims)
        return out


@register_layer(match=True)
class RMSNormRoom(LayerRoom):
    """RMSNorm-like layers whose weight gradient is verified to be ``dy * xhat`` (the module)."""

    name = "rms_norm"

    def matches(self, module, module_type):
        """Whether the formula was verified for the layer's type (:func:`has_rms_formula`)."""
        return has_rms_formula(module, module_type)

    def types_in(self, model):
        """:func:`rms_norm_types`."""
        return rms_norm_types(model)

    norm = staticmethod(rms_norm_sample)

    sums_sequence_shards = True

    def per_sample_grad(self, layer, activations, backprops, sequence_group=None):
        """:func:`per_sample_weight_grads` (summed over ``sequence_group``'s shards)."""
        g = per_sample_weight_grads(activations[0], backprops, epsilon(layer))
        return {"weight": sum_sequence_shards(g, sequence_group)}

    def clipped_grad(self, layer, inputs, grad_out, scale, sequence_group=None):
        """``sum_t dy_t * xhat_t`` over the batch and the positions, of the scaled gradient."""
        grad_out = scale_rows(grad_out, scale)
        x = inputs[0]
        xhat = _xhat(x, epsilon(layer))
        wide = torch.promote_types(grad_out.dtype, xhat.dtype)
        grad = (grad_out.to(wide) * xhat.to(wide)).reshape(-1, x.shape[-1]).sum(0)
        # sequence parallelism: this rank's tokens only, summed over tp
        return {"weight": sum_sequence_shards(grad, sequence_group)}
