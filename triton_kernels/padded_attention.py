"""Single-head causal attention over left-padded sequences, tiled with an online softmax.

Tensors are ``[batch, seq, head_dim]``; ``n_pad[b]`` leading tokens of sequence ``b`` are padding.
Query ``i`` attends to keys ``n_pad[b] <= j <= i``; padding queries produce zeros (and a
log-sum-exp of -inf), never NaN. Two forward kernels share the same online-softmax tile update:

* ``attention_fwd_kernel`` computes logits from q and k (``padded_attention``);
* ``scores_v_fwd_kernel`` reads given logits (``padded_softmax_v``: softmax(scores) @ v).

The backward pass is flash-attention style: ``delta = rowsum(o * do)``, then one kernel per key
block for dk/dv and one per query block for dq, recomputing probabilities from the saved
log-sum-exp (kept in base-2 units, as the forward works with ``exp2``).

Any sequence length works and any head_dim <= 256 (padded to a power of two inside the kernel
by masked loads, never by copying inputs).
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from .plan import DeviceFacts, LaunchPlan, Output, cdiv, check_float_dtype, fp32, next_power_of_2

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# --------------------------------------------------------------------------------------------
# shared pieces


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    # "upcast" is the interpreter's plan: its bf16 dot multiplies raw bit patterns (triton
    # 3.9), so operands go through float32 there. GPUs get the plan's real input precision.
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _causal_padded_keep(offs_m, offs_n, pad, seq_len):
    """Which (query, key) pairs are attended: key in [pad, query], both inside the sequence."""
    i = offs_m[:, None]
    j = offs_n[None, :]
    return (j <= i) & (j >= pad) & (i < seq_len)


@triton.jit
def _online_softmax_update(acc, m_i, l_i, s, keep, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 logits ``s`` (and its values ``v``) into the running state."""
    s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # all-masked so far: keep exp2 finite
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _finish_rows(acc, m_i, l_i, o_ptrs, lse_ptrs, row_mask, d_mask, WRITE_LSE: tl.constexpr):
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse2 = tl.where(empty, -float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptrs, lse2, mask=row_mask)


# --------------------------------------------------------------------------------------------
# forward kernels


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_fwd_kernel(q_ptr, k_ptr, v_ptr, n_pad_ptr, seq_len, head_dim, qk_scale,
                         o_ptr, lse_ptr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < seq_len
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    q = tl.load(q_ptr + base + offs_m[:, None] * head_dim + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N  # keys before the padding block are never attended
    hi = tl.minimum(start_m + BLOCK_M, seq_len)  # nor are keys after the last query (causal)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < seq_len)[:, None] & d_mask[None, :]
        kv_offs = base + offs_n[:, None] * head_dim + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, keep, v, DOT_PRECISION)

    o_ptrs = o_ptr + base + offs_m[:, None] * head_dim + offs_d[None, :]
    _finish_rows(acc, m_i, l_i, o_ptrs, lse_ptr + b * seq_len + offs_m, row_mask, d_mask, True)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_fwd_kernel(s_ptr, v_ptr, n_pad_ptr, seq_len, head_dim, o_ptr, lse_ptr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < seq_len
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    s_base = b * seq_len * seq_len

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        s = tl.load(s_ptr + s_base + offs_m[:, None] * seq_len + offs_n[None, :], mask=keep, other=0.0)
        v = tl.load(v_ptr + base + offs_n[:, None] * head_dim + offs_d[None, :],
                    mask=(offs_n < seq_len)[:, None] & d_mask[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s.to(tl.float32) * 1.4426950408889634,
                                               keep, v, DOT_PRECISION)

    o_ptrs = o_ptr + base + offs_m[:, None] * head_dim + offs_d[None, :]
    _finish_rows(acc, m_i, l_i, o_ptrs, lse_ptr + b * seq_len + offs_m, row_mask, d_mask, True)


# --------------------------------------------------------------------------------------------
# backward kernels


@triton.jit(do_not_specialize_on_alignment=["n_rows", "head_dim"])
def attention_bwd_delta_kernel(o_ptr, do_ptr, n_rows, head_dim, delta_ptr,
                               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (offs_d < head_dim)[None, :]
    offs = rows.to(tl.int64)[:, None] * head_dim + offs_d[None, :]
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


@triton.jit
def _recompute_p(q, k, lse2, keep, qk_scale, DOT_PRECISION: tl.constexpr):
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
    lse_ref = tl.where(lse2 == -float("inf"), float("inf"), lse2)  # empty rows: p = 0
    return tl.where(keep, tl.exp2(s - lse_ref[:, None]), 0.0)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr,
                              seq_len, head_dim, qk_scale, sm_scale,
                              dk_ptr, dv_ptr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    kv_mask = (offs_n < seq_len)[:, None] & d_mask[None, :]
    kv_offs = base + offs_n[:, None] * head_dim + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = (tl.maximum(start_n, pad) // BLOCK_M) * BLOCK_M  # queries before this key never see it
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_mask = offs_m < seq_len
        q_offs = base + offs_m[:, None] * head_dim + offs_d[None, :]
        q_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + q_offs, mask=q_mask, other=0.0)
        lse2 = tl.load(lse_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
        delta = tl.load(delta_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _recompute_p(q, k, lse2, keep, qk_scale, DOT_PRECISION)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION)
        dp = _dot(do, tl.trans(v), DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION)

    tl.store(dk_ptr + kv_offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr,
                            seq_len, head_dim, qk_scale, sm_scale,
                            dq_ptr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < seq_len
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    q_offs = base + offs_m[:, None] * head_dim + offs_d[None, :]
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_offs, mask=q_mask, other=0.0)
    lse2 = tl.load(lse_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < seq_len)[:, None] & d_mask[None, :]
        kv_offs = base + offs_n[:, None] * head_dim + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _recompute_p(q, k, lse2, keep, qk_scale, DOT_PRECISION)
        dp = _dot(do, tl.trans(v), DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION)

    tl.store(dq_ptr + q_offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _probs_from_scores(s_ptr, s_base, offs_m, offs_n, lse2, keep, seq_len):
    s = tl.load(s_ptr + s_base + offs_m[:, None] * seq_len + offs_n[None, :], mask=keep, other=0.0)
    lse_ref = tl.where(lse2 == -float("inf"), float("inf"), lse2)
    return tl.where(keep, tl.exp2(s.to(tl.float32) * 1.4426950408889634 - lse_ref[:, None]), 0.0)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_bwd_ds_kernel(s_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr, seq_len, head_dim,
                           ds_ptr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # dscores = P * (dO v^T - delta); every tile is written (zeros outside the window).
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < seq_len
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    s_base = b * seq_len * seq_len
    do = tl.load(do_ptr + base + offs_m[:, None] * head_dim + offs_d[None, :],
                 mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    lse2 = tl.load(lse_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
    delta = tl.load(delta_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _probs_from_scores(s_ptr, s_base, offs_m, offs_n, lse2, keep, seq_len)
        v = tl.load(v_ptr + base + offs_n[:, None] * head_dim + offs_d[None, :],
                    mask=(offs_n < seq_len)[:, None] & d_mask[None, :], other=0.0)
        dp = _dot(do, tl.trans(v), DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        tl.store(ds_ptr + s_base + offs_m[:, None] * seq_len + offs_n[None, :], ds.to(ds_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (offs_n < seq_len)[None, :])


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_bwd_dv_kernel(s_ptr, do_ptr, lse_ptr, n_pad_ptr, seq_len, head_dim, dv_ptr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # dv = P^T dO, one key block per program.
    start_n = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    base = b * seq_len * head_dim
    s_base = b * seq_len * seq_len
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = (tl.maximum(start_n, pad) // BLOCK_M) * BLOCK_M
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_mask = offs_m < seq_len
        do = tl.load(do_ptr + base + offs_m[:, None] * head_dim + offs_d[None, :],
                     mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        lse2 = tl.load(lse_ptr + b * seq_len + offs_m, mask=row_mask, other=0.0)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _probs_from_scores(s_ptr, s_base, offs_m, offs_n, lse2, keep, seq_len)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION)
    tl.store(dv_ptr + base + offs_n[:, None] * head_dim + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=(offs_n < seq_len)[:, None] & d_mask[None, :])


# --------------------------------------------------------------------------------------------
# plans


def _dot_precision(dtype: str, facts: DeviceFacts) -> str:
    if facts.is_cpu:
        return "upcast"
    # fp32 inputs get true fp32 products (tf32 would cost ~1e-3 relative error).
    return "ieee" if dtype == "float32" else "tf32"


def _check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")


def _fwd_tiles(head_dim: int, dtype: str, facts: DeviceFacts) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for a forward pass."""
    block_d = max(16, next_power_of_2(head_dim))
    if facts.is_cpu:  # the interpreter favours few, large tiles
        return 64, 64, block_d, 4, 1
    elem = 4 if dtype == "float32" else 2
    block_m, block_n = (128, 64) if block_d <= 128 else (64, 32)
    if elem == 4:
        block_n //= 2
    num_warps = 4 if block_d <= 64 else 8
    num_stages = 3 if block_d <= 64 else 2
    # k and v tiles, double-buffered per stage, plus q: keep inside shared memory.
    while num_stages * 2 * block_n * block_d * elem + block_m * block_d * elem > facts.shared_memory * 0.9:
        num_stages -= 1
        if num_stages == 1:
            break
    return block_m, block_n, block_d, num_warps, num_stages


def _bwd_tiles(head_dim: int, dtype: str, facts: DeviceFacts) -> tuple[int, int, int, int, int]:
    block_d = max(16, next_power_of_2(head_dim))
    if facts.is_cpu:
        return 64, 64, block_d, 4, 1
    elem = 4 if dtype == "float32" else 2
    block = 64 if block_d <= 64 else 32
    if elem == 4 and block_d > 64:
        block = 16 if block_d > 128 else 32
    return block, block, block_d, 4 if block_d <= 64 else 8, 1


def _common(q_shape, dtype):
    check_float_dtype("q", dtype)
    batch, seq_len, head_dim = q_shape
    _check_head_dim(head_dim)
    return batch, seq_len, head_dim


@functools.lru_cache(maxsize=512)
def attention_fwd_plan(q_shape: tuple, dtype: str, softmax_scale: float, facts: DeviceFacts) -> LaunchPlan:
    batch, seq_len, head_dim = _common(q_shape, dtype)
    bm, bn, bd, warps, stages = _fwd_tiles(head_dim, dtype, facts)
    return LaunchPlan(
        kernel=attention_fwd_kernel,
        grid=(cdiv(seq_len, bm), batch),
        inputs=("q_ptr", "k_ptr", "v_ptr", "n_pad_ptr"), input_dtypes=(dtype, dtype, dtype, "int32"),
        scalars=(("seq_len", seq_len), ("head_dim", head_dim), ("qk_scale", fp32(softmax_scale * LOG2E))),
        outputs=(Output("o_ptr", tuple(q_shape), dtype), Output("lse_ptr", (batch, seq_len), "float32")),
        constexprs=(("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd), ("DOT_PRECISION", _dot_precision(dtype, facts))),
        num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )


@functools.lru_cache(maxsize=512)
def scores_v_fwd_plan(v_shape: tuple, dtype: str, facts: DeviceFacts) -> LaunchPlan:
    batch, seq_len, head_dim = _common(v_shape, dtype)
    bm, bn, bd, warps, stages = _fwd_tiles(head_dim, dtype, facts)
    return LaunchPlan(
        kernel=scores_v_fwd_kernel,
        grid=(cdiv(seq_len, bm), batch),
        inputs=("s_ptr", "v_ptr", "n_pad_ptr"), input_dtypes=(dtype, dtype, "int32"),
        scalars=(("seq_len", seq_len), ("head_dim", head_dim)),
        outputs=(Output("o_ptr", tuple(v_shape), dtype), Output("lse_ptr", tuple(v_shape[:2]), "float32")),
        constexprs=(("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd), ("DOT_PRECISION", _dot_precision(dtype, facts))),
        num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )


def _delta_plan(batch, seq_len, head_dim, block_d, dtype, facts) -> LaunchPlan:
    n_rows = batch * seq_len
    rows = 16 if not facts.is_cpu else 64
    return LaunchPlan(
        kernel=attention_bwd_delta_kernel,
        grid=(cdiv(n_rows, rows),),
        inputs=("o_ptr", "do_ptr"), input_dtypes=(dtype, dtype),
        scalars=(("n_rows", n_rows), ("head_dim", head_dim)),
        outputs=(Output("delta_ptr", (batch, seq_len), "float32"),),
        constexprs=(("BLOCK_M", rows), ("BLOCK_D", block_d)),
        num_warps=4, num_stages=1, enable_fp_fusion=True,
    )


@functools.lru_cache(maxsize=512)
def attention_bwd_plans(q_shape: tuple, dtype: str, softmax_scale: float,
                        facts: DeviceFacts) -> tuple[LaunchPlan, LaunchPlan, LaunchPlan]:
    """(delta, dk/dv, dq) plans. Inputs: delta(o, do); dkdv and dq(q, k, v, do, lse, delta, n_pad)."""
    batch, seq_len, head_dim = _common(q_shape, dtype)
    bm, bn, bd, warps, stages = _bwd_tiles(head_dim, dtype, facts)
    delta = _delta_plan(batch, seq_len, head_dim, bd, dtype, facts)
    inputs = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "n_pad_ptr")
    in_dtypes = (dtype,) * 4 + ("float32", "float32", "int32")
    scalars = (("seq_len", seq_len), ("head_dim", head_dim),
               ("qk_scale", fp32(softmax_scale * LOG2E)), ("sm_scale", fp32(softmax_scale)))
    consts = (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd), ("DOT_PRECISION", _dot_precision(dtype, facts)))
    dkdv = LaunchPlan(
        kernel=attention_bwd_dkdv_kernel, grid=(cdiv(seq_len, bn), batch),
        inputs=inputs, input_dtypes=in_dtypes, scalars=scalars,
        outputs=(Output("dk_ptr", tuple(q_shape), dtype), Output("dv_ptr", tuple(q_shape), dtype)),
        constexprs=consts, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )
    dq = LaunchPlan(
        kernel=attention_bwd_dq_kernel, grid=(cdiv(seq_len, bm), batch),
        inputs=inputs, input_dtypes=in_dtypes, scalars=scalars,
        outputs=(Output("dq_ptr", tuple(q_shape), dtype),),
        constexprs=consts, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )
    return delta, dkdv, dq


@functools.lru_cache(maxsize=512)
def scores_v_bwd_plans(v_shape: tuple, dtype: str, facts: DeviceFacts) -> tuple[LaunchPlan, LaunchPlan, LaunchPlan]:
    """(delta, dscores, dv) plans for padded_softmax_v. Inputs: delta(o, do);
    dscores(scores, v, do, lse, delta, n_pad); dv(scores, do, lse, n_pad)."""
    batch, seq_len, head_dim = _common(v_shape, dtype)
    bm, bn, bd, warps, stages = _bwd_tiles(head_dim, dtype, facts)
    delta = _delta_plan(batch, seq_len, head_dim, bd, dtype, facts)
    scalars = (("seq_len", seq_len), ("head_dim", head_dim))
    consts = (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd), ("DOT_PRECISION", _dot_precision(dtype, facts)))
    dscores = LaunchPlan(
        kernel=scores_v_bwd_ds_kernel, grid=(cdiv(seq_len, bm), batch),
        inputs=("s_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "n_pad_ptr"),
        input_dtypes=(dtype, dtype, dtype, "float32", "float32", "int32"), scalars=scalars,
        outputs=(Output("ds_ptr", (batch, seq_len, seq_len), dtype),),
        constexprs=consts, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )
    dv = LaunchPlan(
        kernel=scores_v_bwd_dv_kernel, grid=(cdiv(seq_len, bn), batch),
        inputs=("s_ptr", "do_ptr", "lse_ptr", "n_pad_ptr"), input_dtypes=(dtype, dtype, "float32", "int32"),
        scalars=scalars, outputs=(Output("dv_ptr", tuple(v_shape), dtype),),
        constexprs=consts, num_warps=warps, num_stages=stages, enable_fp_fusion=True,
    )
    return delta, dscores, dv


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
