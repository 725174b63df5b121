"""The TensorRT backend: the ``trt_int8`` / ``trt_fp8`` platforms with their capabilities, and the ``"tensorrt"``
exporter (explicit-quantization Q/DQ ONNX, :mod:`.exporter`), its rule checker of written files (:mod:`.check`)
and the implicit-quantization side files (:mod:`.legacy`)."""
from fxq.backends.tensorrt.check import TRT_WEIGHTED_OPS, check_tensorrt
from fxq.backends.tensorrt.exporter import TensorRTExporter, activation_scales
from fxq.backends.tensorrt.platforms import TRT_QUANTIZED_OPS, TensorRTFp8, TensorRTInt8

__all__ = ["TensorRTExporter", "activation_scales", "check_tensorrt", "TRT_WEIGHTED_OPS", "TRT_QUANTIZED_OPS",
           "TensorRTInt8", "TensorRTFp8"]
