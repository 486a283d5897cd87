"""Ops over the shared Triton kernels."""
from .flash_attention import flash_attention, flash_attention_dropout_mask, flash_attention_varlen
from .grouped_matmul import grouped_matmul, transposed_grouped_matmul
from .padded_attention import padded_attention
from .softmax import padded_softmax, padded_softmax_v, softmax

__all__ = [
    "flash_attention", "flash_attention_dropout_mask", "flash_attention_varlen", "grouped_matmul",
    "padded_attention", "padded_softmax", "padded_softmax_v", "softmax", "transposed_grouped_matmul",
]
