"""Output-gradient tensor hooks in place of Opacus's full backward hooks, for one-output layers.

Opacus registers two hooks per layer: a forward hook that captures the inputs and a *full*
backward hook that reads the output gradient. torch implements a full backward hook by wrapping
the layer's inputs and outputs in an autograd function on every forward (two extra graph nodes
and their Python callbacks per layer and step), then calls it once the gradients w.r.t. the
layer's inputs are known. The norms only read the output gradient, so for a layer whose forward
returns one tensor (``Linear``, ``Embedding``, ``LayerNorm``, the RMSNorm-like layers) the
forward hook registers a hook on that output tensor instead, which autograd calls with the same
gradient (the sum over every use of the output) before the layer's own backward runs:

- the layer's own backward math is unchanged, and so are the norms and clipped gradients, bit for
  bit (the tests compare against the full-backward-hook path and the clip-each-sample loop);
- a hook on an output passed to ``backward(inputs=...)`` (the activations-only first pass's
  sources) is called too;
- a forward hook registered after Opacus's (after ``make_private``) that replaces the layer's
  output does not change what the norms read: the gradient w.r.t. the layer's own output (a
  full backward hook reads the gradient w.r.t. the replaced output).

An output that is a view (``Linear`` on a sequence returns one) would lose its hook to a later
in-place op on it (``h += r``, ``relu_``, an in-place dropout): autograd rebuilds a modified
view's node, and the gradient w.r.t. the layer's own output is never formed (the full backward
hook refused such models at forward time). The layer therefore returns a non-view alias of such
an output (``aten::_unsafe_view``: the same memory, no copy, an ordinary autograd node), on
which the hook is registered; an in-place op on it keeps the hook, called with the gradient
w.r.t. the value before the op, as on any non-view tensor.

A tensor-parallel model keeps Opacus's full backward hooks: its layers' outputs may be DTensors
that a later hook redistributes. So does every other layer type.
"""

from __future__ import annotations

from functools import partial

import torch
from opacus.grad_sample.functorch import prepare_layer
from opacus.layers import DPGRU, DPLSTM, DPRNN
from torch import nn

from .._torch_compat import in_backward, view_base
from ..distributed.tensor_parallel import on_tp_mesh
from ..errors import UnsupportedConfigurationError

#: Layer types whose forward returns one tensor: their output gradient comes from a tensor hook.
ONE_OUTPUT_TYPES: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


class OutputGradHooksMixin:
    """``add_hooks`` with output tensor hooks for one-output layers (see the module docstring).

    The class it is mixed into provides Opacus's hook API (``iterate_submodules``,
    ``_get_module_type``, ``GRAD_SAMPLERS``, ``capture_activations_hook``,
    ``capture_backprops_hook``, ``enable_hooks``).
    """

    #: ``id`` of each layer whose output gradient comes from a tensor hook.
    _output_hooked: frozenset[int] = frozenset()
    #: Opacus's backward-hook arguments (``loss_reduction``, ``batch_first``).
    _output_hook_kwargs: dict = {}

    def one_output_layer_types(self) -> set[type]:
        """Layer types beyond :data:`ONE_OUTPUT_TYPES` known to return one tensor (overridable)."""
        return set()

    def add_hooks(
        self,
        *,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        force_functorch: bool = False,
    ) -> None:
        """Opacus's hooks, a one-output layer's full backward hook replaced by an output hook.

        Each hooked layer gets Opacus's capture as a forward hook; a one-output layer of a model
        without tensor parallelism reports its output gradient through a hook the capture
        registers on its output (:meth:`hook_output`), every other layer through Opacus's full
        backward hook. Opacus's handle list (``autograd_grad_sample_hooks``) holds every handle,
        so its ``remove_hooks`` removes them all.

        Raises:
            ValueError: if the model already has Opacus's hooks (as Opacus raises).
        """
        model = self._module
        if hasattr(model, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        handles: list = []
        model.autograd_grad_sample_hooks = handles
        self.autograd_grad_sample_hooks = handles
        kwargs = {"loss_reduction": loss_reduction, "batch_first": batch_first}
        self._output_hook_kwargs = kwargs
        tensor_parallel = any(on_tp_mesh(p) for p in model.parameters())
        types = {*ONE_OUTPUT_TYPES, *self.one_output_layer_types()}
        by_tensor_hook = set()
        for module in self.iterate_submodules(model):
            if type(module) in (DPRNN, DPLSTM, DPGRU):  # their RNNLinear cells are hooked
                continue
            layer_type = self._get_module_type(module)
            if force_functorch or layer_type not in self.GRAD_SAMPLERS:
                prepare_layer(module, batch_first=batch_first)
            handles.append(module.register_forward_hook(self.capture_activations_hook))
            if not tensor_parallel and layer_type in types:
                by_tensor_hook.add(id(module))
            else:
                hook = partial(self.capture_backprops_hook, **kwargs)
                handles.append(module.register_full_backward_hook(hook))
        self._output_hooked = frozenset(by_tensor_hook)
        self.enable_hooks()

    def hook_output(self, module: nn.Module, forward_output, captured: bool) -> None:
        """Registers the output-gradient hook of a one-output layer whose inputs were captured.

        Args:
            module: The layer.
            forward_output: What its forward returned (as its forward hooks saw it).
            captured: Whether this forward's inputs were captured (the backward reads them).

        Raises:
            UnsupportedConfigurationError: for a one-output layer type whose forward returned
                something else than one tensor (its norm would go missing).
        """
        if not captured or id(module) not in self._output_hooked:
            return
        if not isinstance(forward_output, torch.Tensor):
            raise UnsupportedConfigurationError(
                f"{type(module).__name__} returned {type(forward_output).__name__}, not one "
                "tensor; its output gradient cannot be read. Restore the layer's own forward "
                "or file an issue with the layer."
            )
        if forward_output.requires_grad:
            forward_output.register_hook(partial(self._output_grad_hook, module))

    def unviewed_output(self, module: nn.Module, forward_output):
        """``forward_output``, or a non-view alias of it for a one-output layer's view output.

        The alias (``aten::_unsafe_view``) shares the output's memory; autograd treats it as a
        tensor of its own, so an in-place op on it does not drop the hook registered on it (see
        the module docstring). Any other output (not a view, not requiring gradients, of a layer
        on a full backward hook, with the hooks off, or in a checkpoint's recomputation) is
        returned as it is.
        """
        if (
            not self.hooks_enabled
            or id(module) not in self._output_hooked
            or type(forward_output) is not torch.Tensor
            or not forward_output.requires_grad
            or view_base(forward_output) is None
            or in_backward()
        ):
            return forward_output
        return torch.ops.aten._unsafe_view(forward_output, forward_output.shape)

    def _output_grad_hook(self, module: nn.Module, grad: torch.Tensor) -> None:
        """Hands the output gradient to the capture, as the full backward hook would."""
        self.capture_backprops_hook(module, None, (grad,), **self._output_hook_kwargs)
