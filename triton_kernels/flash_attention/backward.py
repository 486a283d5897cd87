"""Flash-attention backward, deterministic (no atomics):

* ``flash_bwd_delta_kernel``: delta = rowsum(o * do) - dlse, in the lse layout;
* ``flash_bwd_dkdv_kernel``: one program per (key block, kv head, batch row), looping over every
  query head of its group and the query blocks that can see the keys; also writes dS (the
  gradient of the logits) when the bias needs a gradient;
* ``flash_bwd_dq_kernel``: one program per (query block, head, batch row).

Probabilities are recomputed from the saved log-sum-exp; dropout regenerates the forward's mask
from (seed, element offset). Rows that attend nothing have lse = -inf and get p = 0, hence zero
gradients.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..padded_attention import _dot
from .tiles import (LOG2E_C, _dropout_keep, _keep, _key_range, _load_bias, _load_rows, _logits2, _query_range,
                    _row_base, _sequence, _store_rows)

RUNTIME_INTS = ["seq_q", "seq_k", "total_q", "total_k", "win_left", "win_right"]


@triton.jit(do_not_specialize_on_alignment=["seq_q", "seq_k", "total_q", "total_k"])
def flash_bwd_delta_kernel(o_ptr, do_ptr, dlse_ptr, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k,
                           delta_ptr,
                           HEADS_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, USE_DLSE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start, len_q, _, _ = _sequence(b, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k, IS_VARLEN)
    if start_m >= len_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(o_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM).to(tl.float32)
    do = _load_rows(do_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    rows = _row_base(b, h, q_start, seq_q, total_q, HEADS_Q, IS_VARLEN) + offs_m
    if USE_DLSE:  # d lse / d logits = p, so a gradient on lse folds into delta
        delta -= tl.load(dlse_ptr + rows, mask=offs_m < len_q, other=0.0)
    tl.store(delta_ptr + rows, delta, mask=offs_m < len_q)


@triton.jit
def _probs_and_dlogits(q, k, v, do, lse2, delta, bias, keep, seed, drop_base, offs_m, offs_n, seq_k,
                       logit_scale, softcap, dropout_p, dropout_scale,
                       USE_SOFTCAP: tl.constexpr, USE_BIAS: tl.constexpr, USE_DROPOUT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """(p as applied to v (dropped and rescaled), dS = dL/dlogits, dS through the soft cap)."""
    s, t = _logits2(_dot(q, tl.trans(k), DOT_PRECISION), bias, logit_scale, softcap, USE_SOFTCAP, USE_BIAS)
    lse_ref = tl.where(lse2 == -float("inf"), float("inf"), lse2)  # empty rows: p = 0
    p = tl.where(keep, tl.exp2(s - lse_ref[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), DOT_PRECISION)
    p_v = p
    if USE_DROPOUT:
        z = tl.where(_dropout_keep(seed, drop_base, offs_m, offs_n, seq_k, dropout_p), dropout_scale, 0.0)
        p_v = p * z
        dp = dp * z
    ds = p * (dp - delta[:, None])
    ds_raw = ds
    if USE_SOFTCAP:
        ds_raw = ds * (1.0 - t * t)
    return p_v, ds, ds_raw


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
    k_seg = offs_n
    if USE_SEGMENTS:
        k_seg = tl.load(kv_seg_ptr + b * seq_k + offs_n, mask=offs_n < len_k, other=0)
    seed = 0
    if USE_DROPOUT:
        seed = tl.load(seed_ptr)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, hi = _query_range(start_n, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, USE_WINDOW)
    for g in range(GROUP):  # the query heads sharing this kv head: summed here, not with atomics
        h = h_kv * GROUP + g
        rows = _row_base(b, h, q_start, seq_q, total_q, HEADS_Q, IS_VARLEN)
        drop_base = (b * HEADS_Q + h) * seq_q
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_mask = offs_m < len_q
            q = _load_rows(q_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
            do = _load_rows(do_ptr, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
            lse2 = tl.load(lse_ptr + rows + offs_m, mask=row_mask, other=0.0) * LOG2E_C
            delta = tl.load(delta_ptr + rows + offs_m, mask=row_mask, other=0.0)
            q_seg = offs_m
            if USE_SEGMENTS:
                q_seg = tl.load(q_seg_ptr + b * seq_q + offs_m, mask=row_mask, other=0)
            bias = 0.0
            if USE_BIAS:
                bias = _load_bias(bias_ptr, b, h, offs_m, offs_n, len_q, len_k, BIAS_BATCHED, BIAS_HEADS)
            keep = _keep(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg, USE_WINDOW, USE_SEGMENTS)
            p_v, ds, ds_raw = _probs_and_dlogits(q, k, v, do, lse2, delta, bias, keep, seed, drop_base, offs_m,
                                                 offs_n, seq_k, logit_scale, softcap, dropout_p, dropout_scale,
                                                 USE_SOFTCAP, USE_BIAS, USE_DROPOUT, DOT_PRECISION)
            dv += _dot(tl.trans(p_v.to(do.dtype)), do, DOT_PRECISION)
            dk += _dot(tl.trans(ds_raw.to(q.dtype)), q, DOT_PRECISION)
            if WRITE_DS:  # [batch, heads_q, seq_q, seq_k], float32; every pair is visited once
                ds_base = (b * HEADS_Q + h) * seq_q * seq_k
                tl.store(ds_ptr + ds_base + offs_m[:, None].to(tl.int64) * seq_k + offs_n[None, :], ds,
                         mask=row_mask[:, None] & (offs_n < len_k)[None, :])

    _store_rows(dk_ptr, dk * sm_scale, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
    _store_rows(dv_ptr, dv, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)


@triton.jit(do_not_specialize_on_alignment=RUNTIME_INTS)
def flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                        do_ptr, lse_ptr, delta_ptr,
                        seq_q, seq_k, total_q, total_k, win_left, win_right,
                        logit_scale, softcap, dropout_p, dropout_scale, sm_scale,
                        dq_ptr,
                        HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        IS_VARLEN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                        USE_BIAS: tl.constexpr, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr,
                        USE_SEGMENTS: tl.constexpr, USE_DROPOUT: tl.constexpr,
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
    lse2 = tl.load(lse_ptr + rows + offs_m, mask=row_mask, other=0.0) * LOG2E_C
    delta = tl.load(delta_ptr + rows + offs_m, mask=row_mask, other=0.0)
    q_seg = offs_m
    if USE_SEGMENTS:
        q_seg = tl.load(q_seg_ptr + b * seq_q + offs_m, mask=row_mask, other=0)
    seed = 0
    if USE_DROPOUT:
        seed = tl.load(seed_ptr)
    drop_base = (b * HEADS_Q + h) * seq_q

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, USE_WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
        v = _load_rows(v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
        k_seg = offs_n
        if USE_SEGMENTS:
            k_seg = tl.load(kv_seg_ptr + b * seq_k + offs_n, mask=offs_n < len_k, other=0)
        bias = 0.0
        if USE_BIAS:
            bias = _load_bias(bias_ptr, b, h, offs_m, offs_n, len_q, len_k, BIAS_BATCHED, BIAS_HEADS)
        keep = _keep(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg, USE_WINDOW, USE_SEGMENTS)
        _, _, ds_raw = _probs_and_dlogits(q, k, v, do, lse2, delta, bias, keep, seed, drop_base, offs_m, offs_n,
                                          seq_k, logit_scale, softcap, dropout_p, dropout_scale,
                                          USE_SOFTCAP, USE_BIAS, USE_DROPOUT, DOT_PRECISION)
        dq += _dot(ds_raw.to(k.dtype), k, DOT_PRECISION)

    _store_rows(dq_ptr, dq * sm_scale, q_start, offs_m, len_q, h, offs_d, HEADS_Q * HEAD_DIM, HEAD_DIM)
