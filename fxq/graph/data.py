"""Calibration data: batches in many shapes (tensor, tuple, dict, DataLoader) -> model call arguments."""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from torch import fx, nn

from fxq.errors import CalibrationError, ConfigError, FxqError, GraphError, one_line
from fxq.graph.info import is_quantizer_node
from fxq.graph.nodes import Interpreter

__all__ = [
    "to_device",
    "source_dynamic_dims",
    "source_batch_dim",
    "source_unbatched",
    "input_batch_dim",
    "check_sized_inputs",
    "data_failure",
    "onnx_output_name",
    "onnx_input_name",
    "doubled_dim_probes",
    "iter_batches",
    "call_model",
    "model_device",
    "input_names",
    "count_batches",
    "placeholder_values",
    "first_batch_errors",
    "rewrite_failure",
    "diagnose_failure",
    "diagnose_batch",
    "diagnose_block_failure",
    "algorithm_errors",
    "check_steps",
    "record_example_values",
    "example_value",
    "EXAMPLE_VALUES_KEY",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")

# Set by iter_batches while the batch it just yielded has other non-batch sizes than the first one: first_batch_errors
# then reports a model failure on it as a CalibrationError naming the batch and the shapes.
_RESIZED_BATCH: contextvars.ContextVar[str | None] = contextvars.ContextVar("fxq_resized_batch", default=None)


EXAMPLE_VALUES_KEY = "fxq_example_values"
"""``gm.meta`` key: the example batch's non-float inputs by placeholder name (:func:`record_example_values`)."""
_MAX_EXAMPLE_VALUES = 4096


def record_example_values(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    """Keep the example batch's small non-float inputs (a target shape, sizes, indices, a mode flag) in
    ``gm.meta``, for exporters that trace the model on inputs of their own: integer inputs made up as zeros give an
    ``Expand`` to ``[0, ...]`` or an empty gather, and the trace fails or records another graph."""
    kept = {node.name: value.detach().cpu().clone()
            for node, value in zip(_placeholders(gm), args)
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()
            and value.numel() <= _MAX_EXAMPLE_VALUES}
    if kept:
        gm.meta[EXAMPLE_VALUES_KEY] = kept


def example_value(gm: fx.GraphModule, placeholder: fx.Node, shape: Sequence[int], dtype: torch.dtype
                  ) -> torch.Tensor | None:
    """The recorded example value of a non-float input (:func:`record_example_values`) when it has this shape and
    dtype; else None."""
    kept = gm.meta.get(EXAMPLE_VALUES_KEY) if isinstance(getattr(gm, "meta", None), dict) else None
    value = kept.get(placeholder.name) if isinstance(kept, dict) else None
    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape) and value.dtype == dtype:
        return value.clone()
    return None


def model_device(model: nn.Module) -> torch.device:
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def _placeholders(model: nn.Module) -> list[fx.Node]:
    if isinstance(model, fx.GraphModule):
        return [n for n in model.graph.nodes if n.op == "placeholder"]
    return []


def input_names(model: nn.Module) -> list[str]:
    """The keyword each input is passed by (a placeholder's target: its node name may carry a suffix)."""
    return [str(n.target) for n in _placeholders(model)]


def count_batches(data: Any, steps: int | None) -> int | None:
    try:
        n = len(data)
    except TypeError:
        return steps
    return n if steps is None else min(n, steps)


def check_steps(steps: Any) -> int | None:
    """``steps`` as given when it is ``None`` or a positive int, else :class:`ConfigError`."""
    if steps is None or (isinstance(steps, int) and not isinstance(steps, bool) and steps > 0):
        return steps
    raise ConfigError(f"steps={steps!r}: give a positive number of batches, or None for all of them")


def _tensor_leaves(batch: Any, path: str = "") -> dict[str, Any]:
    """``{input label: tensor or type name}`` for the leaves of a batch (tensor, tuple/list, dict, nested)."""
    if isinstance(batch, torch.Tensor):
        return {path or "input": batch}
    if isinstance(batch, dict):
        items: Iterable[tuple[str, Any]] = ((f"{path}[{k!r}]" if path else f"input {k!r}", v) for k, v in batch.items())
    elif isinstance(batch, (tuple, list)):
        items = ((f"{path}[{i}]" if path else f"input {i}", v) for i, v in enumerate(batch))
    else:
        return {path or "input": type(batch).__name__}
    out: dict[str, Any] = {}
    for label, value in items:
        out.update(_tensor_leaves(value, label))
    return out


class _BatchConsistency:
    """Every batch must have the first batch's inputs, ranks and dtypes; other non-batch sizes are logged once."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.first: dict[str, Any] | None = None
        self.logged = False

    def _where(self, index: int) -> str:
        source = getattr(self.data, "batch_source", None)
        name = source(index) if callable(source) else None
        return f"batch {index}" + (f" ({name})" if name else "")

    def __call__(self, index: int, batch: Any) -> str | None:
        """Check batch ``index``; return a note when a non-batch size differs from the first batch, else None."""
        leaves = _tensor_leaves(batch)
        if self.first is None:
            self.first = leaves
            return None
        first, where = self.first, self._where(index)
        if set(leaves) != set(first):
            raise CalibrationError(f"{where} has inputs {list(leaves)} but batch 0 had {list(first)}; "
                                   f"give every batch the same inputs")
        note = None
        for label, value in leaves.items():
            ref = first[label]
            if not isinstance(value, torch.Tensor) or not isinstance(ref, torch.Tensor):
                continue
            if value.dim() != ref.dim() or value.dtype != ref.dtype:
                raise CalibrationError(
                    f"{where}, {label}: expected a {str(ref.dtype).replace('torch.', '')} tensor of rank "
                    f"{ref.dim()} like batch 0 {list(ref.shape)}, found {str(value.dtype).replace('torch.', '')} "
                    f"{list(value.shape)}; every batch needs the first batch's rank and dtype (only sizes may vary)")
            if tuple(value.shape[1:]) != tuple(ref.shape[1:]) and note is None:
                note = f"{where}, {label}, has shape {list(value.shape)} but batch 0 {list(ref.shape)}"
        if note is not None and not self.logged:
            self.logged = True
            logger.info("%s (non-batch sizes vary; fine if the model accepts them)", note)
        return note


def iter_batches(data: Any, steps: int | None = None,
                 collate_fn: Callable[[Any], Any] | None = None) -> Iterator[Any]:
    """Yield at most ``steps`` batches of ``data`` (a bare tensor or dict is one batch).

    Raises:
        ConfigError: ``steps`` is not None or a positive int.
        CalibrationError: no data, or a batch whose inputs, ranks or dtypes differ from the first batch's (the
            batch dimension and other sizes may differ).
    """
    check_steps(steps)
    if data is None:
        raise CalibrationError("no calibration data given: pass a list of batches or a DataLoader")
    if isinstance(data, (torch.Tensor, dict)):
        data = [data]
    if not isinstance(data, Iterable):
        raise CalibrationError(f"calibration data must be iterable (list, DataLoader...), got {type(data).__name__}")
    it = iter(data)
    if steps is not None:
        it = itertools.islice(it, steps)
    consistent = _BatchConsistency(data)
    token = _RESIZED_BATCH.set(None)  # restored at the end: an iteration nested in this one leaves this one's note
    try:
        for index, batch in enumerate(it):
            batch = collate_fn(batch) if collate_fn is not None else batch
            _RESIZED_BATCH.set(consistent(index, batch))
            yield batch
    finally:
        try:
            _RESIZED_BATCH.reset(token)
        except ValueError:  # the generator was closed from another context
            _RESIZED_BATCH.set(None)


def to_device(value: Any, device: torch.device | str) -> Any:
    """Move every tensor inside ``value`` (tensors, tuples, lists, dicts) to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def source_dynamic_dims(model: nn.Module, placeholder: fx.Node) -> set[int] | None:
    """Dims of an input that the model's source ONNX file leaves symbolic or unknown (any size runs there);
    None when the model has no source file's shapes (a native model: nothing says which dims may vary)."""
    meta = getattr(model, "meta", None)
    onnx_meta = meta.get("onnx") if isinstance(meta, dict) else None
    shapes = onnx_meta.get("source_input_shapes") if isinstance(onnx_meta, dict) else None
    if not isinstance(shapes, dict):
        return None
    dims = shapes.get(onnx_input_name(placeholder))
    return {i for i, d in enumerate(dims or []) if not (isinstance(d, int) and d > 0)}


def onnx_input_name(placeholder: fx.Node) -> str:
    """The name of the source ONNX file's input that ``placeholder`` is (torch may have renamed it: ``input.1``)."""
    info = placeholder.meta.get("onnx")
    names = info.get("outputs", []) if isinstance(info, dict) else []
    return names[0] if names else placeholder.name


def onnx_output_name(model: nn.Module, output: int) -> str | None:
    """The name of graph output number ``output`` in the model's source ONNX file; None without one."""
    found = _source_tensor(model, None, output)
    return (found[1] or None) if found is not None else None


def _source_tensor(model: nn.Module, placeholder: fx.Node | None, output: int | None
                   ) -> tuple[dict[str, Any], str, list[Any]] | None:
    """The source ONNX file's record of an input or output: (the model's ``meta["onnx"]``, its name, its declared
    dims); None for a model without a source file."""
    meta = getattr(model, "meta", None)
    onnx_meta = meta.get("onnx") if isinstance(meta, dict) else None
    if not isinstance(onnx_meta, dict):
        return None
    inputs, outputs = onnx_meta.get("source_input_shapes"), onnx_meta.get("source_output_shapes")
    if not isinstance(inputs, dict) or not inputs:
        return None
    if placeholder is not None:
        name = onnx_input_name(placeholder)
        return onnx_meta, name, list(inputs.get(name) or [])
    declared = list(outputs.items()) if isinstance(outputs, dict) else []
    name, dims = declared[output] if output is not None and output < len(declared) else ("", [])
    return onnx_meta, name, list(dims)


def source_batch_dim(model: nn.Module, placeholder: fx.Node | None = None, output: int | None = None) -> int | None:
    """The dim of an input (``placeholder``) or of graph output number ``output`` that holds the batch by the
    model's source ONNX file: where its declared shape has the symbol that the first input has at dim 0 (silero's
    ``state`` and ``stateN`` are ``[2, batch, 128]`` beside ``input`` ``[batch, sequence]``), or as
    ``load_onnx(batch_dims=...)`` gave it; None where neither says (a native model, fixed or unnamed dims) or where
    ``batch_dims`` says the tensor has no batch (:func:`source_unbatched`)."""
    found = _source_tensor(model, placeholder, output)
    if found is None:
        return None
    onnx_meta, name, dims = found
    given = onnx_meta.get("batch_dims") or {}
    if name in given:  # load_onnx(batch_dims=...)
        return given[name]
    first_name, first = next(((k, v) for k, v in onnx_meta["source_input_shapes"].items()
                              if not (k in given and given[k] is None)), (None, None))
    if first_name is None:  # every input declared without a batch
        return None
    at = given.get(first_name, 0)  # the first batched input's batch dim, as given or dim 0
    symbol = first[at] if first and at < len(first) and isinstance(first[at], str) and first[at] else None
    return dims.index(symbol) if symbol is not None and symbol in dims else None


def input_batch_dim(model: nn.Module, placeholder: fx.Node) -> int | None:
    """Where input ``placeholder``'s batch is: None when ``load_onnx(batch_dims={name: None})`` says it has none,
    else as :func:`source_batch_dim` finds it, else dim 0 (a native model's inputs)."""
    if source_unbatched(model, placeholder):
        return None
    found = source_batch_dim(model, placeholder)
    return 0 if found is None else found


def source_unbatched(model: nn.Module, placeholder: fx.Node | None = None, output: int | None = None) -> bool:
    """Whether ``load_onnx(batch_dims={name: None})`` says this input or output has no batch dim (a time step, a
    shape, a 1-D control vector): runtimes without a batch (ncnn) take it whole."""
    found = _source_tensor(model, placeholder, output)
    if found is None:
        return False
    onnx_meta, name, _ = found
    given = onnx_meta.get("batch_dims") or {}
    return name in given and given[name] is None


def doubled_dim_probes(args: tuple, wanted: Sequence[tuple[int, int]],
                       run: Callable[[tuple], R | None]) -> list[R]:
    """What ``run`` gives on ``args`` repeated twice along the ``wanted`` (input index, dim) pairs: all of them at
    once, else each alone (an OCR recognizer's height is symbolic in its file but only its width may vary);
    ``run`` returns None where the model does not run at that size. The one probing policy of the exporters that
    keep dims dynamic (the QDQ marks, ncnn's reshapes)."""
    results: list[R] = []
    groups = [list(wanted)] + ([[w] for w in wanted] if len(wanted) > 1 else [])
    for group in groups if wanted else []:
        probe = list(args)
        for i, d in group:
            probe[i] = probe[i].repeat(*[2 if k == d else 1 for k in range(probe[i].dim())])
        result = run(tuple(probe))
        if result is not None:
            results.append(result)
            if len(group) == len(wanted):
                break  # every dim at once ran: nothing more to learn
    return results


def _free_text(free: set[int]) -> str:
    return "batch dimension" if free == {0} else f"dims {sorted(free)}: batch and the source file's symbolic dims"


def _check(model: nn.Module, args: tuple, kwargs: dict) -> None:
    phs = _placeholders(model)
    if not phs:
        return
    required = [p for p in phs if not p.args]  # placeholders with defaults carry them in args
    given = len(args) + len(kwargs)
    if given < len(required) or given > len(phs):
        raise CalibrationError(
            f"the model takes {len(required)} input(s) {[p.name for p in required]} but a batch gave {given}; "
            f"pass a tuple (positional) or a dict keyed by input name per batch"
        )
    named = dict(zip([p.name for p in phs], args))
    named.update(kwargs)
    for p in phs:
        val, ref = named.get(p.name), p.meta.get("val")
        if isinstance(val, torch.Tensor) and isinstance(ref, torch.Tensor):
            free = (source_dynamic_dims(model, p) or set()) | {0}
            if val.dim() != ref.dim() or any(a != b for i, (a, b) in enumerate(zip(val.shape, ref.shape))
                                             if i not in free):
                raise CalibrationError(
                    f"input {p.name!r}: batch has shape {tuple(val.shape)}, the model was prepared for "
                    f"{tuple(ref.shape)} ({_free_text(free)} free); fix the data or the example_inputs"
                )


def _onnx_name_map(model: nn.Module) -> dict[str, str]:
    out = {}
    for p in _placeholders(model):
        info = p.meta.get("onnx")
        if isinstance(info, dict):
            for name in info.get("outputs", []):
                out[name] = str(p.target)  # the keyword forward takes (the node name may carry a suffix)
    return out


def to_call_args(model: nn.Module, batch: Any, check: bool = True) -> tuple[tuple, dict]:
    """Positional and keyword arguments for one batch, on the model's device."""
    batch = to_device(batch, model_device(model))
    if isinstance(batch, dict):
        aliases = _onnx_name_map(model)
        kwargs = {aliases.get(k, k): v for k, v in batch.items()}
        names = input_names(model)
        unknown = [k for k in kwargs if names and k not in names]
        if unknown:
            raise CalibrationError(f"batch keys {unknown} are not model inputs; inputs are {names}")
        args: tuple = ()
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    if check:
        _check(model, args, kwargs)
    return args, kwargs


def placeholder_values(gm: fx.GraphModule, batch: Any, check: bool = False) -> dict[fx.Node, Any]:
    """The value of every placeholder of ``gm`` for one batch (on the model's device), for node-level executors.

    Positional values fill the placeholders in order, then keyword values by name, then the placeholders'
    defaults.

    Raises:
        CalibrationError: a placeholder gets no value (or, with ``check``, the batch does not fit the model).
    """
    args, kwargs = to_call_args(gm, batch, check=check)
    values: dict[fx.Node, Any] = {}
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if i < len(args):
            values[ph] = args[i]
        elif ph.name in kwargs:
            values[ph] = kwargs[ph.name]
        elif ph.target in kwargs:
            values[ph] = kwargs[ph.target]
        elif ph.args:
            values[ph] = ph.args[0]
        else:
            raise CalibrationError(f"no value for model input {ph.name!r} in the batch; give it positionally or "
                                   f"by name")
    return values


def rewrite_failure(node: str | None, exc: BaseException, what: str | None = None,
                    block: str | None = None) -> GraphError:
    """The error for fxq's quantized model failing on a batch its FP32 model runs: fxq's rewrite, not the data.

    ``node``: the fx node that failed (None when the failure did not reproduce node by node: then ``block``, the
    part that failed in words, when a part did). ``what``: the pass that ran it (an algorithm), if not calibration
    or analysis.
    """
    where = f"node {node!r}" if node is not None else block or "the model"
    during = f" during {what}" if what else ""
    return GraphError(f"{where} failed in fxq's quantized model{during} on a batch that the FP32 model runs "
                      f"({type(exc).__name__}: {one_line(exc)}): this is a failure of fxq's own "
                      f"rewrite, not of your data; please report it to fxq with this message")


class _Locator(Interpreter):
    """Runs a graph node by node and remembers the node it is executing (the failing one after an error)."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


class _FP32(_Locator):
    """The FP32 model inside fxq's rewrite: quantizer nodes pass their input through without running their module
    (with :func:`~fxq.graph.convert.fp32_mode` for the weights)."""

    def run_node(self, n: fx.Node) -> Any:
        if is_quantizer_node(n):
            self.current = n
            args, _ = self.fetch_args_kwargs_from_env(n)
            return args[0]
        return super().run_node(n)


def diagnose_failure(gm: fx.GraphModule, values: dict[fx.Node, Any], exc: BaseException,
                     what: str | None = None) -> GraphError | None:
    """Whose failure ``exc`` of quantized ``gm`` on one batch is: None when the FP32 model fails on it too (the
    data's), else :func:`rewrite_failure` naming the node where ``gm`` as it is fails (``what``: the pass).

    ``values``: the batch's placeholder values (:func:`placeholder_values`). Only called after a failure: it runs
    the batch up to twice more and may leave observers with more data.
    """
    from fxq.graph.convert import fp32_mode  # noqa: PLC0415  (convert sits above the data helpers)

    args = [values[n] for n in gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        with fp32_mode(gm):
            if _fp32_fails(gm, args) is not None:
                return None
        return _locate(gm, args, exc, what)


def diagnose_batch(gm: fx.GraphModule, batch: Any, exc: BaseException, what: str | None = None) -> GraphError | None:
    """:func:`diagnose_failure` for one batch as the data gives it (its values are computed only now)."""
    return diagnose_failure(gm, placeholder_values(gm, batch), exc, what)


def diagnose_block_failure(module: fx.GraphModule, args: Sequence[Any], fp32_args: Sequence[Any],
                           exc: BaseException, what: str, block: str, batch: int) -> FxqError:
    """Whose failure ``exc`` of a block ``module`` (a sub-graph of fxq's model, weights unbaked) run on ``args`` is.

    A :class:`CalibrationError` naming the node when the FP32 block fails on ``fp32_args`` (the FP32 model's values
    for batch ``batch``): the data does not fit the model. Else :func:`rewrite_failure`, naming the node where the
    block fails on ``args``, or ``block`` (the block in words) when it does not fail node by node (a backward pass).
    """
    with torch.no_grad():
        node = _fp32_fails(module, list(fp32_args))
        if node is not None:
            return CalibrationError(f"{what}: the FP32 model fails on calibration batch {batch} too, at node {node!r} "
                                    f"({type(exc).__name__}: {one_line(exc)}); give batches that "
                                    f"the model runs (the ones it was calibrated on)")
        return _locate(module, list(args), exc, what, block)


class _SqueezeWatch(_FP32):
    """The FP32 model, noting ONNX ``Squeeze`` nodes whose squeezed dims are not 1 on this batch: ONNX (and
    onnxruntime) refuse such an input, while onnx2torch's squeeze keeps the dim and the graph fails further on (an
    OCR recognizer's height squeeze on a line of another height)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.kept: list[str] = []

    def run_node(self, n: fx.Node) -> Any:
        info = n.meta.get("onnx")
        if isinstance(info, dict) and info.get("op_type") == "Squeeze" and n.op == "call_module":
            axes = getattr(self.module.get_submodule(str(n.target)), "axes", None)
            if axes is None and len(n.args) > 1:  # opset 13+: the axes are an input
                given = self.env.get(n.args[1]) if isinstance(n.args[1], fx.Node) else n.args[1]
                axes = given.reshape(-1).tolist() if isinstance(given, torch.Tensor) else given
            x = self.env.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
            if axes and isinstance(x, torch.Tensor):
                wrong = [a % x.dim() for a in axes if x.shape[a % x.dim()] != 1]
                if wrong:
                    self.kept.append(f"ONNX Squeeze {info.get('node_name') or n.name!r} squeezes dim(s) {wrong} of "
                                     f"its input of shape {tuple(x.shape)}, which ONNX requires to be 1")
        return super().run_node(n)


def check_sized_inputs(gm: nn.Module, args: Sequence[Any]) -> None:
    """Refuse data whose sizes differ from those a caffe net was loaded at when its graph holds constants of those
    sizes (a PriorBox's boxes), which would silently stop matching the network's outputs."""
    meta = getattr(gm, "meta", {}).get("caffe")
    layers = meta.get("sized_by_input") if isinstance(meta, dict) else None
    if not layers:
        return
    for name, value in zip(meta.get("inputs", []), args):
        want = meta.get("input_shapes", {}).get(name)
        if isinstance(value, torch.Tensor) and want and tuple(value.shape[1:]) != tuple(want[1:]):
            raise CalibrationError(
                f"input {name!r}: the batch has shape {tuple(value.shape)}, but layer(s) {layers[:3]} "
                f"(PriorBox) hold boxes computed at load for shape {list(want)}. Fix: load the net with "
                f"fxq.load_caffe(..., input_shapes={{{name!r}: {list(value.shape)}}}) (CLI: --input-shape "
                f"{name}={','.join(str(d) for d in value.shape)}), or give data of shape "
                f"[N, {', '.join(str(d) for d in want[1:])}]")


def data_failure(gm: fx.GraphModule, args: Sequence[Any], exc: BaseException, what: str) -> FxqError:
    """The error for the first ``what`` batch failing in the FP32 model ``gm`` (the data does not fit it): the
    node where it fails (with its ONNX node), the batch's input shapes and, for an ONNX file, the input shapes the
    file declares, and any ONNX ``Squeeze`` of a dim that is not 1 on this batch (:class:`_SqueezeWatch`). When
    the graph runs the batch, the failure is fxq's own (:func:`rewrite_failure`)."""
    watch = _SqueezeWatch(gm)
    try:
        with torch.no_grad():
            watch.run(*args)
    except Exception:  # noqa: BLE001  (the failure being described)
        node = watch.current
    else:
        return rewrite_failure(None, exc, f"preparing on the first {what} batch")
    where = ""
    if node is not None:
        info = node.meta.get("onnx")
        onnx_node = (f" (ONNX {info.get('op_type')} {info.get('node_name')!r})"
                     if isinstance(info, dict) and info.get("node_name") else "")
        where = f" at node {node.name!r}{onnx_node}"
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    shapes = ", ".join(f"{name} {tuple(a.shape)}" for name, a in zip(names, args) if isinstance(a, torch.Tensor))
    onnx_meta = getattr(gm, "meta", {}).get("onnx")
    declared = onnx_meta.get("source_input_shapes") if isinstance(onnx_meta, dict) else None
    lines = [f"the first {what} batch failed in the model{where} ({type(exc).__name__}: {one_line(exc)})",
             f"the batch's inputs: {shapes}" if shapes else ""]
    if declared:
        lines.append("the ONNX file declares " + ", ".join(f"{k} {list(v)}" for k, v in declared.items()))
    lines += watch.kept[:3]
    fix = ("give batches of the sizes the model takes (the ONNX file runs in onnxruntime on them), and load it "
           "with input_shapes= of those sizes so that load_onnx checks its conversion on them (CLI: --input-shape "
           "N,C,H,W, which also resizes a folder's images to that size)" if declared else
           "give batches that the model runs")
    return CalibrationError("; ".join(line for line in lines if line) + f". Fix: {fix}")


def _fp32_fails(gm: fx.GraphModule, args: list[Any]) -> str | None:
    """The node where ``gm`` with its quantizers passed through fails on ``args`` ("?" unknown), None if it runs."""
    fp32 = _FP32(gm)
    try:
        fp32.run(*args)
    except Exception:  # noqa: BLE001  (any failure of the FP32 model: the data does not fit it)
        return fp32.current.name if fp32.current is not None else "?"
    return None


def _locate(gm: fx.GraphModule, args: list[Any], exc: BaseException, what: str | None,
            block: str | None = None) -> GraphError:
    """:func:`rewrite_failure` naming the node where ``gm`` fails on ``args`` again (``block`` if it does not).

    The message quotes ``exc``, the failure as it happened (torch.fx's interpreter adds its graph dump to ``again``).
    """
    locator = _Locator(gm)
    try:
        locator.run(*args)
    except Exception:  # noqa: BLE001
        node = locator.current
        return rewrite_failure(node.name if node is not None else None, exc, what, block)
    return rewrite_failure(None, exc, what, block)


@contextlib.contextmanager
def algorithm_errors(what: str, diagnose: Callable[[BaseException], FxqError | None]) -> Iterator[None]:
    """Name whose failure it is when fxq's quantized model (or a block of it) fails inside the pass ``what``.

    For passes over batches that the FP32 model runs first (calibration did, or the pass itself did): a failure is
    fxq's own. ``diagnose(exc)`` (:func:`diagnose_batch`, :func:`diagnose_block_failure`) runs only after a failure
    and returns the error to raise: fxq's :class:`GraphError` naming the node, or a :class:`CalibrationError` when
    the FP32 model fails on the batch too (None: that, without a node). fxq's own errors and out-of-memory pass as
    they are; a diagnosis that fails itself still reports fxq's failure, without a node.
    """
    try:
        yield
    except (FxqError, torch.OutOfMemoryError):  # memory: neither the data's nor the rewrite's fault
        raise
    except Exception as exc:  # noqa: BLE001  (any error inside fxq's model: say whose it is)
        try:
            own = diagnose(exc)
        except Exception:  # noqa: BLE001
            logger.debug("diagnosing %s in %s failed", type(exc).__name__, what, exc_info=True)
            own = rewrite_failure(None, exc, what)
        if own is None:
            own = CalibrationError(f"{what}: the FP32 model fails on a batch too ({type(exc).__name__}: "
                                   f"{one_line(exc)}); give batches that the model runs")
        raise own from exc


@contextlib.contextmanager
def first_batch_errors(what: str, first: bool,
                       diagnose: Callable[[BaseException], FxqError | None] | None = None) -> Iterator[None]:
    """Turn a model failure on the ``first`` batch into a :class:`CalibrationError` (the data does not fit).

    ``diagnose`` (for a block that runs fxq's quantized model without a preceding FP32 pass) is asked first: it
    returns fxq's own error when the FP32 model runs the batch (see :func:`diagnose_failure`), None when not.
    A later batch's failure re-raises as it is (the data fitted once, so it is something else), unless that
    batch, from :func:`iter_batches`, has other non-batch sizes than the first one: then it names batch and shapes.
    """
    try:
        yield
    except FxqError:
        raise
    except (RuntimeError, TypeError, ValueError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):  # memory: neither the data's nor the rewrite's fault
            raise
        if first:
            own = _diagnosed(diagnose, exc)
            if own is not None:
                raise own from exc
            raise CalibrationError(f"the first {what} batch failed in the model: {exc}") from exc
        resized = _RESIZED_BATCH.get()
        if resized is not None:
            raise CalibrationError(f"{what} {resized}, and the model failed on it: {exc}; "
                                   f"give every batch the first batch's non-batch sizes") from exc
        raise


def _diagnosed(diagnose: Callable[[BaseException], FxqError | None] | None, exc: BaseException) -> FxqError | None:
    """``diagnose(exc)``; None when there is none or it fails itself (the original error is the one to report)."""
    if diagnose is None:
        return None
    try:
        return diagnose(exc)
    except Exception:  # noqa: BLE001
        logger.debug("diagnosing %s failed", type(exc).__name__, exc_info=True)
        return None


def call_model(model: nn.Module, batch: Any, check: bool = True) -> Any:
    """``model`` on one batch; a GraphModule is called past torch.fx's wrapper, which prints failures to stderr."""
    args, kwargs = to_call_args(model, batch, check)
    if isinstance(model, fx.GraphModule):
        return nn.Module.__call__(model, *args, **kwargs)
    return model(*args, **kwargs)
