"""The dropout keep-mask flash attention draws, materialised (for tests and debugging): the same
``_dropout_keep`` call as the attention kernels, so the mask is bit-for-bit theirs."""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import _dropout_keep


@triton.jit(do_not_specialize_on_alignment=["seq_q", "seq_k"])
def dropout_mask_kernel(seed_ptr, seq_q, seq_k, dropout_p, mask_ptr,
                        HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    dropout_p = tl.cast(dropout_p, tl.float32)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seed = tl.load(seed_ptr)
    row_base = (b * HEADS + h) * seq_q
    for start_n in range(0, seq_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed, row_base, offs_m, offs_n, seq_k, dropout_p)
        ptrs = mask_ptr + (row_base + offs_m[:, None]).to(tl.int64) * seq_k + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int32), mask=(offs_m < seq_q)[:, None] & (offs_n < seq_k)[None, :])
