"""Finding weights shared by several layers, and refusing the pairs we cannot handle."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .cross_terms import SUPPORTED


class UnsupportedTiedParameterError(NotImplementedError):
    """A weight shared between layers whose per-sample cross term we cannot compute."""


@dataclass
class SharedParameter:
    """One weight and the layers that use it.

    Attributes:
        param: The parameter as registered at construction (FSDP2 swaps in an unsharded
            parameter during forward and backward, so hooks look it up by ``local_name``).
        owners: ``(qualified name, module, attribute name on that module)`` per use.
    """

    param: nn.Parameter
    owners: list[tuple[str, nn.Module, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The first qualified name of the weight."""
        return self.owners[0][0]


def find_shared_parameters(model: nn.Module) -> list[SharedParameter]:
    """Trainable parameters registered on more than one module (the same ``Parameter`` object).

    A module registered twice under two names appears once in ``named_modules()``; calling one
    module twice per forward is caught at run time instead.
    """
    by_id: dict[int, SharedParameter] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                entry = by_id.setdefault(id(p), SharedParameter(p))
                entry.owners.append((f"{mname}.{pname}" if mname else pname, module, pname))
    return [s for s in by_id.values() if len(s.owners) > 1]


def check_supported(shared: list[SharedParameter], norm_samplers: dict, type_of=type) -> None:
    """Raises for a shared weight whose owners are not Linear/Embedding ghost-clipping layers.

    Raises:
        UnsupportedTiedParameterError: naming the parameter, the modules and the way out.
    """
    for s in shared:
        for qname, module, _ in s.owners:
            kind = type_of(module)
            if not issubclass(kind, SUPPORTED) or kind not in norm_samplers:
                users = ", ".join(f"{n} ({type_of(m).__name__})" for n, m, _ in s.owners)
                raise UnsupportedTiedParameterError(
                    f"Parameter '{s.name}' is shared by {users}; exact ghost-clipping norms of "
                    f"a shared weight are supported between nn.Linear and nn.Embedding layers "
                    f"only, not {kind.__name__} ('{qname}'). Untie it (for a Hugging Face model: "
                    "config.tie_word_embeddings=False before building, or "
                    "`layer.weight = nn.Parameter(layer.weight.detach().clone())`), or use "
                    "grad_sample_mode='hooks'."
                )
