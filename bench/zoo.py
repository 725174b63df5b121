"""Model-zoo conformance: every torchvision model through fxq's capture paths, platforms, exporters and runtimes.

    python bench/zoo.py                                   # all 109 models, every path (hours on 2 cores)
    python bench/zoo.py --families timm --paths native,legacy17   # one model per timm architecture (93)
    python bench/zoo.py --families ultralytics           # ultralytics' YOLO / RT-DETR architectures (20)
    python bench/zoo.py --families transformers          # HF transformers vision / audio models, small configs (21)
    python bench/zoo.py --families text                  # HF transformers text encoders / decoders, token ids (11)
    python bench/zoo.py --models resnet18,googlenet --paths native,legacy13 --platforms trt_int8
    python bench/zoo.py --subset                          # the dozen models the tests run (tests/test_zoo_subset.py)
    python bench/zoo.py --paths native --capture fx,export,auto --platforms trt_int8   # capture paths side by side

Each model is built with seeded random init at the smallest input it accepts and, for each capture path, run in its
own subprocess with a timeout:

* paths: ``native`` (the ``nn.Module`` itself, captured by :func:`fxq.graph.capture.capture` with ``--capture``:
  ``auto`` by default; with several, ``native`` becomes ``native-fx``, ``native-export``, ``native-auto``; the
  ``captured_by`` column says which path ``auto`` took: ``fx``, ``export`` or ``fx+islands``), ``legacy13`` / ``legacy17`` (``torch.onnx.export(dynamo=False)`` at
  that opset, then :func:`fxq.load_onnx`; where the load error names a cut before post-processing fxq cannot
  convert, such as a detector's NMS, the file is loaded at that cut: ``captured_by`` ``onnx-cut(N outputs)``), ``dynamo`` (``torch.onnx.export(dynamo=True)``, then ``load_onnx``);
* per platform (``trt_int8``, ``ort_int8``, ``ncnn_int8``): ``quantize`` (:func:`fxq.quantize`, two calibration
  batches), ``export`` (:func:`fxq.export`), ``runtime`` — the exported file in onnxruntime (default session and
  ``ORT_DISABLE_ALL``) or ncnn against fxq's simulation on a fresh input, passing at cosine >= 0.999. A file
  below the bar is diagnosed (``tf_*`` and ``cosine_sim_perturbed`` columns): ``Sensitive`` when its codes,
  teacher-forced (ONNX in ``ORT_DISABLE_ALL``, ncnn in ncnn), are within 1 LSB of the simulation's and the
  simulation itself moves
  below the bar on a 1e-4 input perturbation (a rounding tie amplified by the model, not an export fault), else
  ``Mismatch``; a simulation whose every output is at most 1e-6 is ``Degenerate`` (cosine of rounding noise); a
  Q/DQ file that passes in ``ORT_DISABLE_ALL`` but not in the default session is ``Saturated`` where this machine's
  CPU (x86 without VNNI) makes onnxruntime's int8 kernels saturate pairs of products and the file's weights reach
  that (``fxq.backends.qdq.ort_bias.u8s8_saturation_issues``; ``ort_int8_reduce_range`` avoids it), else ``Fused``
  (onnxruntime's fused int8 kernels, issue #13 point 9). None of these passes. Where torch's exporter cannot write the model on a file
  path (VOLO's ``col2im`` before opset 18), the path's row is step ``source``, ``NoSourceFile``: no file reached fxq.

Every step records ``ok``, ``skipped`` (an earlier step failed) or the error's class and first line; the CSV has one
row per model x path x platform x step, and the markdown table counts passes per family and step.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

PATHS = ("native", "legacy13", "legacy17", "dynamo")
CAPTURES = ("auto", "fx", "export")
PLATFORMS = ("trt_int8", "ort_int8", "ncnn_int8")
STEPS = ("capture", "quantize", "export", "runtime")
COSINE_BAR = 0.999
DEGENERATE_OUTPUT = 1e-6
"""A simulation whose outputs are all this small (a random-init model whose activations vanished) makes cosine
compare rounding noise: such rows are ``Degenerate``, not ``Mismatch`` (neither passes)."""
SUBSET = ("alexnet", "resnet18", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x0_5", "squeezenet1_1",
          "googlenet", "mnasnet0_5", "regnet_x_400mf", "densenet121", "efficientnet_b0", "vgg11")
"""Small models of distinct families (residual, depthwise, channel shuffle, fire/concat, inception, SE,
grouped, dense concat, plain): the tests run these at 32x32 (tests/test_zoo_subset.py)."""
TIMM_MODELS = (
    "beit_base_patch16_224", "halonet_h1", "mobileone_s1", "cait_xxs24_224", "coat_tiny", "convit_tiny",
    "convmixer_768_32", "convnext_zepto_rms", "cpubone_nano", "crossvit_tiny_240", "csatv2", "cs3darknet_focus_s",
    "cspnext_tiny", "davit_tiny", "deit_tiny_patch16_224", "densenet121", "dla46x_c", "dpn48b", "edgenext_xx_small",
    "efficientformer_l1", "efficientformerv2_s0", "mobilenetv2_035", "efficientvim_m1", "efficientvit_b0",
    "efficientvit_m0", "vit_tiny_patch16_dinov3_qkvb", "fasternet_t0", "fastvit_t8", "focalnet_tiny_srf",
    "gcvit_xxtiny", "ghostnet_050", "hardcorenas_b", "hgnetv2_b0", "hiera_tiny_224", "hrnet_w18_small", "iformer_t",
    "inception_next_atto", "inception_resnet_v2", "inception_v3", "inception_v4", "lcnetv2_small", "levit_128s",
    "lowformer_b0", "mambaout_femto", "maxvit_pico_rw_256", "poolformerv2_s12", "gmlp_ti16_224",
    "mobilenetv3_small_050", "mobilenetv5_base", "mobilevit_xxs", "mvitv2_tiny", "nasnetalarge", "nest_tiny",
    "nextvit_small", "nf_regnet_b0", "pit_ti_224", "pnasnet5large", "pvt_v2_b0", "rdnet_tiny", "regnetx_002",
    "repghostnet_050", "repvit_m1", "res2next50", "resnest14d", "resnet10t", "resnetv2_18", "rexnet_100",
    "selecsls42", "legacy_seresnet18", "sequencer2d_s", "shvit_s1", "skresnet18", "starnet_s050", "swiftformer_xs",
    "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224", "tiny_vit_5m_224",
    "tnt_s_legacy_patch16_224", "tresnet_m", "twins_svt_small", "vgg11", "visformer_tiny", "vit_tiny_patch16_224",
    "vit_tiny_r_s16_p8_224", "vit_srelpos_small_patch16_224", "samvit_base_patch16_224", "vitamin_small_224",
    "volo_d1_224", "ese_vovnet19b_slim_dw", "legacy_xception", "xception41p", "xcit_nano_12_p8_224")
"""timm 1.0's architectures, one model each: the fewest parameters of each model module's non-test models (93 of 98
modules; left out: four vision towers of 87-412 M parameters at 546-896 pixels, and NaFlexViT's variable-patch
input). Built with random init at the model's own input size; in the zoo as ``timm-<name>``, family ``timm``
(``--families timm``). Files nobody here wrote: ``timm`` is ``pip install timm``, nothing downloads."""
TIMM_PREFIX = "timm-"

ULTRALYTICS_MODELS = (
    "yolov3-tiny", "yolov5n", "yolov6n", "yolov8n", "yolov8n-seg", "yolov8n-pose", "yolov8n-obb", "yolov8n-cls",
    "yolov8n-ghost", "yolov9t", "yolov10n", "yolo11n", "yolo11n-seg", "yolo11n-pose", "yolo11n-obb", "yolo12n",
    "yolo26n", "yolo26n-seg", "yolo26n-pose", "rtdetr-l")
"""Ultralytics' detectors, segmenters, pose / rotated-box heads and classifiers, the smallest scale of each
architecture its package defines (``pip install ultralytics``; built from the package's own yaml, nothing downloads),
in their export form (the head's ``export`` flag, as ``YOLO.export`` sets it: one decoded output, no raw
features), at 320x320 (224 for classifiers) on images in [0, 1]. In the zoo as ``yolo-<name>``, family
``ultralytics`` (``--families ultralytics``): the YOLO heads' concat of box coordinates and class scores is
issue #13's mixed-range class on files nobody here wrote."""
ULTRALYTICS_PREFIX = "yolo-"

_HF_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
HF_MODELS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "vit": ("ViTConfig", "ViTForImageClassification", 32, {"image_size": 32, "patch_size": 8, **_HF_SMALL}),
    "deit": ("DeiTConfig", "DeiTForImageClassification", 32, {"image_size": 32, "patch_size": 8, **_HF_SMALL}),
    "beit": ("BeitConfig", "BeitForImageClassification", 32, {"image_size": 32, "patch_size": 8, **_HF_SMALL}),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", 28, {"image_size": 28, "patch_size": 7, **_HF_SMALL}),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", 32, {"image_size": 32, "patch_size": 8, **_HF_SMALL}),
    "yolos": ("YolosConfig", "YolosForObjectDetection", 64,
              {"image_size": [64, 64], "patch_size": 16, "num_detection_tokens": 10, **_HF_SMALL}),
    "dpt": ("DPTConfig", "DPTForDepthEstimation", 64,
            {"image_size": 64, "patch_size": 16, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "intermediate_size": 128, "backbone_out_indices": [0, 1, 2, 3], "neck_hidden_sizes": [16, 32, 64, 64],
             "fusion_hidden_size": 32}),
    "swin": ("SwinConfig", "SwinForImageClassification", 64,
             {"image_size": 64, "patch_size": 4, "embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4],
              "window_size": 4}),
    "swinv2": ("Swinv2Config", "Swinv2ForImageClassification", 64,
               {"image_size": 64, "patch_size": 4, "embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4],
                "window_size": 4}),
    "focalnet": ("FocalNetConfig", "FocalNetForImageClassification", 64,
                 {"image_size": 64, "embed_dim": 16, "depths": [1, 1], "hidden_sizes": [16, 32]}),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", 64,
                 {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", 64,
                   {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", 64,
               {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16}),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", 64,
               {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16, "groups_width": 8}),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", 64,
                     {"image_size": 64, "width_coefficient": 0.25, "depth_coefficient": 0.25, "hidden_dim": 320}),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", 64,
                     {"image_size": 64, "depth_multiplier": 0.35}),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", 64, {"image_size": 64}),
    "levit": ("LevitConfig", "LevitForImageClassification", 64, {"image_size": 64}),
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", 64,
                   {"hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]}),
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation", 64,
                  {"hidden_sizes": [16, 32, 64, 128], "decoder_hidden_size": 64}),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC", 4000,
                 {"conv_dim": (32, 32, 32), "conv_stride": (5, 2, 2), "conv_kernel": (10, 3, 3),
                  "num_feat_extract_layers": 3, "vocab_size": 32, **_HF_SMALL}),
}
"""Hugging Face transformers' vision and audio architectures, small configs, random init (``pip install
transformers``; built from the config class, nothing downloads): ``(config class, model class, input size,
config)``; the input is an image ``(1, 3, size, size)`` or, for wav2vec2, a waveform ``(1, size)``. In the zoo as
``hf-<name>``, family ``transformers``; the model returns the tensors of its output record."""
HF_PREFIX = "hf-"
TEXT_VOCAB = 128
"""Vocabulary of the text models' configs: their token ids are drawn from ``[0, TEXT_VOCAB)``."""
_HF_TEXT_SMALL = {**_HF_SMALL, "vocab_size": TEXT_VOCAB, "max_position_embeddings": 64, "use_cache": False}
HF_TEXT_MODELS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertForSequenceClassification", 16, _HF_TEXT_SMALL),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification", 16,
                   {"vocab_size": TEXT_VOCAB, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128,
                    "max_position_embeddings": 64}),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", 16, _HF_TEXT_SMALL),
    "albert": ("AlbertConfig", "AlbertForSequenceClassification", 16, {**_HF_TEXT_SMALL, "embedding_size": 32}),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", 16, {**_HF_TEXT_SMALL, "embedding_size": 32}),
    "mobilebert": ("MobileBertConfig", "MobileBertForSequenceClassification", 16,
                   {**_HF_TEXT_SMALL, "embedding_size": 32, "intra_bottleneck_size": 32, "true_hidden_size": 32,
                    "num_feedforward_networks": 2}),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", 16, _HF_TEXT_SMALL),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", 16,
             {"vocab_size": TEXT_VOCAB, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
              "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}),
    "opt": ("OPTConfig", "OPTForCausalLM", 16,
            {**_HF_TEXT_SMALL, "ffn_dim": 128, "word_embed_proj_dim": 64, "pad_token_id": 1}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", 16, {**_HF_TEXT_SMALL, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 16, {**_HF_TEXT_SMALL, "num_key_value_heads": 2}),
}
"""Hugging Face transformers' text architectures (encoders, decoders), small configs, random init, no cache: ``(config
class, model class, sequence length, config)``; the input is ``(1, length)`` token ids. In the zoo as ``hf-<name>``,
family ``text``; the model returns the tensors of its output record."""


# --------------------------------------------------------------------------------------------- the models
def families() -> dict[str, str]:
    """Model name -> family, for the 109 float torchvision models (the pre-quantized ``quantized_*`` excluded)."""
    import torchvision.models as M

    out = {}
    for fam, mod in (("detection", M.detection), ("segmentation", M.segmentation), ("video", M.video),
                     ("optical_flow", M.optical_flow)):
        for name in M.list_models(mod):
            out[name] = fam
    for name in M.list_models():
        if not name.startswith("quantized_"):
            out.setdefault(name, "classification")
    for name in TIMM_MODELS:
        out[TIMM_PREFIX + name] = "timm"
    for name in ULTRALYTICS_MODELS:
        out[ULTRALYTICS_PREFIX + name] = "ultralytics"
    for name in HF_MODELS:
        out[HF_PREFIX + name] = "transformers"
    for name in HF_TEXT_MODELS:
        out[HF_PREFIX + name] = "text"
    return out


_SIZES = (32, 64, 96, 128, 160, 224, 256, 299)


def _exportable(model: Any, args: tuple) -> bool:
    """Whether ONNX can express the model at this input size: adaptive pooling to a size that does not divide the
    input (VGG's and AlexNet's 7x7 / 6x6 at small inputs) is not expressible; other models are not probed."""
    import io

    import torch

    pools = [m for m in model.modules() if isinstance(m, (torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveMaxPool2d))]
    if all(m.output_size in (1, (1, 1)) for m in pools):
        return True
    try:
        torch.onnx.export(model, args, io.BytesIO(), opset_version=13, dynamo=False)
    except Exception:
        return False
    return True


def example_input(name: str, family: str, model: Any = None) -> Any:
    """The smallest input the model accepts (random, seeded by the caller): image models try square sizes from 32
    up until the FP32 model runs and ONNX can express it."""
    import torch

    if family == "video":  # (frames, size) from small up until the model runs (MViT needs 16 x 224, S3D more than 64)
        last_video: Exception | None = None
        for frames, size in ((8, 64), (16, 112), (16, 224)):
            clip = (torch.randn(1, 3, frames, size, size),)
            if model is None:
                return clip
            try:
                with torch.no_grad():
                    model(*clip)
                return clip
            except Exception as exc:  # too small for this model: try the next size
                last_video = exc
        raise RuntimeError(f"{name} runs at none of the clip sizes tried: {last_video}")
    if family == "optical_flow":
        return (torch.randn(1, 3, 128, 128), torch.randn(1, 3, 128, 128))
    if family == "timm":  # the size the model was defined at (position embeddings and windows fix it)
        return (torch.randn(1, *model.pretrained_cfg["input_size"]),)
    if family == "detection":
        return ([torch.rand(3, 320, 320)],)
    if family == "ultralytics":
        size = 224 if name.endswith("-cls") else 320
        return (torch.rand(1, 3, size, size),)
    if family == "text":
        return (torch.randint(0, TEXT_VOCAB, (1, HF_TEXT_MODELS[name[len(HF_PREFIX):]][2])),)
    if family == "transformers":
        size = HF_MODELS[name[len(HF_PREFIX):]][2]
        return (torch.randn(1, size),) if name == HF_PREFIX + "wav2vec2" else (torch.randn(1, 3, size, size),)
    last: Exception | None = None
    for size in _SIZES:
        args = (torch.randn(1, 3, size, size),)
        if model is None:
            return args
        try:
            with torch.no_grad():
                model(*args)
        except Exception as exc:  # too small for this model: try the next size
            last = exc
            continue
        if _exportable(model, args):
            return args
        last = RuntimeError(f"ONNX cannot express the model at {size}x{size}")
    raise RuntimeError(f"{name} runs at none of the sizes {_SIZES}: {last}")


def build(name: str) -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    if name.startswith(TIMM_PREFIX):
        import timm

        return timm.create_model(name[len(TIMM_PREFIX):], pretrained=False).eval()
    if name.startswith(HF_PREFIX):
        import transformers

        key = name[len(HF_PREFIX):]
        config_class, model_class, _, config = HF_MODELS[key] if key in HF_MODELS else HF_TEXT_MODELS[key]
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).eval()
        return _output_tensors(model)
    if name.startswith(ULTRALYTICS_PREFIX):
        import ultralytics

        cfg = name[len(ULTRALYTICS_PREFIX):] + ".yaml"
        model = (ultralytics.RTDETR(cfg) if cfg.startswith("rtdetr") else ultralytics.YOLO(cfg)).model.eval()
        head = model.model[-1]
        if hasattr(head, "export"):  # as YOLO.export(format="onnx") runs it
            head.export, head.format = True, "onnx"
        return model
    kwargs = {"weights": None}
    builder = torchvision.models.get_model_builder(name)
    if "weights_backbone" in inspect.signature(builder).parameters:  # no pretrained backbone: nothing downloads
        kwargs["weights_backbone"] = None
    if name.startswith(("googlenet", "inception_v3")):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True
    return torchvision.models.get_model(name, **kwargs).eval()


def advised_batch_dims(message: str) -> dict[str, Any] | None:
    """The ``batch_dims={...}`` an export error advises with concrete dims (an output's), else None (advice with a
    placeholder such as ``<its batch dim>`` needs the user's knowledge)."""
    import ast
    import re

    found = re.search(r"batch_dims=(\{[^}]*\})", message)
    if found is None:
        return None
    try:
        value = ast.literal_eval(found.group(1))
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None



def _output_tensors(model: Any) -> Any:
    """``model`` (a transformers model) returning the tensors of its output record (``logits``, ``pred_boxes``...)."""
    import torch

    class OutputTensors(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> tuple:
            return tuple(self.model(x, return_dict=True).values())  # symbolic tracing's values are Proxies

    return OutputTensors().eval()


# --------------------------------------------------------------------------------------------- one worker
def _flat(out: Any) -> "Any":
    import torch

    if isinstance(out, torch.Tensor):
        return out.detach().float().reshape(-1)
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        parts = [_flat(o) for o in out]
        parts = [p for p in parts if p is not None and p.numel()]
        return torch.cat(parts) if parts else None
    return None


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two outputs over their finite values; NaN where the shapes or the non-finite values
    (NaN / inf of the model itself, in both at the same places) differ."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        return float("nan")
    finite = np.isfinite(a)  # a model's own NaN / inf (sqrt of a negative input) must be where the other has it
    if not np.array_equal(finite, np.isfinite(b)) or not np.array_equal(a[~finite], b[~finite], equal_nan=True):
        return float("nan")
    a, b = a[finite], b[finite]
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / (na * nb)) if na and nb else 0.0


def _error(exc: BaseException) -> str:
    import fxq

    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = type(exc).__name__ + ("" if isinstance(exc, fxq.FxqError) else " (raw)")
    return f"{kind}: {msg[:300]}"


def _native_capture(path: str) -> str | None:
    """The ``capture=`` mode of a native path (``native`` is ``auto``), None for file paths."""
    if path == "native":
        return "auto"
    return path[len("native-"):] if path.startswith("native-") else None


def captured_by(gm: Any) -> str:
    if not hasattr(gm, "graph"):
        return "parts"
    if "zoo_cut" in gm.meta:
        return f"onnx-cut({len(gm.meta['zoo_cut'])} outputs)"
    islands = gm.meta.get("fxq_fp32_islands") or {}
    return gm.meta.get("fxq_capture", "fx") + (f"+islands({len(islands)})" if islands else "")


class NoSourceFile(Exception):
    """torch's exporter cannot write the model on this path: there is no file for fxq to load (step ``source``)."""


def _capture(name: str, path: str, model: Any, args: tuple, tmp: Path) -> Any:
    import torch

    import fxq
    from fxq.graph.capture import capture

    mode = _native_capture(path)
    if mode is not None:
        try:
            return capture(model, args, capture=mode)
        except fxq.TraceError:
            if mode != "auto":
                raise
            return model  # fxq.quantize then quantizes its capturable parts (fxq.parts)
    onnx_path = tmp / f"{name}_{path}.onnx"
    try:
        if path.startswith("legacy"):
            torch.onnx.export(model, args, onnx_path, opset_version=int(path[len("legacy"):]), dynamo=False)
        else:
            torch.onnx.export(model, args, onnx_path, dynamo=True)
    except Exception as exc:  # torch's exporter, before fxq sees anything
        raise NoSourceFile(f"torch.onnx ({path}) cannot write this model: {_error(exc)}") from exc
    try:
        return fxq.load_onnx(onnx_path)
    except fxq.FrontendError as exc:
        if not exc.suggested_outputs:
            raise
        # what a user does next: the cut the error names (the post-processing stays out, run in FP32 beside it)
        gm = fxq.load_onnx(onnx_path, outputs=exc.suggested_outputs)
        gm.meta["zoo_cut"] = list(exc.suggested_outputs)
        return gm


def ort_outputs(file: Path, args: tuple, optimize: bool) -> list[Any]:
    """The exported ONNX ``file``'s outputs on ``args`` in onnxruntime: its default session (``optimize``) or
    ``ORT_DISABLE_ALL`` (the graph as written)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(file), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})


def _run_ort(file: Path, args: tuple, optimize: bool) -> Any:
    import numpy as np

    return np.concatenate([np.asarray(o, dtype=np.float64).reshape(-1) for o in ort_outputs(file, args, optimize)])


def ncnn_net(files: list[Path]) -> Any:
    """The exported int8 ``.param/.bin`` loaded in ncnn (CPU, one thread, fp16/bf16 off)."""
    import ncnn

    param = next(f for f in files if f.name.endswith(".param") and not f.name.endswith(".fp32.param"))
    binf = next(f for f in files if f.name.endswith(".bin") and not f.name.endswith(".fp32.bin"))
    net = ncnn.Net()
    o = net.opt
    o.use_vulkan_compute = False
    o.num_threads = 1
    o.use_fp16_storage = o.use_fp16_packed = o.use_fp16_arithmetic = o.use_bf16_storage = False
    if net.load_param(str(param)) != 0 or net.load_model(str(binf)) != 0:
        raise RuntimeError("ncnn could not load the exported files")
    return net


def ncnn_outputs(net: Any, args: tuple, n_outputs: int, param: Path | None = None, model: Any = None
                 ) -> list[Any]:
    """The outputs ``out0..`` of one sample (batch 1 inputs ``in0..``), as ncnn shapes them. An input whose
    ``Input`` layer in ``param`` has the tensor's whole rank is unbatched (a detector's ``[3, H, W]`` image): fed as
    it is, not its first sample. An input of ``model`` (the quantized model) whose batch is not dim 0 (silero's
    ``state`` ``[2, batch, 128]``) gives its first sample along that dim."""
    import numpy as np

    from fxq.analysis.mismatch_ncnn import ncnn_mat
    from fxq.backends.ncnn.writer import shape_params

    dims = {str(k) for k in shape_params((1, 1, 1, 1))}  # the param ids of a blob's dims (w, h, d, c)
    ranks = {}
    if param is not None:
        for line in param.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == "Input":
                ranks[parts[1]] = sum(p.split("=")[0] in dims for p in parts if "=" in p)
    at = [0] * len(args)
    if model is not None:
        from fxq.graph.data import input_batch_dim

        at = [input_batch_dim(model, p) or 0 for p in model.graph.find_nodes(op="placeholder")]
    ex = net.create_extractor()
    for i, a in enumerate(args):
        whole = ranks.get(f"in{i}") == a.dim()
        value = (a if whole else a.select(at[i], 0)).numpy()  # ncnn reads float32 (a float64 array would be misread), ids int32
        cast = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32}.get(value.dtype)
        ex.input(f"in{i}", ncnn_mat(value if cast is None else value.astype(cast)))
    outs = []
    for i in range(n_outputs):
        ret, m = ex.extract(f"out{i}")
        if ret != 0:
            raise RuntimeError(f"ncnn could not compute out{i}")
        outs.append(np.array(m))
    return outs


def ncnn_run(net: Any, args: tuple, n_outputs: int, param: Path | None = None, model: Any = None) -> Any:
    """:func:`ncnn_outputs` flattened and concatenated (float64)."""
    import numpy as np

    return np.concatenate([np.asarray(o, dtype=np.float64).reshape(-1)
                           for o in ncnn_outputs(net, args, n_outputs, param, model)])


def _vary(a: Any, noise: float | None) -> Any:
    """Another input like ``a``: ``a`` plus ``noise`` times N(0, 1) (None: N(0, 1) alone), or, for token ids,
    other ids of the text models' vocabulary."""
    import torch

    if not a.is_floating_point():
        return torch.randint_like(a, 0, TEXT_VOCAB)
    return torch.randn_like(a) if noise is None else a + noise * torch.randn_like(a)


def _map_tensors(fn: Any, obj: Any) -> Any:
    """``obj`` (tensors in tuples, lists, dicts) with ``fn`` applied to every tensor."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[Any]:
    """The tensors of ``obj`` in the order torch.onnx makes them the file's inputs."""
    out: list[Any] = []
    _map_tensors(out.append, obj)
    return out


def work(name: str, family: str, path: str, platforms: list[str]) -> list[dict[str, Any]]:
    """Run one model through one capture path and every platform; one record per step."""
    import torch

    import fxq

    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []

    def row(platform: str, step: str, status: str, **extra: Any) -> None:
        rows.append({"model": name, "family": family, "path": path, "platform": platform, "step": step,
                     "status": status, **extra})

    model = build(name)
    torch.manual_seed(1)
    args = example_input(name, family, model)
    calib = [args, _map_tensors(lambda a: _vary(a, 0.1), args)]
    fresh = _map_tensors(lambda a: _vary(a, None), args)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        t0 = time.perf_counter()
        try:
            source = _capture(name, path, model, args, tmp)
        except NoSourceFile as exc:
            row("-", "source", f"NoSourceFile: {str(exc)[:300]}")
            return rows
        except Exception as exc:
            row("-", "capture", _error(exc))
            return rows
        if _native_capture(path) is None:  # an ONNX file takes the tensors of the model's inputs, flattened
            calib, fresh = [tuple(_tensors(c)) for c in calib], tuple(_tensors(fresh))
        row("-", "capture", "ok", seconds=round(time.perf_counter() - t0, 2),
            captured_by=captured_by(source) if _native_capture(path) or "zoo_cut" in getattr(source, "meta", {})
            else "")
        with torch.no_grad():
            t0 = time.perf_counter()
            try:
                model(*args)
                fp32_s = time.perf_counter() - t0
            except Exception:
                fp32_s = float("nan")
        for platform in platforms:
            qmodel = None  # the previous platform's: holding two quantized copies at once doubles the peak
            t0 = time.perf_counter()
            try:
                qmodel = fxq.quantize(source, calib, platform=platform, progress=False)
            except Exception as exc:
                row(platform, "quantize", _error(exc))
                continue
            ptq_s = time.perf_counter() - t0
            row(platform, "quantize", "ok", seconds=round(ptq_s, 2),
                ptq_over_fp32=round(ptq_s / fp32_s, 2) if fp32_s == fp32_s and fp32_s > 0 else "")
            out = tmp / f"{name}_{path}_{platform}.onnx"
            try:
                try:
                    files = fxq.export(qmodel, platform, out)
                except fxq.ExportError as exc:
                    if not exc.suggested_outputs or _native_capture(path) is not None:
                        raise
                    # what a user does next: load the file up to the cut the error names (ncnn has no layer for
                    # what follows: a score threshold's comparisons), quantize that, export it
                    cut, given = exc.suggested_outputs, {}
                    while True:  # and load it again with the batch_dims the cut's export advises, if any
                        qmodel = fxq.quantize(fxq.load_onnx(tmp / f"{name}_{path}.onnx", outputs=cut,
                                                            batch_dims=given or None),
                                              calib, platform=platform, progress=False)
                        try:
                            files = fxq.export(qmodel, platform, out)
                            break
                        except fxq.ExportError as again:
                            more = advised_batch_dims(str(again))
                            if not more or set(more) <= set(given):
                                raise
                            given.update(more)
                    row(platform, "export", "ok", captured_by=f"export-cut({len(cut)} outputs)",
                        diagnosis=f"followed: batch_dims={given}" if given else "")
                else:
                    row(platform, "export", "ok")
            except Exception as exc:
                row(platform, "export", _error(exc))
                continue
            try:
                status, extra = check_runtime(qmodel, files, fresh, platform, f"{name}_{path}_{platform}")
            except Exception as exc:
                row(platform, "runtime", _error(exc))
                continue
            row(platform, "runtime", status, **extra)
    return rows


def check_runtime(qmodel: Any, files: list[Path], fresh: tuple, platform: str, stem: str
                  ) -> tuple[str, dict[str, Any]]:
    """The exported ``files`` run on ``fresh`` in their runtime (onnxruntime's default session and
    ``ORT_DISABLE_ALL``, or ncnn) against ``qmodel``'s simulation: ``("ok", cosines)`` at cosine >= the bar, else
    the row's class (``Mismatch``, ``Degenerate``, ``Fused``, ``Sensitive``: see the module docstring) with the
    cosines and the diagnosis columns. A model quantized in parts is checked part by part (``stem``: the export's
    file stem). Raises what the runtime raises."""
    import torch

    from fxq.parts import quantized_parts

    files = [Path(f) for f in files]
    if quantized_parts(qmodel):
        cos = _parts_cosines(qmodel, files, stem, fresh, platform)
        worst = min(cos.values())
        status = "ok" if worst >= COSINE_BAR else f"Mismatch: cosine {worst:.5f} < {COSINE_BAR}"
        return status, {f"cosine_{k}": round(v, 6) for k, v in cos.items()}
    with torch.no_grad():
        outs = qmodel(*fresh)
    sim = _flat(outs)
    if sim is None:
        raise RuntimeError("the model has no tensor outputs to compare")
    if platform == "ncnn_int8":
        n_out = len(outs) if isinstance(outs, (list, tuple)) else 1
        param = next(f for f in files if f.name.endswith(".param") and not f.name.endswith(".fp32.param"))
        cos = {"ncnn": cosine(ncnn_run(ncnn_net(files), fresh, n_out, param, qmodel), sim.numpy())}
        diagnosed = param
    else:
        cos = {"ort": cosine(_run_ort(files[0], fresh, True), sim.numpy()),
               "ort_disable_all": cosine(_run_ort(files[0], fresh, False), sim.numpy())}
        diagnosed = files[0]
    worst = min(cos.values())
    try:  # a failed diagnosis leaves the measured cosine standing
        extra = {} if worst >= COSINE_BAR else _diagnose(qmodel, diagnosed, fresh, sim)
    except Exception as exc:
        extra = {"diagnosis": _error(exc)}
    status = "ok" if worst >= COSINE_BAR else f"Mismatch: cosine {worst:.5f} < {COSINE_BAR}"
    peak = float(sim.abs().max()) if sim.numel() else 0.0
    if worst < COSINE_BAR and peak <= DEGENERATE_OUTPUT:
        status = (f"Degenerate: cosine {worst:.5f} < {COSINE_BAR}; the simulation's output is at most "
                  f"{peak:.1e} everywhere (activations vanish at random init), so cosine compares rounding "
                  f"noise")
    elif cos.get("ort_disable_all", 0.0) >= COSINE_BAR > cos.get("ort", 1.0):
        only = (f"cosine {worst:.5f} < {COSINE_BAR} in onnxruntime's default session only "
                f"(ORT_DISABLE_ALL {cos['ort_disable_all']:.5f})")
        saturated = _saturated(files[0])
        if saturated:
            status = (f"Saturated: {only} on this CPU (x86 without VNNI), whose int8 kernels add pairs of products "
                      f"with int16 saturation, and the file has weight pairs that reach it ({saturated})")
        else:
            status = f"Fused: {only}: its fused int8 kernels compute the file differently from its Q/DQ ops"
    elif extra.get("tf_max_code_diff", 2) <= 1 and extra.get("cosine_sim_perturbed", 1.0) < COSINE_BAR:
        where = "ncnn" if platform == "ncnn_int8" else "ORT_DISABLE_ALL"
        status = (f"Sensitive: cosine {worst:.5f} < {COSINE_BAR}; teacher-forced codes ({where}) "
                  f"within 1 LSB, the simulation against itself on a 1e-4 perturbed input "
                  f"reaches {extra['cosine_sim_perturbed']:.5f}")
    return status, {**{f"cosine_{k}": round(v, 6) for k, v in cos.items()}, **extra}


def _saturated(file: Path) -> str:
    """The first of the file's nodes whose int8 products this machine's onnxruntime saturates, or "" (a CPU with
    VNNI, no such weights, or biases the default session changes as well):
    :func:`fxq.backends.qdq.ort_bias.u8s8_saturation_issues`."""
    import onnx

    from fxq.backends.qdq.ort_bias import cpu_saturates_u8s8, ort_bias_issues, u8s8_saturation_issues

    if not cpu_saturates_u8s8():
        return ""
    model = onnx.load(str(file), load_external_data=False)
    if ort_bias_issues(model):  # the default session adds other biases too: not this cause alone
        return ""
    issues = u8s8_saturation_issues(model)
    return f"{issues[0]}{f' and {len(issues) - 1} more' if len(issues) > 1 else ''}" if issues else ""


def _diagnose(qmodel: Any, file: Path, args: tuple, sim: Any) -> dict[str, Any]:
    """Why an exported file's output disagrees: the file's codes teacher-forced against the simulation (a Q/DQ file
    in ``ORT_DISABLE_ALL``, an ncnn ``.param`` in ncnn; local mismatches only: a within-1-LSB file computes what the
    simulation computes), and the
    simulation's own sensitivity (cosine of its output against its output on inputs perturbed by 1e-4 of their
    spread, worst of two draws): a model that turns one rounding tie into that much output change fails the bar
    on any runtime whose float accumulation order differs from torch's."""
    import torch

    import fxq

    report = fxq.locate_mismatch(qmodel, file, [args], teacher_forced=True, optimize=False)
    worst = 1.0
    with torch.no_grad():
        for seed in (1, 2):
            gen = torch.Generator().manual_seed(seed)
            moved = tuple(a + 1e-4 * a.std() * torch.randn(a.shape, generator=gen, dtype=a.dtype)
                          if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            worst = min(worst, cosine(_flat(qmodel(*moved)).numpy(), sim.numpy()))
    return {"tf_identical": round(report.identical, 6), "tf_max_code_diff": max((r.max_diff for r in report),
                                                                                 default=0),
            "cosine_sim_perturbed": round(worst, 6)}


def _parts_cosines(qmodel: Any, files: list[Path], stem: str, args: tuple, platform: str) -> dict[str, float]:
    """The worst cosine per runtime over the parts of a model quantized in parts: each part's files (named
    ``<stem>_<part path>``) on the inputs the model gives that part, against the part's simulation."""
    import torch

    from fxq.parts import flat_inputs, part_file_stem, part_inputs, quantized_parts

    feeds = part_inputs(qmodel, args)
    worst: dict[str, float] = {}
    for path, part in quantized_parts(qmodel).items():
        if path not in feeds:
            continue
        mine = [f for f in files if f.name.startswith(part_file_stem(stem, path) + ".")]
        values = tuple(feeds[path].values())
        with torch.no_grad():
            out = flat_inputs(part)(*values)
        sim = _flat(out)
        if platform == "ncnn_int8":
            n_out = len(torch.utils._pytree.tree_leaves(out))
            got = {"ncnn": cosine(ncnn_run(ncnn_net(mine), values, n_out), sim.numpy())}
        else:
            onnx_file = next(f for f in mine if f.suffix == ".onnx")
            got = {"ort": cosine(_run_ort(onnx_file, values, True), sim.numpy()),
                   "ort_disable_all": cosine(_run_ort(onnx_file, values, False), sim.numpy())}
        for k, v in got.items():
            worst[k] = min(worst.get(k, 1.0), v)
    return worst


# --------------------------------------------------------------------------------------------- the driver
def run_one(name: str, family: str, path: str, platforms: list[str], timeout: float) -> list[dict[str, Any]]:
    cmd = [sys.executable, __file__, "--worker", name, "--family", family, "--paths", path,
           "--platforms", ",".join(platforms)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"model": name, "family": family, "path": path, "platform": "-", "step": "timeout",
                 "status": f"Timeout: over {timeout:.0f} s", "seconds": round(time.perf_counter() - t0, 1)}]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ZOO-ROWS "):
            return json.loads(line[len("ZOO-ROWS "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return [{"model": name, "family": family, "path": path, "platform": "-", "step": "crash",
             "status": f"Crash (exit {proc.returncode}): {tail}"}]


def record_rows(got: list[dict[str, Any]], rows: list[dict[str, Any]], writer: Any, fh: Any, label: str,
                t0: float) -> None:
    """Keep one run's rows, write them to the CSV at once (a long run can be read midway) and print one line."""
    rows.extend(got)
    writer.writerows(got)
    fh.flush()
    bad = [f"{r['platform']}/{r['step']}: {r['status']}" for r in got if r["status"] != "ok"]
    print(f"{label} {time.perf_counter() - t0:6.1f} s  {'ok' if not bad else bad[0][:150]}", flush=True)


def summarize(rows: list[dict[str, Any]], paths: list[str], platforms: list[str]) -> str:
    """Markdown: per family, for each path, models passing every step of each platform; then the failure classes."""
    fams: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        fams[r["family"]].add(r["model"])
    by_key: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_key[(r["model"], r["path"], r["platform"])].append(r)

    def passed(model: str, path: str, platform: str) -> bool:
        cap = by_key.get((model, path, "-"), [])
        if not cap or any(r["status"] != "ok" for r in cap):
            return False
        steps = by_key.get((model, path, platform), [])
        return {r["step"] for r in steps if r["status"] == "ok"} >= {"quantize", "export", "runtime"}

    def captured(model: str, path: str) -> bool:
        cap = by_key.get((model, path, "-"), [])
        return bool(cap) and all(r["status"] == "ok" for r in cap)

    head = "| family | models | " + " | ".join(
        " | ".join([f"{p} capture"] + [f"{p} {pl}" for pl in platforms]) for p in paths) + " |"
    lines = [head, "|" + "---|" * (2 + len(paths) * (1 + len(platforms)))]
    total = sorted({r["model"] for r in rows})
    for fam in sorted(fams) + ["all"]:
        models = sorted(fams[fam]) if fam != "all" else total
        cells = []
        for p in paths:
            cells.append(f"{sum(captured(m, p) for m in models)}")
            cells.extend(f"{sum(passed(m, p, pl) for m in models)}" for pl in platforms)
        lines.append(f"| {fam} | {len(models)} | " + " | ".join(cells) + " |")
    failures: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["status"] not in ("ok",):
            failures[f"{r['step']}: {r['status'].split(':')[0]}"] += 1
    by: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        if r["step"] == "capture" and r["status"] == "ok" and r.get("captured_by"):
            by[r["path"]][r["captured_by"].split("(")[0]] += 1
    if by:
        lines.append("")
    for p, counts in sorted(by.items()):
        lines.append(f"- {p} captured by: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines += ["", "| failure (step: class) | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(failures.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated model names (default: all 109)")
    parser.add_argument("--subset", action="store_true", help="the dozen models the tests run")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--platforms", default=",".join(PLATFORMS))
    parser.add_argument("--capture", default="auto",
                        help=f"capture mode(s) of the native path, comma-separated from {CAPTURES}")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model and path")
    parser.add_argument("--csv", default="bench/zoo.csv")
    parser.add_argument("--families", help="comma-separated families (classification, detection, segmentation, "
                                           "video, optical_flow; timm, ultralytics, transformers: not in the default run)")
    parser.add_argument("--summarize", metavar="CSV", help="print the table of an earlier (or running) run's CSV")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    captures = [c for c in args.capture.split(",") if c]
    if any(c not in CAPTURES for c in captures):
        parser.error(f"--capture {args.capture}: use {', '.join(CAPTURES)}")
    if captures != ["auto"] and "native" in paths:
        i = paths.index("native")
        paths[i:i + 1] = [f"native-{c}" for c in captures]
    platforms = [p for p in args.platforms.split(",") if p]
    if args.worker:
        try:
            rows = work(args.worker, args.family, paths[0], platforms)
        except Exception as exc:  # a failure outside the recorded steps
            traceback.print_exc()
            rows = [{"model": args.worker, "family": args.family, "path": paths[0], "platform": "-",
                     "step": "setup", "status": f"{type(exc).__name__} (raw): {str(exc)[:300]}"}]
        print("ZOO-ROWS " + json.dumps(rows, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
        return 0
    if args.summarize:
        with open(args.summarize, newline="") as fh:
            done = list(csv.DictReader(fh))
        print(summarize(done, [p for p in paths if any(r["path"] == p for r in done)], platforms))
        return 0
    fams = families()
    opt_in = ("timm", "ultralytics", "transformers", "text")  # families of other packages: run when named
    names = list(SUBSET) if args.subset else (args.models.split(",") if args.models else
                                              sorted(n for n, f in fams.items() if f not in opt_in or args.families))
    if args.families:
        names = [n for n in names if fams.get(n) in args.families.split(",")]
    unknown = [n for n in names if n not in fams]
    if unknown:
        parser.error(f"unknown models {unknown}")
    fields = ["model", "family", "path", "platform", "step", "status", "seconds", "captured_by", "ptq_over_fp32",
              "cosine_ort",
              "cosine_ort_disable_all", "cosine_ncnn", "tf_identical", "tf_max_code_diff", "cosine_sim_perturbed",
              "diagnosis"]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(args.csv, "w", newline="") as fh:  # rows are written as they come: a long run can be read midway
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for name in names:
            for path in paths:
                t0 = time.perf_counter()
                record_rows(run_one(name, fams[name], path, platforms, args.timeout), rows, writer, fh,
                            f"{name:32s} {path:9s}", t0)
    print()
    print(summarize(rows, paths, platforms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
