"""Steps every ONNX-based exporter shares: validate the model, plan the files, finalize, write them as one set."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import fx, nn

from fxq import onnx_data
from fxq.backends.qdq.onnx_graph import remove_initializers
from fxq.errors import ExportError, GraphError
from fxq.graph.info import graph_quant
from fxq.graph.quant_graph import QuantGraph
from fxq.io import check_output_dir
from fxq.onnx_data import check_model, data_path, infer_shapes, onnx_files
from fxq.spec import QuantState

__all__ = ["quantized_graph", "plan_paths", "finalize", "serialize",
           "IR_VERSION"]

logger = logging.getLogger(__name__)

IR_VERSION = 10
"""onnx 1.23 writes IR 14, which onnxruntime 1.31 rejects; every model fxq writes says 10."""

def quantized_graph(model: nn.Module) -> fx.GraphModule:
    """``model`` as a calibrated fxq GraphModule, or :class:`ExportError` saying what to do first."""
    if not isinstance(model, fx.GraphModule):
        raise ExportError(f"export needs the GraphModule returned by fxq.quantize / fxq.prepare, got "
                          f"{type(model).__name__}")
    try:
        graph_quant(model)
        qg = QuantGraph(model)
    except GraphError as exc:
        raise ExportError(str(exc)) from None
    pending = [name for name, fq in qg.quantizers()
               if fq.config.state in (QuantState.INITIAL, QuantState.PASSIVE_INIT)]
    if pending:
        shown = ", ".join(pending[:6]) + (" ..." if len(pending) > 6 else "")
        raise ExportError(f"{len(pending)} quantizer(s) are not calibrated yet ({shown}): run fxq.calibrate(model, "
                          f"data) (or fxq.quantize) before exporting")
    return model


def plan_paths(path: str | os.PathLike, suffix: str, extras: dict[str, str] | None = None) -> dict[str, Path]:
    """The main file (``path``, with ``suffix`` appended unless it already ends in it: ``ocr_v2.0_trt`` becomes
    ``ocr_v2.0_trt.onnx``, not a file without an extension) and companions ``stem + ext`` beside it.

    Checks that the folder is writable or can be created (the exporter creates it when it writes), before anything is
    computed or written.
    """
    p = Path(path)
    if p.is_dir():
        raise ExportError(f"export path {str(p)!r} is a directory; give a file path such as {str(p / ('model' + suffix))!r}")
    if p.suffix.lower() != suffix.lower():
        p = p.with_name(p.name + suffix)
    check_output_dir(p.parent)
    out = {"main": p}
    for key, ext in (extras or {}).items():
        out[key] = p.with_name(p.stem + ext)
    for q in out.values():
        if q.is_dir():
            raise ExportError(f"export file {str(q)!r} is an existing directory; remove it or choose another path")
    return out


def finalize(model: Any, opset: int, *, check: bool = True) -> Any:
    """Standard opset imports only, IR version 10, fresh shapes, and ``onnx.checker``."""

    from fxq.backends.qdq.marking import MARK_DOMAIN

    kept = [o for o in model.opset_import if o.domain not in (MARK_DOMAIN,)]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = opset
    model.ir_version = IR_VERSION
    model.producer_name = "fxq"
    fold_initializer_identities(model.graph)
    _name_nodes(model.graph)
    del model.graph.value_info[:]
    model = _infer_shapes(model)
    if check:
        try:
            check_model(model)
        except Exception as exc:
            raise ExportError(f"the exported ONNX model is invalid ({exc}); please report this with the model") from exc
    return model


def _infer_shapes(model: Any) -> Any:
    """:func:`fxq.onnx_data.infer_shapes` in place (a convenience: unchanged on failure)."""
    try:
        return infer_shapes(model, in_place=True)
    except Exception as exc:  # shapes are a convenience; the checker is what matters
        logger.debug("shape inference failed on the exported model: %s", exc)
        return model


def _name_nodes(graph: Any) -> None:
    """Every node gets a unique, non-empty name (side files key nodes by name)."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)


def fold_initializer_identities(graph: Any) -> None:
    """``Identity(initializer)`` nodes (torch.onnx de-duplicates equal constants that way) become initializers."""
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    keep = []
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in inits and node.output[0] not in outputs:
            graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(inits[node.input[0]]),
                                                            node.output[0]))
            continue
        keep.append(node)
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)
        used = {i for n in graph.node for i in n.input} | outputs
        remove_initializers(graph, {t.name for t in graph.initializer} - used)


def serialize(model: Any, path: Path) -> dict[Path, bytes | bytearray | None]:
    """The files of ``model`` written at ``path``: the ``.onnx`` alone, or, for a model over
    :data:`fxq.onnx_data.EXTERNAL_DATA_THRESHOLD` (protobuf's 2 GiB limit), the ``.onnx`` and its external data
    ``<name>.onnx.data`` (:func:`fxq.onnx_data.onnx_files`), to be written in the same atomic set. A ``.onnx``
    written alone maps ``<name>.onnx.data`` to ``None``: an earlier large export's data file there is deleted in
    the same set."""
    files: dict[Path, bytes | bytearray | None] = dict(onnx_files(model, path))
    if len(files) > 1:
        logger.info("%s: the model is over %d bytes; its weights go to external data %s", path.name,
                    onnx_data.EXTERNAL_DATA_THRESHOLD, data_path(path).name)
    else:
        files[data_path(path)] = None
    return files

