"""JAX face of the ejkernel bridge: the shared Triton kernels as jax ops with custom VJPs."""
from . import reference
from .ops import padded_attention, padded_softmax, padded_softmax_v, softmax

__all__ = ["padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax"]

from .ops import grouped_matmul, transposed_grouped_matmul  # noqa: E402

__all__ += ["grouped_matmul", "transposed_grouped_matmul"]
