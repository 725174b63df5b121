"""Prepare: insert FakeQuantize modules where the dispatched platforms say, as in PPQ's quantizer.

Rules, in order:

* an op dispatched to a platform gets configs for its tensor inputs (activation / weight / bias roles)
  and, when the platform quantizes outputs, for its output;
* **fusion**: a computing op (or Add) whose only user is a fusable activation (ReLU/Clip) on the same
  platform hands its output quantizer to the activation (state OVERLAPPED);
* **passive ops** (MaxPool, Reshape, ...) share their input's quantizer (state PASSIVE);
* a tensor is quantized at most once per scheme: consumers of an already-quantized tensor see the
  quantized value (their input configs are OVERLAPPED); several quantized consumers of an FP32 tensor
  share one input quantizer;
* **bias** quantizers are passive: scale = input scale x weight scale, filled in after calibration (the
  bias FakeQuantize records the two in ``derived_from``);
* **alignment** groups (elementwise inputs aligned to the largest, concat inputs to the output) are
  recorded here on their members (``FakeQuantize.aligned``) and applied after calibration; an aligned input is its producer's quantizer, so alignment
  always overlaps (PPQ's ``force_alignment_overlap=True``) and no tensor is quantized twice (PPQ's
  ``remove_useless_quantization=True``): both are how fxq works, not settings;
* each FakeQuantize records its role, source node and parameter (:meth:`~fxq.FakeQuantize.set_record`);
  ``node.meta`` holds placement only (:class:`~fxq.graph.info.NodeQuant`);
* every activation / weight config is checked against its platform's :attr:`~fxq.Platform.capability`
  before its quantizer is made, so a scheme the exporter cannot write fails here, not at export.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import fx, nn

from fxq.graph.dispatch import Dispatch, is_float_tensor
from fxq.graph.info import QUANTIZERS_ATTR, GraphQuant, NodeQuant, computed_from_parameters, is_quantizer_node
from fxq.graph.nodes import get_attr_value
from fxq.graph.op_types import conv_attrs, op_type, pad_fill, weight_arg_nodes, weight_bias_args
from fxq.graph.quant_graph import AlignGroup, quantizer_name, record_alignment
from fxq.nn.fake_quantize import FakeQuantize
from fxq.qconfig.base import COMPUTING_OPS, Platform
from fxq.setting import QuantizationSetting
from fxq.spec import QuantState, TensorQuantConfig

__all__ = ["insert_quantizers"]

logger = logging.getLogger(__name__)

MULTI_INPUT_OPS = COMPUTING_OPS | {"Add", "Sub", "Mul", "Div", "Concat"}
FUSION_SOURCES = COMPUTING_OPS | {"Add"}


class _Builder:
    def __init__(self, gm: fx.GraphModule, plan: Dispatch, setting: QuantizationSetting) -> None:
        self.gm = gm
        self.plan = plan
        self.setting = setting
        self.modules = dict(gm.named_modules())
        self.holder = nn.ModuleDict()
        gm.add_module(QUANTIZERS_ATTR, self.holder)
        self.covering: dict[fx.Node, tuple[str, QuantState]] = {}  # node -> (quantizer, state)
        self.shared_inputs: dict[tuple[fx.Node, str], str] = {}
        self.types = {n: op_type(n, self.modules) for n in gm.graph.nodes}
        self.overlapped_by: dict[fx.Node, fx.Node] = {}  # conv -> the activation that quantizes its output
        self.output_decided: set[fx.Node] = set()  # nodes whose output quantizer was decided as an output
        self.param_memo: dict[fx.Node, bool] = {}  # computed_from_parameters answers

    # ------------------------------------------------------------------ helpers
    def platform_of(self, node: fx.Node) -> Platform | None:
        p = self.plan.get(node)
        return p if isinstance(p, Platform) else None

    @staticmethod
    def _capable(p: Platform, role: str, cfg: TensorQuantConfig, node: fx.Node) -> TensorQuantConfig:
        """``cfg`` if ``p``'s exporter can express it (:attr:`Platform.capability`), else a ConfigError."""
        p.check_config(role, cfg, f"node {node.name!r} ({role} config from platform {p.name!r})")
        return cfg

    def _new_quantizer(self, base: str, cfg: TensorQuantConfig, role: str, source: fx.Node,
                       param: str | None = None, derived_from: tuple[str | None, str] | None = None) -> str:
        base = re.sub(r"\W", "_", base)
        if base[0].isdigit():
            base = f"q_{base}"
        name = base
        i = 1
        while name in self.holder:
            i += 1
            name = f"{base}_{i}"
        self.holder[name] = FakeQuantize(cfg, name=name, role=role, param=param, derived_from=derived_from)
        return name

    def _insert_after(self, source: fx.Node, qname: str, users: list[fx.Node]) -> fx.Node:
        with self.gm.graph.inserting_after(source):
            qnode = self.gm.graph.call_module(f"{QUANTIZERS_ATTR}.{qname}", (source,))
        if "val" in source.meta:
            qnode.meta["val"] = source.meta["val"]
        for user in users:
            user.replace_input_with(source, qnode)
        return qnode

    # ------------------------------------------------------------------ decisions
    def wants_output(self, node: fx.Node) -> bool:
        p = self.platform_of(node)
        return bool(p and p.quantizes_output(self.types[node]) and is_float_tensor(node.meta.get("val"))
                    and not (node.users and all(self._divides_by(u, node) for u in node.users)))

    def _pads_with_values(self, node: fx.Node) -> bool:
        """Whether ``node`` pads with a finite constant other than 0 (EfficientViT's ``F.pad(v, (0, 1),
        value=1.0)``): the constant need not lie on the input's grid, nor in its range, so the result gets a
        quantizer of its own (a passive one would simulate the ones exactly while the file rounds and clips them to
        the input's grid). An infinite one stays passive: a max pool's SAME padding (NASNet's ``-inf``), which no
        window takes, and which a grid of its own could not hold."""
        if self.types.get(node) != "Pad":
            return False
        value = pad_fill(node, self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None)
        if isinstance(value, fx.Node):  # ONNX Pad(data, pads, constant_value): stored, or computed (unknown)
            value = get_attr_value(self.gm, str(value.target)) if value.op == "get_attr" else None
        values = torch.as_tensor(0.0 if value is None else value, dtype=torch.float64)
        return bool(torch.any(torch.isfinite(values) & (values != 0)))

    def _divides_by(self, node: fx.Node, value: fx.Node) -> bool:
        """Whether ``node`` divides by ``value``. A divisor stays FP32: rounding takes the epsilon it carries to 0
        (EfficientViT's ``x / (s + 1e-15)``: 0 / 0 on every quiet pixel), and no backend divides in int8."""
        return self.types.get(node) == "Div" and len(node.args) > 1 and node.args[1] is value and \
            node.args[0] is not value

    def fused_into(self, node: fx.Node) -> fx.Node | None:
        """The activation that takes over this node's output quantizer (conv -> relu), if any."""
        fs = self.setting.fusion_setting
        if not (self.setting.fusion and fs.fuse_activation) or self.types[node] not in FUSION_SOURCES:
            return None
        if len(node.users) != 1:
            return None
        (user,) = node.users
        p, pu = self.platform_of(node), self.platform_of(user)
        if p is None or pu is not p or self.types[user] not in p.fusable_activations or not self.wants_output(user):
            return None
        return user

    def data_inputs(self, node: fx.Node) -> list[tuple[fx.Node, str]]:
        """(input node, role) pairs this op quantizes."""
        t = self.types[node]
        w, b = weight_bias_args(node)
        weights = weight_arg_nodes(node)  # recurrent ops: W and R
        out: list[tuple[fx.Node, str]] = []
        seen: set[fx.Node] = set()
        for i, inp in enumerate(node.all_input_nodes):
            if inp in seen or not is_float_tensor(inp.meta.get("val")) or self._divides_by(node, inp):
                continue
            seen.add(inp)
            if (inp is w and t in COMPUTING_OPS) or inp in weights:
                out.append((inp, "weight"))
            elif inp is b and t in COMPUTING_OPS:
                out.append((inp, "bias"))
            elif t == "MatMul" and i > 0 and computed_from_parameters(inp, self.param_memo):
                out.append((inp, "weight"))
            elif computed_from_parameters(inp, self.param_memo) and t not in MULTI_INPUT_OPS:
                continue  # parameters of LayerNorm, PReLU... stay FP32
            elif t in MULTI_INPUT_OPS or not out:
                out.append((inp, "activation"))
        return out

    # ------------------------------------------------------------------ main
    def run(self) -> GraphQuant:
        graph = self.gm.graph
        fs = self.setting.fusion_setting
        passive_enabled = self.setting.fusion and fs.fuse_passive_op
        gq = GraphQuant(platform="", dispatcher=self.setting.dispatcher)
        overlapped_by = self.overlapped_by
        for node in list(graph.nodes):
            if node.op in ("placeholder", "output", "get_attr") or is_quantizer_node(node):
                continue
            p = self.platform_of(node)
            t = self.types[node]
            status = self.plan.get(node, "fp32")
            nq = NodeQuant(op_type=t, platform=p.name if p else str(status))
            node.meta["fxq"] = nq
            if p is None:
                continue
            # ---- inputs
            weight_q: str | None = None
            data_q: str | None = None
            bias_node: fx.Node | None = None
            if p.quantizes_inputs(t):
                for inp, role in self.data_inputs(node):
                    if self.overlapped_by.get(inp) is node:
                        nq.inputs[inp.name] = None  # filled in once this node's own quantizer exists
                        continue
                    if role == "bias":
                        bias_node = inp
                        continue
                    q = self._quantize_input(node, inp, role, p, t)
                    nq.inputs[inp.name] = q
                    if role == "weight":
                        weight_q = q
                    elif data_q is None:
                        data_q = q
            if bias_node is not None:
                nq.inputs[bias_node.name] = self._quantize_bias(node, bias_node, p, t, data_q, weight_q)
            # ---- output
            if not self.wants_output(node):
                self._pass_pieces_through(node, p, t, passive_enabled)
                continue
            fused = self.fused_into(node)
            if fused is not None:
                overlapped_by[node] = fused
                continue
            first = node.all_input_nodes[0] if node.all_input_nodes else None
            upstream = self._cover_of(first) if first is not None else None
            if passive_enabled and t in p.passive_ops and upstream is not None and not self._pads_with_values(node):
                self.covering[node] = (upstream[0], QuantState.PASSIVE)
            else:
                cfg = self._capable(p, "activation", p.activation_config(t, node.name), node)
                q = self._new_quantizer(f"{node.name}_out", cfg, "activation", node)
                users = [u for u in node.users]
                self._insert_after(node, q, users)
                self.covering[node] = (q, QuantState.ACTIVATED)
            self.output_decided.add(node)
            for src, act in list(overlapped_by.items()):
                if act is node:
                    self.covering[src] = (self.covering[node][0], QuantState.OVERLAPPED)
                    self.output_decided.add(src)
                    nq.inputs[src.name] = self.covering[node][0]
                    del overlapped_by[src]
            nq.output, nq.output_state = self.covering[node]
        self._record_alignment()
        for node in graph.nodes:  # only output decisions; input-only quantizers belong to their consumers
            nq = node.meta.get("fxq")
            if isinstance(nq, NodeQuant) and node in self.output_decided:
                nq.output, nq.output_state = self.covering[node]
        return gq

    def _pass_pieces_through(self, node: fx.Node, p: Platform, t: str, passive_enabled: bool) -> None:
        """A passive op with several outputs (``Split``: split, chunk, ONNX Split; a tuple, which no quantizer
        reads) cuts a quantized input into pieces on that input's grid: its pieces (``getitem``, passive too) are
        covered by the input's quantizer, instead of each being quantized again on a grid of its own."""
        val = node.meta.get("val")
        if not (passive_enabled and t in p.passive_ops and p.quantizes_output(t) and isinstance(val, (tuple, list))
                and val and all(is_float_tensor(v) for v in val) and node.all_input_nodes):
            return
        upstream = self._cover_of(node.all_input_nodes[0])
        if upstream is not None:
            self.covering[node] = (upstream[0], QuantState.PASSIVE)

    def _cover_of(self, n: fx.Node) -> tuple[str, QuantState] | None:
        if is_quantizer_node(n):
            return quantizer_name(n), QuantState.ACTIVATED
        return self.covering.get(n)

    def _quantize_input(self, node: fx.Node, inp: fx.Node, role: str, p: Platform, t: str) -> str | None:
        if inp in self.covering and role == "activation":
            q = self.covering[inp][0]  # already quantized upstream: this input config is OVERLAPPED
            # an input quantizer of another consumer reads ``inp`` directly: read its quantized value too
            qnode = next((u for u in inp.users if quantizer_name(u) == q), None)
            if qnode is not None and qnode is not node:
                node.replace_input_with(inp, qnode)
            return q
        if is_quantizer_node(inp):
            return quantizer_name(inp)
        if role == "weight":
            value = get_attr_value(self.gm, inp.target) if inp.op == "get_attr" else inp.meta.get("val")
            shape = tuple(value.shape) if value is not None else None
            cfg = p.weight_config(t, node.name, shape, conv_attrs(node))
            if cfg.per_channel and shape is not None and len(shape) < 2:
                cfg = cfg.replace(per_channel=False)
            cfg = self._capable(p, "weight", cfg, node)
            base = (inp.target.replace(".", "_") if inp.op == "get_attr" else inp.name)
            param = inp.target if inp.op == "get_attr" else None
        else:
            cfg = self._capable(p, "activation", p.activation_config(t, node.name), node)
            base, param = f"{inp.name}_q", None
        key = (inp, role, cfg.scheme)
        if key in self.shared_inputs:
            q = self.shared_inputs[key]
            qnode = next(n for n in inp.users if quantizer_name(n) == q)
            node.replace_input_with(inp, qnode)
            return q
        q = self._new_quantizer(base, cfg, role, inp, param=param)
        self._insert_after(inp, q, [node])
        self.shared_inputs[key] = q
        if role == "activation":
            self.covering.setdefault(inp, (q, QuantState.ACTIVATED))
        return q

    def _quantize_bias(self, node: fx.Node, bias: fx.Node, p: Platform, t: str, data_q: str | None,
                       weight_q: str | None) -> str | None:
        cfg = p.bias_config(t, node.name)
        if cfg is None or weight_q is None or not self.setting.quantize_parameter_setting.quantize_passive_parameter:
            return None
        wcfg = self.holder[weight_q].config
        cfg = cfg.replace(per_channel=wcfg.per_channel, channel_axis=0)
        base = bias.target.replace(".", "_") if bias.op == "get_attr" else f"{bias.name}_bias"
        q = self._new_quantizer(base, cfg, "bias", bias, param=bias.target if bias.op == "get_attr" else None,
                                derived_from=(data_q, weight_q))
        self._insert_after(bias, q, [node])
        return q

    def _record_alignment(self) -> None:
        fs = self.setting.fusion_setting
        if not (self.setting.fusion and fs.align_quantization):
            return
        by_name = {n.name: n for n in self.gm.graph.nodes}
        for node in self.gm.graph.nodes:
            nq = node.meta.get("fxq")
            if not isinstance(nq, NodeQuant) or not nq.quantized:
                continue
            # a constant added (a bias, a learned shift) keeps a grid of its own: on the activation's, a shift under
            # half its step rounds to 0 and moves every value of the tensor alike
            ins = [q for name, q in nq.inputs.items() if q is not None and self.holder[q].role == "activation"
                   and not (nq.op_type in ("Add", "Sub") and computed_from_parameters(by_name[name], self.param_memo))]
            ins = list(dict.fromkeys(ins))
            mode = {"Add": fs.align_elementwise_to, "Sub": fs.align_elementwise_to,
                    "Concat": fs.align_concat_to, "Resize": fs.align_resize_to,
                    "AveragePool": fs.align_avgpooling_to, "GlobalAveragePool": fs.align_avgpooling_to,
                    }.get(nq.op_type, "None")
            own_out = node in self.covering and self.covering[node][1] in (QuantState.ACTIVATED,
                                                                            QuantState.OVERLAPPED)
            if mode == "Align to Large" and len(ins) > 1:
                record_alignment(self.holder, AlignGroup("largest", tuple(ins)))
            elif mode == "Align to Output" and ins and own_out:
                record_alignment(self.holder, AlignGroup("output", tuple(ins), self.covering[node][0]))


def insert_quantizers(gm: fx.GraphModule, plan: Dispatch, setting: QuantizationSetting,
                      platform: Platform) -> fx.GraphModule:
    """Insert the FakeQuantize modules for ``plan`` into ``gm`` (in place) and record the metadata."""
    builder = _Builder(gm, plan, setting)
    gq = builder.run()
    gq.platform = platform.name
    gm.meta["fxq"] = gq
    gm.graph.lint()
    gm.recompile()
    return gm
