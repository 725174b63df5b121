"""Native save / load of quantized GraphModules, without pickling objects.

``fxq.save(model, path)`` writes one file with ``torch.save``: a plain dict of tensors (parameters, buffers,
quantizer scales, FP32 backups of baked weights; baked weights as their integer codes, see
:mod:`fxq.serialization.packing`) and a JSON string describing the module tree, the graph (node by node,
targets by name) and the meta records fxq and its exporters read. ``fxq.load(path)`` reads it
with ``torch.load(weights_only=True)`` and resolves every class and function through an allow-list
(:mod:`fxq.serialization.allowlist`); extend it with :func:`register_serializable`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxq.errors import FrontendError, FxqError, NotSupportedError
from fxq.io import atomic_path, check_writable_dir
from fxq.serialization.allowlist import register_serializable
from fxq.serialization.codec import TensorTable, Unencodable
from fxq.serialization.graph import decode_graph, decode_meta, encode_graph, encode_meta
from fxq.serialization.modules import decode_modules, encode_modules
from fxq.serialization.packing import pack_baked_parameters, unpack_parameters

__all__ = ["save", "load", "register_serializable", "FORMAT", "VERSION"]

logger = logging.getLogger(__name__)

FORMAT = "fxq.graphmodule"
VERSION = 2  # 2: baked weights as integer codes ("packed"); version 1 files are read too
_READABLE = (1, 2)


def save(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save a GraphModule from fxq (quantized or not) to ``path`` (one file, written atomically).

    Raises:
        NotSupportedError: a module class or function outside the allow-list, or an attribute that is not a
            plain value / tensor (the message names the module, node or attribute).
        ExportError: the folder does not exist or is not writable.

    Example:
        >>> fxq.save(qmodel, "resnet18_trt.fxq")
        >>> again = fxq.load("resnet18_trt.fxq")
    """
    if not isinstance(model, fx.GraphModule):
        raise NotSupportedError(f"fxq.save takes a torch.fx.GraphModule (from fxq.quantize / fxq.prepare / "
                                f"fxq.load_onnx), got {type(model).__name__}; use torch.save(model.state_dict()) "
                                f"for other modules")
    target = Path(path)
    check_writable_dir(target.parent)
    table = TensorTable()
    doc = {
        "modules": encode_modules(model, table),
        "graph": encode_graph(model, table),
        "meta": encode_meta(getattr(model, "meta", {}), table, "model", tensor_spec_only=False),
        "training": bool(model.training),
        "torch": torch.__version__,
    }
    doc["packed"] = pack_baked_parameters(model, table)
    with atomic_path(target) as tmp:  # streamed to the temp file: no second in-memory copy of the model
        torch.save({"format": FORMAT, "version": VERSION, "spec": json.dumps(doc), "tensors": table.tensors}, tmp)
    logger.info("saved %s (%d tensors)", target, len(table.tensors))
    return target


def load(path: str | os.PathLike, map_location: Any = "cpu") -> fx.GraphModule:
    """Load a model written by :func:`save`; tensors go to ``map_location``.

    Raises:
        FrontendError: missing, unreadable or foreign file.
        NotSupportedError: the file names a class or function outside the allow-list.
    """
    p = Path(path)
    if not p.is_file():
        raise FrontendError(f"fxq model file {str(p)!r} does not exist")
    try:
        blob = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise FrontendError(f"{str(p)!r} is not a readable fxq model file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise FrontendError(f"{str(p)!r} is not an fxq model file (saved with fxq.save)")
    if blob.get("version") not in _READABLE:
        raise FrontendError(f"{str(p)!r} has format version {blob.get('version')}; this fxq reads versions "
                            f"{', '.join(map(str, _READABLE))} (a newer file: upgrade fxq; an older one: save it "
                            f"again with the fxq that wrote it)")
    try:
        doc = json.loads(blob["spec"])
        table = TensorTable(blob["tensors"])
        unpack_parameters(doc.get("packed", {}), table)
        gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name="GraphModule")
        decode_modules(doc["modules"], gm, table)
        gm.graph = decode_graph(doc["graph"], table)
        gm.graph.lint()
        gm.meta.update(decode_meta(doc["meta"], table))
    except FxqError:
        raise
    except (Unencodable, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FrontendError(f"{str(p)!r} is damaged or from an incompatible fxq ({type(exc).__name__}: {exc})") from exc
    gm.train(doc.get("training", False))
    logger.info("loaded %s", p)
    return gm
