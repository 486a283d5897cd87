"""Row softmax over the last axis (forward and backward), plain and left-padded causal.

Every row ``r`` has a window of valid columns ``[lo_r, hi_r)``; columns outside it get
probability 0. Plain softmax uses ``[0, n_cols)``. The padded causal variant reads a
``[batch, seq, seq]`` score tensor whose first ``n_pad[b]`` tokens are left padding: row ``i``
of batch ``b`` keeps columns ``n_pad[b] <= j <= i`` and padding rows (``i < n_pad[b]``) are
all zeros. A row with nothing valid (or only -inf logits) is all zeros, never NaN.

Math is float32 whatever the storage dtype. Rows that fit one block are read once
(``ONE_PASS``); longer rows are streamed twice: an online max/sum pass, then a write pass.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from .plan import DeviceFacts, LaunchPlan, Output, cdiv, check_float_dtype, next_power_of_2

# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _load_window(ptrs, in_bounds, in_window):
    # Load with the bounds mask only (it is uniform over aligned chunks when the row length is
    # a constexpr, so loads vectorize), then drop what lies outside the row's window.
    x = tl.load(ptrs, mask=in_bounds, other=-float("inf")).to(tl.float32)
    return tl.where(in_window, x, -float("inf"))


@triton.jit
def _softmax_fwd_rows(x_ptr, y_ptr, rows, row_ok, lo, hi, n_cols,
                      BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    base = rows.to(tl.int64)[:, None] * n_cols
    lo = lo[:, None]
    hi = hi[:, None]
    if ONE_PASS:
        c = cols[None, :]
        x = _load_window(x_ptr + base + c, row_ok[:, None] & (c < n_cols), (c >= lo) & (c < hi))
        m = tl.max(x, axis=1)
        m = tl.where(m == -float("inf"), 0.0, m)  # empty row: exp(-inf - 0) = 0, no NaN
        e = tl.exp(x - m[:, None])
        s = tl.sum(e, axis=1)
        # One division per row, not per element. Only an empty row's 0 is replaced: a NaN sum
        # (a NaN in the row) must stay NaN, as in torch.softmax.
        inv = 1.0 / tl.where(s == 0.0, 1.0, s)
        y = e * inv[:, None]
        tl.store(y_ptr + base + c, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (c < n_cols))
    else:
        # Pass 1: per-lane running max and sum (no reductions inside the loop).
        m_lane = tl.full([rows.shape[0], BLOCK_N], -float("inf"), tl.float32)
        l_lane = tl.zeros([rows.shape[0], BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols[None, :]
            x = _load_window(x_ptr + base + c, row_ok[:, None] & (c < n_cols), (c >= lo) & (c < hi))
            m_new = tl.maximum(m_lane, x)
            m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
            l_lane = l_lane * tl.exp(m_lane - m_ref) + tl.exp(x - m_ref)
            m_lane = m_new
        m = tl.max(m_lane, axis=1)
        m = tl.where(m == -float("inf"), 0.0, m)
        s = tl.sum(l_lane * tl.exp(m_lane - m[:, None]), axis=1)
        inv = 1.0 / tl.where(s == 0.0, 1.0, s)
        # Pass 2: normalize and write every column (zeros outside the window).
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols[None, :]
            x = _load_window(x_ptr + base + c, row_ok[:, None] & (c < n_cols), (c >= lo) & (c < hi))
            y = tl.exp(x - m[:, None]) * inv[:, None]
            tl.store(y_ptr + base + c, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (c < n_cols))


@triton.jit
def _load_y_dy(y_ptr, dy_ptr, offs, keep):
    """(y, dy) in float32, dy zeroed where y is 0: the outputs outside each row's window (whole
    padding rows too) are constants, so a NaN/inf cotangent there must not reach dx as 0 * NaN,
    within the row's sum or at its own place. (Elsewhere y = 0 is an underflow whose term is 0.)"""
    y = tl.load(y_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    return y, tl.where(y == 0, 0.0, dy)


@triton.jit
def _softmax_bwd_rows(y_ptr, dy_ptr, dx_ptr, rows, row_ok, n_cols,
                      BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr):
    # dx = y * (dy - sum(y * dy)); y is 0 outside the window, so dx is too.
    cols = tl.arange(0, BLOCK_N)
    base = rows.to(tl.int64)[:, None] * n_cols
    if ONE_PASS:
        c = cols[None, :]
        keep = row_ok[:, None] & (c < n_cols)
        y, dy = _load_y_dy(y_ptr, dy_ptr, base + c, keep)
        dot = tl.sum(y * dy, axis=1)
        tl.store(dx_ptr + base + c, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=keep)
    else:
        acc = tl.zeros([rows.shape[0], BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols[None, :]
            keep = row_ok[:, None] & (c < n_cols)
            y, dy = _load_y_dy(y_ptr, dy_ptr, base + c, keep)
            acc += y * dy
        dot = tl.sum(acc, axis=1)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols[None, :]
            keep = row_ok[:, None] & (c < n_cols)
            y, dy = _load_y_dy(y_ptr, dy_ptr, base + c, keep)
            tl.store(dx_ptr + base + c, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=keep)


# The kernels are persistent: each program walks row blocks pid, pid + grid, ... so that on a
# GPU the loads of the next block overlap the math of this one (``tl.range`` pipelining).


@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def softmax_fwd_kernel(x_ptr, n_rows, y_ptr, N_COLS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    for block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        lo = tl.zeros([BLOCK_M], tl.int32)
        _softmax_fwd_rows(x_ptr, y_ptr, rows, rows < n_rows, lo, lo + N_COLS, N_COLS, BLOCK_N, ONE_PASS)


@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def padded_softmax_fwd_kernel(x_ptr, n_pad_ptr, n_rows, y_ptr, SEQ_LEN: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                              NUM_STAGES: tl.constexpr):
    for block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        query = rows % SEQ_LEN
        pad = tl.load(n_pad_ptr + rows // SEQ_LEN, mask=row_ok, other=0)
        hi = tl.where(query >= pad, query + 1, pad)  # padding rows: empty window [pad, pad)
        _softmax_fwd_rows(x_ptr, y_ptr, rows, row_ok, pad, hi, SEQ_LEN, BLOCK_N, ONE_PASS)


@triton.jit(do_not_specialize_on_alignment=["n_rows"])
def softmax_bwd_kernel(y_ptr, dy_ptr, n_rows, dx_ptr, N_COLS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    for block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        _softmax_bwd_rows(y_ptr, dy_ptr, dx_ptr, rows, rows < n_rows, N_COLS, BLOCK_N, ONE_PASS)


# --------------------------------------------------------------------------------------------
# plans

# Longest row kept in registers in one block; longer rows stream in STREAM_BLOCK_N chunks.
MAX_ONE_PASS = 32768
# Rows one launch takes: the kernels count rows in int32 and round them up to whole blocks
# in int32 (tl.cdiv(n_rows, BLOCK_M) adds BLOCK_M - 1): past 2**31 - BLOCK_M the block count
# wrapped negative and no row was written. BLOCK_M is at most MAX_BLOCK_M.
MAX_BLOCK_M = 1024
MAX_ROWS = 2**31 - MAX_BLOCK_M


def check_rows(name: str, n_rows: int, what: str = "rows") -> None:
    """An op's argument ``name`` whose ``n_rows`` rows (``what`` says how they are counted) one
    launch takes: a ValueError naming it past ``MAX_ROWS``, before any kernel runs."""
    if n_rows > MAX_ROWS:
        raise ValueError(f"{name} has {n_rows} {what}, more than the {MAX_ROWS} one softmax launch takes "
                         "(its kernels count rows in int32); split it")


def max_padded_batch(seq_len: int) -> int:
    """The most batch rows of ``seq_len`` one padded softmax launch takes (``seq_len`` rows each)."""
    return MAX_ROWS // max(seq_len, 1)


def rows_fold_limit(shape) -> int:
    """The most rows of a ``[rows, cols]`` sample that one folded launch takes (the fronts' vmap rules)."""
    return MAX_ROWS


def padded_fold_limit(shape) -> int:
    """The most batch rows of a ``[batch, seq, seq]`` scores sample that one folded launch takes."""
    return max_padded_batch(shape[1])


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
STREAM_BLOCK_N = 4096


def _row_tiling(n_rows: int, n_cols: int, facts: DeviceFacts, streamed_bytes: int) -> tuple[dict, int]:
    """(constexprs, num_warps) for a row kernel.

    GPU: short rows share a program (about 256 elements each), rows of 512+ get a program of
    their own, and warps grow with the row (one warp per 512 elements, 1..16). From a sweep on
    an H200 (scripts/tune_softmax.py): fewer, narrower programs lose bandwidth on short rows,
    and 8 warps on a 512-column row cost half of it. The interpreter pays per program, not per
    element, so CPU plans use few, large programs. ``streamed_bytes`` is what one row element
    costs across the kernel's inputs; the pipeliner buffers NUM_STAGES blocks of it in shared
    memory, so deeper pipelining is planned only where that fits.
    """
    one_pass = n_cols <= MAX_ONE_PASS
    block_n = next_power_of_2(max(n_cols, 16)) if one_pass else STREAM_BLOCK_N
    if facts.is_cpu:
        block_m = max(1, min((1 << 16) // block_n, next_power_of_2(max(n_rows, 1)), 1024))
    else:
        # Not capped by n_rows: the block's shape sets how a row's max and sum are reduced
        # across threads, so a row must get the same tile in any batch (vmap folds samples into
        # the rows; with a cap, 2 and 4 rows of 16 gave different last bits on an H100). Surplus
        # rows of a tiny problem are masked.
        block_m = max(1, 256 // block_n)
    assert block_m <= MAX_BLOCK_M  # MAX_ROWS relies on it
    num_warps = max(1, min(16, block_m * block_n // 512))
    # Only a one-pass body is simple enough for the software pipeliner to overlap blocks.
    fits = 2 * block_m * block_n * streamed_bytes <= facts.shared_memory * 3 // 4
    stages = 2 if one_pass and fits and not facts.is_cpu else 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, NUM_STAGES=stages), num_warps


def _row_plan(kernel, inputs, input_dtypes, row_len: tuple[str, int], output: Output, n_rows: int,
              facts: DeviceFacts) -> LaunchPlan:
    # The row length is a constexpr (one compile per length): masks and row offsets then carry
    # their alignment, and loads vectorize in both launchers alike.
    n_cols = row_len[1]
    check_rows(kernel.fn.__name__, n_rows)  # the fronts name the argument; this guards direct plan users
    streamed = sum(ITEMSIZE[d] for d in input_dtypes if d in ITEMSIZE)
    consts, warps = _row_tiling(n_rows, n_cols, facts, streamed)
    blocks = cdiv(n_rows, consts["BLOCK_M"]) if n_cols else 0
    # Persistent grid on a GPU: a few programs per SM (as many as 32 warps' worth allow).
    grid = blocks if facts.is_cpu else min(blocks, facts.num_sms * max(1, 32 // warps))
    return LaunchPlan(
        kernel=kernel, grid=(grid,), inputs=inputs, input_dtypes=input_dtypes, scalars=(("n_rows", n_rows),),
        outputs=(output,), constexprs=(row_len, *consts.items()),
        num_warps=warps, num_stages=1, enable_fp_fusion=True,
    )


@functools.lru_cache(maxsize=512)
def softmax_fwd_plan(n_rows: int, n_cols: int, dtype: str, facts: DeviceFacts) -> LaunchPlan:
    check_float_dtype("x", dtype)
    return _row_plan(softmax_fwd_kernel, ("x_ptr",), (dtype,), ("N_COLS", n_cols),
                     Output("y_ptr", (n_rows, n_cols), dtype), n_rows, facts)


@functools.lru_cache(maxsize=512)
def softmax_bwd_plan(n_rows: int, n_cols: int, dtype: str, facts: DeviceFacts) -> LaunchPlan:
    check_float_dtype("y", dtype)
    return _row_plan(softmax_bwd_kernel, ("y_ptr", "dy_ptr"), (dtype, dtype), ("N_COLS", n_cols),
                     Output("dx_ptr", (n_rows, n_cols), dtype), n_rows, facts)


@functools.lru_cache(maxsize=512)
def padded_softmax_fwd_plan(batch: int, seq_len: int, dtype: str, facts: DeviceFacts) -> LaunchPlan:
    check_float_dtype("scores", dtype)
    n_rows = batch * seq_len
    return _row_plan(padded_softmax_fwd_kernel, ("x_ptr", "n_pad_ptr"), (dtype, "int32"), ("SEQ_LEN", seq_len),
                     Output("y_ptr", (batch, seq_len, seq_len), dtype), n_rows, facts)
