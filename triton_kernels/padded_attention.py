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

from .params import BwdParams, FwdParams, attention_smem_bytes, check_params, check_tile_numel, itemsize
from . import plan as launch_plan
from .plan import DeviceFacts, LaunchPlan, Output, cdiv, check_float_dtype, fp32, next_power_of_2

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
INT32_MAX = 2**31 - 1


def max_batch(seq_len: int) -> int:
    """The most batch rows of ``seq_len`` one launch takes: the batch is the kernels' grid axis 1
    (CUDA's limit, ``plan.MAX_GRID``), and the backward's delta kernel counts batch * seq_len
    rows in int32 (a runtime scalar)."""
    return min(launch_plan.MAX_GRID[1], INT32_MAX // max(seq_len, 1))


def fold_limit(shape) -> int:
    """The most batch rows of a ``[batch, seq, ...]`` sample (q, or padded_softmax_v's scores) that
    one folded launch takes (the fronts' vmap rules)."""
    return max_batch(shape[1])


def check_batch(name: str, batch: int, seq_len: int) -> None:
    """An op's argument ``name`` of ``batch`` rows of ``seq_len``: a ValueError naming it past
    ``max_batch``, before any kernel runs (the forward ran, and the gradient failed in the delta
    kernel's plan, past int32 rows)."""
    limit = max_batch(seq_len)
    if batch > limit:
        raise ValueError(f"{name} has batch {batch}, more than the {limit} batch rows of seq {seq_len} one launch "
                         f"takes (a CUDA grid axis of {launch_plan.MAX_GRID[1]}, and batch * seq within int32); "
                         "split the batch")


def check_sequence(name: str, seq_len: int, width: int) -> None:
    """An op's argument ``name`` whose sequences are ``seq_len`` rows of ``width`` elements (q, k,
    v: head_dim; padded_softmax_v's scores: seq_len): the kernels address a sequence's elements
    with int32 offsets (row x width; the batch term is int64), which wrapped past 2**31 - 1 and
    read and wrote elsewhere (scores from seq 46341 on). Refused by name before any kernel runs:
    64-bit offsets there cost padded_softmax_v 10-25% on an H200 at every size."""
    if seq_len * width > INT32_MAX:
        raise ValueError(f"{name} has sequences of {seq_len} x {width} elements, past the {INT32_MAX} that the "
                         "kernels' 32-bit offsets address; use flash_attention (no [seq, seq] scores) or "
                         "shorter sequences")


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
def _dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` with the product accumulated in place (no second accumulator tile)."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _causal_padded_keep(offs_m, offs_n, pad, seq_len):
    """Which (query, key) pairs are attended: key in [pad, query], both inside the sequence."""
    i = offs_m[:, None]
    j = offs_n[None, :]
    return (j <= i) & (j >= pad) & (i < seq_len)


@triton.jit
def _exp2_units(x, UNIT: tl.constexpr):
    """2 ** (x * UNIT) for a logit difference x <= 0, in logit units of UNIT bits each. Scaling
    the difference, not each logit, keeps logits beyond 3.4e38 / UNIT from overflowing."""
    if UNIT == 1.0:
        return tl.exp2(x)
    else:
        return tl.exp2(x * UNIT)


@triton.jit
def _online_softmax_update(acc, m_i, l_i, s, keep, v, DOT_PRECISION: tl.constexpr, UNIT: tl.constexpr):
    """Fold one tile of logits ``s`` (``UNIT`` bits each: 1 for base-2 logits, log2(e) for
    natural ones) and its values ``v`` into the running state."""
    s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # all-masked so far: keep exp2 finite
    p = _exp2_units(s - m_ref[:, None], UNIT)
    alpha = _exp2_units(m_i - m_ref, UNIT)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _sequence(n_pad_ptr, seq_len, head_dim):
    """This program's batch row: (index b as int64, its padding clamped to [0, seq_len], the
    offset of its [seq, head_dim] slab)."""
    b = tl.program_id(1).to(tl.int64)
    pad = tl.minimum(tl.maximum(tl.load(n_pad_ptr + b), 0), seq_len)
    return b, pad, b * seq_len * head_dim


@triton.jit
def _tile_mask(offs, offs_d, seq_len, head_dim):
    return (offs < seq_len)[:, None] & (offs_d < head_dim)[None, :]


@triton.jit
def _load_tokens(ptr, base, offs, offs_d, pad, seq_len, head_dim):
    """Rows ``offs`` of a [seq, head_dim] slab, zero outside it (head_dim padded to BLOCK_D) and
    on the padding rows (``offs < pad``), which are never read: padding may hold anything (an
    uninitialized buffer's NaN), and a masked probability of 0 times a NaN is still NaN in
    ``p @ v``, ``ds @ k`` and ``ds^T @ q``."""
    return tl.load(ptr + base + offs[:, None] * head_dim + offs_d[None, :],
                   mask=_tile_mask(offs, offs_d, seq_len, head_dim) & (offs >= pad)[:, None], other=0.0)


@triton.jit
def _store_tile(ptr, base, offs, offs_d, seq_len, head_dim, value):
    tl.store(ptr + base + offs[:, None] * head_dim + offs_d[None, :], value.to(ptr.dtype.element_ty),
             mask=_tile_mask(offs, offs_d, seq_len, head_dim))


@triton.jit
def _load_token_rows(ptr, b, offs, pad, seq_len):
    """Per-row float32 statistics (lse, delta) of batch row ``b``, zero on rows below ``pad``:
    delta = rowsum(o * do) is NaN there when the incoming gradient's padding rows are."""
    return tl.load(ptr + b * seq_len + offs, mask=(offs < seq_len) & (offs >= pad), other=0.0)


@triton.jit
def _finish_rows(acc, m_i, l_i, o_ptr, lse_ptr, b, base, offs_m, offs_d, seq_len, head_dim, UNIT: tl.constexpr):
    """Store the output rows and their log-sum-exp, in the logits' units (see _online_softmax_update)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    # one reciprocal a row, then products: not a division an element (as the flash forward)
    _store_tile(o_ptr, base, offs_m, offs_d, seq_len, head_dim, acc * (1.0 / l_safe)[:, None])
    log_l = tl.log2(l_safe)
    if UNIT != 1.0:
        log_l = log_l / UNIT
    tl.store(lse_ptr + b * seq_len + offs_m, tl.where(empty, -float("inf"), m_i + log_l), mask=offs_m < seq_len)


# --------------------------------------------------------------------------------------------
# forward kernels


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_fwd_kernel(q_ptr, k_ptr, v_ptr, n_pad_ptr, seq_len, head_dim, qk_scale,
                         o_ptr, lse_ptr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    qk_scale = tl.cast(qk_scale, tl.float32)
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tokens(q_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N  # keys before the padding block are never attended
    hi = tl.minimum(start_m + BLOCK_M, seq_len)  # nor are keys after the last query (causal)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tokens(k_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        v = _load_tokens(v_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, keep, v, DOT_PRECISION, 1.0)
    _finish_rows(acc, m_i, l_i, o_ptr, lse_ptr, b, base, offs_m, offs_d, seq_len, head_dim, 1.0)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_fwd_kernel(s_ptr, v_ptr, n_pad_ptr, seq_len, head_dim, o_ptr, lse_ptr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        s = _load_scores(s_ptr, b, offs_m, offs_n, keep, seq_len)
        v = _load_tokens(v_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        acc, m_i, l_i = _online_softmax_update(acc, m_i, l_i, s, keep, v, DOT_PRECISION, 1.4426950408889634)
    _finish_rows(acc, m_i, l_i, o_ptr, lse_ptr, b, base, offs_m, offs_d, seq_len, head_dim, 1.4426950408889634)


@triton.jit
def _load_scores(s_ptr, b, offs_m, offs_n, mask, seq_len):
    """A float32 tile of the [batch, seq, seq] score tensor."""
    ptrs = s_ptr + b * seq_len * seq_len + offs_m[:, None] * seq_len + offs_n[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


# --------------------------------------------------------------------------------------------
# backward kernels


@triton.jit(do_not_specialize_on_alignment=["n_rows", "head_dim"])
def attention_bwd_delta_kernel(o_ptr, do_ptr, n_rows, head_dim, delta_ptr,
                               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # delta = rowsum(o * do), over all batch rows at once (a [batch * seq, head_dim] slab).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tokens(o_ptr, 0, rows.to(tl.int64), offs_d, 0, n_rows, head_dim).to(tl.float32)
    do = _load_tokens(do_ptr, 0, rows.to(tl.int64), offs_d, 0, n_rows, head_dim).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


@triton.jit
def _recompute_p(q, k, lse2, keep, qk_scale, DOT_PRECISION: tl.constexpr):
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
    return _probs(s, lse2, keep, 1.0)


@triton.jit
def _probs(s, lse, keep, UNIT: tl.constexpr):
    """Probabilities from logits and the row's log-sum-exp (both ``UNIT`` bits per unit, see
    _online_softmax_update); 0 where masked."""
    lse_ref = tl.where(lse == -float("inf"), float("inf"), lse)  # empty rows: p = 0
    return tl.where(keep, _exp2_units(s - lse_ref[:, None], UNIT), 0.0)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr,
                              seq_len, head_dim, qk_scale, sm_scale,
                              dk_ptr, dv_ptr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tokens(k_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
    v = _load_tokens(v_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = (tl.maximum(start_n, pad) // BLOCK_M) * BLOCK_M  # queries before this key never see it
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tokens(q_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
        do = _load_tokens(do_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _recompute_p(q, k, _load_token_rows(lse_ptr, b, offs_m, 0, seq_len), keep, qk_scale, DOT_PRECISION)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION)
        dp = _dot(do, tl.trans(v), DOT_PRECISION)
        ds = p * (dp - _load_token_rows(delta_ptr, b, offs_m, pad, seq_len)[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION)
    _store_tile(dk_ptr, base, offs_n, offs_d, seq_len, head_dim, dk * sm_scale)
    _store_tile(dv_ptr, base, offs_n, offs_d, seq_len, head_dim, dv)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr,
                            seq_len, head_dim, qk_scale, sm_scale,
                            dq_ptr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    # torch.compile passes Python floats to Triton as fp64; keep the math in fp32 everywhere.
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tokens(q_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
    do = _load_tokens(do_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
    lse2 = _load_token_rows(lse_ptr, b, offs_m, 0, seq_len)
    delta = _load_token_rows(delta_ptr, b, offs_m, pad, seq_len)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = (pad // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tokens(k_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        v = _load_tokens(v_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _recompute_p(q, k, lse2, keep, qk_scale, DOT_PRECISION)
        ds = p * (_dot(do, tl.trans(v), DOT_PRECISION) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION)
    _store_tile(dq_ptr, base, offs_m, offs_d, seq_len, head_dim, dq * sm_scale)


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_bwd_ds_kernel(s_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, n_pad_ptr, seq_len, head_dim,
                           ds_ptr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # dscores = P * (dO v^T - delta); every tile is written (zeros outside the window).
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    do = _load_tokens(do_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
    lse = _load_token_rows(lse_ptr, b, offs_m, 0, seq_len)  # natural log (the scores' units)
    delta = _load_token_rows(delta_ptr, b, offs_m, pad, seq_len)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        p = _probs(_load_scores(s_ptr, b, offs_m, offs_n, keep, seq_len), lse, keep, 1.4426950408889634)
        v = _load_tokens(v_ptr, base, offs_n, offs_d, pad, seq_len, head_dim)
        ds = p * (_dot(do, tl.trans(v), DOT_PRECISION) - delta[:, None])
        ptrs = ds_ptr + b * seq_len * seq_len + offs_m[:, None] * seq_len + offs_n[None, :]
        tl.store(ptrs, ds.to(ds_ptr.dtype.element_ty), mask=(offs_m < seq_len)[:, None] & (offs_n < seq_len)[None, :])


@triton.jit(do_not_specialize_on_alignment=["seq_len", "head_dim"])
def scores_v_bwd_dv_kernel(s_ptr, do_ptr, lse_ptr, n_pad_ptr, seq_len, head_dim, dv_ptr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    # dv = P^T dO, one key block per program.
    b, pad, base = _sequence(n_pad_ptr, seq_len, head_dim)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = (tl.maximum(start_n, pad) // BLOCK_M) * BLOCK_M
    for start_m in range(lo, seq_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        do = _load_tokens(do_ptr, base, offs_m, offs_d, pad, seq_len, head_dim)
        keep = _causal_padded_keep(offs_m, offs_n, pad, seq_len)
        s = _load_scores(s_ptr, b, offs_m, offs_n, keep, seq_len)
        p = _probs(s, _load_token_rows(lse_ptr, b, offs_m, 0, seq_len), keep, 1.4426950408889634)
        dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PRECISION)
    _store_tile(dv_ptr, base, offs_n, offs_d, seq_len, head_dim, dv)


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


MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16
# Attention names for the same tile sides; either spelling works, not both with different values.
_TILE_FIELDS = (("blocksize_m", "q_blocksize"), ("blocksize_n", "kv_blocksize"))


def override_tiles(tiles: tuple[int, int, int, int, int], params: FwdParams | BwdParams | None, dtype: str,
                   facts: DeviceFacts, what: str) -> tuple[int, int, int, int, int]:
    """``tiles`` (BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) with ``params``' fields
    applied, rejecting fields that do not apply, tiles below ``MIN_BLOCK`` and configs whose
    estimated shared memory does not fit ``facts`` (``what`` names the argument in errors)."""
    if params is None:
        return tiles
    given = params.to_dict()
    known = {f for pair in _TILE_FIELDS for f in pair} | {"num_warps", "num_stages"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{what}: field(s) {unknown} do not apply; use {sorted(known)}")
    bm, bn, bd, warps, stages = tiles
    sides = []
    for (name, alias), default in zip(_TILE_FIELDS, (bm, bn)):
        a, b = given.get(name), given.get(alias)
        if a is not None and b is not None and a != b:
            raise ValueError(f"{what}: {name}={a} and {alias}={b} disagree (they are the same tile side)")
        side = a or b or default
        if side < MIN_BLOCK:
            raise ValueError(f"{what}: {name} must be at least {MIN_BLOCK}, got {side}")
        sides.append(side)
    bm, bn = sides
    check_tile_numel(what, (bm, bn), (bm, bd), (bn, bd))
    warps, stages = given.get("num_warps", warps), given.get("num_stages", stages)
    smem = attention_smem_bytes(bm, bn, bd, dtype, stages)
    if isinstance(params, BwdParams):  # the backward keeps one more tile (dO or V) resident
        smem += max(bm, bn) * bd * itemsize(dtype)
    check_params(params, facts, smem, what)
    return bm, bn, bd, warps, stages


def _common(q_shape, dtype):
    check_float_dtype("q", dtype)
    batch, seq_len, head_dim = q_shape
    _check_head_dim(head_dim)
    return batch, seq_len, head_dim


@functools.lru_cache(maxsize=512)
def attention_fwd_plan(q_shape: tuple, dtype: str, softmax_scale: float, facts: DeviceFacts,
                       params: FwdParams | None = None) -> LaunchPlan:
    """``params`` overrides block sizes, warps and stages (see ``override_tiles``)."""
    batch, seq_len, head_dim = _common(q_shape, dtype)
    bm, bn, bd, warps, stages = override_tiles(_fwd_tiles(head_dim, dtype, facts), params, dtype, facts,
                                               "padded_attention fwd_params")
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
def attention_bwd_plans(q_shape: tuple, dtype: str, softmax_scale: float, facts: DeviceFacts,
                        params: BwdParams | None = None) -> tuple[LaunchPlan, LaunchPlan, LaunchPlan]:
    """(delta, dk/dv, dq) plans. Inputs: delta(o, do); dkdv and dq(q, k, v, do, lse, delta, n_pad).
    ``params`` overrides the dk/dv and dq tiles (see ``override_tiles``)."""
    batch, seq_len, head_dim = _common(q_shape, dtype)
    bm, bn, bd, warps, stages = override_tiles(_bwd_tiles(head_dim, dtype, facts), params, dtype, facts,
                                               "padded_attention bwd_params")
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
