"""fx helpers every graph pass needs, kept below all of them (no fxq imports) so any pass can use them."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn

__all__ = ["get_attr_value", "redirect_later_readers", "thaw", "Interpreter", "eval_mode", "output_shapes",
           "without_grad_first"]


def get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target (``"layer1.0.conv1.weight"``) names in ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def redirect_later_readers(written: fx.Node, new_value: fx.Node, writer: fx.Node, order: dict[fx.Node, int]) -> None:
    """Make the readers of ``written`` that come after ``writer`` (by ``order``, node -> position) read
    ``new_value``: how an in-place write becomes an out-of-place one without changing what the graph computes."""
    for user in [u for u in written.users if order.get(u, -1) > order[writer]]:
        user.replace_input_with(written, new_value)


def thaw(value: Any) -> Any:
    """Plain lists / dicts for fx's immutable argument containers (nested in tuples too): the arguments a node's
    function gets when the generated code runs it (a literal ``[7, 7, 7]`` is a new list on every call)."""
    from torch.fx.immutable_collections import immutable_dict, immutable_list

    if isinstance(value, immutable_list):
        return [thaw(v) for v in value]
    if isinstance(value, immutable_dict):
        return {k: thaw(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(thaw(v) for v in value)
    return value


class Interpreter(fx.Interpreter):
    """``torch.fx.Interpreter`` whose calls get their own mutable copies of list / dict arguments, as the generated
    code gives them. torch.fx's own passes the node's immutable list itself, which functions that edit their argument
    in place (torchvision's Swin3D ``_get_window_and_shift_size``) cannot take. Every fxq interpreter derives from
    this one."""

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return thaw(args), thaw(kwargs)


def without_grad_first(run: Callable[[], Any], before_retry: Callable[[], None] | None = None) -> tuple[Any, bool]:
    """``(run(), False)`` without an autograd record (fxq's own runs of a model need none, and a record keeps every
    saved tensor); where that fails, ``(run(), True)`` in grad mode after ``before_retry()``: a forward that takes
    gradients itself (``torch.autograd.grad``). The first failure is raised when both fail; fxq's own errors and
    running out of memory are not retried."""
    from fxq.errors import FxqError  # noqa: PLC0415  (fxq.errors is a leaf; kept local to this helper)

    try:
        with torch.no_grad():
            return run(), False
    except Exception as exc:  # noqa: BLE001 - retried once, then re-raised as it was
        if isinstance(exc, (FxqError, torch.OutOfMemoryError)):
            raise
        if before_retry is not None:
            before_retry()
        try:
            with torch.enable_grad():
                return run(), True
        except Exception:  # noqa: BLE001 - not a forward that needs grad mode: the first failure is the one
            raise exc from None


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with every submodule in eval mode inside the block (BatchNorm statistics, dropout and QAT's
    running ranges untouched by a run fxq makes for itself), each submodule's own mode back after it."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes.items():
            m.training = training


def output_shapes(gm: fx.GraphModule, args: tuple) -> dict[fx.Node, tuple[int, ...]]:
    """The shape of each tensor a node of ``gm`` computes on ``args``: one run in eval mode without gradients,
    so nothing the model keeps changes; raises what that run raises."""
    shapes: dict[fx.Node, tuple[int, ...]] = {}

    class _Recorder(Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n] = tuple(int(d) for d in out.shape)
            return out

    with eval_mode(gm), torch.no_grad():
        _Recorder(gm).run(*args)
    return shapes


_NEW_METHODS = {"new_zeros", "new_ones", "new_full", "new_empty"}
_LIKE = {torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like}
_SIZE_METHODS = {"size", "dim", "numel"}


def value_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs whose values ``node`` reads: not those it reads for their dtype, device or shape only
    (``a.type_as(b)``, ``a.to(b)``, ``a.expand_as(b)``, ``b.new_zeros(n)``, ``torch.zeros_like(b)``, ``b.size()``, an
    ONNX file's ``Shape``; Ultralytics' anchors: ``arange(w).type_as(feats)``)."""
    args: tuple[Any, ...] = node.args
    meta_only: tuple[Any, ...] = ()
    if node.op == "call_method":
        if node.target in _SIZE_METHODS or node.target in _NEW_METHODS:
            meta_only = args[:1]
        elif node.target in ("type_as", "expand_as", "view_as", "reshape_as"):
            meta_only = args[1:2]
        elif node.target == "to":
            meta_only = tuple(a for a in args[1:] if isinstance(a, fx.Node))
    elif node.op == "call_module":
        onnx = node.meta.get("onnx")
        if isinstance(onnx, dict) and onnx.get("op_type") in ("Shape", "Size"):  # an ONNX file's ``Shape`` module
            meta_only = args[:1]
    elif node.op == "call_function":
        if node.target in _LIKE or node.target is torch.numel or (
                node.target is getattr and len(args) > 1 and args[1] in ("shape", "dtype", "device", "ndim")):
            meta_only = args[:1]
    return [i for i in node.all_input_nodes if all(i is not m for m in meta_only)]


def value_read_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values (not only shapes or dtypes) the graph's outputs depend on (:func:`value_inputs`)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    live: set[fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        for i in value_inputs(node):
            if i not in live:
                live.add(i)
                stack.append(i)
    return live
