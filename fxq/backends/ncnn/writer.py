"""A small in-memory ncnn model (layers, blobs, weights) and its three file formats.

* ``.param`` — text: magic ``7767517``, ``<layer count> <blob count>``, then one line per layer:
  ``<type> <name> <#bottoms> <#tops> <bottoms...> <tops...> <id>=<value>...``. Float values always carry an
  exponent (ncnn tells floats from ints by a ``.`` or ``e`` in the token, at most 15 characters long); an
  array is written ``<-23300 - id>=<count>,<v0>,<v1>...`` (the form every ncnn version reads, one element too).
* ``.bin`` — the layers' weight buffers, in layer order, little-endian. A *tagged* buffer (what ncnn reads
  with ``ModelBin::load(n, 0)``: conv / inner-product weights) starts with a 4-byte flag, 0 for raw float32;
  a *raw* buffer (``load(n, 1)``: biases, int8 scales, BatchNorm statistics) is bare float32.
* ``.table`` — ncnn2table's calibration table: weight lines ``<layer>_param_0 s0 s1 ...`` first, then
  activation lines ``<layer> s``; every number ``%f``-formatted and followed by a space. Scales multiply
  (``q = round(x * s)``), so ``s = 1 / fxq_scale``.

Int8 inference must stay on for the int8 files: ncnn quantizes the weights of every layer whose param has
``8=`` (``int8_scale_term``) to int8 when it loads the bin, whatever ``Option.use_int8_inference`` says, and with
int8 inference off its FP32 kernels then read those int8 bytes as floats (NaN / huge outputs); ncnn2int8's files
behave the same. With ``use_int8_inference = False`` run the ``.fp32.param`` / ``.fp32.bin`` pair (no ``8=``),
which is correct under either setting.

Nothing here knows about torch.fx; :mod:`fxq.backends.ncnn.builder` builds an :class:`NcnnModel`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Union

import numpy as np

from fxq.errors import ExportError

__all__ = ["NcnnLayer", "NcnnModel", "Int8Scales", "format_param_value", "shape_params", "drop_dim", "MAGIC"]

MAGIC = 7767517
ParamValue = Union[int, float, str, list, tuple]
_NAME_RE = re.compile(r"^\S{1,255}$")


def format_param_value(value: ParamValue) -> str:
    """One ``.param`` value: ints as ints, floats with an exponent (infinities as the largest float), arrays as
    ``count,v0,v1...``."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            raise ExportError("ncnn param values cannot be NaN")
        if math.isinf(value):  # ncnn reads digits only: -inf (a max pool's padding) as the lowest float
            value = math.copysign(float(np.finfo(np.float32).max), value)
        text = f"{float(value):.8e}"
        return text if len(text) <= 15 else f"{float(value):e}"
    if isinstance(value, (list, tuple)):
        if not value:
            raise ExportError("ncnn param arrays cannot be empty")
        return ",".join([str(len(value))] + [format_param_value(v) for v in value])
    raise ExportError(f"cannot write ncnn param value {value!r} of type {type(value).__name__}")


def shape_params(shape: tuple[int, ...]) -> dict[int, int]:
    """ncnn Input / Reshape params for a batch-less shape: w=0, h=1, d=11, c=2 (innermost first)."""
    keys = {1: (0,), 2: (1, 0), 3: (2, 1, 0), 4: (2, 11, 1, 0)}[len(shape)]
    return {k: int(v) for k, v in zip(keys, shape)}


def drop_dim(shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    """``shape`` without ``dim`` (a value's blob shape given its batch dim; ``None`` keeps every dim)."""
    return shape if dim is None else shape[:dim] + shape[dim + 1:]


@dataclasses.dataclass
class Int8Scales:
    """ncnn int8 scales of one Convolution / ConvolutionDepthWise / InnerProduct layer (ncnn convention).

    Attributes:
        weight: ``1 / weight scale`` per output channel (per group for depthwise), float32.
        bottom: ``1 / input scale``, a single float.
    """

    weight: np.ndarray
    bottom: float


@dataclasses.dataclass
class NcnnLayer:
    """One ncnn layer.

    Attributes:
        type: ncnn layer type (``Convolution``, ``ReLU``...).
        name: unique layer name (the key of the ``.table`` lines).
        bottoms / tops: blob names.
        params: param id -> value.
        weights: ``(kind, array)`` buffers in the order ncnn's ``load_model`` reads them; ``kind`` is
            ``"tagged"`` (flag word + float32) or ``"raw"`` (float32 only).
        int8: scales when this layer runs int8 (ncnn appends them to the bin after the bias).
        int8_weights: the buffers written instead of ``weights`` in the int8 model (the weights already on
            fxq's integer grid, so that ncnn's load-time quantization reproduces fxq's integers exactly; a
            float layer's stored values as the simulation computes them, where the FP32 file stores the float
            model's).
        int8_term: value of param 8 (``int8_scale_term``) when ``int8`` is set.
        source: the fx node this layer came from (for error messages).
    """

    type: str
    name: str
    bottoms: list[str]
    tops: list[str]
    params: dict[int, ParamValue] = dataclasses.field(default_factory=dict)
    weights: list[tuple[str, np.ndarray]] = dataclasses.field(default_factory=list)
    int8: Int8Scales | None = None
    int8_weights: list[tuple[str, np.ndarray]] | None = None
    int8_term: int = 2
    source: str = ""

    def param_line(self, int8: bool) -> str:
        params = dict(self.params)
        if int8 and self.int8 is not None:
            params[8] = self.int8_term
        head = f"{self.type:<24} {self.name:<24} {len(self.bottoms)} {len(self.tops)}"
        blobs = " ".join(self.bottoms + self.tops)
        kv = " ".join(f"{self._key(k, v)}={format_param_value(v)}" for k, v in sorted(params.items()))
        return " ".join(p for p in (head, blobs, kv) if p)

    @staticmethod
    def _key(key: int, value: ParamValue) -> int:
        return -23300 - key if isinstance(value, (list, tuple)) else key

    def weight_bytes(self, int8: bool) -> bytes:
        out = bytearray()
        use_int8 = int8 and self.int8 is not None
        buffers = self.int8_weights if int8 and self.int8_weights is not None else self.weights
        for kind, arr in buffers:
            data = np.ascontiguousarray(arr, dtype="<f4").reshape(-1)
            if kind == "tagged":
                out += np.zeros(1, dtype="<u4").tobytes()
            out += data.tobytes()
        if use_int8:
            out += np.ascontiguousarray(self.int8.weight, dtype="<f4").reshape(-1).tobytes()
            out += np.asarray([self.int8.bottom], dtype="<f4").tobytes()
        return bytes(out)


@dataclasses.dataclass
class NcnnModel:
    """An ordered list of layers with named input and output blobs."""

    layers: list[NcnnLayer] = dataclasses.field(default_factory=list)
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)

    def blobs(self) -> list[str]:
        seen: dict[str, None] = {}
        for layer in self.layers:
            for b in layer.tops:
                seen[b] = None
        return list(seen)

    def validate(self) -> None:
        """Raise :class:`ExportError` unless names are unique and every bottom is produced before use."""
        names: set[str] = set()
        produced: set[str] = set()
        consumed: set[str] = set()
        for layer in self.layers:
            if not _NAME_RE.match(layer.name) or layer.name in names:
                raise ExportError(f"ncnn layer name {layer.name!r} (from node {layer.source!r}) is empty, has "
                                  "whitespace or is used twice")
            names.add(layer.name)
            for b in layer.bottoms:
                if b not in produced:
                    raise ExportError(f"ncnn layer {layer.name!r} reads blob {b!r} that no earlier layer writes")
                if b in consumed:
                    raise ExportError(f"ncnn blob {b!r} is read twice (layer {layer.name!r}): a Split is missing")
                consumed.add(b)
            for b in layer.tops:
                if not _NAME_RE.match(b) or b in produced:
                    raise ExportError(f"ncnn blob name {b!r} of layer {layer.name!r} is invalid or written twice")
                produced.add(b)

    def to_param(self, int8: bool) -> str:
        self.validate()
        lines = [str(MAGIC), f"{len(self.layers)} {len(self.blobs())}"]
        lines += [layer.param_line(int8) for layer in self.layers]
        return "\n".join(lines) + "\n"

    def to_bin(self, int8: bool) -> bytes:
        return b"".join(layer.weight_bytes(int8) for layer in self.layers)

    def to_table(self) -> str:
        """ncnn2table's layout: all weight lines, then all activation lines, in layer order."""
        weight_lines, act_lines = [], []
        for layer in self.layers:
            if layer.int8 is None:
                continue
            weight_lines.append(f"{layer.name}_param_0 " + "".join(f"{float(s):f} " for s in layer.int8.weight))
            act_lines.append(f"{layer.name} {float(layer.int8.bottom):f} ")
        return "".join(line + "\n" for line in weight_lines + act_lines)
