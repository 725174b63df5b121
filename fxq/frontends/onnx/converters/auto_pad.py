"""``auto_pad`` = ``SAME_UPPER`` / ``SAME_LOWER`` on ``Conv``, ``AveragePool`` and ``MaxPool`` (all versions), and
explicit pads that differ between a dim's start and end on the same ops (:class:`OnnxAsymmetricPad`).

onnx2torch 1.5.15 refuses both (``"SAME_UPPER" auto_pad is not implemented``); ``VALID`` and ``NOTSET`` it
converts right, and those keep its modules untouched (no extra op). ONNX's SAME pads follow from the input size:
``out = ceil(in / stride)``, ``total = max(0, (out - 1) * stride + (kernel - 1) * dilation + 1 - in)``, split in half
with the odd element at the end (``SAME_UPPER``) or the start (``SAME_LOWER``). They are computed from ``x.shape``
when the module runs (:class:`OnnxSamePad`), so a converted model, and a file exported from it with dynamic axes,
stays right at other input sizes: fx records the arithmetic on the traced sizes, torch.onnx writes it as
Shape/Gather/arithmetic ops feeding a ``Pad``. ``ceil_mode`` has no effect under SAME (the output size is fixed).

After conversion :func:`inline_wrappers` writes such a module's code into the graph (pad arithmetic, ``F.pad``, then
a plain ``call_module`` of the ``nn.Conv*`` it holds, under the ONNX node's name), so the conv's weight is quantized
like any other conv's: fxq keeps a loaded GraphModule's modules whole, and an opaque wrapper would keep its conv in
float. Pools have no weights and stay one module.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from onnx import helper
from onnx2torch.node_converters.registry import get_converter
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OperationConverterResult
from torch import fx, nn

from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxSamePad", "OnnxAsymmetricPad", "same_pad_converter", "is_same_pad", "inline_wrappers"]

Converter = Callable[[OnnxNode, OnnxGraph], OperationConverterResult]


def same_pads(sizes: list, kernel: list[int], stride: list[int], dilation: list[int], upper: bool) -> list:
    """``F.pad`` pads (last spatial dim first) for ONNX's SAME rule. ``sizes`` may be fx proxies or traced sizes:
    only ``+ - * // %`` are used, no ``max`` or branch on them, and ``//`` and ``%`` only on non-negative numbers
    (torch.onnx writes ``//`` as ``Div``, which truncates towards zero)."""
    pads: list = []
    for size, k, s, d in reversed(list(zip(sizes, kernel, stride, dilation))):
        eff = (k - 1) * d + 1
        total = eff - 1 - (size - 1) % s  # = (ceil(size / s) - 1) * s + eff - size
        if eff < s:  # total may be negative, in (-s, s): max(0, total) = total * ((total + s) // s)
            total = total * ((total + s) // s)
        small = total // 2
        large = total - small
        pads += [small, large] if upper else [large, small]
    return pads


class _PadThenOp(nn.Module):
    """``op`` (a conv or pool without padding of its own) after ``F.pad`` of the input by :meth:`pads_for`.

    ``value`` is the pad value (``-inf`` for max pooling); ``exclude_pad``: average pooling that leaves the pads out
    of the count (``count_include_pad=0``): the result is divided by ``op`` of the padded ones, the share of real
    elements in each window."""

    op: nn.Module
    value: float
    exclude_pad: bool

    @property
    def fxq_inline(self) -> bool:
        """Inlined at load when ``op`` has weights (a conv, see :func:`inline_wrappers`); a pool stays one module,
        quantized at its input and output like the ONNX node."""
        return any(True for _ in self.op.parameters())

    def pads_for(self, x: torch.Tensor) -> list:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = self.pads_for(x)
        y = self.op(F.pad(x, pads, value=self.value))
        if self.exclude_pad:
            ones = torch.ones((1, 1) + x.shape[2:], dtype=x.dtype, device=x.device)  # from the shape: no activation
            y = y / self.op(F.pad(ones, pads, value=0.0))
        return y


class OnnxSamePad(_PadThenOp):
    """ONNX's SAME padding, computed from the input's size at each call.

    Args:
        op: the module applied to the padded input.
        kernel, stride, dilation: of each spatial dim.
        upper: SAME_UPPER (odd pad at the end) or SAME_LOWER (at the start).
        value, exclude_pad: as :class:`_PadThenOp`.
    """

    def __init__(self, op: nn.Module, kernel: list[int], stride: list[int], dilation: list[int], upper: bool,
                 value: float = 0.0, exclude_pad: bool = False) -> None:
        super().__init__()
        self.op = op
        self.kernel, self.stride, self.dilation = list(kernel), list(stride), list(dilation)
        self.upper, self.value, self.exclude_pad = upper, value, exclude_pad

    def pads_for(self, x: torch.Tensor) -> list:
        n = len(self.kernel)
        return same_pads([x.shape[2 + i] for i in range(n)], self.kernel, self.stride, self.dilation, self.upper)

    def extra_repr(self) -> str:
        return (f"kernel={self.kernel}, stride={self.stride}, dilation={self.dilation}, "
                f"{'SAME_UPPER' if self.upper else 'SAME_LOWER'}, value={self.value}, exclude_pad={self.exclude_pad}")


class OnnxAsymmetricPad(_PadThenOp):
    """Fixed pads that differ between a dim's start and end, which torch's convs and pools cannot take. onnx2torch
    refused them for AveragePool ("non symmetrical padding") and wrapped Conv and MaxPool in an ``nn.Sequential``
    with its pad module, which hid the conv's weight from the quantizers (tf2onnx writes TensorFlow's SAME this way;
    onnx-caffe2's GoogLeNet / Inception-v2 pool so).

    Args:
        op: the module applied to the padded input.
        pads: ``F.pad`` order (last dim first, begin then end).
        value, exclude_pad: as :class:`_PadThenOp`.
    """

    def __init__(self, op: nn.Module, pads: list[int], value: float = 0.0, exclude_pad: bool = False) -> None:
        super().__init__()
        self.op = op
        self.pads = [int(p) for p in pads]
        self.value = float(value)
        self.exclude_pad = exclude_pad

    def pads_for(self, x: torch.Tensor) -> list:
        return self.pads

    def extra_repr(self) -> str:
        return f"pads={self.pads}, value={self.value}, exclude_pad={self.exclude_pad}"


def _asymmetric_pads(node: OnnxNode) -> list[int] | None:
    """An explicitly padded node's pads in ``F.pad`` order when some dim's begin and end differ; else None."""
    from fxq.frontends.onnx.converters.pad import torch_pads

    pads = [int(p) for p in node.attributes.get("pads", [])]
    n = len(pads) // 2
    if node.attributes.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or pads[:n] == pads[n:]:
        return None
    return torch_pads(pads, None, None)


def is_same_pad(node: OnnxNode) -> bool:
    """Whether ``node`` asks for SAME_UPPER / SAME_LOWER padding."""
    return node.attributes.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")


def _unpadded(node: OnnxNode, keep_ceil_mode: bool = False) -> OnnxNode:
    """A copy of ``node`` without padding: no auto_pad, pads or (unless kept) ceil_mode (SAME fixes the output
    size)."""
    proto = node.proto
    dropped = ("auto_pad", "pads") if keep_ceil_mode else ("auto_pad", "pads", "ceil_mode")
    attrs = [a for a in proto.attribute if a.name not in dropped]
    copy = helper.make_node(proto.op_type, list(proto.input), list(proto.output), name=proto.name,
                            domain=proto.domain or None)
    copy.attribute.extend(attrs)
    return OnnxNode(copy, node.unique_name)


def _kernel(node: OnnxNode, graph: OnnxGraph) -> list[int]:
    kernel = node.attributes.get("kernel_shape")
    if kernel is None:  # Conv may leave it out: the weight's spatial dims
        kernel = list(graph.initializers[node.input_values[1]].to_torch().shape[2:])
    return [int(k) for k in kernel]


def same_pad_converter(inner: Converter, value: float = 0.0) -> Converter:
    """Wrap ``inner`` (the converter of the unpadded op) in :class:`OnnxSamePad` for SAME nodes and in
    :class:`OnnxAsymmetricPad` for explicit pads that differ at a dim's start and end; others go to ``inner`` as they
    are."""

    def convert(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
        exclude = node.operation_type == "AveragePool" and not int(node.attributes.get("count_include_pad", 0))
        if not is_same_pad(node):
            pads = _asymmetric_pads(node)
            if pads is None:
                return inner(node, graph)
            converted = inner(_unpadded(node, keep_ceil_mode=True), graph)
            return OperationConverterResult(
                torch_module=OnnxAsymmetricPad(converted.torch_module, pads, value, exclude),
                onnx_mapping=converted.onnx_mapping)
        a = node.attributes
        kernel = _kernel(node, graph)
        n = len(kernel)
        stride = [int(s) for s in a.get("strides", [1] * n)]
        dilation = [int(d) for d in a.get("dilations", [1] * n)]
        if any(d != 1 for d in dilation):
            raise NotImplementedError(
                f"{node.operation_type}: auto_pad={a['auto_pad']} with dilations={dilation}: onnxruntime refuses it "
                "(Conv) or pads for the undilated kernel (MaxPool), against the ONNX spec, so no reference says what "
                "the file computes; re-export it with explicit pads")
        converted = inner(_unpadded(node), graph)
        module = OnnxSamePad(converted.torch_module, kernel, stride, dilation, a["auto_pad"] == "SAME_UPPER",
                             value, exclude)
        return OperationConverterResult(torch_module=module, onnx_mapping=converted.onnx_mapping)

    convert.__name__ = f"same_pad_{getattr(inner, '__name__', 'converter')}"
    return convert


for _op, _versions in (("Conv", (1, 11)), ("AveragePool", (7, 10, 11))):
    for _v in _versions:
        _inner = get_converter(operation_type=_op, version=_v)  # onnx2torch's, taken before ours replaces it
        register_onnx_converter(_op, _v, override=True)(same_pad_converter(_inner))


def inline_wrappers(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each ``call_module`` of a module marked ``fxq_inline`` (:class:`OnnxSamePad`, ConvTranspose's crop)
    by its traced code; the torch.nn modules inside stay ``call_module`` nodes (of ``<node>.<child>``).

    The first module call inside (the conv or pool of the data) takes the ONNX node's name and metadata (its
    ``params`` keys lose the child's prefix), so quantizers, exports and error messages still name the ONNX node;
    the ONNX output names go to the node that returns the wrapper's result where that is another one (ConvTranspose's
    crop), since that is the tensor the file names.
    """
    modules = dict(gm.named_modules())
    changed = False
    for node in list(gm.graph.nodes):
        mod = modules.get(node.target) if node.op == "call_module" else None
        if mod is None or not getattr(mod, "fxq_inline", False) or node.kwargs:
            continue
        inner = fx.symbolic_trace(mod)
        env: dict[fx.Node, Any] = {}
        args = iter(node.args)
        result_node: Any = None
        calls: list[fx.Node] = []
        with gm.graph.inserting_before(node):
            for sub in inner.graph.nodes:
                if sub.op == "placeholder":
                    env[sub] = next(args)
                elif sub.op == "output":
                    result_node = fx.map_arg(sub.args[0], env.__getitem__)
                else:
                    new = gm.graph.node_copy(sub, env.__getitem__)
                    if sub.op in ("call_module", "get_attr"):
                        new.target = f"{node.target}.{sub.target}"
                    if sub.op == "call_module":
                        calls.append(new)
                    env[sub] = new
        meta = dict(node.meta)
        if calls and "onnx" in meta:
            child = calls[0].target[len(node.target) + 1:]
            info = dict(meta["onnx"])
            info["params"] = {k[len(child) + 1:] if k.startswith(child + ".") else k: v
                              for k, v in info.get("params", {}).items()}
            calls[0].meta.update({**meta, "onnx": info})
            if isinstance(result_node, fx.Node) and result_node is not calls[0]:
                # the ONNX output is what the wrapper returned (the cropped result), not the inner op's value
                result_node.meta["onnx"] = {k: v for k, v in info.items() if k not in ("params", "args")}
                info.pop("outputs", None)
        node.replace_all_uses_with(result_node)
        gm.graph.erase_node(node)
        if calls:
            from fxq.graph.passes import reuse_node_name

            reuse_node_name(calls[0], node.name)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
