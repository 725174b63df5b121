"""``load_caffe``: a deploy prototxt (+ caffemodel) -> ``torch.fx.GraphModule``, no caffe installation needed."""
from __future__ import annotations

import logging
import os
from typing import Mapping, Sequence

import torch.fx

import fxq.frontends.caffe.layers  # noqa: F401  (registers the converters)
from fxq.errors import FrontendError
from fxq.frontends.caffe.builder import MAX_ELEMENTS, GraphBuilder
from fxq.frontends.caffe.reader import layer_in_test_phase, read_caffemodel, read_prototxt
from fxq.frontends.caffe.registry import CAFFE_LAYERS, supported_layer_types

__all__ = ["load_caffe"]

logger = logging.getLogger(__name__)


def _net_level_inputs(net, label: str) -> list[tuple[str, list[int] | None]]:
    """The deprecated ``input`` / ``input_shape`` / ``input_dim`` fields of NetParameter."""
    names = list(net.input)
    if len(net.input_shape):
        if len(net.input_shape) != len(names):
            raise FrontendError(f"{label}: {len(names)} input(s) but {len(net.input_shape)} input_shape(s)")
        return [(n, list(s.dim)) for n, s in zip(names, net.input_shape)]
    if len(net.input_dim):
        if len(net.input_dim) != 4 * len(names):
            raise FrontendError(f"{label}: input_dim must hold 4 values per input, got {len(net.input_dim)} "
                                f"for {len(names)} input(s)")
        dims = list(net.input_dim)
        return [(n, dims[4 * i: 4 * i + 4]) for i, n in enumerate(names)]
    return [(n, None) for n in names]


def load_caffe(prototxt: str | os.PathLike, caffemodel: str | os.PathLike | None = None, *,
               input_shapes: Mapping[str, Sequence[int]] | None = None,
               outputs: Sequence[str] | None = None,
               max_elements: int = MAX_ELEMENTS) -> torch.fx.GraphModule:
    """Convert a caffe deploy net into a ``torch.fx.GraphModule`` (in eval mode).

    Layers become ``nn`` submodules named after the (sanitised) caffe layer names, or torch-op nodes for routing
    layers; the layers of a TEST-phase net are kept (``include`` / ``exclude`` rules). Every node carries
    ``node.meta["caffe"] = {"layer", "type", "bottom", "top", "produces"}`` (``produces``: the top blobs whose
    value the node is; custom modules add ``op_type``, e.g. ``"MaxPool"``). ``gm.meta["caffe"]`` holds
    ``inputs``, ``outputs`` (caffe's net outputs: blobs no later layer consumes, in production order),
    ``input_shapes``, ``aliases`` (Split tops -> source blob), ``name`` and ``source`` (file base names).
    One output is returned as a tensor, several as a tuple.

    Args:
        prototxt: path of the deploy ``.prototxt`` (layer parameters always come from here).
        caffemodel: path of the binary ``.caffemodel``; its blobs are matched to layers by name, as caffe does.
            Without it, learned layers keep torch's default (random) initialisation, BatchNorm has mean 0 and
            variance 1, Scale is 1 and 0; a warning is logged. Useful for structure and shape work only.
        input_shapes: shapes by input blob name, overriding or completing those of the prototxt (e.g. another
            batch size). Every input needs a shape: each layer is run once on shape-only (meta) tensors.
        outputs: blob names to end the net at, in this order: only the layers they need are converted (an SSD
            detector before its ``DetectionOutput`` post-processing). Default: caffe's net outputs.
        max_elements: the most elements an input or a learned weight may have (default 2**28), checked before
            anything is allocated.

    Returns:
        The ``GraphModule``; call it with the inputs in ``gm.meta["caffe"]["inputs"]`` order.

    Raises:
        FrontendError: unreadable, binary-as-text or malformed files (with the line of a syntax error), inputs with
            non-positive dims or over ``max_elements``, V1 (``layers``) prototxts, unsupported layer types (naming
            the file, layer and type and listing the supported ones), missing or mis-shaped blobs (naming the
            layer), layers that cannot run on their bottoms.

    Example::

        gm = fxq.load_caffe("deploy.prototxt", "weights.caffemodel")
        probs = gm(torch.randn(1, 3, 224, 224))
    """
    label = os.fspath(prototxt)
    net = read_prototxt(prototxt)
    if len(net.layers):
        names = ", ".join(repr(layer.name) for layer in list(net.layers)[:5])
        raise FrontendError(
            f"{label}: uses the deprecated V1 'layers' format ({len(net.layers)} layers: {names}...); upgrade it "
            "with caffe's upgrade_net_proto_text tool (and the caffemodel with upgrade_net_proto_binary)"
        )
    weights = read_caffemodel(caffemodel) if caffemodel is not None else None
    if weights is None:
        logger.warning("%s: no caffemodel given; learned layers keep random initial weights", label)
    try:
        shapes = {str(k): tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
    except (TypeError, ValueError):
        raise FrontendError(f"{label}: input_shapes must map input names to lists of ints, got {input_shapes!r}"
                            ) from None
    builder = GraphBuilder(label, weights, shapes, max_elements)
    for name, shape in _net_level_inputs(net, label):
        builder.add_input(name, shape)
    layers = []
    for layer in net.layer:
        if not layer_in_test_phase(layer, net.state):
            logger.debug("%s: skipping layer %r, not part of the TEST phase", label, layer.name)
            continue
        layers.append(layer)
    if outputs is not None:
        outputs = [str(o) for o in ([outputs] if isinstance(outputs, str) else outputs)]
        layers = _layers_for(layers, outputs, builder.inputs, label)
    for i, layer in enumerate(layers):
        if layer.type not in CAFFE_LAYERS:
            raise FrontendError(
                f"{label}: layer {layer.name!r} has type {layer.type!r}, which fxq's caffe frontend does not "
                f"support; supported types: {', '.join(supported_layer_types())}{_cut_advice(layers, i)}"
            )
        builder.convert(layer, CAFFE_LAYERS.get(layer.type).fn)
    unused = builder.unused_shape_overrides()
    if unused:
        raise FrontendError(f"{label}: input_shapes names {unused}, which are not inputs of the net "
                            f"(inputs: {builder.inputs})")
    source = {
        "prototxt": os.path.basename(label),
        "caffemodel": os.path.basename(os.fspath(caffemodel)) if caffemodel is not None else None,
    }
    return builder.finish(net.name, source, outputs)


def _layers_for(layers: list, outputs: list[str], inputs: list[str], label: str) -> list:
    """The layers (in order) that compute blobs ``outputs``: walked back from them, a layer is kept when it writes
    a blob still needed, whose bottoms are then needed (an in-place layer keeps its blob's earlier writer too)."""
    if not outputs or len(set(outputs)) != len(outputs):
        raise FrontendError(f"{label}: outputs={outputs!r} must name one or more distinct blobs")
    known = set(inputs) | {str(t) for layer in layers for t in layer.top}
    unknown = [o for o in outputs if o not in known]
    if unknown:
        some = sorted(known)[:12]
        raise FrontendError(f"{label}: outputs {unknown} are not blobs of the net; its blobs include {some}")
    needed, kept = set(outputs), []
    for layer in reversed(layers):
        tops = {str(t) for t in layer.top}
        if tops & needed:
            kept.append(layer)
            needed = (needed - tops) | {str(b) for b in layer.bottom}
    return kept[::-1]


def _cut_advice(layers: list, index: int) -> str:
    """For an unsupported layer at the end of the net (no later layer reads what it writes): the ``outputs=`` cut
    that loads the net before it and before every other such layer (a detector's post-processing, as YOLO's
    detection layers, one per scale)."""

    def terminal(i: int) -> bool:
        written = {str(t) for t in layers[i].top}
        return not any(written & {str(b) for b in layer.bottom} for layer in layers[i + 1:])

    if not terminal(index):
        return ""
    ends = [layer for i, layer in enumerate(layers) if layer.type not in CAFFE_LAYERS and terminal(i)]
    bottoms = list(dict.fromkeys(str(b) for layer in ends for b in layer.bottom))
    in_place = [layer.name for layer in ends if {str(t) for t in layer.top} & {str(b) for b in layer.bottom}]
    rename = (f" first give the top of {in_place} a name of its own in the prototxt (it writes its input in place, "
              "so no cut can end before it), then" if in_place else "")
    return (f". It ends the net (post-processing?):{rename} load the net before it with fxq.load_caffe(..., "
            f"outputs={bottoms}) (CLI: --outputs {','.join(bottoms)}) and run it after the runtime")
