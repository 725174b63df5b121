"""Quantization modules."""
from fxq.nn.fake_quantize import MODES, FakeQuantize, fake_quant_mode

__all__ = ["FakeQuantize", "fake_quant_mode", "MODES"]
