"""Torch ops over the shared Triton kernels."""
from .padded_attention import padded_attention
from .softmax import padded_softmax, padded_softmax_v, softmax

__all__ = ["padded_attention", "padded_softmax", "padded_softmax_v", "softmax"]

from .grouped_matmul import grouped_matmul, transposed_grouped_matmul  # noqa: E402

__all__ += ["grouped_matmul", "transposed_grouped_matmul"]
