"""Tile-level pieces the flash-attention kernels share: where a sequence lives, which key/query
blocks can matter, which (query, key) pairs are attended, the logits, and the dropout draw.

Conventions (all kernels): the grid's axis 1 is the head and axis 2 the batch row (or sequence,
for varlen); logits are kept in base-2 units (``exp2``), the log-sum-exp in memory is natural.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Kernels may only read constexpr globals.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)


@triton.jit
def _sequence(b, cu_q_ptr, cu_k_ptr, seq_q, seq_k, total_q, total_k, IS_VARLEN: tl.constexpr):
    """(first token, length) of row ``b``'s queries and keys in the packed token axis."""
    if IS_VARLEN:
        # Clamped so that cu_seqlens values jax could not check (under jit) stay in bounds.
        q_end = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1), 0), total_q).to(tl.int64)
        q_start = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b), 0).to(tl.int64), q_end)
        k_end = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b + 1), 0), total_k).to(tl.int64)
        k_start = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b), 0).to(tl.int64), k_end)
        len_q = tl.minimum(q_end - q_start, seq_q).to(tl.int32)
        len_k = tl.minimum(k_end - k_start, seq_k).to(tl.int32)
    else:
        q_start = b * seq_q
        k_start = b * seq_k
        len_q = seq_q
        len_k = seq_k
    return q_start, len_q, k_start, len_k


@triton.jit
def _key_range(start_m, len_q, len_k, win_left, win_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """[lo, hi): the keys a query block can attend; lo is a multiple of BLOCK_N."""
    if USE_WINDOW:
        diag = start_m + len_k - len_q  # key on the (bottom-right aligned) diagonal of the first query
        lo = (tl.maximum(diag - win_left, 0) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(diag + BLOCK_M + win_right, len_k)
    else:
        lo = 0
        hi = len_k
    return lo, hi


@triton.jit
def _query_range(start_n, len_q, len_k, win_left, win_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """[lo, hi): the queries that can attend a key block; lo is a multiple of BLOCK_M."""
    if USE_WINDOW:
        diag = start_n - (len_k - len_q)  # query whose diagonal key is the block's first key
        lo = (tl.maximum(diag - win_right, 0) // BLOCK_M) * BLOCK_M
        hi = tl.minimum(diag + BLOCK_N + win_left, len_q)
    else:
        lo = 0
        hi = len_q
    return lo, hi


@triton.jit
def _split3(lo, hi, full_lo, full_hi):
    """Clamp a fully-kept sub-range into [lo, hi): lo <= a <= b <= hi. The loops then visit
    [lo, a) and [b, hi) with masks and [a, b) without."""
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    return a, b


@triton.jit
def _run_bounds(run: tl.constexpr, lo, a, b, hi):
    """Bounds of run 0, 1 or 2 of a loop split at a <= b: [lo, a), [a, b), [b, hi)."""
    if run == 0:
        return lo, a
    elif run == 1:
        return a, b
    else:
        return b, hi


@triton.jit
def _full_key_range(start_m, len_q, len_k, win_left, win_right, lo, hi, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SEGMENTS: tl.constexpr):
    """[a, b) inside [lo, hi), multiples of BLOCK_N: key blocks every query row of the block
    attends entirely (inside the sequence and the window), so they need no mask. Rows past
    ``len_q`` are ignored: they are never stored. Segment ids: every block is masked."""
    if USE_SEGMENTS:
        return hi, hi
    if USE_WINDOW:
        diag_first = start_m + len_k - len_q
        first = tl.maximum(diag_first + BLOCK_M - 1 - win_left, 0)  # the last row's first key
        full_lo = (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        end = tl.maximum(tl.minimum(diag_first + win_right + 1, len_k), 0)  # the first row's end
        full_hi = end // BLOCK_N * BLOCK_N
    else:
        full_lo = lo
        full_hi = len_k // BLOCK_N * BLOCK_N
    return _split3(lo, hi, full_lo, full_hi)


@triton.jit
def _full_query_range(start_n, len_q, len_k, win_left, win_right, lo, hi, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SEGMENTS: tl.constexpr):
    """[a, b) inside [lo, hi), multiples of BLOCK_M: query blocks inside the sequence that attend
    every key of the block at ``start_n``, so they need no mask (keys past ``len_k`` are never
    stored). The backward needs whole query blocks: a row past ``len_q`` would add to dk/dv."""
    if USE_SEGMENTS:
        return hi, hi
    end = len_q
    full_lo = lo
    if USE_WINDOW:
        off = len_k - len_q
        first = tl.maximum(start_n + BLOCK_N - 1 - off - win_right, 0)  # first row that sees the last key
        full_lo = (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.maximum(tl.minimum(start_n - off + win_left + 1, len_q), 0)  # rows that see the first key
    return _split3(lo, hi, full_lo, end // BLOCK_M * BLOCK_M)


@triton.jit
def _segment_ids(seg_ptr, b, seq, offs, length, USE_SEGMENTS: tl.constexpr):
    """Segment ids of positions ``offs`` of row ``b`` (``[batch, seq]``), 0 past ``length``.
    Without segments the positions stand in: ``_keep`` then never reads them."""
    ids = offs
    if USE_SEGMENTS:
        ids = tl.load(seg_ptr + b * seq + offs, mask=offs < length, other=0)
    return ids


@triton.jit
def _keep(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg,
          USE_WINDOW: tl.constexpr, USE_SEGMENTS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: query i attends key j."""
    return _keep_pairs(offs_m[:, None], offs_n[None, :], len_q, len_k, win_left, win_right, q_seg[:, None],
                       k_seg[None, :], USE_WINDOW, USE_SEGMENTS)


@triton.jit
def _keep_t(offs_m, offs_n, len_q, len_k, win_left, win_right, q_seg, k_seg,
            USE_WINDOW: tl.constexpr, USE_SEGMENTS: tl.constexpr):
    """``_keep`` transposed: [BLOCK_N, BLOCK_M], keys down, queries across."""
    return _keep_pairs(offs_m[None, :], offs_n[:, None], len_q, len_k, win_left, win_right, q_seg[None, :],
                       k_seg[:, None], USE_WINDOW, USE_SEGMENTS)


@triton.jit
def _keep_pairs(i, j, len_q, len_k, win_left, win_right, q_seg, k_seg,
                USE_WINDOW: tl.constexpr, USE_SEGMENTS: tl.constexpr):
    """Query i attends key j, for broadcastable 2-D index tiles (and their segment ids)."""
    keep = (i < len_q) & (j < len_k)
    if USE_WINDOW:
        diag = i + (len_k - len_q)
        keep = keep & (j >= diag - win_left) & (j <= diag + win_right)
    if USE_SEGMENTS:  # same segment, and ids <= 0 are padding
        keep = keep & (q_seg == k_seg) & (q_seg > 0)
    return keep


# Soft caps above this take tanh's precise form (``_tanh``); the plan decides (``softcap_mode``).
PRECISE_TANH_ABOVE = 128.0


def softcap_mode(softcap: float | None) -> int:
    """The kernels' USE_SOFTCAP constexpr: 0 without a soft cap, 1 with tanh's exp2 form, 2 with
    its precise form (caps above ``PRECISE_TANH_ABOVE``)."""
    if softcap is None:
        return 0
    return 2 if softcap > PRECISE_TANH_ABOVE else 1


@triton.jit
def _tanh(x, PRECISE: tl.constexpr):
    """tanh from exp2, so the interpreter and every GPU evaluate the same formula. Its ``1 - e``
    cancels at small |x| (relative error about 6e-8 / |x|), which a soft cap c turns into an
    absolute error of about c * 3e-8 in the logits: 3e-6 at c = 100, 3e-2 at c = 1e6. ``PRECISE``
    takes an odd Taylor polynomial to x**5 below |x| = 0.1 (2.7e-7 relative error throughout).
    It costs: on an H200 (bf16, 4 x 4096 x 16 x 128) a capped forward took 1.43-1.47x the time,
    forward + backward 1.22-1.31x, so only large caps use it."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E_C))  # tensor first: constexpr * tensor breaks the interpreter
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    if PRECISE:
        x2 = x * x
        t = tl.where(tl.abs(x) < 0.1, x * ((x2 * (2.0 / 15.0) - 1.0 / 3.0) * x2 + 1.0), t)
    return t


@triton.jit
def _logits2(qk, bias, logit_scale, softcap, USE_SOFTCAP: tl.constexpr, USE_BIAS: tl.constexpr):
    """Base-2 logits of a tile from raw q.k products, and tanh of the capped logits (for dS).

    Natural logits are ``softcap * tanh(qk * scale / softcap) + bias``; the plan passes
    ``logit_scale`` = scale / softcap with a soft cap, scale with a bias only, else
    scale * log2(e) (one multiply on the plain path). ``USE_SOFTCAP`` is ``softcap_mode``'s.
    """
    t = qk
    if USE_SOFTCAP:
        t = _tanh(qk * logit_scale, USE_SOFTCAP == 2)
        s = t * softcap
        if USE_BIAS:
            s = s + bias
        s = s * LOG2E_C
    elif USE_BIAS:
        s = (qk * logit_scale + bias) * LOG2E_C
    else:
        s = qk * logit_scale
    return s, t


@triton.jit
def _load_bias(bias_ptr, b, h, offs_m, offs_n, len_q, len_k, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr):
    """Float32 tile of a dense [batch|1, heads|1, seq_q, seq_k] bias (int64 offsets: it is big)."""
    return _load_bias_pairs(bias_ptr, b, h, offs_m[:, None], offs_n[None, :], len_q, len_k, BIAS_BATCHED, BIAS_HEADS)


@triton.jit
def _load_bias_pairs(bias_ptr, b, h, i, j, len_q, len_k, BIAS_BATCHED: tl.constexpr, BIAS_HEADS: tl.constexpr):
    """The bias at broadcastable 2-D query/key index tiles (``_load_bias`` or its transpose)."""
    plane = (b * BIAS_BATCHED * BIAS_HEADS + h % BIAS_HEADS) * len_q  # b is int64
    return tl.load(bias_ptr + (plane + i) * len_k + j, mask=(i < len_q) & (j < len_k), other=0.0).to(tl.float32)


@triton.jit
def _dropout_keep(seed, row_base, offs_m, offs_n, seq_k, dropout_p):
    """Philox draw per element; the element offset is ((b * heads_q + h) * seq_q + i) * seq_k + j
    (varlen: b is the sequence, seq_q/seq_k the max lengths). Kept with probability 1 - p."""
    return _dropout_keep_pairs(seed, row_base, offs_m[:, None], offs_n[None, :], seq_k, dropout_p)


@triton.jit
def _dropout_keep_pairs(seed, row_base, i, j, seq_k, dropout_p):
    """``_dropout_keep`` at broadcastable 2-D index tiles: the draw depends on (i, j) only, so a
    transposed tile sees the same mask."""
    return tl.rand(seed, (row_base + i).to(tl.int64) * seq_k + j) >= dropout_p


@triton.jit
def _load_rows(ptr, token_start, offs, n_rows, col, offs_d, ROW_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[len(offs), BLOCK_D] tile of head ``col`` of a [tokens, heads, head_dim] array (zero padded)."""
    ptrs = ptr + (token_start + offs[:, None]) * ROW_STRIDE + col * HEAD_DIM + offs_d[None, :]
    return tl.load(ptrs, mask=(offs < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_full_rows(ptr, token_start, offs, col, offs_d, ROW_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """``_load_rows`` for rows known to lie inside the sequence: no row mask, and no mask at all
    when the head fills the tile, so the loads vectorize and pipeline."""
    ptrs = ptr + (token_start + offs[:, None]) * ROW_STRIDE + col * HEAD_DIM + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_kv(k_ptr, v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """The k and v tiles of key block ``offs_n``; unmasked rows when the block lies inside the sequence."""
    if MASKED:
        k = _load_rows(k_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
        v = _load_rows(v_ptr, k_start, offs_n, len_k, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM)
    else:
        k = _load_full_rows(k_ptr, k_start, offs_n, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM, BLOCK_D)
        v = _load_full_rows(v_ptr, k_start, offs_n, h_kv, offs_d, HEADS_KV * HEAD_DIM, HEAD_DIM, BLOCK_D)
    return k, v


@triton.jit
def _store_rows(ptr, value, token_start, offs, n_rows, col, offs_d, ROW_STRIDE: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    ptrs = ptr + (token_start + offs[:, None]) * ROW_STRIDE + col * HEAD_DIM + offs_d[None, :]
    tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=(offs < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _row_base(b, h, q_start, seq_q, total_q, HEADS_Q: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Offset of query 0 of (b, h) in the lse/delta layout: [heads, total_q] for varlen, else
    [batch, heads, seq_q]."""
    if IS_VARLEN:
        return h.to(tl.int64) * total_q + q_start
    else:
        return (b * HEADS_Q + h) * seq_q
