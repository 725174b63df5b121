"""``load_onnx``: read -> clean -> check every op -> onnx2torch.convert -> name mapping. Nothing partial escapes."""
from __future__ import annotations

import contextlib
import functools
import keyword
import logging
import os
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

import onnx
import torch
from torch import fx

from fxq.errors import FrontendError
from fxq.frontends.onnx import cleanup, control_flow, cut, dequantize, naming, reader, shapes, support
from fxq.frontends.onnx import verify as checks
from fxq.recurrent.modules import functionalize_recurrent

__all__ = ["load_onnx"]

_LOG = logging.getLogger(__name__)


def _placeholder_names_ok(model: onnx.ModelProto) -> bool:
    """onnx2torch can name placeholders after the inputs only when they are Python identifiers."""
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    return all(n.isidentifier() and not keyword.iskeyword(n) for n in names)


_CONVERT_LOCK = threading.Lock()


@contextlib.contextmanager
def _onnx2torch_shortcuts() -> Iterator[None]:
    """Two steps of ``onnx2torch.convert`` that only cost time here, skipped inside this block (one conversion at a
    time; other threads are not affected):

    * it starts by running onnx's shape inference on the whole model, serializing every weight (a quarter of a
      ResNet-18 load). The model it gets here is inferred already (:func:`fxq.frontends.onnx.shapes.
      infer_for_conversion`: the same inference with data propagation, on a copy without the weights' data), so
      that step hands the model back as it is;
    * it builds each module with torch's random init and then overwrites the weights with the file's: a third of
      a VGG's load. In this thread, ``torch.nn.init``'s ``kaiming_uniform_`` and ``uniform_`` are put off until
      the block ends, and then run only on the tensors nothing wrote: neither replaced (``.data = ``, a new
      address) nor written in place (``copy_``: the NaN put in their first element is gone). None, so far: every
      converter sets its module's parameters.
    """
    import onnx2torch.converter as converter

    with _CONVERT_LOCK:
        original = converter.safe_shape_inference
        inits = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
        converter.safe_shape_inference = lambda model, **kwargs: model
        for name, init in inits.items():
            setattr(torch.nn.init, name, _deferred_in_this_thread(init))
        _LOADING.deferred = []
        try:
            yield
            for tensor, address, init, args, kwargs in _LOADING.deferred:
                if tensor.data_ptr() == address and _unwritten(tensor):  # initialise it as torch would
                    init(tensor, *args, **kwargs)
        finally:
            _LOADING.deferred = None
            for name, init in inits.items():
                setattr(torch.nn.init, name, init)
            converter.safe_shape_inference = original


_RANDOM_INITS = ("kaiming_uniform_", "uniform_")
"""The ``torch.nn.init`` functions that the reset_parameters of convolutions and linear layers call."""

_LOADING = threading.local()
"""``deferred``: in a thread inside :func:`_onnx2torch_shortcuts`, the init calls put off (tensor, its memory's
address, the init and its arguments); None or absent elsewhere."""


def _deferred_in_this_thread(init: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(init)
    def deferred(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls = getattr(_LOADING, "deferred", None)
        if calls is None or not tensor.is_floating_point() or not tensor.numel():
            return init(tensor, *args, **kwargs)
        with torch.no_grad():
            tensor[(0,) * tensor.dim()].fill_(float("nan"))  # a mark any write of the file's values removes
        calls.append((tensor, tensor.data_ptr(), init, args, kwargs))
        return tensor

    return deferred


def _unwritten(tensor: torch.Tensor) -> bool:
    """Whether the mark :func:`_deferred_in_this_thread` put in ``tensor``'s first element is still there."""
    return bool(torch.isnan(tensor[(0,) * tensor.dim()]))


def _locate_failures(
    model: onnx.ModelProto, source: str, exc: Exception, aliases: dict[str, str]
) -> FrontendError:
    """Re-run each node's converter alone to name every node that breaks ``convert`` (failure path only)."""
    from onnx2torch.node_converters.registry import get_converter
    from onnx2torch.onnx_graph import OnnxGraph

    graph = OnnxGraph(model.graph)
    failures: list[str] = []
    failed_outputs: set[str] = set()
    for onode in graph.nodes.values():
        opset = support.opset_of(model, onode.domain) or 0
        try:
            get_converter(operation_type=onode.operation_type, version=opset, domain=onode.domain)(onode, graph)
        except Exception as node_exc:  # noqa: BLE001  (any converter failure is reported with its node)
            domain = aliases.get(onode.domain, onode.domain) or "ai.onnx"
            failures.append(
                f"  - node {onode.name or onode.unique_name!r} ({onode.operation_type}, domain {domain!r}, "
                f"opset {opset}): {type(node_exc).__name__}: {node_exc}"
            )
            failed_outputs.update(onode.output_values)
    if not failures:
        return FrontendError(
            f"cannot convert ONNX model {source!r}: onnx2torch failed: {type(exc).__name__}: {exc}"
        )
    message = (
        f"cannot convert ONNX model {source!r}: {len(failures)} node(s) use a form of their op that the "
        "converters do not handle:\n" + "\n".join(failures) + "\nWhat to do: re-export the model without these "
        "forms (other attribute values, constant instead of computed inputs), or register a converter with "
        "fxq.frontends.onnx.register_onnx_converter(op_type, schema_version, override=True)"
    )
    blocking = [i for i, n in enumerate(model.graph.node) if set(n.output) & failed_outputs]
    if blocking and cut.follows_data_shaped(model.graph, blocking):  # post-processing (after NMS): cut before it
        return cut.refusal(message, model, blocking, source)
    return FrontendError(message + ".")


def load_onnx(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    base_dir: str | os.PathLike | None = None,
    input_shapes: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
    verify: bool | str = "auto",
    outputs: Sequence[str] | None = None,
    input_values: Mapping[str, Any] | None = None,
    batch_dims: Mapping[str, int | None] | None = None,
) -> fx.GraphModule:
    """Load an ONNX model as a ``torch.fx.GraphModule`` whose nodes carry their ONNX names.

    The model is cleaned (Constant/Identity-of-initializer folding, shape inference), every node is checked for a
    converter (onnx2torch's or fxq's), converted by onnx2torch, and annotated: ``node.meta["onnx"]`` and
    ``gm.meta["onnx"]`` as laid out in :mod:`fxq.frontends.onnx`. The GraphModule returns the ONNX graph outputs
    in order (one tensor, or a tuple for several). Then (``verify``) the conversion is run once against
    onnxruntime on a generated input.

    Args:
        model: path of a ``.onnx`` file (its ``.onnx.data`` external data is read from beside it) or a
            ``ModelProto`` (copied, never modified).
        base_dir: folder holding external data files, when not the model file's folder (or for a ``ModelProto``
            whose tensors still refer to external files).
        input_shapes: ``{input name: [dims]}`` (or one shape for a single-input model) fixing the symbolic or
            unknown dims of the file's inputs for loading, shape inference and the check; exports keep the dims
            the file has symbolic dynamic. Dims the file fixes must match.
        verify: run the converted graph and onnxruntime on one generated input and raise when they differ;
            ``"auto"`` (default) does so when onnxruntime is installed, the weights take at most
            ``VERIFY_AUTO_MAX_BYTES`` (256 MiB) and every input dim is known (from the file or ``input_shapes``).
        outputs: tensor names to load the graph up to, as its outputs (in this order): only the nodes, inputs
            and weights they need are loaded. For cutting a model before what fxq cannot convert or should not
            quantize (a detector's NMS and data-dependent ``If``; the error for such a node names the cut).
        input_values: ``{input name: value}`` making inputs that select a mode rather than carry data constants of
            the model (silero VAD's sample rate: ``{"sr": 16000}``), so an ``If`` on them folds at load time; the
            loaded graph and its exports no longer take them.
        batch_dims: ``{input or output name: dim}`` for tensors whose batch is not dim 0 where the file does not
            say so by name (silero VAD's ``state`` is ``[2, batch, 128]``; a file with named dims tells by the
            symbol at dim 0 of the first input), or ``None`` for a tensor without a batch dim (a time step, a
            shape). Read by exports to runtimes without a batch (ncnn), which drop that dim from the tensor's blob
            (and keep a tensor without one whole).

    Returns:
        The converted ``GraphModule`` in eval mode.

    Raises:
        FrontendError: missing, corrupt or non-ONNX file (a PyTorch archive of fxq.save: the message says
            fxq.load), missing external data, ops without a converter (all
            listed at once, with op type, domain, opset and node names), a converter failing on a node, ranks
            shape inference cannot tell without ``input_shapes`` (naming the inputs), or a converted graph that
            differs from onnxruntime (naming the first differing ONNX node).

    Example:
        >>> gm = load_onnx("model.onnx")                              # doctest: +SKIP
        >>> conv = next(n for n in gm.graph.nodes if n.meta.get("onnx", {}).get("op_type") == "Conv")  # +SKIP
        >>> conv.meta["onnx"]["params"]["weight"]                      # doctest: +SKIP
        'conv1.weight'
    """
    from onnx2torch import convert

    from fxq.frontends.onnx.converters.auto_pad import inline_wrappers
    from fxq.frontends.onnx.converters.registry import load_builtin_converters

    load_builtin_converters()
    proto, source = reader.read_model(model, base_dir)
    values = shapes.fix_input_values(proto, input_values, source)
    if outputs is not None:
        proto = cut.keep_outputs(proto, [outputs] if isinstance(outputs, str) else list(outputs), source)
    fixed = shapes.fix_input_shapes(proto, input_shapes, source)
    file_tensors = {o for n in proto.graph.node for o in n.output if o}  # what outputs= can name
    dequantize.fold_qdq(proto, source)  # a QDQ file: its float model (checked against that below)
    original = None
    if checks.wants_check(proto, verify):
        original = onnx.ModelProto()
        original.CopyFrom(proto)
    declared = shapes.source_dims(proto)
    declared_outputs = {o.name: shapes.tensor_dims(o) or [] for o in proto.graph.output}
    batches = shapes.check_batch_dims(batch_dims, {**declared, **declared_outputs}, source)
    proto = shapes.infer_for_conversion(cleanup.clean(proto, infer=False), fixed)
    if control_flow.fold_constant_ifs(proto, source, fixed, file_tensors):  # the taken branches' nodes get their shapes
        proto = shapes.infer_for_conversion(cleanup.clean(proto, infer=False), fixed)
    control_flow.refuse_loops(proto, source, file_tensors)
    support.check_wiring(proto, source)
    upgraded = support.upgrade_for_converters(proto, source)
    if upgraded is not proto:  # the adapters' new nodes (a Reshape's shape, Dropout's ratio) get cleaned and shapes
        proto = shapes.infer_for_conversion(cleanup.clean(upgraded, infer=False), fixed)
    support.check_supported(proto, source)
    unknown = shapes.unknown_rank_nodes(proto)
    if unknown and shapes.symbolic_inputs(proto) and not set(shapes.symbolic_inputs(proto)) <= set(fixed):
        raise FrontendError(shapes.advice(proto, source, unknown))
    aliases = cleanup.alias_dotted_domains(proto)
    try:
        with _onnx2torch_shortcuts():
            gm = convert(proto, save_input_names=_placeholder_names_ok(proto), attach_onnx_mapping=True)
    except Exception as exc:  # noqa: BLE001  (onnx2torch raises anything; we name the node)
        raise _locate_failures(proto, source, exc, aliases) from exc
    try:
        gm = naming.annotate(gm, proto, source, aliases)
    except Exception as exc:  # noqa: BLE001  (a bug of ours or an odd graph: still no partial result)
        raise FrontendError(
            f"converted ONNX model {source!r} but could not map its names onto the graph "
            f"({type(exc).__name__}: {exc}); please report this with the model"
        ) from exc
    inline_wrappers(gm)  # SAME-padded convs / pools: their conv visible to the quantizers
    functionalize_recurrent(gm)  # LSTM / GRU weights become graph inputs, as for nn.LSTM / nn.GRU
    gm.meta["onnx"]["source_input_shapes"] = {k: list(v) for k, v in declared.items()}
    gm.meta["onnx"]["source_output_shapes"] = {k: list(v) for k, v in declared_outputs.items()}
    if fixed:
        gm.meta["onnx"]["input_shapes"].update({k: list(v) for k, v in fixed.items()})
    if values:
        gm.meta["onnx"]["input_values"] = {k: v.tolist() for k, v in values.items()}
    if batches:
        gm.meta["onnx"]["batch_dims"] = batches
    gm.eval()
    if original is not None:
        checks.check_conversion(gm, original, fixed, source, verify)
    _LOG.info("loaded ONNX model %s: %d nodes, opset %s", source, len(proto.graph.node), gm.meta["onnx"]["opset"])
    return gm
