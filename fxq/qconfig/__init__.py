"""Platform qconfig maps. Importing this package registers the built-in platforms."""
from fxq.qconfig import academic, dsp, ncnn, onnxruntime, openppl, tensorrt  # noqa: F401  (register)
from fxq.qconfig.base import PLATFORMS, Capability, Platform, RoleCapability, get_platform, register_platform

__all__ = ["Platform", "PLATFORMS", "register_platform", "get_platform", "Capability", "RoleCapability"]
