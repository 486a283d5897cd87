"""JAX face of the ejkernel bridge: the shared Triton kernels as jax ops with custom VJPs.

Submodules: ``reference``, ``xla_utils`` (packed-sequence helpers), ``utils``, ``pallas.tpu``
(blocksparse attention with its masks and MaskInfo, grouped matmul v2) and ``nn`` (Flax
modules; import it explicitly, it needs flax).
"""
from . import reference, utils, xla_utils
from .ops import (
    flash_attention,
    flash_attention_dropout_mask,
    flash_attention_varlen,
    grouped_matmul,
    padded_attention,
    padded_softmax,
    padded_softmax_v,
    softmax,
    transposed_grouped_matmul,
)

__all__ = [
    "flash_attention", "flash_attention_dropout_mask", "flash_attention_varlen", "grouped_matmul",
    "padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax",
    "transposed_grouped_matmul", "utils", "xla_utils",
]
