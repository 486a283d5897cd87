"""Flash-attention backward, deterministic (no atomics):

* ``flash_bwd_dq_kernel``: one program per (query block, head, batch row). It runs first: each
  program computes its rows' delta = rowsum(o * do) - dlse from the o and do rows it loads anyway,
  uses it, and stores it (lse layout) for dk/dv;
* ``flash_bwd_dkdv_kernel``: one program per (key block, kv head, batch row), looping over every
  query head of its group and the query blocks that can see the keys; also writes dS (the
  gradient of the logits) when the bias needs a gradient.

Probabilities are recomputed from the saved log-sum-exp; dropout regenerates the forward's mask
from (seed, element offset). Rows that attend nothing have lse = -inf and get p = 0, hence zero
gradients.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..padded_attention import _dot, _dot_acc
from .tiles import (LOG2E_C, _dropout_keep_pairs, _full_key_range, _full_query_range, _keep, _keep_t, _key_range,
                    _load_bias, _load_bias_pairs, _load_full_rows, _load_kv, _load_rows, _logits2, _query_range,
                    _row_base, _run_bounds, _segment_ids, _sequence, _store_rows)

RUNTIME_INTS = ["seq_q", "seq_k", "total_q", "total_k", "win_left", "win_right"]


@triton.jit
def _store_delta(o_ptr, do, dlse_ptr, delta_ptr, q_start, offs_m, len_q, h, offs_d, rows, HEADS_Q: tl.constexpr,
                 HEAD_DIM: tl.constexpr, USE_DLSE: tl.constexpr):
    """delta = rowsum(o * do) - dlse of rows ``offs_m`` (``do`` loaded), stored at ``rows + offs_m``
    and returned; rows past ``len_q`` get 0."""
    o = _load_rows(o_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), axis=1)
    row_mask = offs_m < len_q
    if USE_DLSE:  # d lse / d logits = p, so a gradient on lse folds into delta
        delta -= tl.load(dlse_ptr + rows + offs_m, mask=row_mask, other=0.0)
    tl.store(delta_ptr + rows + offs_m, delta, mask=row_mask)
    return delta


@triton.jit
def _lse2(lse, MAY_BE_EMPTY: tl.constexpr):
    """Base-2 lse as the backward uses it. A row that attends nothing has lse = -inf; it becomes
    +inf, so that exp2(s - lse2) is 0 for every logit s, -inf included. Rows of an unmasked tile
    attend its keys, so only a -inf bias can empty them (``MAY_BE_EMPTY=USE_BIAS`` there: the
    select costs the dk/dv loop 3-6% when causal on an H100)."""
    if MAY_BE_EMPTY:
        return tl.where(lse == -float("inf"), float("inf"), lse * LOG2E_C)
    return lse * LOG2E_C


@triton.jit
def _dlogits(s, t, dp, lse2, delta, keep, seed, drop_base, i, j, seq_k, dropout_p, dropout_scale,
             MASKED: tl.constexpr, TRANSPOSED: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_DROPOUT: tl.constexpr):
    """(p as applied to v (dropped and rescaled), dS = dL/dlogits, dS through the soft cap) of a
    tile of base-2 logits ``s`` with dP = dO V^T ``dp``. ``lse2``/``delta`` are per query: along
    the rows, or the columns when ``TRANSPOSED`` (keys down); ``i``/``j`` are the broadcastable
    query/key indices the dropout draw is keyed on."""
    if TRANSPOSED:
        lse_b = lse2[None, :]
        delta_b = delta[None, :]
    else:
        lse_b = lse2[:, None]
        delta_b = delta[:, None]
    if MASKED:
        p = tl.where(keep, tl.exp2(s - lse_b), 0.0)
    else:  # lse2 of an empty row is +inf (_lse2), so p = 0 there without a mask
        p = tl.exp2(s - lse_b)
    p_v = p
    if USE_DROPOUT:
        z = tl.where(_dropout_keep_pairs(seed, drop_base, i, j, seq_k, dropout_p), dropout_scale, 0.0)
        p_v = p * z
        dp = dp * z
    ds = p * (dp - delta_b)
    ds_raw = ds
    if USE_SOFTCAP:
        ds_raw = ds * (1.0 - t * t)
    return p_v, ds, ds_raw


@triton.jit
def _dkdv_step(dk, dv, k, v, k_seg, start_m, offs_n, offs_d, q_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptr, q_seg_ptr,
               ds_ptr, b, h, q_start, rows, seq_q, seq_k, len_q, len_k, win_left, win_right,
               logit_scale, softcap, dropout_p, dropout_scale, seed, drop_base,
               HEADS_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_BIAS: tl.constexpr,
               BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr, USE_SEGMENTS: tl.constexpr,
               USE_DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add query block ``start_m`` of head ``h`` to the key block's dk, dv (and write its dS).

    Works on transposed tiles (keys down, queries across), so p and dS feed the dk/dv products
    without a register transpose; only loaded q/do tiles are transposed. ``MASKED=False`` is for
    query blocks that attend every key of the block (``_full_query_range``)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_mask = offs_m < len_q
    if MASKED:
        q = _load_rows(q_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
        do = _load_rows(do_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
        lse2 = _lse2(tl.load(lse_ptr + rows + offs_m, mask=row_mask, other=0.0), True)
        delta = tl.load(delta_ptr + rows + offs_m, mask=row_mask, other=0.0)
    else:
        q = _load_full_rows(q_ptr, q_start, offs_m, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM, BLOCK_D)
        do = _load_full_rows(do_ptr, q_start, offs_m, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM, BLOCK_D)
        lse2 = _lse2(tl.load(lse_ptr + rows + offs_m), USE_BIAS)
        delta = tl.load(delta_ptr + rows + offs_m)
    i = offs_m[None, :]
    j = offs_n[:, None]
    bias = 0.0
    if USE_BIAS:
        bias = _load_bias_pairs(bias_ptr, b, h, i, j, len_q, len_k, BIAS_BATCHED, BIAS_HEADS)
    s, t = _logits2(_dot(k, tl.trans(q), DOT_PRECISION), bias, logit_scale, softcap, USE_SOFTCAP, USE_BIAS)
    keep = True
    if MASKED:
        q_seg = _segment_ids(q_seg_ptr, b, seq_q, offs_m, len_q, USE_SEGMENTS)
        keep = _keep_t(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg, USE_WINDOW, USE_SEGMENTS)
    dp = _dot(v, tl.trans(do), DOT_PRECISION)
    p_v, ds, ds_raw = _dlogits(s, t, dp, lse2, delta, keep, seed, drop_base, i, j, seq_k, dropout_p, dropout_scale,
                               MASKED, True, USE_SOFTCAP, USE_DROPOUT)
    dv = _dot_acc(p_v.to(do.dtype), do, dv, DOT_PRECISION)
    dk = _dot_acc(ds_raw.to(q.dtype), q, dk, DOT_PRECISION)
    if WRITE_DS:  # [batch, heads_q, seq_q, seq_k], float32; every pair is visited once
        ds_base = (b * HEADS_Q + h) * seq_q * seq_k
        tl.store(ds_ptr + ds_base + i.to(tl.int64) * seq_k + j, ds, mask=(i < len_q) & (j < len_k))
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse2, delta, q_seg, start_n, offs_m, offs_d, k_ptr, v_ptr, bias_ptr, kv_seg_ptr, b, h, h_kv,
             k_start, seq_k, len_q, len_k, win_left, win_right, logit_scale, softcap, dropout_p, dropout_scale, seed,
             drop_base, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_BIAS: tl.constexpr,
             BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr, USE_SEGMENTS: tl.constexpr,
             USE_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add key block ``start_n``'s share to the query block's dq (``MASKED`` as in ``_fwd_step``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = _load_kv(k_ptr, v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV, HEAD_DIM, BLOCK_D, MASKED)
    bias = 0.0
    if USE_BIAS:
        bias = _load_bias(bias_ptr, b, h, offs_m, offs_n, len_q, len_k, BIAS_BATCHED, BIAS_HEADS)
    s, t = _logits2(_dot(q, tl.trans(k), DOT_PRECISION), bias, logit_scale, softcap, USE_SOFTCAP, USE_BIAS)
    keep = True
    if MASKED:
        k_seg = _segment_ids(kv_seg_ptr, b, seq_k, offs_n, len_k, USE_SEGMENTS)
        keep = _keep(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg, USE_WINDOW, USE_SEGMENTS)
    dp = _dot(do, tl.trans(v), DOT_PRECISION)
    _, _, ds_raw = _dlogits(s, t, dp, lse2, delta, keep, seed, drop_base, offs_m[:, None], offs_n[None, :], seq_k,
                            dropout_p, dropout_scale, MASKED, False, USE_SOFTCAP, USE_DROPOUT)
    return _dot_acc(ds_raw.to(k.dtype), k, dq, DOT_PRECISION)


@triton.jit(do_not_specialize_on_alignment=RUNTIME_INTS)
def flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                          do_ptr, lse_ptr, delta_ptr,
                          seq_q, seq_k, total_q, total_k, win_left, win_right,
                          logit_scale, softcap, dropout_p, dropout_scale, sm_scale,
                          dk_ptr, dv_ptr, ds_ptr,
                          HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          IS_VARLEN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                          USE_BIAS: tl.constexpr, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr,
                          USE_SEGMENTS: tl.constexpr, USE_DROPOUT: tl.constexpr,
                          WRITE_DS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    GROUP: tl.constexpr = HEADS_Q // HEADS_KV
    start_n = tl.program_id(0) * BLOCK_N
    h_kv = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, len_q, k_start, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k, IS_VARLEN)
    if start_n >= len_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
    v = _load_rows(v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
    k_seg = _segment_ids(kv_seg_ptr, b, seq_k, offs_n, len_k, USE_SEGMENTS)
    seed = 0
    if USE_DROPOUT:
        seed = tl.load(seed_ptr)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, hi = _query_range(start_n, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, USE_WINDOW)
    a, z = _full_query_range(start_n, len_q, len_k, win_left, win_right, lo, hi, BLOCK_M, BLOCK_N, USE_WINDOW,
                             USE_SEGMENTS)
    for g in range(GROUP):  # the query heads sharing this kv head: summed here, not with atomics
        h = h_kv * GROUP + g
        rows = _row_base(b, h, q_start, seq_q, total_q, HEADS_Q, IS_VARLEN)
        drop_base = (b * HEADS_Q + h) * seq_q
        # Unlike the forward and dq kernels, empty runs are not skipped with a branch here:
        # that made this kernel 20% slower at head_dim 128 on an H100 (Triton 3.6).
        for run in tl.static_range(3):  # masked [lo, a), whole [a, z), masked [z, hi)
            first, last = _run_bounds(run, lo, a, z, hi)
            for start_m in range(first, last, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, k_seg, start_m, offs_n, offs_d, q_ptr, do_ptr, lse_ptr, delta_ptr,
                                    bias_ptr, q_seg_ptr, ds_ptr, b, h, q_start, rows, seq_q, seq_k, len_q, len_k,
                                    win_left, win_right, logit_scale, softcap, dropout_p, dropout_scale, seed,
                                    drop_base, HEADS_Q, HEAD_DIM, BLOCK_M, BLOCK_D, run != 1, USE_WINDOW,
                                    USE_SOFTCAP, USE_BIAS, BIAS_BATCHED, BIAS_HEADS, USE_SEGMENTS, USE_DROPOUT,
                                    WRITE_DS, DOT_PRECISION)

    _store_rows(dk_ptr, dk * sm_scale, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
    _store_rows(dv_ptr, dv, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)


@triton.jit(do_not_specialize_on_alignment=RUNTIME_INTS)
def flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                        do_ptr, lse_ptr, o_ptr, dlse_ptr,
                        seq_q, seq_k, total_q, total_k, win_left, win_right,
                        logit_scale, softcap, dropout_p, dropout_scale, sm_scale,
                        dq_ptr, delta_ptr,
                        HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        IS_VARLEN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                        USE_BIAS: tl.constexpr, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr,
                        USE_SEGMENTS: tl.constexpr, USE_DROPOUT: tl.constexpr, USE_DLSE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    logit_scale = tl.cast(logit_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    dropout_p = tl.cast(dropout_p, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, len_q, k_start, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k, IS_VARLEN)
    if start_m >= len_q:
        return
    h_kv = h // (HEADS_Q // HEADS_KV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < len_q
    q = _load_rows(q_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
    do = _load_rows(do_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
    rows = _row_base(b, h, q_start, seq_q, total_q, HEADS_Q, IS_VARLEN)
    lse2 = _lse2(tl.load(lse_ptr + rows + offs_m, mask=row_mask, other=0.0), True)  # once, outside the loop
    delta = _store_delta(o_ptr, do, dlse_ptr, delta_ptr, q_start, offs_m, len_q, h, offs_d, rows, HEADS_Q, HEAD_DIM,
                         USE_DLSE)
    q_seg = _segment_ids(q_seg_ptr, b, seq_q, offs_m, len_q, USE_SEGMENTS)
    seed = 0
    if USE_DROPOUT:
        seed = tl.load(seed_ptr)
    drop_base = (b * HEADS_Q + h) * seq_q

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, USE_WINDOW)
    a, z = _full_key_range(start_m, len_q, len_k, win_left, win_right, lo, hi, BLOCK_M, BLOCK_N, USE_WINDOW,
                           USE_SEGMENTS)
    for run in tl.static_range(3):  # masked [lo, a), whole [a, z), masked [z, hi); empty ones skipped
        first, last = _run_bounds(run, lo, a, z, hi)
        if first < last:
            for start_n in range(first, last, BLOCK_N):
                dq = _dq_step(dq, q, do, lse2, delta, q_seg, start_n, offs_m, offs_d, k_ptr, v_ptr, bias_ptr,
                              kv_seg_ptr, b, h, h_kv, k_start, seq_k, len_q, len_k, win_left, win_right, logit_scale,
                              softcap, dropout_p, dropout_scale, seed, drop_base, HEADS_KV, HEAD_DIM, BLOCK_N, BLOCK_D,
                              run != 1, USE_WINDOW, USE_SOFTCAP, USE_BIAS, BIAS_BATCHED, BIAS_HEADS, USE_SEGMENTS,
                              USE_DROPOUT, DOT_PRECISION)

    _store_rows(dq_ptr, dq * sm_scale, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
