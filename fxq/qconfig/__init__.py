"""Platform qconfig maps: the :class:`Platform` base, :class:`Capability` and the registry.

The built-in platforms live with their backends (``fxq/backends/<name>/``) and are registered by ``import fxq``.
"""
from fxq.qconfig.base import PLATFORMS, Capability, Platform, RoleCapability, get_platform, register_platform

__all__ = ["Platform", "PLATFORMS", "register_platform", "get_platform", "Capability", "RoleCapability"]
