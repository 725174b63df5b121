"""``RecurrentLayer``: an ONNX ``LSTM`` / ``GRU`` node as a module, and the pass that makes its weights graph inputs.

The ONNX frontend converts each ``LSTM`` / ``GRU`` node into a ``RecurrentLayer`` (a ``call_module`` node, as
onnx2torch builds graphs); :func:`functionalize_recurrent` then rewrites the call as ``fxq::lstm`` / ``fxq::gru``
over ``get_attr`` weights, the form ``nn.LSTM`` / ``nn.GRU`` trace to, so both are quantized and exported alike.
The module stays as the holder of its parameters (``W``, ``R``, ``B``), so state_dict keys do not change.
"""
from __future__ import annotations

import torch
from torch import Tensor, fx, nn

__all__ = ["RecurrentLayer", "functionalize_recurrent"]


class RecurrentLayer(nn.Module):
    """One ONNX ``LSTM`` (``kind="LSTM"``) or ``GRU`` layer in ONNX layout (see :mod:`fxq.recurrent.ops`).

    Args:
        kind: ``"LSTM"`` or ``"GRU"``.
        w, r, b: ONNX ``W [D, G*H, I]``, ``R [D, G*H, H]``, ``B [D, 2*G*H]`` (zeros when the node has none).
        direction: ``"forward"``, ``"reverse"`` or ``"bidirectional"``.
        has_h, has_c: whether the node takes ``initial_h`` / ``initial_c`` (passed positionally after ``x``).
        num_outputs: how many of the node's outputs (``Y``, ``Y_h``, ``Y_c``) are returned.
        linear_before_reset: GRU's attribute.
    """

    def __init__(self, kind: str, w: Tensor, r: Tensor, b: Tensor, direction: str, *, has_h: bool = False,
                 has_c: bool = False, num_outputs: int = 1, linear_before_reset: int = 0) -> None:
        super().__init__()
        self.kind = kind
        self.direction = direction
        self.hidden_size = int(r.shape[-1])
        self.has_h, self.has_c = has_h, has_c
        self.num_outputs = num_outputs
        self.linear_before_reset = int(linear_before_reset)
        self.W = nn.Parameter(w.detach().clone().float())
        self.R = nn.Parameter(r.detach().clone().float())
        self.B = nn.Parameter(b.detach().clone().float())

    def extra_repr(self) -> str:
        return f"{self.kind}, hidden_size={self.hidden_size}, direction={self.direction!r}"

    def op_args(self, x: object, w: object, r: object, b: object, states: list[object]) -> tuple[object, ...]:
        """Arguments of ``fxq::lstm`` / ``fxq::gru`` (tensors or graph nodes) for inputs ``x`` and ``states``."""
        it = iter(states)
        h = next(it) if self.has_h else None
        if self.kind == "LSTM":
            c = next(it) if self.has_c else None
            return (x, w, r, b, h, c, self.hidden_size, self.direction)
        return (x, w, r, b, h, self.hidden_size, self.direction, self.linear_before_reset)

    @property
    def op(self) -> object:
        return torch.ops.fxq.lstm.default if self.kind == "LSTM" else torch.ops.fxq.gru.default

    def forward(self, x: Tensor, *states: Tensor) -> tuple[Tensor, ...] | Tensor:
        outs = self.op(*self.op_args(x, self.W, self.R, self.B, list(states)))
        return outs[0] if self.num_outputs == 1 else tuple(outs[: self.num_outputs])


def functionalize_recurrent(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every ``RecurrentLayer`` call as ``fxq::lstm`` / ``fxq::gru`` over ``get_attr`` weights (in place).

    The new node keeps the call's metadata (ONNX names, ``module_path``) and name; with one output it is followed
    by ``getitem(·, 0)`` so users still see a tensor.
    """
    import operator

    from fxq.graph.passes import reuse_node_name

    modules = dict(gm.named_modules())
    changed = False
    for node in list(gm.graph.nodes):
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(mod, RecurrentLayer) or node.kwargs:
            continue
        with gm.graph.inserting_before(node):
            w, r, b = (gm.graph.get_attr(f"{node.target}.{p}") for p in ("W", "R", "B"))
            new = gm.graph.call_function(mod.op, mod.op_args(node.args[0], w, r, b, list(node.args[1:])))
        new.meta.update(node.meta)
        new.meta["module_path"] = node.target
        name = node.name
        if mod.num_outputs == 1:
            new.meta.pop("val", None)  # a tuple now; the getitem holds the tensor
            with gm.graph.inserting_after(new):
                first = gm.graph.call_function(operator.getitem, (new, 0))
            if "val" in node.meta:
                first.meta["val"] = node.meta["val"]
            if isinstance(node.meta.get("onnx"), dict):
                from fxq.frontends.onnx.naming import output_meta

                first.meta["onnx"] = output_meta(node.meta["onnx"], 0)
            node.replace_all_uses_with(first)
        else:
            node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        reuse_node_name(new, name)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
