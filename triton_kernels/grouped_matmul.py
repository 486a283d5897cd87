"""Grouped matmul for mixture-of-experts: ``gmm`` and ``tgmm`` as persistent Triton kernels.

Semantics (the same as the Pallas TPU version in ``ejkernel_jax.pallas.tpu.grouped_matmul``):

* ``group_sizes`` (int32 ``[num_groups]``) splits the rows ``[0, sum)`` of the grouped operand into
  consecutive groups. ``group_offset`` (a device scalar) selects ``num_selected`` consecutive groups
  ``[g0, g0 + num_selected)``: the experts one shard holds.
* gmm: ``out[rows_g] = lhs[rows_g] @ rhs[g - g0]`` for each selected group ``g``; every other row
  (other groups, rows past ``sum(group_sizes)``) is written as zeros.
* tgmm: ``out[i] = lhs[:, rows_g] @ rhs[rows_g]`` with ``g = g0 + i``; an empty group gives zeros.
  ``lhs`` is ``[k, m]`` (``LHS_MK=False``, the public layout) or ``[m, k]`` (``LHS_MK=True``, what
  the gmm backward has at hand, so it needs no transpose copy).

Schedule: one persistent program per SM walks a global tile order. The order is derived on
device from ``group_sizes``: each program scans the selected groups once (scalar loads, an
in-kernel running cumsum) and takes every ``num_programs``-th tile. No host sync, no launch per
group. gmm tiles start at their group's first row, so a tile never mixes groups; the zero rows
outside the selected groups are tiled the same way at the end of the order. tgmm has a static
number of output tiles (groups x k-tiles x n-tiles); a tile loops over its group's rows.

Sizes the kernels cannot trust are clamped, never trusted: negative sizes count as 0, groups are
cut at row ``m``, ``group_offset`` is clamped into range. So traced bad values (jax under jit)
give meaningless numbers but no out-of-bounds access; the fronts check concrete values eagerly.

``k`` and ``n`` are constexprs while ``m`` is a runtime scalar: row strides then have known
divisibility, which vectorized (16-byte) loads need, and ``m`` (tokens) may vary per call
without a recompile. Offsets that scale with ``m`` or the group index are int64.

Speed note: in tgmm's public ``[k, m]`` layout the group's rows run along the contiguous axis, so
the row mask differs per element and those loads are not vectorized. The training path (gmm's
backward) reads ``[m, k]`` (``LHS_MK``), whose masks are per row and keep 16-byte async copies.
"""
from __future__ import annotations

import functools
import operator

import triton
import triton.language as tl

from . import checks
from .padded_attention import _dot_acc, _dot_precision
from .params import FwdParams, check_params, itemsize, select_num_stages
from .plan import DeviceFacts, LaunchPlan, Output, cdiv, check_float_dtype, next_power_of_2

# --------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _group_size(group_sizes_ptr, g, NUM_GROUPS: tl.constexpr):
    # Out-of-range groups and negative sizes count as empty (see the module docstring).
    return tl.maximum(tl.load(group_sizes_ptr + g, mask=g < NUM_GROUPS, other=0), 0)


@triton.jit
def _first_selected(group_sizes_ptr, group_offset_ptr, m,
                    NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr):
    """(g0, first row of group g0): the clamped offset and the sum of the sizes before it."""
    g0 = tl.load(group_offset_ptr)
    g0 = tl.minimum(tl.maximum(g0, 0), NUM_GROUPS - NUM_SELECTED)
    row = tl.zeros([], tl.int32)
    for g in range(0, g0):
        row = tl.minimum(row + _group_size(group_sizes_ptr, g, NUM_GROUPS), m)
    return g0, row


@triton.jit
def _group_table(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                 GROUPS_P2: tl.constexpr):
    """First row and row count of each selected group as [GROUPS_P2] vectors (count 0 past
    NUM_SELECTED), and the selection's first and end row."""
    g0, first_row = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
    offs_g = tl.arange(0, GROUPS_P2)
    sizes = tl.where(offs_g < NUM_SELECTED, _group_size(group_sizes_ptr, g0 + offs_g, NUM_GROUPS), 0)
    # Clamping the running sum at m once is clamping every step (sizes are >= 0); int64 so that
    # unchecked huge sizes cannot wrap around.
    ends = first_row + tl.cumsum(sizes.to(tl.int64), axis=0)
    starts = tl.minimum(ends - sizes, m)
    ends = tl.minimum(ends, m)
    last_row = tl.max(tl.where(offs_g < NUM_SELECTED, ends, first_row), axis=0).to(tl.int32)
    return offs_g, starts.to(tl.int32), (ends - starts).to(tl.int32), first_row, last_row


@triton.jit
def _pick(offs_g, values, index):
    """values[index] of a register vector (0 when index is out of range)."""
    return tl.sum(tl.where(offs_g == index, values, 0), axis=0)


@triton.jit
def _swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # Runs of GROUP_M row tiles sweep the n-tiles together, so rhs tiles are reused from L2.
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (local % width) % size_m, (local % width) // size_m


# --------------------------------------------------------------------------------------------
# gmm


@triton.jit
def _gmm_operands(lhs_ptr, rhs_ptr, first_row, m_mask, rhs_index, offs_n, n_mask, k0,
                  K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] lhs tile and [BLOCK_K, BLOCK_N] rhs tile of step ``k0``."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = lhs_ptr + (first_row + offs_m[:, None]) * K + offs_k[None, :]
    rhs_base = rhs_ptr + rhs_index.to(tl.int64) * (K * N)
    if TRANSPOSE_RHS:  # rhs[g] is [N, K]: read a [BLOCK_N, BLOCK_K] tile, transpose in registers
        b_ptrs = rhs_base + offs_n[:, None] * K + offs_k[None, :]
    else:
        b_ptrs = rhs_base + offs_k[:, None] * N + offs_n[None, :]
    if K % BLOCK_K == 0 and K > 0:  # decided at compile time: no k mask on even shapes
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        if TRANSPOSE_RHS:
            b = tl.trans(tl.load(b_ptrs, mask=n_mask[:, None], other=0.0))
        else:
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
    else:
        k_mask = offs_k < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if TRANSPOSE_RHS:
            b = tl.trans(tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0))
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    return a, b


@triton.jit
def _gmm_locate(tile, offs_g, starts, counts, tile_ends, tiles_n,
                NUM_SELECTED: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(group, its first row, its rows, row tile, column tile) of global tile ``tile``: the group
    is the number of groups whose tiles all come before it (empty groups have none)."""
    g = tl.sum(tl.where((tile_ends <= tile) & (offs_g < NUM_SELECTED), 1, 0), axis=0)
    rows = _pick(offs_g, counts, g)
    tiles_m = tl.maximum(tl.cdiv(rows, BLOCK_M), 1)  # >= 1 past the last tile too: no division by 0
    pm, pn = _swizzle(tile - (_pick(offs_g, tile_ends, g) - tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    return g, _pick(offs_g, starts, g), rows, pm, pn


@triton.jit
def _zero_rows(out_ptr, tile, done, start, end, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write zeros to this program's tiles among the ``[done, done + count)`` of rows
    ``[start, end)``; ``tile`` is the next global tile it owns. Returns it and the new ``done``."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    count = tl.cdiv(end - start, BLOCK_M) * tiles_n
    offs_m = tl.arange(0, BLOCK_M)
    while tile < done + count:
        local = tile - done
        first_row = (start + (local // tiles_n) * BLOCK_M).to(tl.int64)
        offs_n = (local % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (first_row + offs_m < end)[:, None] & (offs_n < N)[None, :]
        tl.store(out_ptr + (first_row + offs_m[:, None]) * N + offs_n[None, :],
                 tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=mask)
        tile += tl.num_programs(0)
    return tile, done + count


@triton.jit(do_not_specialize_on_alignment=["m"])
def gmm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
               out_ptr,
               K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
               GROUPS_P2: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Global tile order: the selected groups' tiles (each group's own row tiles, swizzled), then
    the zero rows before them, then the zero rows after them. A program owns every
    num_programs-th tile; the k-steps of all its group tiles run as ONE flat loop, so the
    software pipeline keeps loading across tile boundaries instead of draining at each."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.maximum(tl.cdiv(K, BLOCK_K), 1)  # K = 0: one masked step stores the zeros
    offs_g, starts, counts, first_row, last_row = _group_table(
        group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED, GROUPS_P2)
    tile_ends = tl.cumsum(tl.cdiv(counts, BLOCK_M) * tiles_n, axis=0)
    group_tiles = tl.max(tile_ends, axis=0)
    mine = tl.maximum(group_tiles - pid + programs - 1, 0) // programs

    # The loop's shape follows Triton's persistent-matmul pattern, which its software pipeliner
    # handles: the next tile is located at the top of its first step, the tile is stored at the
    # bottom of its last one.
    offs_m = tl.arange(0, BLOCK_M)
    tile = pid - programs
    step = k_steps - 1
    zero = tl.zeros([], tl.int32)
    g, start, rows, pm, pn = zero, zero, zero, zero, zero
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, mine * k_steps):
        step = tl.where(step == k_steps - 1, 0, step + 1)
        if step == 0:
            tile += programs
            g, start, rows, pm, pn = _gmm_locate(tile, offs_g, starts, counts, tile_ends, tiles_n, NUM_SELECTED,
                                                 BLOCK_M, GROUP_M)
        first = (start + pm * BLOCK_M).to(tl.int64)  # int64: a big group times K passes 2**31
        m_mask = offs_m < rows - pm * BLOCK_M
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        a, b = _gmm_operands(lhs_ptr, rhs_ptr, first, m_mask, g, offs_n, n_mask, step * BLOCK_K, K, N,
                             TRANSPOSE_RHS, BLOCK_M, BLOCK_K)
        acc = _dot_acc(a, b, acc, DOT_PRECISION)
        if step == k_steps - 1:
            tl.store(out_ptr + (first + offs_m[:, None]) * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    tile = pid + mine * programs  # the program's first tile past the groups' ones
    tile, done = _zero_rows(out_ptr, tile, group_tiles, 0, first_row, N, BLOCK_M, BLOCK_N)
    _zero_rows(out_ptr, tile, done, last_row, m, N, BLOCK_M, BLOCK_N)


# --------------------------------------------------------------------------------------------
# tgmm


@triton.jit(do_not_specialize_on_alignment=["m"])
def tgmm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
                out_ptr,
                K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                GROUPS_P2: tl.constexpr, LHS_MK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[i][k-tile, n-tile] = lhs[k-tile, rows of group g0 + i] @ rhs[rows, n-tile].

    Output tiles are ordered group-major; a program owns every num_programs-th one. Its row
    steps over all its tiles run as ONE flat loop: a tile of a small group has only a few steps,
    and a loop per tile would drain and refill the software pipeline at each of them. An empty
    group's tile takes one fully masked step, so it stores its zeros like any other.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_k * tiles_n
    offs_g, starts, counts, _, _ = _group_table(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED,
                                                GROUPS_P2)
    steps = tl.maximum(tl.cdiv(counts, BLOCK_M), 1)
    # Tiles of group g are [g * per_group, (g + 1) * per_group); count the ones congruent to pid.
    below = tl.maximum(offs_g * per_group - pid + programs - 1, 0) // programs
    upto = tl.maximum((offs_g + 1) * per_group - pid + programs - 1, 0) // programs
    total = tl.sum(tl.where(offs_g < NUM_SELECTED, (upto - below) * steps, 0), axis=0)

    offs_r = tl.arange(0, BLOCK_M)
    tile = pid - programs
    zero = tl.zeros([], tl.int32)
    step, last = zero - 1, zero - 1
    index, start, rows, pk, pn = zero, zero, zero, zero, zero
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for _ in range(0, total):  # as gmm_kernel's loop: locate at the first step, store at the last
        step = tl.where(step == last, 0, step + 1)
        if step == 0:
            tile += programs
            index = tile // per_group
            start = _pick(offs_g, starts, index)
            rows = _pick(offs_g, counts, index)
            last = tl.maximum(tl.cdiv(rows, BLOCK_M), 1) - 1
            pk = (tile - index * per_group) // tiles_n
            pn = (tile - index * per_group) % tiles_n
        offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        k_mask = offs_k < K
        n_mask = offs_n < N
        # Rows of other groups are masked on both operands, so their values (even inf/NaN)
        # never reach this group's sum.
        r_mask = offs_r < rows - step * BLOCK_M
        first = (start + step * BLOCK_M).to(tl.int64)
        if LHS_MK:  # [m, K]: read a [BLOCK_M, BLOCK_K] tile, transpose in registers
            a = tl.trans(tl.load(lhs_ptr + (first + offs_r[:, None]) * K + offs_k[None, :],
                                 mask=r_mask[:, None] & k_mask[None, :], other=0.0))
        else:  # [K, m]
            a = tl.load(lhs_ptr + offs_k[:, None].to(tl.int64) * m + first + offs_r[None, :],
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(rhs_ptr + (first + offs_r[:, None]) * N + offs_n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot_acc(a, b, acc, DOT_PRECISION)
        if step == last:
            out_ptrs = out_ptr + index.to(tl.int64) * (K * N) + offs_k[:, None] * N + offs_n[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])
            acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)


# --------------------------------------------------------------------------------------------
# argument checks (shapes and dtype names; both fronts call these before any kernel runs)


def check_group_sizes(shape, dtype: str) -> int:
    if dtype != "int32":
        raise TypeError(f"group_sizes must be an int32 array, got {dtype}")
    checks.ndim("group_sizes", shape, 1, "[num_groups]")
    return int(shape[0])


def check_group_values(lowest: int, total: int, m: int) -> None:
    """Value checks (they need the values: eager in torch, concrete-only in jax)."""
    if lowest < 0:
        raise ValueError(f"group_sizes must be non-negative, got a size of {lowest}")
    if total > m:
        raise ValueError(f"sum(group_sizes) = {total} exceeds the {m} rows of the grouped operand")


def check_group_offset_value(g0: int, num_groups: int, num_selected: int) -> None:
    if not 0 <= g0 <= num_groups - num_selected:
        raise ValueError(f"group_offset={g0} selects groups [{g0}, {g0 + num_selected}), "
                         f"but group_sizes has {num_groups}")


def check_group_offset_shape(shape, dtype: str) -> None:
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"group_offset must be an int or an integer scalar array, got {dtype}")
    if tuple(shape) not in ((), (1,)):
        raise ValueError(f"group_offset must be a scalar, got shape {tuple(shape)}")


def check_out_dtype(dtype: str) -> None:
    if dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"preferred_element_type must be float16, bfloat16 or float32, got {dtype}")


def check_gmm(lhs_shape, lhs_dtype: str, rhs_shape, rhs_dtype: str, gs_shape, gs_dtype: str,
              transpose_rhs: bool) -> tuple[int, int, int, int, int]:
    """Returns (m, k, n, num_groups, num_selected)."""
    checks.float_input("lhs", lhs_dtype)
    checks.float_input("rhs", rhs_dtype)
    checks.ndim("lhs", lhs_shape, 2, "[m, k]")
    layout = "[groups, n, k]" if transpose_rhs else "[groups, k, n]"
    checks.ndim("rhs", rhs_shape, 3, layout)
    checks.same_dtype(("lhs", "rhs"), (lhs_dtype, rhs_dtype))
    m, k = lhs_shape
    num_selected, rk, n = (rhs_shape[0], rhs_shape[2], rhs_shape[1]) if transpose_rhs else rhs_shape
    if rk != k:
        raise ValueError(f"rhs {tuple(rhs_shape)} ({layout}) does not match lhs {tuple(lhs_shape)} ([m, k]) in k")
    num_groups = check_group_sizes(gs_shape, gs_dtype)
    if num_selected > num_groups:
        raise ValueError(f"rhs has {num_selected} groups but group_sizes only {num_groups}")
    return m, k, n, num_groups, num_selected


def check_tgmm(lhs_shape, lhs_dtype: str, rhs_shape, rhs_dtype: str, gs_shape, gs_dtype: str,
               num_actual_groups) -> tuple[int, int, int, int, int]:
    """Returns (m, k, n, num_groups, num_selected)."""
    checks.float_input("lhs", lhs_dtype)
    checks.float_input("rhs", rhs_dtype)
    checks.ndim("lhs", lhs_shape, 2, "[k, m]")
    checks.ndim("rhs", rhs_shape, 2, "[m, n]")
    checks.same_dtype(("lhs", "rhs"), (lhs_dtype, rhs_dtype))
    k, m = lhs_shape
    if rhs_shape[0] != m:
        raise ValueError(f"lhs {tuple(lhs_shape)} ([k, m]) and rhs {tuple(rhs_shape)} ([m, n]) disagree on m")
    num_groups = check_group_sizes(gs_shape, gs_dtype)
    if num_actual_groups is None:
        num_actual_groups = num_groups
    try:  # any integer (numpy's too), but not a bool or an array
        if isinstance(num_actual_groups, bool):
            raise TypeError
        selected = operator.index(num_actual_groups)
    except TypeError:
        raise TypeError(f"num_actual_groups must be a Python int, got {num_actual_groups!r}") from None
    if not 0 <= selected <= num_groups:
        raise ValueError(f"num_actual_groups must be in [0, {num_groups}], got {selected}")
    return m, k, rhs_shape[1], num_groups, selected


# --------------------------------------------------------------------------------------------
# plans

MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16 on GPUs
CPU_PROGRAMS = 3  # the interpreter runs programs one after another; 3 exercises the striding


def _merge(defaults: dict, params: FwdParams | None, facts: DeviceFacts, what: str) -> dict:
    cfg = dict(defaults)
    given = FwdParams.coerce(params).to_dict()
    unknown = sorted(set(given) - set(cfg))
    if unknown:
        raise ValueError(f"{what}: fwd_params field(s) {unknown} do not apply; use {sorted(cfg)}")
    cfg.update(given)
    small = {f: v for f, v in cfg.items() if f.startswith("blocksize") and v < MIN_BLOCK}
    if small:
        raise ValueError(f"{what}: block sizes must be at least {MIN_BLOCK}, got {small}")
    return cfg


def _finish(cfg: dict, a_tile: int, b_tile: int, out_tile: int, dtype: str, out_dtype: str, params,
            facts: DeviceFacts, what: str) -> dict:
    """Fill in num_stages (most that fit, unless given) and check shared memory. The output tile
    is stored inside the flat loop, while the pipeline's buffers are live: the layout change of
    its store needs room of its own (up to the whole tile: measured by the AOT test)."""
    per_stage = (a_tile + b_tile) * itemsize(dtype)
    epilogue = out_tile * itemsize(out_dtype)
    if cfg.get("num_stages") is None:
        cfg["num_stages"] = select_num_stages(per_stage, facts, max_stages=cfg.pop("max_stages"), fixed_smem=epilogue)
    cfg.pop("max_stages", None)
    cfg["smem"] = per_stage * cfg["num_stages"] + epilogue
    if not facts.is_cpu:
        check_params(FwdParams.coerce(params), facts, cfg["smem"], what)
    return cfg


def _gmm_config(m: int, k: int, n: int, num_selected: int, dtype: str, out_dtype: str, facts: DeviceFacts,
                params) -> dict:
    if facts.is_cpu:  # the interpreter pays per tile, not per element: few, large tiles
        base = dict(blocksize_m=64, blocksize_n=64, blocksize_k=64, num_warps=4, num_stages=1)
    elif itemsize(dtype) == 4:  # fp32 products are FMA-bound; moderate tiles
        base = dict(blocksize_m=64, blocksize_n=64, blocksize_k=32, num_warps=4, num_stages=None, max_stages=3)
    else:
        # Expert row counts average m / groups; small experts waste less of a 64-row tile.
        rows = m / max(num_selected, 1)
        bm = 128 if rows >= 256 else 64
        bn = 256 if n >= 1024 and bm == 128 else 128
        base = dict(blocksize_m=bm, blocksize_n=bn, blocksize_k=64, num_warps=8 if bm * bn >= 128 * 256 else 4,
                    num_stages=None, max_stages=4 if bn == 128 else 3)
    cfg = _merge({**base, "max_stages": base.get("max_stages", 1)}, params, facts, "grouped_matmul")
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    return _finish(cfg, bm * bk, bk * bn, bm * bn, dtype, out_dtype, params, facts, "grouped_matmul")


def _tgmm_config(k: int, n: int, dtype: str, out_dtype: str, facts: DeviceFacts, params) -> dict:
    # blocksize_k x blocksize_n is the output tile; blocksize_m the chunk of rows summed per step.
    if facts.is_cpu:
        base = dict(blocksize_m=64, blocksize_n=64, blocksize_k=64, num_warps=4, num_stages=1)
    elif itemsize(dtype) == 4:
        base = dict(blocksize_m=32, blocksize_n=64, blocksize_k=64, num_warps=4, num_stages=None, max_stages=3)
    else:
        # 128 x 256 output tiles: 0.90-1.08x torch._grouped_mm on an H100 where 128 x 128 gave
        # 0.77-0.90x (scripts/sweep_gmm_backward.py, benchmarks/results/sweep_gmm_backward-*.json).
        bn = 256 if n >= 1024 else 128
        base = dict(blocksize_m=64, blocksize_n=bn, blocksize_k=128, num_warps=8, num_stages=None,
                    max_stages=3 if bn == 256 else 4)
    cfg = _merge({**base, "max_stages": base.get("max_stages", 1)}, params, facts, "transposed_grouped_matmul")
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    return _finish(cfg, bk * bm, bm * bn, bk * bn, dtype, out_dtype, params, facts, "transposed_grouped_matmul")


def programs_per_sm(cfg: dict, facts: DeviceFacts) -> int:
    """Resident programs one SM can hold: 2 for 4-warp tiles whose buffers fit twice (registers
    then always fit: 2 x 128 threads x 255), else 1. A persistent grid must never exceed what is
    resident at once, or the programs of a second wave start only when the first ones finish."""
    reserved = 1024  # shared memory the hardware keeps per program
    return 2 if cfg["num_warps"] <= 4 and 2 * (cfg["smem"] + reserved) <= facts.shared_memory else 1


def _programs(tiles: int, cfg: dict, facts: DeviceFacts) -> int:
    return min(tiles, CPU_PROGRAMS if facts.is_cpu else facts.num_sms * programs_per_sm(cfg, facts))


def _group_inputs(dtype: str) -> dict:
    return dict(inputs=("lhs_ptr", "rhs_ptr", "group_sizes_ptr", "group_offset_ptr"),
                input_dtypes=(dtype, dtype, "int32", "int32"))


@functools.lru_cache(maxsize=512)
def gmm_plan(m: int, k: int, n: int, num_groups: int, num_selected: int, transpose_rhs: bool,
             dtype: str, out_dtype: str, facts: DeviceFacts, params: FwdParams | None = None) -> LaunchPlan:
    """Plan for ``out[m, n] = grouped lhs[m, k] @ rhs[num_selected, k, n]`` (``[.., n, k]`` if
    ``transpose_rhs``). Inputs: lhs, rhs, group_sizes (int32 [num_groups]), group_offset (int32 [1])."""
    check_float_dtype("lhs", dtype)
    check_out_dtype(out_dtype)
    cfg = _gmm_config(m, k, n, num_selected, dtype, out_dtype, facts, params)
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    # Upper bound on the tiles: each group adds at most one partial row tile, and so does each
    # of the two zero segments.
    tiles = cdiv(n, bn) * (cdiv(m, bm) + num_selected + 2) if m and n else 0
    return LaunchPlan(
        kernel=gmm_kernel,
        grid=(_programs(tiles, cfg, facts),),
        **_group_inputs(dtype),
        scalars=(("m", m),),
        outputs=(Output("out_ptr", (m, n), out_dtype),),
        constexprs=(("K", k), ("N", n), ("NUM_GROUPS", num_groups), ("NUM_SELECTED", num_selected),
                    ("GROUPS_P2", next_power_of_2(num_selected)), ("TRANSPOSE_RHS", bool(transpose_rhs)), ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk),
                    ("GROUP_M", 8), ("DOT_PRECISION", _dot_precision(dtype, facts))),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True,
    )


@functools.lru_cache(maxsize=512)
def tgmm_plan(m: int, k: int, n: int, num_groups: int, num_selected: int, lhs_mk: bool,
              dtype: str, out_dtype: str, facts: DeviceFacts, params: FwdParams | None = None) -> LaunchPlan:
    """Plan for ``out[num_selected, k, n]``, ``out[i] = lhs[:, rows_(g0+i)] @ rhs[rows_(g0+i)]``.

    ``lhs`` is ``[k, m]``, or ``[m, k]`` when ``lhs_mk``; ``rhs`` is ``[m, n]``. Inputs as gmm_plan.
    """
    check_float_dtype("lhs", dtype)
    check_out_dtype(out_dtype)
    cfg = _tgmm_config(k, n, dtype, out_dtype, facts, params)
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    tiles = num_selected * cdiv(k, bk) * cdiv(n, bn)
    return LaunchPlan(
        kernel=tgmm_kernel,
        grid=(_programs(tiles, cfg, facts),),
        **_group_inputs(dtype),
        scalars=(("m", m),),
        outputs=(Output("out_ptr", (num_selected, k, n), out_dtype),),
        constexprs=(("K", k), ("N", n), ("NUM_GROUPS", num_groups), ("NUM_SELECTED", num_selected),
                    ("GROUPS_P2", next_power_of_2(num_selected)), ("LHS_MK", bool(lhs_mk)), ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk),
                    ("DOT_PRECISION", _dot_precision(dtype, facts))),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True,
    )
