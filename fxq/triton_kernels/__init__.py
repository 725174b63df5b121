"""Triton implementations of the ``fxq::`` ops (filled in by the kernel work)."""


def register_cuda_kernels() -> None:
    """Attach the Triton kernels to the ``fxq::`` ops for CUDA tensors."""
