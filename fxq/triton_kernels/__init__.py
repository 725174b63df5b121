"""Triton implementations of the ``fxq::`` ops for CUDA tensors.

:func:`register_cuda_kernels` attaches one kernel per op with ``torch.library.register_kernel(op, "cuda")``
(not ``triton_op``, which inductor inlines and which then breaks ``torch.compile`` on CPU). Nothing here
imports triton until a CUDA tensor reaches an op, so ``import fxq`` works without triton or a GPU; if
triton cannot be imported then, the op logs one warning and runs the torch reference.

Kernels live in :mod:`fxq.triton_kernels.linear` and :mod:`fxq.triton_kernels.floating`; they are
bit-identical to :mod:`fxq.numeric.reference` (tests run them under ``TRITON_INTERPRET=1`` on CPU, and on a GPU
with ``FXQ_TEST_TRITON_GPU=1``: ``bench/gpu.sh``). Two differences seen on an H100 (Triton 3.6), both tested:
the scale / offset gradients are the reference's own torch sum, which on CUDA adds in another order than on CPU
(the kernels equal the reference run on the same device, not the CPU's sums to the last bit); and Triton compiles
float32 arithmetic with flush-to-zero, so a subnormal input (|x| < 2**-126) counts as 0, which changes a result
only under the directed roundings UP / DOWN (0 instead of one step).
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Callable

import torch

from fxq.numeric.opspec import FLOAT, LINEAR, OP_SPECS

__all__ = ["cuda_binders", "cuda_kernel_in_use", "cuda_kernels", "register_cuda_kernels", "triton_kernels_available"]

log = logging.getLogger(__name__)

_MODULES = {LINEAR.name: "linear", FLOAT.name: "floating"}
"""The kernel module of each op of :data:`~fxq.numeric.opspec.OP_SPECS`; it defines ``<op>_triton`` and
``<op>_backward_triton``."""

_lock = threading.Lock()
_registered = False


def triton_kernels_available() -> bool:
    """True when triton imports and the kernel modules compile to Python (no GPU needed)."""
    try:
        importlib.import_module("fxq.triton_kernels.linear")
        importlib.import_module("fxq.triton_kernels.floating")
    except Exception:  # triton missing, or too old / broken on this platform
        return False
    return True


class _LazyKernel:
    """The CUDA implementation of one op: imports its Triton module on first use, else the torch reference."""

    def __init__(self, op: str, module: str, name: str, reference: Callable[..., Any], quiet: bool = False) -> None:
        self.op, self.module, self.name, self.reference = op, module, name, reference
        self.quiet = quiet  # a binder: the op's own kernel already warns when Triton is unusable
        self._impl: Callable[..., Any] | None = None

    def _resolve(self) -> Callable[..., Any]:
        try:
            mod = importlib.import_module(f"fxq.triton_kernels.{self.module}")
            return getattr(mod, self.name)
        except Exception as exc:  # ImportError, or triton failing to initialise
            if self.quiet:
                return self.reference
            log.warning(
                "%s: Triton kernels unavailable (%s: %s); running the torch reference on CUDA. "
                "Install a triton that matches your torch to get the fused kernels.",
                self.op,
                type(exc).__name__,
                exc,
            )
            return self.reference

    def __call__(self, *args: Any) -> Any:
        impl = self._impl
        if impl is None:
            impl = self._impl = self._resolve()
        return impl(*args)


_cuda_kernels: dict[str, _LazyKernel] = {}
"""The CUDA kernel registered for each op (qualified name), once :func:`register_cuda_kernels` ran."""
_cuda_binders: dict[str, _LazyKernel] = {}
"""The binder of each forward op (qualified name): ``bind_<op>(args, tag)`` of its kernel module."""


def _no_binding(args: tuple[Any, ...], tag: Any) -> None:
    """The binder where Triton is unusable: every call goes through the op."""
    return None


def cuda_kernels() -> dict[str, Callable[..., Any]]:
    """The CUDA kernel of each ``fxq::`` op by qualified name (what the dispatcher runs for CUDA tensors), for
    callers that skip the dispatcher on plain eager calls; empty before :func:`register_cuda_kernels`."""
    return dict(_cuda_kernels)


def cuda_binders() -> dict[str, Callable[..., Any]]:
    """The binder of each forward ``fxq::`` op on CUDA by qualified name: ``binder(args, tag)`` gives a
    :class:`~fxq.triton_kernels.common.BoundLaunch` for calls like ``args`` (or None); empty before
    :func:`register_cuda_kernels`."""
    return dict(_cuda_binders)


def cuda_kernel_in_use(op: str) -> str | None:
    """What runs ``op`` on CUDA tensors: ``"triton"``, ``"reference"`` (Triton failed to load) or None (not
    called on CUDA yet in this process)."""
    kernel = _cuda_kernels.get(op)
    if kernel is None or kernel._impl is None:
        return None
    return "reference" if kernel._impl is kernel.reference else "triton"


def register_cuda_kernels() -> bool:
    """Attach the Triton kernels to the ``fxq::`` ops for CUDA tensors (idempotent).

    Returns:
        True once the kernels are registered. Triton itself is imported lazily, on the first CUDA call.
    """
    global _registered
    with _lock:
        if _registered:
            return True
        for spec in OP_SPECS:
            module = _MODULES[spec.name]
            for op, name, reference in ((spec.qualname, spec.name, spec.forward),
                                        (spec.backward_qualname, spec.backward_name, spec.backward)):
                kernel = _cuda_kernels[op] = _LazyKernel(op, module, f"{name}_triton", reference)
                torch.library.register_kernel(op, "cuda", kernel)
            _cuda_binders[spec.qualname] = _LazyKernel(spec.qualname, module, f"bind_{spec.name}", _no_binding,
                                                        quiet=True)
        _registered = True
    return True
