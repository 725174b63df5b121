"""FP32 islands in ncnn files: each island module traced by torch.onnx, loaded back as fx ops, spliced inline.

Capture keeps a submodule that neither symbolic tracing nor torch.export enters as a ``call_module`` leaf (an FP32
*island*, :data:`fxq.graph.capture.ISLANDS_KEY`). The ONNX exporters write its float ops because torch.onnx's
TorchScript exporter records the branch the example takes. ncnn's converters read fx ops, so here each island is
exported the same way, alone, on the inputs the network gives it for the export's example batch; the ONNX file is
loaded back with :func:`fxq.load_onnx` (which checks the conversion against onnxruntime) and its nodes replace the
``call_module`` in a copy of the graph. The builder then converts them with the converters of every other float
op, so the island is float ncnn layers in the same param/bin. The simulation keeps running the Python module.

A call of a Python function the capture kept whole (``torch.fx.wrap``, as torchvision's Swin attention and patch
merging), of no op type fxq knows, is an island the same way: traced alone on the values it gets, its arguments that
do not depend on the network's inputs (weights, tables) constants of the trace. A call that reads no input at all
(Swin-V2's relative position bias, an MLP on a stored table) is a constant of the file: the value the simulation
computes, stored, and what only it read is not written.
"""
from __future__ import annotations

import io
import logging
import operator
from collections import Counter
from typing import Any

import onnx
import torch
from torch import fx, nn

from fxq.backends.qdq.lowering import example_inputs_for
from fxq.errors import ExportError, FxqError
from fxq.graph.capture import ISLANDS_KEY
from fxq.graph.convert import fp32_mode
from fxq.graph.nodes import eval_mode, get_attr_value
from fxq.graph.passes import propagate_tensor_meta

__all__ = ["FLOAT_VALUE", "ISLAND_META", "MODEL_NODE", "inline_islands", "island_note"]

logger = logging.getLogger(__name__)

ISLAND_META = "fxq_island"
"""``node.meta[ISLAND_META]``: the path of the FP32 island a node of the export graph was spliced from."""

FLOAT_VALUE = "fxq_float_value"
"""``node.meta[FLOAT_VALUE]``: for a constant of the export computed by the simulation (:func:`_to_constant`), the
float model's value, which the FP32 file stores."""

MODEL_NODE = "fxq_model_node"
"""``node.meta[MODEL_NODE]``: the name of the model's node whose value this node of the export graph computes in
its place (an island call or its ``getitem``, a constant of the file, the last op of a fused LayerNorm / GELU)."""

_HOLDER = "fxq_ncnn_islands"  # the view's submodule holding each island's loaded graph
_OPSET = 13


def island_note(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str]:
    """``(where, fix)`` for an error on ``node``: empty unless the node comes from an FP32 island."""
    path = node.meta.get(ISLAND_META)
    if not path:
        return "", ""
    return (f" inside FP32 island {path!r} ({_why(gm, path)})",
            f"; this op comes from the island's own code: write it with ops ncnn has, make {path!r} traceable so "
            "fxq captures and quantizes it, or deploy with trt_int8 / ort_int8, whose ONNX files take any op")


def inline_islands(gm: fx.GraphModule, example_inputs: Any = None) -> fx.GraphModule:
    """``gm``, or a view of it (same modules and quantizers, ``gm`` untouched) whose island ``call_module`` nodes
    are replaced by the float ops of their torch.onnx trace on the values ``gm`` gives them for ``example_inputs``
    (the first sample of the user's batch; default: seeded inputs shaped like calibration's, see
    :func:`~fxq.backends.qdq.lowering.example_inputs_for`); node values recorded (``node.meta["val"]``) for those
    inputs. A branch on tensor values inside an island is fixed as that example takes it.

    Raises:
        ExportError: an island torch.onnx cannot trace or fxq's ONNX frontend cannot load, or whose inputs /
            outputs are not tensors (naming the island and what to do).
    """
    from fxq.parts import record_inputs  # fxq.parts imports the API, which imports the backends

    islands = getattr(gm, "meta", {}).get(ISLANDS_KEY) or {}
    nodes = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) in islands]
    functions, constants = _opaque_functions(gm)
    if not nodes and not functions and not constants:
        return gm
    example_inputs = tuple(t[:1] if isinstance(t, torch.Tensor) and t.dim() else t
                           for t in example_inputs_for(gm, example_inputs))  # ncnn files are batch 1
    paths = list(dict.fromkeys(str(n.target) for n in nodes))
    with eval_mode(gm):  # as the ONNX exporters trace: BatchNorm statistics and dropout untouched
        calls = record_inputs(gm, paths, [example_inputs], 1, None) if paths else {}
        called, values = _record_calls(gm, functions, constants, example_inputs)
        float_values: dict[fx.Node, torch.Tensor] = {}
        if constants:
            with fp32_mode(gm):  # the FP32 file's constants: the float model's values
                _, float_values = _record_calls(gm, {}, constants, example_inputs)
    env: dict[fx.Node, fx.Node] = {}
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, env))
    holder = nn.Module()
    modules = dict(gm.named_modules())
    for k, node in enumerate([n for n in gm.graph.nodes if n in nodes or n in functions]):
        call = env[node]  # its arguments as they are now: an earlier island may have made a number of one
        if node.op == "call_module":
            path = str(node.target)
            recorded = calls[path].pop(0) if calls[path] else None
            island, positions, returned = _island_graph(gm, node, path, recorded)
        else:
            path = node.name
            slots = {i for i in functions[node] if i < 0 or isinstance(call.args[i], fx.Node)}
            island, positions, returned = _island_graph(gm, node, path, called.get(node), slots)
        holder.add_module(f"island{k}", island)
        baked = [a for a in call.all_input_nodes if a not in [call.args[i] for i in positions]]
        _splice(graph, call, [call.args[i] for i in positions], island, f"{_HOLDER}.island{k}", path, returned)
        _drop_unused(graph, baked, modules)  # what only the island's constant arguments read (a quantized MLP)
    for k, node in enumerate(constants):
        if node not in values:
            continue  # not a tensor, or not reached by the example: left to the writer, which names it
        holder.register_buffer(f"constant{k}", values[node])
        stored = _to_constant(graph, env[node], f"{_HOLDER}.constant{k}", modules)
        stored.meta[MODEL_NODE] = node.name
        if node in float_values:
            stored.meta[FLOAT_VALUE] = float_values[node]
    owners = {str(n.target): get_attr_value(holder, str(n.target).split(".", 1)[1])
              if str(n.target).startswith(_HOLDER + ".") else get_attr_value(gm, str(n.target))
              for n in graph.nodes if n.op in ("get_attr", "call_module")}
    view = fx.GraphModule(owners, graph, class_name=type(gm).__name__)
    for name, child in gm.named_children():  # the quantizer holder and modules as they are, not rebuilt paths
        setattr(view, name, child)
    view.meta = gm.meta
    propagate_tensor_meta(view, list(example_inputs))
    return view


def _opaque_functions(gm: fx.GraphModule) -> tuple[dict[fx.Node, set[int]], list[fx.Node]]:
    """The calls of Python functions the capture kept whole (``torch.fx.wrap``, as torchvision's Swin attention),
    of no op type fxq knows: those that read the network's values, each with the positions of its arguments that do
    (the others are constants of the export: weights, tables, and values computed from them), and those that do
    not (Swin-V2's relative position bias, from a quantized MLP on a stored table: a constant of the export).

    Calls of shapes and stored tensors only are neither: the writer evaluates those itself at each input size
    (:meth:`~fxq.backends.ncnn.builder.NcnnBuilder.static_value`). A network value nested in a list, tuple or
    keyword argument is marked ``-1`` (refused by name in :func:`_island_graph`)."""
    import inspect

    from fxq.backends.ncnn.registry import NCNN_CONVERTERS
    from fxq.backends.ncnn.static import shape_only_nodes
    from fxq.graph.op_types import op_type

    modules = dict(gm.named_modules())
    static = shape_only_nodes(gm, modules)  # the writer's own numbers
    live: set[fx.Node] = set()  # depends on the network's values (not only on their shapes)
    found: dict[fx.Node, set[int]] = {}
    constants: list[fx.Node] = []
    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        if n not in static and (n.op == "placeholder" or any(a in live for a in ins)):
            live.add(n)
        if n in static or not (n.op == "call_function" and inspect.isfunction(n.target)
                               and op_type(n, modules) == "Unknown" and "Unknown" not in NCNN_CONVERTERS):
            continue
        if n not in live:
            if ins:
                constants.append(n)
            continue
        found[n] = {i for i, a in enumerate(n.args) if isinstance(a, fx.Node) and a in live}
        nested = [a for i, a in enumerate(n.args) if not isinstance(a, fx.Node)] + list(n.kwargs.values())
        if any(x in live for x in _nodes_in(nested)):
            found[n].add(-1)
    return found, constants


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, fx.Node) else None)
    return found


def _record_calls(gm: fx.GraphModule, calls: dict[fx.Node, set[int]], constants: list[fx.Node],
                  example_inputs: tuple) -> tuple[dict[fx.Node, Any], dict[fx.Node, torch.Tensor]]:
    """``{node: (args, kwargs)}``: the values each opaque function call of ``calls`` gets on ``example_inputs``,
    and ``{node: value}``: the value each of ``constants`` computes (a tensor; the simulation's, quantizers
    included), detached."""
    from fxq.graph.nodes import Interpreter

    seen: dict[fx.Node, Any] = {}
    values: dict[fx.Node, torch.Tensor] = {}
    wanted = set(constants)
    if not calls and not wanted:
        return seen, values

    class _Record(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n in calls and n not in seen:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                seen[n] = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(),
                                                            (tuple(args), dict(kwargs)))
            out = super().run_node(n)
            if n in wanted and n not in values and isinstance(out, torch.Tensor):
                values[n] = out.detach().clone()
            return out

    with torch.no_grad():
        _Record(gm).run(*example_inputs)
    return seen, values


def _to_constant(graph: fx.Graph, call: fx.Node, target: str, modules: dict[str, nn.Module]) -> fx.Node:
    """Replace ``call`` by a ``get_attr`` of ``target`` (returned), and drop what only it read (an MLP on a stored
    table)."""
    with graph.inserting_before(call):
        stored = graph.get_attr(target)
    call.replace_all_uses_with(stored)
    _drop_unused(graph, [call], modules)
    return stored


def _drop_unused(graph: fx.Graph, nodes: list[fx.Node], modules: dict[str, nn.Module]) -> None:
    """Erase ``nodes`` and what they read, as far as nothing else reads them (in-place ops stay)."""
    from fxq.graph.op_types import mutates_first_argument

    dead, erased = list(nodes), set()
    while dead:
        n = dead.pop()
        if (n in erased or n.users or n.op not in ("call_function", "call_module", "call_method", "get_attr")
                or mutates_first_argument(n, modules)):
            continue
        dead.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


class _Function(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class _Number:
    """A non-tensor item of an island's result (MViT's ``_unsqueeze`` returns ``(x, x.dim())``): a number of the
    trace, put in its readers' arguments."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _island_graph(gm: fx.GraphModule, node: fx.Node, path: str, recorded: Any, slots: set[int] | None = None
                  ) -> tuple[fx.GraphModule, list[int], list[int | _Number] | None]:
    """The island's float ops as a GraphModule of fxq's ONNX frontend (its tensor results), the positions of
    ``node``'s arguments its placeholders stand for (a module island's tensor arguments, or an opaque function
    call's ``slots``: its other arguments, recorded as ``(args, kwargs)``, are constants of the trace), and for a
    tuple result, per item, the index of its tensor among the island's outputs or the number it is (None: one
    tensor)."""
    from fxq.backends.qdq.lowering import torch_onnx_export
    from fxq.frontends.onnx import load_onnx

    def refuse(why: str, fix: str) -> ExportError:
        return ExportError(f"ncnn export: FP32 island {path!r} (node {node.name!r}, {_why(gm, path)}) {why}. "
                           f"Fix: {fix}")

    if slots is not None:  # an opaque function call
        if -1 in slots:
            raise refuse("takes a value computed from the network's inputs inside a list, tuple or keyword "
                         "argument", "pass each such tensor as its own positional argument")
        if not isinstance(recorded, tuple):
            raise refuse("was not reached by the export's example batch", "give example_inputs that reach it")
        args, kwargs = recorded
        positions = sorted(slots)
        target: nn.Module = _Function(node.target)
    else:
        if not isinstance(recorded, tuple):
            raise refuse("is called with keyword arguments or was not reached by the export's example batch",
                         "call the island module with positional tensor arguments only")
        kwarg_nodes: list[fx.Node] = []
        fx.node.map_arg(node.kwargs, lambda a: kwarg_nodes.append(a) or a)
        if kwarg_nodes:
            raise refuse("takes a tensor keyword argument", "pass its tensors positionally")
        args, kwargs = recorded, dict(node.kwargs)
        positions = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
        target = gm.get_submodule(path)
    if not all(isinstance(args[i], torch.Tensor) for i in positions):
        raise refuse("takes a non-tensor value computed in the graph (a list or tuple of tensors)",
                     "pass each tensor as its own positional argument")
    call = _Call(target, args, kwargs, positions)
    tensors = tuple(args[i] for i in positions)
    with torch.no_grad():
        out = call(*tensors)
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    picked = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor)]
    if not picked or not all(i in picked or _is_number(t) for i, t in enumerate(items)):
        raise refuse(f"returns {type(out).__name__} ({[type(t).__name__ for t in items]}), not tensors (and "
                     "numbers)", "return tensors from the island module")
    returned = ([picked.index(i) if i in picked else _Number(t) for i, t in enumerate(items)]
                if isinstance(out, (tuple, list)) else None)
    call.picked = picked if returned is not None else None
    buf = io.BytesIO()
    try:
        torch_onnx_export(call, tensors, buf, opset=_OPSET, input_names=[f"x{i}" for i in range(len(tensors))],
                          output_names=[f"y{i}" for i in range(len(picked))])
        island = load_onnx(onnx.load_from_string(buf.getvalue()))
    except FxqError as exc:
        raise refuse(f"cannot be written as float ops: {exc}",
                     "write the island's code with ops torch.onnx and fxq.load_onnx convert, make it traceable so "
                     "fxq captures and quantizes it, or deploy with trt_int8 / ort_int8") from exc
    ops = Counter(str(n.meta.get("onnx", {}).get("op_type", n.target)) for n in island.graph.nodes
                  if n.op not in ("placeholder", "output", "get_attr"))
    logger.warning("ncnn export: FP32 island %r is written as float ncnn layers (ONNX ops %s) traced by torch.onnx "
                   "at input shapes %s: the file computes it at those shapes only (run it at the export's input "
                   "size), and a branch on tensor values is fixed as that example took it", path,
                   dict(ops), [tuple(t.shape) for t in tensors])
    return island, positions, returned


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float, bool)) or value is None
            or isinstance(value, (tuple, list)) and all(_is_number(v) for v in value))


def _why(gm: fx.GraphModule, path: str) -> str:
    why = (getattr(gm, "meta", {}).get(ISLANDS_KEY) or {}).get(path)
    return f"kept FP32: {why}" if why else "kept FP32"


class _Call(nn.Module):
    """The island module called with its recorded constant arguments, taking only its graph tensors as inputs."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, slots: list[int]) -> None:
        super().__init__()
        self.module = module
        self.args, self.kwargs, self.slots = list(args), kwargs, slots
        self.picked: list[int] | None = None  # the tensor items of a tuple result (the rest are numbers)

    def forward(self, *tensors: torch.Tensor) -> Any:
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        out = self.module(*args, **self.kwargs)
        return out if self.picked is None else tuple(out[i] for i in self.picked)


def _splice(graph: fx.Graph, call: fx.Node, args: list[fx.Node], island: fx.GraphModule, prefix: str,
            path: str, returned: list[int | _Number] | None) -> None:
    """Replace ``call`` in ``graph`` by the nodes of ``island`` (registered on the view under ``prefix``), whose
    placeholders read ``args``; the readers of a tuple result's items take the island's outputs and numbers
    (``returned``, :func:`_island_graph`)."""
    inputs = iter(args)
    env: dict[fx.Node, Any] = {}
    result: Any = None
    with graph.inserting_before(call):
        for n in island.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "output":
                result = fx.node.map_arg(n.args[0], lambda a: env[a])
            else:
                new = graph.node_copy(n, lambda a: env[a])
                if n.op in ("get_attr", "call_module"):
                    new.target = f"{prefix}.{n.target}"
                onnx_meta = dict(n.meta.get("onnx") or {})
                if onnx_meta.get("node_name"):  # "/module/scale/Conv" (_Call's scope) -> layer "gate/scale/Conv"
                    name = str(onnx_meta["node_name"]).lstrip("/")
                    onnx_meta["node_name"] = f"{path}/{name.removeprefix('module/')}"
                new.meta = {"onnx": onnx_meta, ISLAND_META: path} if onnx_meta else {ISLAND_META: path}
                env[n] = new
    made = set(env.values())
    if returned is None:
        call.replace_all_uses_with(result)
        if result in made:
            result.meta[MODEL_NODE] = call.name
        graph.erase_node(call)
        return
    outputs = [result] if isinstance(result, fx.Node) else list(result)
    for user in list(call.users):
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            raise ExportError(f"ncnn export: FP32 island {path!r} returns several values and node {user.name!r} "
                              "reads them as a whole. Fix: index the island's result (out[0], out[1]) in the model")
        item = returned[user.args[1]]
        if isinstance(item, _Number):
            for reader in list(user.users):
                reader.args, reader.kwargs = fx.node.map_arg((reader.args, reader.kwargs),
                                                             lambda a, u=user, v=item.value: v if a is u else a)
        else:
            user.replace_all_uses_with(outputs[item])
            if outputs[item] in made:
                outputs[item].meta[MODEL_NODE] = user.name
        graph.erase_node(user)
    graph.erase_node(call)
