"""Quant marks -> ONNX QuantizeLinear / DequantizeLinear, from the fxq quantizers' own configs.

Each quant mark becomes what fxq simulates at that point: ``DQ(Q(x))`` with the quantizer's scale and
zero-point. Constants (weights, biases) are quantized here with :func:`fxq.functional.quantize_to_int`, so
their integer codes are exactly fxq's whatever the rounding policy; activations are quantized by the
runtime's QuantizeLinear (round half to even, saturation to the element type), so their configs must use
HALF_EVEN and a range the element type expresses — a narrower range is written as ``Clip`` before Q when
the policy allows it (exact: clipping to the end points of the grid before rounding equals clamping after).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from fxq.backends.qdq.lowering import Lowered
from fxq.backends.qdq.marking import MARK_DOMAIN, Mark
from fxq.backends.qdq.onnx_graph import (
    INT_RANGES,
    all_tensor_names,
    attr,
    consumers,
    drop_unused_initializers,
    float_initializer,
    initializers,
    int_initializer,
    outer_reads,
    producers,
    rename_outer_reads,
    unique_name,
)
from fxq.errors import ExportError
from fxq.functional import dequantize, quantize_to_int
from fxq.nn.fake_quantize import FakeQuantize
from fxq.spec import FloatFormat, RoundingPolicy, TensorQuantConfig

__all__ = ["QdqPolicy", "QdqRecord", "element_type", "insert_qdq", "strip_marks"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QdqPolicy:
    """What a backend wants Q/DQ to look like.

    Attributes:
        weights: ``"dq"`` — integer initializer + DequantizeLinear; ``"qdq"`` — float initializer (already on
            the grid) + QuantizeLinear + DequantizeLinear.
        bias: ``"dq"`` — int32 initializer + DequantizeLinear; ``"fp32"`` — the fake-quantized values as floats.
        clip_subrange: write ``Clip`` before Q for activation ranges narrower than their element type;
            when False such a range is an :class:`ExportError`.
        fold_weight_transpose: apply a Transpose that follows a weight to the weight itself.
    """

    weights: str = "dq"
    bias: str = "dq"
    clip_subrange: bool = True
    fold_weight_transpose: bool = True


@dataclasses.dataclass(frozen=True)
class QdqRecord:
    """One quantized ONNX tensor."""

    quantizer: str
    role: str  # activation | weight | bias
    tensor: str  # the ONNX tensor that is quantized (Q input, or the weight initializer)
    fx_node: str
    elem_type: int
    axis: int | None
    constant: bool
    requantize: bool


_FP8 = {FloatFormat.E4M3: TensorProto.FLOAT8E4M3FN, FloatFormat.E5M2: TensorProto.FLOAT8E5M2}


def element_type(cfg: TensorQuantConfig, opset: int, *, constant: bool) -> int:
    """The ONNX element type that carries ``cfg``'s codes at ``opset`` (smallest integer type that fits)."""
    if cfg.is_floating:
        if opset < 19:
            raise ExportError(f"FP8 ({cfg.fp_format.name}) Q/DQ needs opset >= 19, got {opset}; pass opset=19")
        return _FP8[cfg.fp_format]
    signed = cfg.quant_min < 0
    order = [TensorProto.INT4, TensorProto.INT8, TensorProto.INT16, TensorProto.INT32] if signed else [
        TensorProto.UINT4, TensorProto.UINT8, TensorProto.UINT16]
    for t in order:
        if t in (TensorProto.INT4, TensorProto.UINT4, TensorProto.INT16, TensorProto.UINT16) and opset < 21:
            continue
        if t == TensorProto.INT32 and not constant:
            continue
        lo, hi = INT_RANGES[t]
        if lo <= cfg.quant_min and cfg.quant_max <= hi:
            return t
    need = "opset 21 (4/16-bit types)" if opset < 21 else "a constant tensor (int32 DQ)"
    raise ExportError(f"no ONNX element type holds [{cfg.quant_min}, {cfg.quant_max}] at opset {opset}; "
                      f"this needs {need}")


class _Inserter:
    def __init__(self, lowered: Lowered, quantizers: dict[str, FakeQuantize], policy: QdqPolicy) -> None:
        self.lowered = lowered
        self.graph = lowered.model.graph
        self.quantizers = quantizers
        self.policy = policy
        self.opset = lowered.opset
        self.used = all_tensor_names(self.graph)
        self.inits = initializers(self.graph)
        self.prod = producers(self.graph)
        self.cons = consumers(self.graph)
        self.sub_reads = outer_reads(self.graph)  # read from inside If/Loop/Scan bodies
        self.moved: dict[str, str] = {}  # tensors renamed or forwarded here: subgraph readers follow them
        self.g_outputs = {o.name for o in self.graph.output}
        self.records: list[QdqRecord] = []
        self.new_inits: list[onnx.TensorProto] = []
        self.removed: set[int] = set()  # ids of nodes folded away
        self.ranks = {m.meta["fxq_export_mark"].id: (m.meta["val"].dim() if isinstance(m.meta.get("val"), torch.Tensor)
                                                     else None)
                      for m in lowered.marked.module.graph.nodes if "fxq_export_mark" in m.meta}

    # ------------------------------------------------------------------ helpers
    def _name(self, base: str) -> str:
        return unique_name(base, self.used)

    def _const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.prod.get(name)
        if node is not None and node.op_type == "Constant" and attr(node, "value") is not None:
            return numpy_helper.to_array(attr(node, "value"))
        return None

    def _qparams(self, base: str, fq: FakeQuantize, elem_type: int, axis: int | None) -> tuple[str, str]:
        cfg = fq.config
        scale = fq.scale.detach().float().cpu().numpy().reshape(-1)
        offset = fq.offset.detach().float().cpu().numpy().reshape(-1)
        shape = (-1,) if axis is not None else ()
        s_name, z_name = self._name(f"{base}_scale"), self._name(f"{base}_zero_point")
        self.new_inits.append(float_initializer(s_name, scale.reshape(shape) if axis is not None else scale[0]))
        if cfg.is_floating:
            zp = np.zeros(scale.shape if axis is not None else (), dtype=np.float32)
            self.new_inits.append(float_initializer(z_name, zp, elem_type))
        else:
            zp = np.rint(offset).astype(np.int64)
            zp = zp.reshape(shape) if axis is not None else zp[0]
            self.new_inits.append(int_initializer(z_name, np.asarray(zp), elem_type))
        return s_name, z_name

    def _axis(self, cfg: TensorQuantConfig, rank: int | None, where: str) -> int | None:
        if not cfg.per_channel:
            return None
        if rank is None:
            return cfg.channel_axis
        if rank == 0:
            raise ExportError(f"{where}: per-channel quantization of a 0-d tensor")
        return cfg.channel_axis % rank

    # ------------------------------------------------------------------ one mark
    def replace(self, node: onnx.NodeProto, mark: Mark) -> list[onnx.NodeProto]:
        fq = self.quantizers[mark.quantizer]
        role = fq.role  # every quantizer has one (QuantGraph checks it)
        x, y = node.input[0], node.output[0]
        value = self._const(x)
        where = f"quantizer {mark.quantizer!r} ({role} of fx node {mark.fx_node!r}, ONNX tensor {x!r})"
        if value is not None and not mark.requantize:
            return self._constant(x, y, value, fq, role, mark, where)
        return self._activation(x, y, fq, role, mark, where)

    def _constant(self, x: str, y: str, value: np.ndarray, fq: FakeQuantize, role: str, mark: Mark,
                  where: str) -> list[onnx.NodeProto]:
        cfg = fq.config
        axis = self._axis(cfg, value.ndim, where)
        try:
            codes_t = quantize_to_int(torch.from_numpy(np.array(value, dtype=np.float32)), cfg)
        except Exception as exc:  # config / shape mismatch
            raise ExportError(f"{where}: cannot quantize the constant: {exc}") from exc
        elem = element_type(cfg, self.opset, constant=True)
        bias_fp32 = role == "bias" and self.policy.bias == "fp32"
        # float form: the values on the grid as FLOAT, then Q -> DQ (FP8 constants are always written this way)
        float_form = bias_fp32 or cfg.is_floating or (self.policy.weights == "qdq" and elem != TensorProto.INT32)
        codes = codes_t.numpy()
        deq = dequantize(codes_t, cfg).numpy().astype(np.float32) if float_form else None
        # a Transpose right after the weight: transpose the constant instead; a weight shared by several layers
        # (a decoder's query MLP called once per layer) has one such Transpose per use, all of one perm
        y_out = y
        users = [n for n in self.cons.get(y, []) if id(n) not in self.removed]
        perms = {tuple(attr(u, "perm") or reversed(range(codes.ndim))) for u in users if u.op_type == "Transpose"}
        if (self.policy.fold_weight_transpose and users and all(u.op_type == "Transpose" for u in users)
                and len(perms) == 1 and y not in self.g_outputs and y not in self.sub_reads
                and not any(u.output[0] in self.g_outputs for u in users[1:])):
            perm = list(perms.pop())
            codes = codes.transpose(perm)
            deq = deq.transpose(perm) if deq is not None else None
            axis = perm.index(axis) if axis is not None else None
            self.removed.update(id(u) for u in users)
            y_out = users[0].output[0]
            for u in users[1:]:
                self._forward(u.output[0], y_out)
        if bias_fp32:  # no Q/DQ: consumers read the fake-quantized values directly
            name = self._float_init(x, deq, value.shape)
            if y_out in self.g_outputs:
                return [helper.make_node("Identity", [name], [y_out], name=self._name(f"{x}_Identity"))]
            self._forward(y_out, name)
            self.records.append(QdqRecord(mark.quantizer, role, name, mark.fx_node, TensorProto.FLOAT, axis, True,
                                          False))
            return []
        s_name, z_name = self._qparams(x, fq, elem, axis)
        axis_kw = {"axis": int(axis)} if axis is not None else {}
        nodes = []
        if float_form:
            tensor = self._float_init(x, deq, value.shape)
            dq_in = self._name(f"{x}_QuantizeLinear_Output")
            nodes.append(helper.make_node("QuantizeLinear", [tensor, s_name, z_name], [dq_in],
                                          name=self._name(f"{x}_QuantizeLinear"), **axis_kw))
        else:
            tensor, dq_in = x, self._name(f"{x}_quantized")
            try:
                self.new_inits.append(int_initializer(dq_in, codes.astype(np.int64), elem))
            except ValueError as exc:
                raise ExportError(f"{where}: {exc}") from exc
        y_final = y_out if y_out in self.g_outputs else self._rename_output(y_out, f"{x}_DequantizeLinear_Output")
        nodes.append(helper.make_node("DequantizeLinear", [dq_in, s_name, z_name], [y_final],
                                      name=self._name(f"{x}_DequantizeLinear"), **axis_kw))
        self.records.append(QdqRecord(mark.quantizer, role, tensor, mark.fx_node, elem, axis, True, False))
        return nodes

    def _float_init(self, x: str, values: np.ndarray, shape: tuple) -> str:
        """Store ``values`` under ``x`` when nothing else reads ``x`` (and the shape is unchanged), else a new name."""
        sole_user = len(self.cons.get(x, [])) == 1 and x not in self.g_outputs and x not in self.sub_reads
        name = x if sole_user and x in self.inits and tuple(values.shape) == tuple(shape) else self._name(
            f"{x}_fakequant")
        if name == x and self._holds(x, values):
            return name  # a baked weight is on the grid already: rewriting it would only grow the proto's arena
        self._replace_init(name, values)
        return name

    def _holds(self, name: str, values: np.ndarray) -> bool:
        """Whether initializer ``name`` already stores ``values`` as FLOAT (protobuf keeps a replaced tensor's bytes
        until the whole model is freed, so an unneeded rewrite costs a copy of the weights)."""
        t = self.inits[name]
        return t.data_type == TensorProto.FLOAT and np.array_equal(numpy_helper.to_array(t), values)

    def _forward(self, y: str, to: str) -> None:
        for n in self.cons.get(y, []):
            for i, name in enumerate(n.input):
                if name == y:
                    n.input[i] = to
        self.cons.setdefault(to, []).extend(self.cons.pop(y, []))
        self.moved[y] = to

    def _activation(self, x: str, y: str, fq: FakeQuantize, role: str, mark: Mark,
                    where: str) -> list[onnx.NodeProto]:
        cfg = fq.config
        if cfg.rounding is not RoundingPolicy.HALF_EVEN:
            raise ExportError(
                f"{where}: rounds {cfg.rounding.name} but ONNX QuantizeLinear rounds half to even, so the runtime "
                f"would not match fxq's simulation; quantize for a platform with HALF_EVEN rounding"
            )
        elem = element_type(cfg, self.opset, constant=False)
        axis = self._axis(cfg, self.ranks.get(mark.id), where)
        nodes: list[onnx.NodeProto] = []
        q_in = x
        if not cfg.is_floating and (cfg.quant_min, cfg.quant_max) != INT_RANGES[elem]:
            if not self.policy.clip_subrange:
                raise ExportError(
                    f"{where}: range [{cfg.quant_min}, {cfg.quant_max}] is narrower than "
                    f"{TensorProto.DataType.Name(elem)} {list(INT_RANGES[elem])} and this backend saturates only to "
                    f"the type's range; use the full range of an 8-bit (or 4/16-bit) type for activations"
                )
            if axis is not None:
                raise ExportError(f"{where}: a per-channel activation with a narrowed range cannot be written")
            s = float(fq.scale.detach().reshape(-1)[0])
            o = float(fq.offset.detach().reshape(-1)[0])
            lo_name, hi_name = self._name(f"{x}_clip_min"), self._name(f"{x}_clip_max")
            self.new_inits.append(float_initializer(lo_name, np.float32((cfg.quant_min - o) * s)))
            self.new_inits.append(float_initializer(hi_name, np.float32((cfg.quant_max - o) * s)))
            q_in = self._name(f"{x}_clipped")
            nodes.append(helper.make_node("Clip", [x, lo_name, hi_name], [q_in], name=self._name(f"{x}_Clip")))
        s_name, z_name = self._qparams(x, fq, elem, axis)
        axis_kw = {"axis": int(axis)} if axis is not None else {}
        q_out = self._name(f"{x}_QuantizeLinear_Output")
        nodes.append(helper.make_node("QuantizeLinear", [q_in, s_name, z_name], [q_out],
                                      name=self._name(f"{x}_QuantizeLinear"), **axis_kw))
        y_final = y if y in self.g_outputs else self._rename_output(y, f"{x}_DequantizeLinear_Output")
        nodes.append(helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [y_final],
                                      name=self._name(f"{x}_DequantizeLinear"), **axis_kw))
        self.records.append(QdqRecord(mark.quantizer, role, x, mark.fx_node, elem, axis, False, mark.requantize))
        return nodes

    def _replace_init(self, name: str, values: np.ndarray) -> None:
        tensor = numpy_helper.from_array(values.astype(np.float32), name)
        if name in self.inits:
            self.inits[name].CopyFrom(tensor)
        else:
            self.new_inits.append(tensor)
            self.used.add(name)

    def _rename_output(self, y: str, wanted: str) -> str:
        new = self._name(wanted)
        for n in self.cons.get(y, []):
            for i, name in enumerate(n.input):
                if name == y:
                    n.input[i] = new
        self.cons[new] = self.cons.pop(y, [])
        self.moved[y] = new
        return new

    # ------------------------------------------------------------------ all marks
    def run(self) -> list[QdqRecord]:
        marks = self.lowered.marked.marks
        out: list[onnx.NodeProto] = []
        for node in list(self.graph.node):
            if id(node) in self.removed:
                continue
            if node.domain == MARK_DOMAIN:
                mark = marks[int(attr(node, "id"))]
                out.extend(self.replace(node, mark))
            else:
                out.append(node)
        out = [n for n in out if id(n) not in self.removed]
        del self.graph.node[:]
        self.graph.node.extend(out)
        self.graph.initializer.extend(self.new_inits)
        rename_outer_reads(self.graph, self.moved)
        drop_unused_initializers(self.graph, self.sub_reads)
        return self.records


def insert_qdq(lowered: Lowered, quantizers: dict[str, FakeQuantize],
               policy: QdqPolicy) -> list[QdqRecord]:
    """Replace every quant mark of ``lowered.model`` by Q/DQ (in place); returns what was quantized."""
    return _Inserter(lowered, quantizers, policy).run()


def strip_marks(lowered: Lowered, quantizers: dict[str, FakeQuantize]) -> list[QdqRecord]:
    """Remove quant marks without Q/DQ (FP32 graph + side table exporters); constants get their fake-quantized
    values so the FP32 graph computes what fxq simulates for them. Returns the records of marked tensors."""
    graph = lowered.model.graph
    inits = initializers(graph)
    g_inputs = {i.name for i in graph.input}
    g_outputs = {o.name for o in graph.output}
    readers = consumers(graph)
    used = all_tensor_names(graph)
    records: list[QdqRecord] = []
    alias: dict[str, str] = {}
    rename: dict[str, str] = {}
    keep: list[onnx.NodeProto] = []
    identities: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain != MARK_DOMAIN:
            keep.append(node)
            continue
        mark = lowered.marked.marks[int(attr(node, "id"))]
        fq = quantizers[mark.quantizer]
        role = fq.role
        x, y = node.input[0], node.output[0]
        while x in alias:
            x = alias[x]
        constant = x in inits and not mark.requantize
        if constant:
            t = torch.from_numpy(numpy_helper.to_array(inits[x]).copy()).float()
            fake = dequantize(quantize_to_int(t, fq.config), fq.config).numpy().astype(np.float32)
            if len(readers.get(x, [])) == 1 and x not in g_outputs:  # only this mark reads it: quantize in place
                inits[x].CopyFrom(numpy_helper.from_array(fake, x))
            else:  # other nodes read the FP32 value: the mark's consumers get a fake-quantized copy
                x = unique_name(f"{x}_fakequant", used)
                graph.initializer.append(numpy_helper.from_array(fake, x))
                inits[x] = graph.initializer[-1]
        tensor = x
        if y in g_outputs:
            if x in g_inputs or x in inits or x in g_outputs or x in rename:
                identities.append(helper.make_node("Identity", [x], [y], name=f"{y}_Identity"))
            else:  # the graph output takes over the name of the value it returns
                rename[x] = tensor = y
        else:
            alias[y] = x
        axis = fq.config.channel_axis if fq.config.per_channel else None
        records.append(QdqRecord(mark.quantizer, role, tensor, mark.fx_node, TensorProto.UNDEFINED, axis, constant,
                                 mark.requantize))
    for node in keep:
        for i, name in enumerate(node.input):
            while name in alias:
                name = alias[name]
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
    records = [dataclasses.replace(r, tensor=rename.get(r.tensor, r.tensor)) for r in records]
    lowered.tensor_of.update({k: rename[v] for k, v in lowered.tensor_of.items() if v in rename})
    del graph.node[:]
    graph.node.extend(keep + identities)
    return records
