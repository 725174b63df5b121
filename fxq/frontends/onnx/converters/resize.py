"""``Resize-10/11/13/18/19`` and ``Upsample-9`` with ONNX's coordinate rules, replacing onnx2torch 1.5.15's converter.

onnx2torch maps every Resize onto ``F.interpolate`` and only warns where torch's rules differ from the node's, so
nearest resizes with ``half_pixel`` / ``align_corners`` / ``round_prefer_*`` (the default nearest mode),
linear/cubic with ``asymmetric`` (Resize-10's only mode), ``cubic_coeff_a`` other than -0.75 and
``exclude_outside=1`` came out wrong (max abs diff 0.14 to 4.2 against onnxruntime on N(0, 1) data), and
``tf_crop_and_resize``, ``axes`` and ``half_pixel_symmetric`` were refused.

The resizes torch computes the ONNX way (nearest asymmetric/floor, nearest half_pixel/round_prefer_ceil =
``nearest-exact``, linear/cubic half_pixel, pytorch_half_pixel, align_corners with cubic a=-0.75, on the spatial
dims) run as one ``F.interpolate``; every other one is resampled axis by axis from ONNX's formulas (:func:`_taps`):
each output position reads 1 (nearest), 2 (linear) or 4 (cubic) input positions with weights. torch.onnx writes
either back as one Resize with the node's attributes. ``keep_aspect_ratio_policy`` other than ``stretch`` is
refused.

``antialias=1`` (Resize-18+, linear and cubic) widens the filter when a dim is downscaled, as onnxruntime does
(Pillow's resampling): output ``i`` with source centre ``c = coordinate(i) + 0.5`` takes input ``j`` with weight
``filter((j + 0.5 - c) * min(scale, 1))`` (triangle for linear, Keys cubic with ``cubic_coeff_a``), the taps past
the input's edges dropped and the rest normalised to sum 1 (:func:`_antialias_weights`). Each resized dim is one
matrix product with an ``[out, in]`` weight matrix. Nearest with antialias is nearest (ONNX: no effect).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from onnx2torch.onnx_graph import OnnxGraph
from onnx2torch.onnx_node import OnnxNode
from onnx2torch.utils.common import OnnxMapping, OperationConverterResult, get_onnx_version
from onnx2torch.utils.custom_export_to_onnx import DefaultExportToOnnx, OnnxToTorchModuleWithCustomExport
from torch import nn

from fxq.frontends.onnx.converters.registry import register_onnx_converter

__all__ = ["OnnxResizeExact", "OnnxUpsample7"]

_TORCH_MODE = {("linear", 1): "linear", ("linear", 2): "bilinear", ("linear", 3): "trilinear", ("cubic", 2): "bicubic"}


def _interpolate_mode(mode: str, ctm: str, nearest_mode: str, cubic_a: float, exclude: bool) -> tuple[str, bool] | None:
    """(torch mode family, align_corners) when ``F.interpolate`` computes this Resize exactly, else None."""
    if mode == "nearest":
        if ctm == "asymmetric" and nearest_mode in ("floor", "simple"):  # simple: when no dim is downsampled
            return "nearest", False
        if ctm in ("half_pixel", "pytorch_half_pixel") and nearest_mode == "round_prefer_ceil":
            return "nearest-exact", False
        return None
    if mode == "cubic" and (cubic_a != -0.75 or exclude):
        return None
    if ctm in ("half_pixel", "pytorch_half_pixel"):
        return mode, False
    if ctm == "align_corners":
        return mode, True
    return None


def _source_coords(ctm: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> torch.Tensor:
    """Input coordinate of each output position (ONNX's ``coordinate_transformation_mode``), in float32 as
    onnxruntime computes it."""
    x = torch.arange(n_out, dtype=torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    if ctm == "half_pixel":
        return (x + 0.5) / s - 0.5
    if ctm == "half_pixel_symmetric":
        adj = n_out / (scale * n_in)
        offset = n_in / 2.0 * (1.0 - adj)
        return offset + (x + 0.5) / s - 0.5
    if ctm == "pytorch_half_pixel":
        return (x + 0.5) / s - 0.5 if n_out > 1 else torch.zeros(n_out)
    if ctm == "align_corners":
        return x * ((n_in - 1) / (n_out - 1)) if n_out > 1 else torch.zeros(n_out)
    if ctm == "asymmetric":
        return x / s
    if ctm == "tf_half_pixel_for_nn":
        return (x + 0.5) / s
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if n_out > 1:
            return start * (n_in - 1) + x * (end - start) * (n_in - 1) / (n_out - 1)  # onnxruntime's order
        return torch.full((n_out,), 0.5 * (start + end) * (n_in - 1))
    raise NotImplementedError(f"Resize: coordinate_transformation_mode={ctm!r}")


def _cubic_weights(t: torch.Tensor, a: float) -> torch.Tensor:
    """Keys cubic weights of the taps at offsets -1, 0, 1, 2 from floor(coordinate); ``t`` the fraction."""
    d = torch.stack([t + 1, t, 1 - t, 2 - t], dim=-1).abs()
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return torch.where(d <= 1, near, far)


def _taps(mode: str, coords: torch.Tensor, n_in: int, nearest_mode: str, cubic_a: float,
          exclude: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input indices, weights), each ``[n_out, taps]``: output ``i`` is ``sum_k w[i, k] * x[idx[i, k]]``."""
    if mode == "nearest":
        rounding = {"round_prefer_floor": lambda c: torch.ceil(c - 0.5), "round_prefer_ceil": lambda c: torch.floor(c + 0.5),
                    "floor": torch.floor, "ceil": torch.ceil}
        if nearest_mode not in rounding:
            raise NotImplementedError(f"Resize: nearest_mode={nearest_mode!r}")
        idx = rounding[nearest_mode](coords).long().clamp(0, n_in - 1)
        return idx[:, None], torch.ones(len(coords), 1)
    if mode == "linear":
        c = coords.clamp(0, n_in - 1)
        i0 = torch.floor(c)
        t = c - i0
        i0 = i0.long()
        return torch.stack([i0, (i0 + 1).clamp(max=n_in - 1)], 1), torch.stack([1 - t, t], 1)
    if mode == "cubic":
        i0 = torch.floor(coords)
        w = _cubic_weights(coords - i0, cubic_a)
        idx = i0.long()[:, None] + torch.arange(-1, 3)
        if exclude:
            w = torch.where((idx >= 0) & (idx < n_in), w, torch.zeros(()))
            w = w / w.sum(1, keepdim=True)
        return idx.clamp(0, n_in - 1), w
    raise NotImplementedError(f"Resize: mode={mode!r}")


def _antialias_weights(mode: str, coords: torch.Tensor, n_in: int, scale: float, cubic_a: float,
                       exclude: bool) -> torch.Tensor:
    """``[n_out, n_in]`` antialiased resampling weights of one dim (see the module docstring)."""
    ss = min(scale, 1.0)
    reach = int(math.ceil((1 if mode == "linear" else 2) / ss)) + 1
    taps = torch.arange(-reach, n_in + reach)
    d = ((taps.to(torch.float32)[None, :] + 0.5 - (coords[:, None] + 0.5)) * ss).abs()
    if mode == "linear":
        w = (1 - d).clamp(min=0)
    else:
        near = ((cubic_a + 2) * d - (cubic_a + 3)) * d * d + 1
        far = ((cubic_a * d - 5 * cubic_a) * d + 8 * cubic_a) * d - 4 * cubic_a
        w = torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros(())))
    inside = (taps >= 0) & (taps < n_in)
    if exclude:
        w = torch.where(inside[None, :], w, torch.zeros(()))
    total = w.sum(1, keepdim=True)
    w = w / torch.where(total == 0, torch.ones(()), total)
    return torch.zeros(len(coords), n_in).index_add_(1, taps.clamp(0, n_in - 1), w)  # outside taps read the edge


class OnnxResizeExact(nn.Module, OnnxToTorchModuleWithCustomExport):
    """ONNX ``Resize`` (``roi``, ``scales``, ``sizes`` read when called, as the node may compute them).

    A leaf for fx tracers that keep onnx2torch's modules whole: the output size is read from the tensors. Exported
    by torch.onnx as one ``Resize`` with the node's attributes (resampled in full when the export opset lacks an
    attribute it needs).
    """

    def __init__(self, mode: str, ctm: str, nearest_mode: str, cubic_a: float, exclude_outside: bool,
                 extrapolation_value: float, axes: list[int] | None, antialias: bool = False) -> None:
        super().__init__()
        self.antialias = antialias and mode != "nearest"
        self.mode, self.ctm, self.nearest_mode = mode, ctm, nearest_mode
        self.cubic_a, self.exclude_outside, self.extrapolation_value = cubic_a, exclude_outside, extrapolation_value
        self.axes = axes
        self.torch_mode = _interpolate_mode(mode, ctm, nearest_mode, cubic_a, exclude_outside)

    def _plan(self, shape: list[int], roi: torch.Tensor | None, scales: torch.Tensor | None,
              sizes: torch.Tensor | None, all_axes: bool = False
              ) -> tuple[list[int], list[float], list[tuple[float, float]], bool]:
        """Per-dimension output size, scale and roi (start, end), with ``axes`` spread over all dimensions, and
        whether the sizes came from ``scales``."""
        rank = len(shape)
        axes = [a % rank for a in self.axes] if self.axes is not None and not all_axes else list(range(rank))
        out, scale, rois = list(shape), [1.0] * rank, [(0.0, 1.0)] * rank
        if sizes is not None and sizes.numel():
            for a, n in zip(axes, sizes.tolist()):
                out[a], scale[a] = int(n), int(n) / shape[a]
            by_scales = False
        elif scales is not None and scales.numel():
            for a, s in zip(axes, scales.tolist()):
                out[a], scale[a] = int(math.floor(shape[a] * s)), float(s)
            by_scales = True
        else:
            raise NotImplementedError("Resize: neither scales nor sizes given")
        if roi is not None and roi.numel() and self.ctm == "tf_crop_and_resize":
            r = roi.tolist()
            for i, a in enumerate(axes):
                rois[a] = (float(r[i]), float(r[len(axes) + i]))
        return out, scale, rois, by_scales

    def forward(self, x: torch.Tensor, roi: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                sizes: torch.Tensor | None = None) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            try:
                opset = get_onnx_version()
            except AttributeError:  # torch's shim without the opset: fxq's exporters set it (qdq.lowering)
                opset = 0
            attrs = self._export_attrs(opset, self._plan(list(x.shape), roi, scales, sizes)[1])
            if attrs is not None:  # the values below cover every dim, so the attribute ``axes`` is left out
                inputs = self._export_inputs(x, roi, scales, sizes) + [None] * 2
                return DefaultExportToOnnx.export(lambda: self._resize(*inputs[:4], all_axes=True), "Resize",
                                                  *[t for t in inputs if t is not None], attrs)
        return self._resize(x, roi, scales, sizes)

    def _nearest(self, scale: float) -> str:
        """The nearest mode of a dimension resized by ``scale``: Resize-10 (``simple``) rounds up when it
        downsamples and down otherwise, as onnxruntime does."""
        if self.nearest_mode == "simple":
            return "ceil" if scale < 1 else "floor"
        return self.nearest_mode

    def _export_attrs(self, opset_version: int, scales: list[float]) -> dict[str, object] | None:
        """The Resize attributes for torch.onnx, or None when ``opset_version``'s Resize cannot say this one."""
        if self.ctm == "half_pixel_symmetric" and opset_version < 19:
            return None
        nearest = {self._nearest(v) for v in scales if v != 1.0} or {self._nearest(1.0)}
        if len(nearest) > 1 or opset_version < 11:
            return None
        if self.ctm == "tf_half_pixel_for_nn" and opset_version >= 18:
            return None
        if getattr(self, "antialias", False) and opset_version < 18:
            return None
        attrs: dict[str, object] = {
            "mode_s": self.mode, "coordinate_transformation_mode_s": self.ctm, "nearest_mode_s": nearest.pop(),
            "cubic_coeff_a_f": self.cubic_a, "exclude_outside_i": int(self.exclude_outside),
            "extrapolation_value_f": self.extrapolation_value,
        }
        if getattr(self, "antialias", False):
            attrs["antialias_i"] = 1
        return attrs

    def _export_inputs(self, x: torch.Tensor, roi: torch.Tensor | None, scales: torch.Tensor | None,
                       sizes: torch.Tensor | None) -> list[torch.Tensor]:
        """Resize's inputs for torch.onnx: absent ones as empty tensors; with ``axes``, values for every
        dimension (the attribute is left out, so any opset reads them)."""
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)
        if self.axes is not None:
            out, scale, rois, by_scales = self._plan(list(x.shape), roi, scales, sizes)
            roi = torch.tensor([r[0] for r in rois] + [r[1] for r in rois], dtype=torch.float32, device=x.device)
            if by_scales:
                return [x, roi, torch.tensor(scale, dtype=torch.float32, device=x.device)]
            return [x, roi, empty, torch.tensor(out, dtype=torch.int64, device=x.device)]
        roi = roi if roi is not None else empty
        if sizes is not None and sizes.numel():
            return [x, roi, empty, sizes]
        return [x, roi, scales if scales is not None else empty]

    def _resize(self, x: torch.Tensor, roi: torch.Tensor | None, scales: torch.Tensor | None,
                sizes: torch.Tensor | None, all_axes: bool = False) -> torch.Tensor:
        shape = list(x.shape)
        out, scale, rois, by_scales = self._plan(shape, roi, scales, sizes, all_axes)
        changed = [d for d in range(len(shape)) if out[d] != shape[d] or (scale[d] != 1.0 and self.ctm != "align_corners")
                   or self.ctm == "tf_crop_and_resize"]
        if not changed:
            return x
        antialias = getattr(self, "antialias", False)  # absent from modules saved before it existed
        if not antialias and self._interpolates(shape, out, scale, changed):
            torch_mode, align = self.torch_mode  # type: ignore[misc]
            if torch_mode in ("linear", "cubic"):
                torch_mode = _TORCH_MODE[torch_mode, len(shape) - 2]
            size, factor = (None, scale[2:]) if by_scales else (out[2:], None)  # torch maps coordinates by 1/factor
            return F.interpolate(x, size=size, scale_factor=factor, mode=torch_mode,
                                 align_corners=align if torch_mode not in ("nearest", "nearest-exact") else None)
        for d in changed:
            coords = _source_coords(self.ctm, shape[d], out[d], scale[d], rois[d])
            if antialias:
                w_aa = _antialias_weights(self.mode, coords, shape[d], scale[d], self.cubic_a,
                                          self.exclude_outside)
                x = torch.matmul(x.movedim(d, -1), w_aa.t().to(x.device, x.dtype)).movedim(-1, d)
                continue
            idx, w = _taps(self.mode, coords, shape[d], self._nearest(scale[d]), self.cubic_a, self.exclude_outside)
            view = [1] * x.dim()
            view[d] = out[d]
            y = None
            for k in range(idx.shape[1]):
                part = x.index_select(d, idx[:, k].to(x.device))
                if self.mode != "nearest":
                    part = part * w[:, k].to(x.device, x.dtype).reshape(view)
                y = part if y is None else y + part
            if self.ctm == "tf_crop_and_resize":
                outside = ((coords < 0) | (coords > shape[d] - 1)).to(x.device).reshape(view)
                y = torch.where(outside, torch.full((), self.extrapolation_value, dtype=x.dtype, device=x.device), y)
            x = y
        return x

    def _interpolates(self, shape: list[int], out: list[int], scale: list[float], changed: list[int]) -> bool:
        """Whether ``F.interpolate`` gives ONNX's result here: a torch-exact mode, spatial dims only, sizes that
        torch's own scale (in / out) reproduces, and no length-1 output under pytorch_half_pixel."""
        if self.torch_mode is None or min(changed) < 2:
            return False
        if self.nearest_mode == "simple" and self._nearest(min(scale[2:])) != "floor":
            return False
        torch_mode = self.torch_mode[0]
        if torch_mode in ("linear", "cubic") and (torch_mode, len(shape) - 2) not in _TORCH_MODE:
            return False
        if self.ctm == "pytorch_half_pixel" and min(out[2:]) == 1:
            return False
        return True

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, coordinate_transformation_mode={self.ctm!r}, nearest_mode={self.nearest_mode!r}"
                f", cubic_coeff_a={self.cubic_a}, exclude_outside={self.exclude_outside}, axes={self.axes}")


@register_onnx_converter("Resize", 10, override=True)
@register_onnx_converter("Upsample", 9)
def _convert_resize_10(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    """Resize-10 / Upsample-9 (inputs X, scales): asymmetric coordinates, onnxruntime's nearest rounding."""
    module = OnnxResizeExact(mode=node.attributes.get("mode", "nearest"), ctm="asymmetric", nearest_mode="simple",
                             cubic_a=-0.75, exclude_outside=False, extrapolation_value=0.0, axes=None)
    x, scales = node.input_values[:2]
    return OperationConverterResult(torch_module=module,
                                    onnx_mapping=OnnxMapping(inputs=(x, "", scales), outputs=node.output_values))


@register_onnx_converter("Resize", (11, 13, 18, 19), override=True)
def _convert_resize(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    a = node.attributes
    if a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise NotImplementedError(f"Resize: keep_aspect_ratio_policy={a['keep_aspect_ratio_policy']!r}")
    axes = a.get("axes")
    if a.get("antialias", 0) and a.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise NotImplementedError("Resize: antialias=1 with coordinate_transformation_mode='tf_crop_and_resize'")
    module = OnnxResizeExact(
        mode=a.get("mode", "nearest"), ctm=a.get("coordinate_transformation_mode", "half_pixel"),
        nearest_mode=a.get("nearest_mode", "round_prefer_floor"), cubic_a=float(a.get("cubic_coeff_a", -0.75)),
        exclude_outside=bool(a.get("exclude_outside", 0)),
        extrapolation_value=float(a.get("extrapolation_value", 0.0)),
        axes=[int(v) for v in axes] if axes is not None else None, antialias=bool(a.get("antialias", 0)),
    )
    return OperationConverterResult(torch_module=module,
                                    onnx_mapping=OnnxMapping(inputs=node.input_values, outputs=node.output_values))


class OnnxUpsample7(OnnxResizeExact):
    """ONNX ``Upsample-7``: Upsample-9's resize (asymmetric coordinates) with the scales in an attribute, kept here."""

    def __init__(self, mode: str, scales: list[float]) -> None:
        super().__init__(mode=mode, ctm="asymmetric", nearest_mode="simple", cubic_a=-0.75, exclude_outside=False,
                         extrapolation_value=0.0, axes=None)
        self.scales = list(scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, None, torch.tensor(self.scales, dtype=torch.float32, device=x.device))


@register_onnx_converter("Upsample", 7)
def _convert_upsample_7(node: OnnxNode, graph: OnnxGraph) -> OperationConverterResult:
    module = OnnxUpsample7(node.attributes.get("mode", "nearest"), [float(v) for v in node.attributes["scales"]])
    return OperationConverterResult(torch_module=module, onnx_mapping=OnnxMapping(
        inputs=(node.input_values[0],), outputs=node.output_values))
