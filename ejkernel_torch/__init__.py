"""PyTorch face of the ejkernel bridge: the shared Triton kernels as torch ops with autograd."""
from . import reference
from .ops import padded_attention, padded_softmax, padded_softmax_v, softmax

__all__ = ["padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax"]

from . import tpu  # noqa: E402  (Pallas TPU kernels through the DLPack bridge; imports jax)
from .ops import grouped_matmul, transposed_grouped_matmul  # noqa: E402

__all__ += ["grouped_matmul", "tpu", "transposed_grouped_matmul"]
