"""Blocksparse (splash-style) attention for TPU, written in Pallas.

Three layers with small interfaces between them:

* ``masks``: symbolic, hashable, sliceable attention masks;
* ``info``: ``MaskInfo``, the per-block schedule a mask compiles to (``process_mask``);
* ``kernel``: the Pallas forward / dQ / dK-dV kernels driven by a ``MaskInfo``;

and ``blocksparse_attention`` on top (``[batch, seq, heads, head_dim]``, custom VJP).
Off TPU the kernels run in Pallas interpret mode.
"""

from .attention import BlockSizes, blocksparse_attention
from .info import (
    MaskInfo,
    process_dynamic_mask,
    process_dynamic_mask_dkv,
    process_mask,
    process_mask_dkv,
)
from .masks import (
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    NumpyMask,
    make_causal_mask,
    make_chunk_attention_mask,
    make_local_attention_mask,
    make_random_mask,
)

__all__ = [
    "BlockSizes",
    "blocksparse_attention",
    "MaskInfo",
    "process_mask",
    "process_mask_dkv",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
    "Mask",
    "LogicalOr",
    "LogicalAnd",
    "FullMask",
    "CausalMask",
    "LocalMask",
    "ChunkedCausalMask",
    "NumpyMask",
    "MultiHeadMask",
    "make_causal_mask",
    "make_local_attention_mask",
    "make_chunk_attention_mask",
    "make_random_mask",
]
