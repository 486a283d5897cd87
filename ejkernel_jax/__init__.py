"""JAX face of the ejkernel bridge: the shared Triton kernels as jax ops with custom VJPs."""
from . import reference
from .launch import launch
from .ops import padded_attention, padded_softmax, padded_softmax_v, softmax

__all__ = ["launch", "padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax"]
