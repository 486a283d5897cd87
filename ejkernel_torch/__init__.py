"""PyTorch face of the ejkernel bridge: the shared Triton kernels as torch ops with autograd."""
from . import reference
from .ops import padded_attention, padded_softmax, padded_softmax_v, softmax

__all__ = ["padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax"]
