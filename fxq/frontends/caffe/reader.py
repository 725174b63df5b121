"""Read a prototxt (text format) and a caffemodel (binary) with fxq's caffe schema subset."""
from __future__ import annotations

import codecs
import logging
import math
import os
import re
from typing import Any

import numpy as np
from google.protobuf import message, text_format

from fxq.errors import FrontendError
from fxq.frontends.caffe import proto

__all__ = ["CaffeWeights", "blob_to_array", "layer_in_test_phase", "read_caffemodel", "read_prototxt"]

logger = logging.getLogger(__name__)

_TEST = 1  # caffe Phase.TEST


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _looks_like_caffemodel(data: bytes) -> bool:
    """Whether ``data`` parses as a binary NetParameter holding layers (a caffemodel given as the prototxt)."""
    net = proto.NetParameter()
    try:
        net.ParseFromString(data)
    except message.DecodeError:
        return False
    return bool(len(net.layer) or len(net.layers))


def read_prototxt(path: str | os.PathLike) -> Any:
    """Parse a prototxt into a ``caffe.NetParameter``; fields fxq does not model are skipped.

    Raises:
        FrontendError: unreadable file, binary or non-UTF-8 content (a caffemodel passed as the prototxt...), or a
            syntax error (with its line and column).
    """
    label = os.fspath(path)
    if os.path.isdir(path):
        raise FrontendError(f"prototxt {label!r} is a folder, not a file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FrontendError(f"cannot read prototxt {label!r}: {exc.strerror or exc}") from None
    if data.startswith(_UTF16_BOMS):
        raise FrontendError(f"{label}: the prototxt is UTF-16 text; save it as UTF-8 (or ASCII) text")
    try:
        text = data.decode("utf-8-sig")
        binary = "\x00" in text
    except UnicodeDecodeError:
        binary = True
    if binary:
        kind = "a binary caffemodel" if _looks_like_caffemodel(data) else "binary data"
        raise FrontendError(f"{label}: not a text prototxt, it holds {kind}; check the file, or whether the "
                            f"prototxt and caffemodel are swapped")
    net = proto.NetParameter()
    try:
        text_format.Parse(text, net, allow_unknown_field=True, allow_unknown_extension=True)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        where = f" (line {line}, column {column})" if line is not None else ""
        why = re.sub(r"^\d+:\d+ : ", "", str(exc))
        raise FrontendError(f"{label}: not a valid caffe prototxt{where}: {why}") from None
    return net


def blob_to_array(blob: Any) -> np.ndarray:
    """A ``BlobProto`` as a float32 array, shaped by ``shape`` or by the legacy num/channels/height/width.

    Raises ``ValueError`` when the data does not fill the shape.
    """
    if blob.HasField("shape"):
        shape = tuple(int(d) for d in blob.shape.dim)
    elif any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = None
    if len(blob.data):
        array = np.array(blob.data, dtype=np.float32)  # fast path in protobuf's C containers
    elif len(blob.double_data):
        array = np.array(blob.double_data, dtype=np.float64).astype(np.float32)
    else:
        array = np.zeros(0, dtype=np.float32)
    if shape is None:
        return array
    if array.size != math.prod(shape):
        raise ValueError(f"holds {array.size} values but its shape {shape} needs {math.prod(shape)}")
    return array.reshape(shape)


class CaffeWeights:
    """The blobs of a caffemodel by layer name (``layer`` entries, or old V1 ``layers``; the last one wins)."""

    def __init__(self, label: str, by_layer: dict[str, list[Any]]) -> None:
        self.label = label
        self._by_layer = by_layer

    def blobs(self, layer_name: str) -> list[Any] | None:
        return self._by_layer.get(layer_name)

    def layer_names(self) -> list[str]:
        return list(self._by_layer)

    @staticmethod
    def to_array(blob: Any) -> np.ndarray:
        return blob_to_array(blob)


def read_caffemodel(path: str | os.PathLike) -> CaffeWeights:
    """Parse a binary caffemodel; only the layers' names and blobs are used."""
    label = os.fspath(path)
    if os.path.isdir(path):
        raise FrontendError(f"caffemodel {label!r} is a folder, not a file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FrontendError(f"cannot read caffemodel {label!r}: {exc.strerror or exc}") from None
    net = proto.NetParameter()
    try:
        net.ParseFromString(data)
    except message.DecodeError as exc:
        hint = "; it is text: are the prototxt and caffemodel swapped?" if _is_text(data) else \
            " (truncated or corrupt?)"
        raise FrontendError(f"{label}: not a valid caffemodel (protobuf decode failed: {exc}){hint}") from None
    if data and not (len(net.layer) or len(net.layers)) and _is_text(data):
        raise FrontendError(f"{label}: not a binary caffemodel, it is text (a prototxt?); are the prototxt and "
                            f"caffemodel swapped?")
    by_layer: dict[str, list[Any]] = {}
    for layer in list(net.layers) + list(net.layer):
        if layer.name in by_layer and len(layer.blobs):
            logger.debug("%s: layer %r appears twice; using its last blobs", label, layer.name)
        if len(layer.blobs) or layer.name not in by_layer:
            by_layer[layer.name] = list(layer.blobs)
    if not any(by_layer.values()):
        logger.warning("%s: the caffemodel holds no blobs at all", label)
    return CaffeWeights(label, by_layer)


def _is_text(data: bytes) -> bool:
    """Whether ``data`` starts as non-empty UTF-8 text (a prototxt, say)."""
    head = data[:4096]
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return "\x00" not in text and bool(text.strip())


def _meets_rule(rule: Any, state: Any) -> bool:
    """caffe's ``StateMeetsRule`` for a net in TEST phase at ``state``'s level and stages."""
    if rule.HasField("phase") and rule.phase != _TEST:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def layer_in_test_phase(layer: Any, state: Any) -> bool:
    """Whether caffe would instantiate ``layer`` in a TEST-phase net (``include`` / ``exclude`` rules)."""
    if len(layer.include):
        return any(_meets_rule(rule, state) for rule in layer.include)
    return not any(_meets_rule(rule, state) for rule in layer.exclude)
