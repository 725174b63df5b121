"""The ``"ncnn"`` exporter: an int8 ncnn model, ncnn2table's calibration table, and the FP32 model.

Files written for ``path = "out/net"`` (a trailing ``.param`` is dropped):

* ``net.param`` / ``net.bin`` — the int8 model ncnn runs with ``opt.use_int8_inference = True``: the FP32
  layers plus, on each int8 Convolution / InnerProduct (``8=2``) and ConvolutionDepthWise (``8=1``), the weight
  scales and the input scale appended to the bin after the bias. ncnn quantizes the stored float weights
  itself at load time; they are stored already on fxq's grid (``q * scale``), so ncnn reproduces fxq's
  integer weights exactly (including 6-bit and clipped ones).
* ``net.table`` — ncnn2table's table (weight lines, then input-scale lines; ``s = 1 / fxq_scale``).
* ``net.fp32.param`` / ``net.fp32.bin`` — the FP32 model with the original weights (``fp32=True``, default);
  with ``net.table`` it is what ncnn's own ``ncnn2int8`` tool takes.

Blobs: inputs ``in0, in1...``, outputs ``out0, out1...``; layers carry the original layer names. CNNs and
transformers export (LayerNorm, attention as InnerProduct / Crop / Reshape / Permute / MatMul / Softmax). ncnn
runs one sample: shapes are taken at batch 1 whatever batch the model was calibrated with, so a graph that moves
the batch or folds it into the heads (``nn.MultiheadAttention``) exports too (see :mod:`fxq.backends.ncnn.builder`).
FP32 islands (submodules capture kept whole) are float layers of the same files
(:mod:`fxq.backends.ncnn.islands`).

Example:
    >>> qmodel = fxq.quantize(model, calib, "ncnn_int8")
    >>> fxq.backends.export(qmodel, "ncnn", "out/net")  # or fxq.export(qmodel, "ncnn_int8", "out/net")
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import fx, nn

from fxq.backends.base import Exporter, FileContents, register_exporter
from fxq.backends.capability import check_capabilities
from fxq.backends.ncnn.builder import build_ncnn_model
from fxq.backends.ncnn.writer import NcnnModel
from fxq.errors import ExportError, GraphError
from fxq.graph.info import graph_quant
from fxq.io import check_output_dir

__all__ = ["NcnnExporter", "ncnn_paths"]

logger = logging.getLogger(__name__)


def ncnn_paths(path: str | os.PathLike) -> dict[str, Path]:
    """The files the exporter writes for ``path``: keys param, bin, table, fp32_param, fp32_bin."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix == ".param" else p
    base = str(stem)
    return {"param": Path(base + ".param"), "bin": Path(base + ".bin"), "table": Path(base + ".table"),
            "fp32_param": Path(base + ".fp32.param"), "fp32_bin": Path(base + ".fp32.bin")}


@register_exporter("ncnn")
class NcnnExporter(Exporter):
    """ncnn int8 param/bin + table (+ the FP32 param/bin); see the module docstring for the files."""

    options = ("fp32", "example_inputs")

    def render_files(self, model: nn.Module, path: str | os.PathLike, **options: Any) -> FileContents:
        """Check everything, then render all files in memory (written as one atomic set by :meth:`export`).

        Args:
            model: the GraphModule from :func:`fxq.quantize` (calibrated).
            path: output stem, e.g. ``"out/net"`` (a missing directory is created).
            fp32: also write ``<stem>.fp32.param`` / ``.fp32.bin`` (default True).
            example_inputs: a batch the FP32 islands are traced on (its first sample; default: seeded inputs shaped
                like calibration's): a branch on values inside an island takes the path this example takes.

        Raises:
            ExportError: unknown option, not an fxq model, uncalibrated quantizers, an op or a quantizer ncnn
                cannot express (naming the node), an output directory that cannot be created or is not writable, or a
                failed write (disk full, file size limit).
        """
        write_fp32 = bool(options.get("fp32", True))
        self._check_model(model)
        check_capabilities(model, self.name)
        if Path(path).is_dir():
            raise ExportError(f"ncnn export path {str(path)!r} is a directory; give a file stem such as "
                              f"{str(Path(path) / 'net')!r}")
        files = ncnn_paths(path)
        check_output_dir(files["param"].parent)
        ncnn_model, _ = build_ncnn_model(model, options.get("example_inputs"))
        rendered = self._render(ncnn_model, write_fp32)
        n_int8 = sum(layer.int8 is not None for layer in ncnn_model.layers)
        logger.info("ncnn export: %d layers (%d int8), inputs %s, outputs %s -> %s", len(ncnn_model.layers), n_int8,
                    ncnn_model.inputs, ncnn_model.outputs, files["param"])
        return {files[key]: data for key, data in rendered.items()}

    @staticmethod
    def _check_model(model: nn.Module) -> None:
        if not isinstance(model, fx.GraphModule):
            raise ExportError(f"ncnn export needs the GraphModule returned by fxq.quantize, got {type(model).__name__}")
        try:
            graph_quant(model)
        except GraphError as exc:
            raise ExportError(f"ncnn export: {exc}") from None

    @staticmethod
    def _render(model: NcnnModel, write_fp32: bool) -> dict[str, str | bytes]:
        out: dict[str, str | bytes] = {
            "param": model.to_param(int8=True),
            "bin": model.to_bin(int8=True),
            "table": model.to_table(),
        }
        if write_fp32:
            out["fp32_param"] = model.to_param(int8=False)
            out["fp32_bin"] = model.to_bin(int8=False)
        return out
