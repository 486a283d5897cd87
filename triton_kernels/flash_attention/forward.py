"""Flash-attention forward: one program per (query block, head, batch row), online softmax over
the key blocks the mask can reach. Writes the output and the natural log-sum-exp (-inf for a
fully masked row, whose output is 0)."""
from __future__ import annotations

import triton
import triton.language as tl

from ..padded_attention import _dot, _dot_acc
from .tiles import (LN2_C, _dropout_keep, _full_key_range, _keep, _key_range, _load_bias, _load_kv,
                    _load_rows, _logits2, _row_base, _run_bounds, _segment_ids, _sequence, _store_rows)

# Runtime ints: listed so torch and jax-triton compile the same PTX (see triton_kernels.plan).
RUNTIME_INTS = ["seq_q", "seq_k", "total_q", "total_k", "win_left", "win_right"]


@triton.jit
def _fwd_step(acc, m_i, l_i, q, q_seg, start_n, k_ptr, v_ptr, bias_ptr, kv_seg_ptr, b, h, h_kv, k_start,
              offs_m, offs_d, seq_q, seq_k, len_q, len_k, win_left, win_right,
              logit_scale, softcap, dropout_p, dropout_scale, seed, drop_base,
              HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_BIAS: tl.constexpr,
              BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr, USE_SEGMENTS: tl.constexpr,
              USE_DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key block ``start_n`` into the online-softmax state (acc, running max, normaliser).
    ``MASKED=False`` is for blocks every row attends entirely (``_full_key_range``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = _load_kv(k_ptr, v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV, HEAD_DIM, BLOCK_D, MASKED)
    bias = 0.0
    if USE_BIAS:
        bias = _load_bias(bias_ptr, b, h, offs_m, offs_n, len_q, len_k, BIAS_BATCHED, BIAS_HEADS)
    qk = _dot(q, tl.trans(k), DOT_PRECISION)
    if MASKED or USE_SOFTCAP or USE_BIAS or NEGATIVE_SCALE:
        s, _ = _logits2(qk, bias, logit_scale, softcap, USE_SOFTCAP, USE_BIAS)
        if MASKED:
            k_seg = _segment_ids(kv_seg_ptr, b, seq_k, offs_n, len_k, USE_SEGMENTS)
            keep = _keep(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg, USE_WINDOW, USE_SEGMENTS)
            s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing attended yet: keep exp2 finite
        p = tl.exp2(s - m_ref[:, None])
    else:
        # Plain whole tile: scale the row max instead of the tile (the same value for a scale >= 0;
        # NEGATIVE_SCALE takes the path above), so that scaling and subtracting fuse into one FMA.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * logit_scale)
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(qk * logit_scale - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)  # the normaliser counts dropped entries too
    if USE_DROPOUT:
        p = tl.where(_dropout_keep(seed, drop_base, offs_m, offs_n, seq_k, dropout_p), p * dropout_scale, 0.0)
    acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize_on_alignment=RUNTIME_INTS)
def flash_fwd_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                     seq_q, seq_k, total_q, total_k, win_left, win_right,
                     logit_scale, softcap, dropout_p, dropout_scale,
                     o_ptr, lse_ptr,
                     HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     IS_VARLEN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                     USE_BIAS: tl.constexpr, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr,
                     USE_SEGMENTS: tl.constexpr, USE_DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    # Last query block first: under a causal mask it has the most keys, so the long programs start
    # early and the short ones fill the tail.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, len_q, k_start, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k, IS_VARLEN)
    if start_m >= len_q:  # varlen: this sequence is shorter than the grid
        return
    h_kv = h // (HEADS_Q // HEADS_KV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
    q_seg = _segment_ids(q_seg_ptr, b, seq_q, offs_m, len_q, USE_SEGMENTS)
    seed = 0
    if USE_DROPOUT:
        seed = tl.load(seed_ptr)
    drop_base = (b * HEADS_Q + h) * seq_q

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo, hi = _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, USE_WINDOW)
    a, z = _full_key_range(start_m, len_q, len_k, win_left, win_right, lo, hi, BLOCK_M, BLOCK_N, USE_WINDOW,
                           USE_SEGMENTS)
    # Key blocks in ascending order, in three runs: masked [lo, a), whole [a, z), masked [z, hi).
    # An empty run is skipped as a whole: its software pipeline would still fill and drain.
    for run in tl.static_range(3):
        first, last = _run_bounds(run, lo, a, z, hi)
        if first < last:
            for start_n in range(first, last, BLOCK_N):
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, q_seg, start_n, k_ptr, v_ptr, bias_ptr, kv_seg_ptr, b, h,
                                          h_kv, k_start, offs_m, offs_d, seq_q, seq_k, len_q, len_k, win_left,
                                          win_right, logit_scale, softcap, dropout_p, dropout_scale, seed, drop_base,
                                          HEADS_KV, HEAD_DIM, BLOCK_N, BLOCK_D, run != 1, USE_WINDOW, USE_SOFTCAP,
                                          USE_BIAS, BIAS_BATCHED, BIAS_HEADS, USE_SEGMENTS, USE_DROPOUT,
                                          NEGATIVE_SCALE, DOT_PRECISION)

    empty = l_i == 0.0  # a fully masked row: acc is 0, and so is its output
    l_safe = tl.where(empty, 1.0, l_i)
    # One reciprocal a row, then products, as the Gluon forward's epilogue (1.01-1.05x there):
    # dividing each element costs about three instructions an element.
    out = acc * (1.0 / l_safe)[:, None]
    _store_rows(o_ptr, out, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
    lse = tl.where(empty, -float("inf"), (m_i + tl.log2(l_safe)) * LN2_C)
    row = _row_base(b, h, q_start, seq_q, total_q, HEADS_Q, IS_VARLEN)
    tl.store(lse_ptr + row + offs_m, lse, mask=offs_m < len_q)
