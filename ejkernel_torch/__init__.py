"""PyTorch face of the ejkernel bridge: the shared Triton kernels as torch ops with autograd.

Submodules: ``nn`` (MultiHeadAttention), ``reference`` (plain torch references), ``xla_utils``
(packed-sequence helpers), ``utils``, ``interop`` (DLPack bridge to jax: ``to_jax``,
``to_torch``, ``jax_to_torch``) and ``tpu`` (the Pallas TPU kernels through that bridge).
``interop`` and ``tpu`` import jax, so they load on first use.
"""
import importlib

from . import nn, reference, utils, xla_utils
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
    "interop", "nn", "padded_attention", "padded_softmax", "padded_softmax_v", "reference", "softmax",
    "tpu", "transposed_grouped_matmul", "utils", "xla_utils",
]

_LAZY = ("interop", "tpu")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
