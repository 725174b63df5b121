"""The ``fxq::`` fake-quant ops, each described once: its arguments and the reference math it runs.

:mod:`fxq.ops` registers every op of :data:`OP_SPECS` (forward, backward, fake, autograd) from these
entries, and the kernels (:mod:`fxq.fused_cpu`, :mod:`fxq.triton_kernels`) split and forward arguments
with them, so an op's argument list is written here and nowhere else. Every op has the same shape:

* forward ``(x, *params, *attrs) -> y``: ``params`` are tensors that get gradients (scale, offset),
  ``attrs`` plain numbers, the channel ``axis`` first;
* backward ``(grad, x, *params, *attrs, *need_<param>_grad) -> (grad_x, *param_grads)``, computed as an
  elementwise part ``(grad_x, *products)`` and the reference's reduction (:meth:`OpSpec.reduce`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxq.numeric import reference as R

__all__ = [
    "OpSpec",
    "LINEAR",
    "FLOAT",
    "OP_SPECS",
    "linear_fake_quantize_backward_reference",
    "float_fake_quantize_backward_reference",
]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One fake-quant op: name, argument list and its reference forward / backward."""

    name: str
    params: tuple[str, ...]
    attrs: tuple[tuple[str, str], ...]
    forward: Callable[..., torch.Tensor]
    elementwise: Callable[..., tuple[torch.Tensor | None, ...]]

    @property
    def qualname(self) -> str:
        return f"fxq::{self.name}"

    @property
    def backward_name(self) -> str:
        return f"{self.name}_backward"

    @property
    def backward_qualname(self) -> str:
        return f"fxq::{self.backward_name}"

    @property
    def num_tensors(self) -> int:
        """Tensors in front of the attributes in the forward's arguments: x and the parameters."""
        return 1 + len(self.params)

    def _arguments(self) -> list[str]:
        return ["Tensor x", *(f"Tensor {p}" for p in self.params), *(f"{t} {a}" for a, t in self.attrs)]

    def schema(self) -> str:
        """The forward's torch schema, e.g. ``(Tensor x, Tensor scale, int axis, ...) -> Tensor``."""
        return f"({', '.join(self._arguments())}) -> Tensor"

    def backward_schema(self) -> str:
        """The backward's torch schema: grad first, one ``need_<param>_grad`` flag per parameter last."""
        args = ["Tensor grad", *self._arguments(), *(f"bool need_{p}_grad" for p in self.params)]
        return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * self.num_tensors)})"

    def split(self, args: Sequence[Any]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[Any, ...]]:
        """Forward arguments as ``(x, params, attrs)``."""
        return args[0], tuple(args[1 : self.num_tensors]), tuple(args[self.num_tensors :])

    def split_backward(self, args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...],
                                                           tuple[Any, ...], tuple[bool, ...]]:
        """Backward arguments as ``(grad, x, params, attrs, needs)``."""
        x, params, rest = self.split(args[1:])
        n_attrs = len(self.attrs)
        return args[0], x, params, tuple(rest[:n_attrs]), tuple(rest[n_attrs:])

    def backward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        """The reference backward: ``(grad_x, *param_grads)`` summed over every axis but the channel axis."""
        return self.reduce(args, self.elementwise(*args))

    def reduce(self, args: Sequence[Any], elementwise: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
        """The backward's result from its elementwise part ``(grad_x, *products)`` (of a kernel, maybe
        flattened): ``grad_x`` and the parameters' gradients, reduced by the reference
        (:func:`~fxq.numeric.reference.param_grads`) so that every implementation sums alike."""
        _, x, params, attrs, _ = self.split_backward(args)
        grad_x, *products = elementwise
        products = [None if p is None else p.view(x.shape) for p in products]
        return (grad_x.view(x.shape), *R.param_grads(products, params, attrs[0]))


LINEAR = OpSpec(
    name="fake_quant_linear",
    params=("scale", "offset"),
    attrs=(("axis", "int"), ("quant_min", "int"), ("quant_max", "int"), ("rounding", "int")),
    forward=R.linear_fake_quantize_reference,
    elementwise=R.linear_fake_quantize_backward_elementwise,
)
FLOAT = OpSpec(
    name="fake_quant_float",
    params=("scale",),
    attrs=(("axis", "int"), ("mantissa_bits", "int"), ("min_exponent", "int"), ("max_value", "float"),
           ("rounding", "int")),
    forward=R.float_fake_quantize_reference,
    elementwise=R.float_fake_quantize_backward_elementwise,
)
OP_SPECS: tuple[OpSpec, ...] = (LINEAR, FLOAT)
"""Every fake-quant op, in registration order."""

linear_fake_quantize_backward_reference = LINEAR.backward
"""Reference backward of ``fxq::fake_quant_linear``: STE for x, LSQ(+) for scale and offset."""
float_fake_quantize_backward_reference = FLOAT.backward
"""Reference backward of ``fxq::fake_quant_float``: STE for x, LSQ for the scale."""
