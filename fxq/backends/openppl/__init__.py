"""The OpenPPL backend: the ``ppl_cuda_int8`` platform with its capability, and the ``"openppl"`` exporter (FP32
ONNX plus ppl.nn's quantization json)."""
from fxq.backends.openppl.exporter import PPL_KEYS, OpenPPLExporter, ppl_json, quant_entry
from fxq.backends.openppl.platforms import PPLCudaInt8

__all__ = ["OpenPPLExporter", "quant_entry", "ppl_json", "PPL_KEYS", "PPLCudaInt8"]
