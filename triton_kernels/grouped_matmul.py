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
On Hopper, where the launcher provides global scratch, both kernels store output tiles through a
tensor descriptor (``TMA_STORE``), asynchronously, while the next tile's loads run: tgmm's output
is a [k, n] matrix per expert, large at many experts (``_tma_store``). gmm does so for the tiles
that lie wholly inside their group; a group's last, partial tile is masked from registers, as its
box would cover the next group's rows. gmm also reads its operands through descriptors there
(``TMA_LOAD``, one problem of 16-bit inputs): its rows are independent, so a box that runs past
the group only reads rows whose results are never stored. On an sm_90 GPU with Gluon the gmm
backward's weight gradient at up to 1024 rows an expert runs
``gluon_grouped_matmul.tgmm_gluon_kernel`` instead (``uses_gluon_tgmm``): the same tile order
and bits, with a loader warp that runs ahead across tiles, which pays where a tile sums few row
steps.
"""
from __future__ import annotations

import functools
import operator

import triton
import triton.language as tl

from . import checks
from .padded_attention import _dot, _dot_precision
from .params import FwdParams, check_params, check_tile_numel, itemsize, select_num_stages
from .plan import DeviceFacts, LaunchPlan, Output, cdiv, check_float_dtype

# --------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _group_size(group_sizes_ptr, g, NUM_GROUPS: tl.constexpr):
    # Out-of-range groups and negative sizes count as empty (see the module docstring).
    return tl.maximum(tl.load(group_sizes_ptr + g, mask=g < NUM_GROUPS, other=0), 0)


@triton.jit
def _group_end(start, group_sizes_ptr, g, m, NUM_GROUPS: tl.constexpr):
    """End row of group ``g`` starting at row ``start <= m``: cut at ``m``. The size is cut before
    the addition, so that an unchecked size near 2**31 cannot wrap the int32 sum negative (a
    negative row would be read out of bounds)."""
    return start + tl.minimum(_group_size(group_sizes_ptr, g, NUM_GROUPS), m - start)


@triton.jit
def _first_selected(group_sizes_ptr, group_offset_ptr, m,
                    NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr):
    """(g0, first row of group g0): the clamped offset and the sum of the sizes before it."""
    g0 = tl.load(group_offset_ptr)
    g0 = tl.minimum(tl.maximum(g0, 0), NUM_GROUPS - NUM_SELECTED)
    row = tl.zeros([], tl.int32)
    for g in range(0, g0):
        row = _group_end(row, group_sizes_ptr, g, m, NUM_GROUPS)
    return g0, row


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
def _gmm_tile(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, start, rows, rhs_index, pm, pn,
              K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_PRECISION: tl.constexpr, TMA_STORE: tl.constexpr, TMA_LOAD: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile of the segment whose ``rows`` rows start at ``start``.
    With ``TMA_STORE`` a tile wholly inside the segment is stored through ``out_desc`` (the
    output's descriptor, where this problem's rows start at ``desc_row0``); a partial one is
    masked from registers, as its box would cover the next segment's rows. With ``TMA_LOAD``
    ``lhs_ptr`` and ``rhs_ptr`` are descriptors (``_gmm_desc_acc``)."""
    first_row = (start + pm * BLOCK_M).to(tl.int64)  # int64: a big group times K passes 2**31
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows - pm * BLOCK_M
    if TMA_LOAD:
        acc = _gmm_desc_acc(lhs_ptr, rhs_ptr, (desc_row0 + first_row).to(tl.int32), rhs_index, pn, K,
                            TRANSPOSE_RHS, IS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    else:
        acc = _gmm_rows_acc(lhs_ptr, rhs_ptr, first_row, offs_m, m_mask, rhs_index, pn, K, N, TRANSPOSE_RHS,
                            IS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if TMA_STORE:
        if rows - pm * BLOCK_M >= BLOCK_M:
            out_desc.store([(desc_row0 + first_row).to(tl.int32), pn * BLOCK_N], acc.to(out_desc.dtype))
        else:
            _gmm_store_rows(out_ptr, first_row, offs_m, m_mask, pn, acc, N, BLOCK_N)
    else:
        _gmm_store_rows(out_ptr, first_row, offs_m, m_mask, pn, acc, N, BLOCK_N)


@triton.jit
def _gmm_rows_tile(lhs_ptr, rhs_ptr, out_ptr, row_base, row_offs, m_mask, rhs_index, pn,
                   K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """The output tile of lhs rows ``row_base + row_offs`` (those in ``m_mask``) and n-tile ``pn``,
    stored from registers. Row offsets that may pass 2**31 / K must be int64."""
    acc = _gmm_rows_acc(lhs_ptr, rhs_ptr, row_base, row_offs, m_mask, rhs_index, pn, K, N, TRANSPOSE_RHS, IS_ZERO,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    _gmm_store_rows(out_ptr, row_base, row_offs, m_mask, pn, acc, N, BLOCK_N)


@triton.jit
def _gmm_store_rows(out_ptr, row_base, row_offs, m_mask, pn, acc, N: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + row_base * N + row_offs[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _gmm_rows_acc(lhs_ptr, rhs_ptr, row_base, row_offs, m_mask, rhs_index, pn,
                  K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """The float32 tile of lhs rows ``row_base + row_offs`` (those in ``m_mask``) times n-tile
    ``pn`` of rhs[rhs_index]; zeros for ``IS_ZERO``."""
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if not IS_ZERO:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = lhs_ptr + row_base * K + row_offs[:, None] * K + offs_k[None, :]
        rhs_base = rhs_ptr + tl.cast(rhs_index, tl.int64) * (K * N)
        if TRANSPOSE_RHS:  # rhs[g] is [N, K]: read a [BLOCK_N, BLOCK_K] tile, transpose in registers
            b_ptrs = rhs_base + offs_n[:, None] * K + offs_k[None, :]
        else:
            b_ptrs = rhs_base + offs_k[:, None] * N + offs_n[None, :]
        for k0 in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:  # decided at compile time: no k mask on even shapes
                a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                if TRANSPOSE_RHS:
                    b = tl.trans(tl.load(b_ptrs, mask=n_mask[:, None], other=0.0))
                else:
                    b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - k0
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                if TRANSPOSE_RHS:
                    b = tl.trans(tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0))
                else:
                    b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += _dot(a, b, DOT_PRECISION)
            a_ptrs += BLOCK_K
            if TRANSPOSE_RHS:
                b_ptrs += BLOCK_K
            else:
                b_ptrs += BLOCK_K * N
    return acc


@triton.jit
def _gmm_desc_acc(lhs_desc, rhs_desc, first_row, rhs_index, pn,
                  K: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """``_gmm_rows_acc`` of the ``BLOCK_M`` rows from ``first_row``, read through descriptors (TMA):
    ``lhs_desc`` over ``[rows, K]``, ``rhs_desc`` over ``[experts, K, N]`` (``[experts, N, K]`` if
    ``TRANSPOSE_RHS``). Rows past the segment are read (another group's, or zeros past the
    array) and never stored: rows are independent in gmm. Boxes past K read zeros, so no mask."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if not IS_ZERO:
        for k0 in range(0, K, BLOCK_K):
            a = lhs_desc.load([first_row, k0])
            if TRANSPOSE_RHS:
                b = tl.trans(rhs_desc.load([rhs_index, pn * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = rhs_desc.load([rhs_index, k0, pn * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            acc += _dot(a, b, DOT_PRECISION)
    return acc


@triton.jit
def _segment_tiles(start, end, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row tiles, tiles) of the output rows ``[start, end)``."""
    tiles_m = tl.cdiv(end - start, BLOCK_M)
    return tiles_m, tiles_m * tl.cdiv(N, BLOCK_N)


@triton.jit
def _next_tile(tile, end):
    """This program's first tile at or past ``end``: its tiles are ``tile`` plus multiples of the grid."""
    programs = tl.num_programs(0)
    return tile + tl.maximum(end - tile + programs - 1, 0) // programs * programs


@triton.jit
def _gmm_segment(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, tile, done, start, end, rhs_index,
                 K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_STORE: tl.constexpr,
                 TMA_LOAD: tl.constexpr):
    """Do this program's tiles among the ``[done, done + count)`` of rows ``[start, end)``, from
    ``tile``, the next global tile index it owns. Returns nothing: the caller advances ``tile``
    (``_next_tile``), so no index flows out of a call given the input pointers, which torch's
    mutation analysis of wrap_triton would take as a write to them (and torch.compile would
    copy lhs and rhs before every launch)."""
    tiles_m, count = _segment_tiles(start, end, N, BLOCK_M, BLOCK_N)
    tiles_n = tl.cdiv(N, BLOCK_N)
    while tile < done + count:
        pm, pn = _swizzle(tile - done, tiles_m, tiles_n, GROUP_M)
        _gmm_tile(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, start, end - start, rhs_index, pm, pn, K, N,
                  TRANSPOSE_RHS, IS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA_STORE, TMA_LOAD)
        tile += tl.num_programs(0)


@triton.jit
def _after_segment(tile, done, start, end, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile, done) after ``_gmm_segment`` of rows ``[start, end)``."""
    _, count = _segment_tiles(start, end, N, BLOCK_M, BLOCK_N)
    return _next_tile(tile, done + count), done + count


@triton.jit
def _gmm_zero_rows(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, tile, done, first, last, m,
                   K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_STORE: tl.constexpr,
                   TMA_LOAD: tl.constexpr):
    """Zeros for a problem's rows outside its selected groups: ``[0, first)``, then ``[last, m)``.
    Returns nothing, as ``_gmm_segment``; ``_after_zero_rows`` advances the walk."""
    zero = tl.zeros([], tl.int32)
    _gmm_segment(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, tile, done, zero, first, zero, K, N,
                 TRANSPOSE_RHS, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, TMA_STORE, TMA_LOAD)
    tile, done = _after_segment(tile, done, zero, first, N, BLOCK_M, BLOCK_N)
    _gmm_segment(lhs_ptr, rhs_ptr, out_ptr, out_desc, desc_row0, tile, done, last, m, zero, K, N,
                 TRANSPOSE_RHS, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, TMA_STORE, TMA_LOAD)


@triton.jit
def _after_zero_rows(tile, done, first, last, m, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile, done) after ``_gmm_zero_rows``."""
    tile, done = _after_segment(tile, done, tl.zeros([], tl.int32), first, N, BLOCK_M, BLOCK_N)
    return _after_segment(tile, done, last, m, N, BLOCK_M, BLOCK_N)


@triton.jit
def _gmm_problem_major(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m, out_ptr, out_desc,
                       K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                       TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BATCH: tl.constexpr, SHARED_RHS: tl.constexpr, TMA_STORE: tl.constexpr,
                       TMA_LOAD: tl.constexpr):
    # Global tile order, per problem of the batch in turn: the selected groups' tiles, then the
    # zero rows before them, then the zero rows after them. Every program walks the groups
    # (scalar loads only) and does the tiles congruent to its id. SHARED_RHS: one rhs for all
    # problems (plans walk those group-major; a plan text cached before GROUP_MAJOR existed runs here).
    tile = tl.program_id(0)
    done = tl.zeros([], tl.int32)
    for b in range(0, BATCH):  # a batch of 1 is no loop: the compiled code is the unbatched one's
        # Problem b's operands, inline: a pointer returned by a helper that was also given lhs
        # would make torch's mutation analysis take lhs as written (see _gmm_segment).
        rows = tl.cast(b, tl.int64) * m
        out_b = out_ptr + rows * N
        if TMA_LOAD:  # descriptors of the whole operands (plans take TMA loads for one problem only)
            lhs_b, rhs_b = lhs_ptr, rhs_ptr
        else:
            lhs_b = lhs_ptr + rows * K
            rhs_b = rhs_ptr + (0 if SHARED_RHS else tl.cast(b, tl.int64) * (NUM_SELECTED * K * N))
        sizes_b = group_sizes_ptr + b * NUM_GROUPS
        offset_b = group_offset_ptr + b
        g0, first_row = _first_selected(sizes_b, offset_b, m, NUM_GROUPS, NUM_SELECTED)
        row = first_row
        for i in range(0, NUM_SELECTED):
            end = _group_end(row, sizes_b, g0 + i, m, NUM_GROUPS)
            _gmm_segment(lhs_b, rhs_b, out_b, out_desc, rows, tile, done, row, end, i, K, N, TRANSPOSE_RHS,
                         False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, TMA_STORE, TMA_LOAD)
            tile, done = _after_segment(tile, done, row, end, N, BLOCK_M, BLOCK_N)
            row = end
        _gmm_zero_rows(lhs_b, rhs_b, out_b, out_desc, rows, tile, done, first_row, row, m, K, N, TRANSPOSE_RHS,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, TMA_STORE, TMA_LOAD)
        tile, done = _after_zero_rows(tile, done, first_row, row, m, N, BLOCK_M, BLOCK_N)


@triton.jit
def _pick(values, b, BATCH_P2: tl.constexpr):
    """Problem ``b``'s entry of a [BATCH_P2] vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, BATCH_P2) == b, values, 0))


@triton.jit
def _gmm_gathered_segment(lhs_ptr, rhs_ptr, out_ptr, tile, done, starts, counts, m, rhs_index,
                          K: tl.constexpr, N: tl.constexpr, TRANSPOSE_RHS: tl.constexpr, IS_ZERO: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, BATCH_P2: tl.constexpr):
    """``_gmm_segment`` of one group's rows in every problem, taken in turn as one run of rows:
    problem b's ``counts[b]`` rows from ``starts[b]`` (``[BATCH_P2]`` vectors, 0 rows past the
    batch). A tile's rows may come from several problems; a tile within one problem is addressed
    as ``_gmm_tile``'s. ``IS_ZERO``: rows outside the selected groups, written as zeros. Returns
    nothing (see ``_gmm_segment``)."""
    total = tl.sum(counts)
    tiles_m, count = _segment_tiles(0, total, N, BLOCK_M, BLOCK_N)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if tile < done + count:  # most programs have no tile here: skip the set-up (a scan)
        before = tl.cumsum(counts, 0) - counts  # the run's rows ahead of problem b's
        # Run row r is row r + shift[b] of lhs and out, for the last problem b with before[b] <= r.
        shift = tl.arange(0, BATCH_P2).to(tl.int64) * m + starts - before
        while tile < done + count:
            pm, pn = _swizzle(tile - done, tiles_m, tiles_n, GROUP_M)
            run = pm * BLOCK_M + tl.arange(0, BLOCK_M)
            # The tile's first problem b (never an empty one: the next problem's before[] is the same).
            b = tl.sum((before <= pm * BLOCK_M).to(tl.int32)) - 1
            here = _pick(shift, b, BATCH_P2)
            if tl.minimum(pm * BLOCK_M + BLOCK_M, total) <= _pick(before, b, BATCH_P2) + _pick(counts, b, BATCH_P2):
                # All rows in problem b: consecutive rows, addressed as _gmm_tile does. Addressed
                # row by row they took 11-15% longer at 1024 rows an expert (H200): the k loop then
                # steps a pointer per row (benchmarks/README.md, "vmap: one launch for all samples").
                offs = tl.arange(0, BLOCK_M)
                _gmm_rows_tile(lhs_ptr, rhs_ptr, out_ptr, here + pm * BLOCK_M, offs, offs < total - pm * BLOCK_M,
                               rhs_index, pn, K, N, TRANSPOSE_RHS, IS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            else:  # rows of several problems: each row's own problem's shift
                inside = (run[:, None] >= before[None, :]) & (run[:, None] < before[None, :] + counts[None, :])
                rows_at = run.to(tl.int64) + tl.sum(tl.where(inside, shift[None, :], 0), axis=1)
                _gmm_rows_tile(lhs_ptr, rhs_ptr, out_ptr, tl.zeros([], tl.int64), rows_at, run < total, rhs_index, pn,
                               K, N, TRANSPOSE_RHS, IS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            tile += tl.num_programs(0)


@triton.jit
def _gmm_group_major(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m, out_ptr,
                     K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                     TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BATCH: tl.constexpr, BATCH_P2: tl.constexpr):
    """A batch of problems sharing one rhs, walked group-major in chunks of ``BATCH_P2`` problems:
    group i's rows of every problem of the chunk as one segment (``_gmm_gathered_segment``), then
    the chunk's zero rows as two more. The programs working at one time then read one expert's
    weights, from L2, where a problem-major walk read them from memory once per problem; and the
    tiles are those of one call on all the chunk's rows (the plan sizes them so), where tiles cut
    per problem were often partly empty. Each problem's row cursor is an entry of a [BATCH_P2]
    vector; the chunks keep those vectors (and the tiles' [BLOCK_M, BATCH_P2] row lookup) within
    registers at any batch (``GROUP_MAJOR_CHUNK``)."""
    probs = tl.arange(0, BATCH_P2)
    tile = tl.program_id(0)
    done = tl.zeros([], tl.int32)
    for c0 in range(0, BATCH, BATCH_P2):
        valid = probs < BATCH - c0
        sizes_ptrs = group_sizes_ptr + (c0 + probs) * NUM_GROUPS
        g0 = tl.load(group_offset_ptr + c0 + probs, mask=valid, other=0)
        g0 = tl.minimum(tl.maximum(g0, 0), NUM_GROUPS - NUM_SELECTED)  # clamped, as _first_selected
        first = tl.zeros([BATCH_P2], tl.int32)
        for g in range(0, tl.max(g0)):  # rows before each problem's first selected group
            size = tl.load(sizes_ptrs + g, mask=valid & (g < g0), other=0)
            first += tl.minimum(tl.maximum(size, 0), m - first)
        # The chunk's operands, inline (see _gmm_problem_major): its rows follow the last chunk's.
        chunk_rows = tl.cast(c0, tl.int64) * m
        lhs_c = lhs_ptr + chunk_rows * K
        out_c = out_ptr + chunk_rows * N
        row = first
        for i in range(0, NUM_SELECTED):
            size = tl.load(sizes_ptrs + g0 + i, mask=valid, other=0)
            end = row + tl.minimum(tl.maximum(size, 0), m - row)  # _group_end's clamps
            _gmm_gathered_segment(lhs_c, rhs_ptr, out_c, tile, done, row, end - row, m, i, K, N, TRANSPOSE_RHS,
                                  False, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, BATCH_P2)
            tile, done = _after_segment(tile, done, 0, tl.sum(end - row), N, BLOCK_M, BLOCK_N)
            row = end
        # The zero rows, gathered too: before each problem's first selected group, then after its
        # last (problem by problem, 1024 samples of 32 tokens took 1.9x as long on an H200).
        _gmm_gathered_segment(lhs_c, rhs_ptr, out_c, tile, done, tl.zeros([BATCH_P2], tl.int32), first, m, 0, K, N,
                              TRANSPOSE_RHS, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, BATCH_P2)
        tile, done = _after_segment(tile, done, 0, tl.sum(first), N, BLOCK_M, BLOCK_N)
        after = tl.where(valid, m - row, 0)
        _gmm_gathered_segment(lhs_c, rhs_ptr, out_c, tile, done, row, after, m, 0, K, N,
                              TRANSPOSE_RHS, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, BATCH_P2)
        tile, done = _after_segment(tile, done, 0, tl.sum(after), N, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize_on_alignment=["m"])
def gmm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
               out_ptr,
               K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
               TRANSPOSE_RHS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BATCH: tl.constexpr = 1, SHARED_RHS: tl.constexpr = False, BATCH_P2: tl.constexpr = 1,
               GROUP_MAJOR: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
               TMA_LOAD: tl.constexpr = False):
    # The batch's constexprs have defaults (one problem): a graph torch.compile cached before
    # they existed launches without them (see ejkernel_torch.launch.plan_from_text). TMA_STORE:
    # whole tiles are stored through a descriptor of the output (problem-major walks only).
    # TMA_LOAD: lhs and rhs are read through descriptors (one problem, problem-major).
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[BATCH * m, N], strides=[N, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    else:
        out_desc = out_ptr
    if TMA_LOAD:
        tl.static_assert(BATCH == 1 and not GROUP_MAJOR)
        lhs_src = tl.make_tensor_descriptor(lhs_ptr, shape=[m, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        # 3-D: a box past K reads zeros, not the next expert's first rows
        if TRANSPOSE_RHS:
            rhs_src = tl.make_tensor_descriptor(rhs_ptr, shape=[NUM_SELECTED, N, K], strides=[N * K, K, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            rhs_src = tl.make_tensor_descriptor(rhs_ptr, shape=[NUM_SELECTED, K, N], strides=[K * N, N, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
    else:
        lhs_src, rhs_src = lhs_ptr, rhs_ptr
    if GROUP_MAJOR:
        _gmm_group_major(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m, out_ptr, K, N, NUM_GROUPS,
                         NUM_SELECTED, TRANSPOSE_RHS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION, BATCH,
                         BATCH_P2)
    else:
        _gmm_problem_major(lhs_src, rhs_src, group_sizes_ptr, group_offset_ptr, m, out_ptr, out_desc, K, N,
                           NUM_GROUPS, NUM_SELECTED, TRANSPOSE_RHS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_PRECISION,
                           BATCH, SHARED_RHS, TMA_STORE, TMA_LOAD)


# --------------------------------------------------------------------------------------------
# tgmm


@triton.jit
def _tgmm_tile(lhs_ptr, rhs_ptr, out, m, start, rows, index, pk, pn,
               K: tl.constexpr, N: tl.constexpr, LHS_MK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA_STORE: tl.constexpr):
    """out[index][k-tile pk, n-tile pn] = lhs[k-tile, rows of the group] @ rhs[rows, n-tile].
    ``out``: the output's pointer, or with ``TMA_STORE`` its [outputs, K, N] tensor descriptor."""
    acc = _tgmm_acc(lhs_ptr, rhs_ptr, m, start, rows, pk, pn, K, N, LHS_MK, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if TMA_STORE:  # from shared memory, asynchronously: the next tile's loads start meanwhile
        out.store([index, pk * BLOCK_K, pn * BLOCK_N], acc.to(out.dtype).reshape(1, BLOCK_K, BLOCK_N))
    else:
        offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ptrs = out + tl.cast(index, tl.int64) * (K * N) + offs_k[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


@triton.jit
def _tgmm_acc(lhs_ptr, rhs_ptr, m, start, rows, pk, pn,
              K: tl.constexpr, N: tl.constexpr, LHS_MK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """The float32 [BLOCK_K, BLOCK_N] tile lhs[k-tile pk, rows] @ rhs[rows, n-tile pn] of the
    ``rows`` rows from ``start``."""
    offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_M)
    k_mask = offs_k < K
    n_mask = offs_n < N
    if LHS_MK:  # [m, K]: read [BLOCK_M, BLOCK_K] tiles, transpose in registers
        a_ptrs = lhs_ptr + start.to(tl.int64) * K + offs_r[:, None] * K + offs_k[None, :]
    else:  # [K, m]: row stride m, so the row offsets are int64 (an int32 row x m passed 2**31 from
        # m = 2**31 / (BLOCK_K - 1) on, about 17M rows at BLOCK_K 128, and read out of bounds)
        a_ptrs = lhs_ptr + offs_k.to(tl.int64)[:, None] * m + start + offs_r[None, :]
    b_ptrs = rhs_ptr + start.to(tl.int64) * N + offs_r[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for r0 in range(0, rows, BLOCK_M):
        # Rows of other groups are masked on both operands, so their values (even inf/NaN)
        # never reach this group's sum.
        r_mask = offs_r < rows - r0
        if LHS_MK:
            a = tl.trans(tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0))
        else:
            a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += _dot(a, b, DOT_PRECISION)
        if LHS_MK:
            a_ptrs += BLOCK_M * K
        else:
            a_ptrs += BLOCK_M
        b_ptrs += BLOCK_M * N
    return acc


@triton.jit(do_not_specialize_on_alignment=["m"])
def tgmm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
                out_ptr,
                K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                LHS_MK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BATCH: tl.constexpr = 1, TMA_STORE: tl.constexpr = False):
    # (constexpr defaults: as gmm_kernel's.) Tiles are ordered problem-major, then group-major, so
    # a program's tiles visit groups in increasing order and the group's row range follows from a
    # running cumsum (one pass over each problem's groups in total).
    if TMA_STORE:  # bounds per output matrix: a tile past K or N is clipped, not spilled
        out = tl.make_tensor_descriptor(out_ptr, shape=[BATCH * NUM_SELECTED, K, N], strides=[K * N, N, 1],
                                        block_shape=[1, BLOCK_K, BLOCK_N])
    else:
        out = out_ptr
    g0, start = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_k * tiles_n
    per_problem = NUM_SELECTED * per_group
    current = tl.zeros([], tl.int32)
    end = _group_end(start, group_sizes_ptr, g0, m, NUM_GROUPS)
    problem = tl.zeros([], tl.int32)
    for tile in range(tl.program_id(0), BATCH * per_problem, tl.num_programs(0)):
        local = tile
        if BATCH > 1:  # decided at compile time: a batch of 1 compiles to the unbatched kernel
            b = tile // per_problem
            if b != problem:  # the next problem this program has tiles of: walk its groups anew
                problem = b
                g0, start = _first_selected(group_sizes_ptr + b * NUM_GROUPS, group_offset_ptr + b, m,
                                            NUM_GROUPS, NUM_SELECTED)
                current = tl.zeros([], tl.int32)
                end = _group_end(start, group_sizes_ptr + b * NUM_GROUPS, g0, m, NUM_GROUPS)
            local -= b * per_problem
        index = local // per_group
        while current < index:
            current += 1
            start = end
            end = _group_end(start, group_sizes_ptr + problem * NUM_GROUPS, g0 + current, m, NUM_GROUPS)
        local -= index * per_group
        # The problem's operands inline (see gmm_kernel): its lhs ([m, K] or [K, m]) and rhs
        # ([m, N]) follow the previous problem's; its outputs are the next NUM_SELECTED.
        rows = tl.cast(problem, tl.int64) * m
        _tgmm_tile(lhs_ptr + rows * K, rhs_ptr + rows * N, out,
                   m, start, end - start, problem * NUM_SELECTED + index, local // tiles_n, local % tiles_n,
                   K, N, LHS_MK, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, TMA_STORE)


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


def group_offset_bounds(num_groups: int, num_selected: int) -> tuple[int, int]:
    """The range the kernels clamp an unchecked group_offset into. The fronts clamp an offset
    array to it *before* narrowing it to int32: the cast wrapped an int64 2**32 + 1 to 1, a
    valid offset, which selected other experts without an error (the kernels' clamp came after)."""
    return 0, num_groups - num_selected


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
    transpose_rhs = checks.flag("transpose_rhs", transpose_rhs)
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
        raise TypeError(f"num_actual_groups must be a Python int, got {checks.got(num_actual_groups)}") from None
    if not 0 <= selected <= num_groups:
        raise ValueError(f"num_actual_groups must be in [0, {num_groups}], got {selected}")
    return m, k, rhs_shape[1], num_groups, selected


# --------------------------------------------------------------------------------------------
# a launch's problem, from its operands' shapes (both fronts: plan arguments and tuning cache key)


def problem_batch(sizes_shape) -> int:
    """Problems in one launch: 1, or the rows of a 2-D ``group_sizes`` (a vmap's folded batch)."""
    return int(sizes_shape[0]) if len(sizes_shape) == 2 else 1


def gmm_problem(lhs_shape, rhs_shape, sizes_shape, transpose_rhs: bool, dtype: str, out_dtype: str) -> tuple:
    """``gmm_plan``'s problem arguments for a launch on lhs ``[batch * m, k]``, rhs ``[.., selected,
    k, n]`` (``[.., n, k]`` if ``transpose_rhs``) and group_sizes ``[.., groups]``: one problem's."""
    (m, k), (selected, *rest) = lhs_shape, rhs_shape[-3:]
    n = rest[0] if transpose_rhs else rest[1]
    return (m // max(problem_batch(sizes_shape), 1), k, n, sizes_shape[-1], selected, transpose_rhs, dtype,
            out_dtype)


# Problems a shared-rhs batch walks group-major at a time: its tiles work out each row's
# problem from [BLOCK_M, next_pow2(chunk)] tensors, which spill registers past 128 on sm_90 (and
# pass Triton's 2**20 elements past 8192). Larger batches go chunk by chunk; walked problem by
# problem instead, 256 samples of 128 tokens took 52x the time of one call on their tokens.
GROUP_MAJOR_CHUNK = 128


def group_major(batch: int, shared_rhs: bool) -> bool:
    """Whether a batch of problems with one rhs (``shared_rhs``) is walked group-major, tiling
    each group's rows of a chunk of problems together (``_gmm_group_major``)."""
    return bool(shared_rhs) and batch > 1


def group_major_rows(m: int, batch: int) -> int:
    """Rows of one group-major segment's problems: ``m`` rows each, a chunk of them."""
    return m * min(batch, GROUP_MAJOR_CHUNK)


def tuning_problem(problem: tuple, batch: int, shared_rhs: bool) -> tuple:
    """The problem whose tuned config a gmm launch reads: its own, except that a batch walked
    group-major is tiled as one call on a chunk of its problems' rows would be (``gmm_plan``), so
    it reads that call's (one problem's entry sized the tiles for one problem's rows)."""
    return (group_major_rows(problem[0], batch), *problem[1:]) if group_major(batch, shared_rhs) else problem


def tgmm_problem(lhs_shape, rhs_shape, sizes_shape, num_selected: int, lhs_mk: bool, dtype: str,
                 out_dtype: str) -> tuple:
    """``tgmm_plan``'s problem arguments for a launch on lhs ``[batch * m, k]`` (``lhs_mk``) or
    ``[.., k, m]``, and rhs ``[batch * m, n]``: one problem's."""
    if lhs_mk:
        m, k = lhs_shape[0] // max(problem_batch(sizes_shape), 1), lhs_shape[1]
    else:
        k, m = lhs_shape[-2:]
    return (m, k, rhs_shape[1], sizes_shape[-1], num_selected, lhs_mk, dtype, out_dtype)


# --------------------------------------------------------------------------------------------
# plans

MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16 on GPUs
PARAM_FIELDS = ("blocksize_m", "blocksize_n", "blocksize_k", "num_warps", "num_stages")  # of FwdParams
CPU_PROGRAMS = 3  # the interpreter runs programs one after another; 3 exercises the striding


def _merge(defaults: dict, params: FwdParams | None, facts: DeviceFacts, what: str) -> dict:
    cfg = dict(defaults)
    given = FwdParams.coerce(params).to_dict()
    unknown = sorted(set(given) - set(cfg))
    if unknown:
        raise ValueError(f"{what}: fwd_params field(s) {unknown} do not apply; use {sorted(PARAM_FIELDS)}")
    cfg.update(given)
    small = {f: v for f, v in cfg.items() if f.startswith("blocksize") and v < MIN_BLOCK}
    if small:
        raise ValueError(f"{what}: block sizes must be at least {MIN_BLOCK}, got {small}")
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    check_tile_numel(what, (bm, bk), (bk, bn), (bm, bn))
    return cfg


def _finish(cfg: dict, a_tile: int, b_tile: int, dtype: str, params, facts: DeviceFacts, what: str) -> dict:
    """Fill in num_stages (most that fit, unless given) and check shared memory."""
    per_stage = (a_tile + b_tile) * itemsize(dtype)
    if cfg.get("num_stages") is None:
        cfg["num_stages"] = select_num_stages(per_stage, facts, max_stages=cfg.pop("max_stages"))
    cfg.pop("max_stages", None)
    cfg["smem"] = per_stage * cfg["num_stages"]
    if not facts.is_cpu:
        check_params(FwdParams.coerce(params), facts, cfg["smem"], what)
    return cfg


def _gmm_config(m: int, k: int, n: int, num_selected: int, dtype: str, facts: DeviceFacts, params) -> dict:
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
    return _finish(cfg, bm * bk, bk * bn, dtype, params, facts, "grouped_matmul")


def _tgmm_config(k: int, n: int, dtype: str, facts: DeviceFacts, params) -> dict:
    # blocksize_k x blocksize_n is the output tile; blocksize_m the chunk of rows summed per step.
    if facts.is_cpu:
        base = dict(blocksize_m=64, blocksize_n=64, blocksize_k=64, num_warps=4, num_stages=1)
    elif itemsize(dtype) == 4:
        base = dict(blocksize_m=32, blocksize_n=64, blocksize_k=64, num_warps=4, num_stages=None, max_stages=3)
    else:
        # 128 x 256 output tiles: 0.90-1.08x torch._grouped_mm on an H100 where 128 x 128 gave
        # 0.77-0.90x (scripts/sweep_gmm_backward.py, benchmarks/results/sweep_gmm_backward-*.json).
        bn = _tgmm_block_n(n)
        base = dict(blocksize_m=64, blocksize_n=bn, blocksize_k=128, num_warps=8, num_stages=None,
                    max_stages=3 if bn == 256 else 4)
    cfg = _merge({**base, "max_stages": base.get("max_stages", 1)}, params, facts, "transposed_grouped_matmul")
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    return _finish(cfg, bk * bm, bm * bn, dtype, params, facts, "transposed_grouped_matmul")


def _tgmm_block_n(n: int) -> int:
    """The 16-bit weight gradient's output tile width, Triton's and Gluon's kernels alike."""
    return 256 if n >= 1024 else 128


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
             dtype: str, out_dtype: str, facts: DeviceFacts, params: FwdParams | None = None,
             batch: int = 1, shared_rhs: bool = False) -> LaunchPlan:
    """Plan for ``out[m, n] = grouped lhs[m, k] @ rhs[num_selected, k, n]`` (``[.., n, k]`` if
    ``transpose_rhs``). Inputs: lhs, rhs, group_sizes (int32 [num_groups]), group_offset (int32 [1]).

    ``batch`` independent problems in one launch (what torch.func.vmap folds): lhs ``[batch * m,
    k]``, group_sizes ``[batch, num_groups]``, group_offset ``[batch]``, rhs ``[batch,
    num_selected, ...]`` or, with ``shared_rhs``, one ``[num_selected, ...]`` for all (walked
    group-major, ``GROUP_MAJOR_CHUNK`` problems at a time); out ``[batch * m, n]``."""
    check_float_dtype("lhs", dtype)
    check_out_dtype(out_dtype)
    shared_rhs, by_group = bool(shared_rhs) and batch > 1, group_major(batch, shared_rhs)
    # Group-major tiles run over a chunk of problems' rows of a group (_gmm_group_major).
    cfg = _gmm_config(group_major_rows(m, batch) if by_group else m, k, n, num_selected, dtype, facts, params)
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    # Upper bound on the tiles: each group adds at most one partial row tile, and so does each
    # of the two zero segments.
    tiles = batch * cdiv(n, bn) * (cdiv(m, bm) + num_selected + 2) if m and n else 0
    # (box coordinates are int32: rows of every problem must count below 2**31)
    tma_store = not by_group and batch * m < 2**31 and _tma_store(cfg, bm, n, out_dtype, facts)
    tma_load = batch == 1 and m < 2**31 and _tma_load(k, n, dtype, facts)
    return LaunchPlan(
        kernel=gmm_kernel,
        grid=(_programs(tiles, cfg, facts),),
        **_group_inputs(dtype),
        scalars=(("m", m),),
        outputs=(Output("out_ptr", (batch * m, n), out_dtype),),
        constexprs=(("K", k), ("N", n), ("NUM_GROUPS", num_groups), ("NUM_SELECTED", num_selected),
                    ("TRANSPOSE_RHS", bool(transpose_rhs)), ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk),
                    ("GROUP_M", 8), ("DOT_PRECISION", _dot_precision(dtype, facts)), ("BATCH", batch),
                    ("SHARED_RHS", shared_rhs), ("BATCH_P2", triton.next_power_of_2(min(batch, GROUP_MAJOR_CHUNK))),
                    ("GROUP_MAJOR", by_group), ("TMA_STORE", tma_store), ("TMA_LOAD", tma_load)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True,
        global_scratch=tma_store or tma_load,
    )


@functools.lru_cache(maxsize=512)
def tgmm_plan(m: int, k: int, n: int, num_groups: int, num_selected: int, lhs_mk: bool,
              dtype: str, out_dtype: str, facts: DeviceFacts, params: FwdParams | None = None,
              batch: int = 1) -> LaunchPlan:
    """Plan for ``out[num_selected, k, n]``, ``out[i] = lhs[:, rows_(g0+i)] @ rhs[rows_(g0+i)]``.

    ``lhs`` is ``[k, m]``, or ``[m, k]`` when ``lhs_mk``; ``rhs`` is ``[m, n]``. Inputs as gmm_plan.
    ``batch`` problems in one launch: lhs ``[batch, k, m]`` or ``[batch * m, k]``, rhs ``[batch *
    m, n]``, group arguments as gmm_plan's; out ``[batch * num_selected, k, n]``.
    """
    check_float_dtype("lhs", dtype)
    check_out_dtype(out_dtype)
    if uses_gluon_tgmm(m, k, n, num_selected, lhs_mk, dtype, out_dtype, facts, params, batch):
        return _tgmm_gluon_plan(m, k, n, num_groups, num_selected, dtype, facts)
    cfg = _tgmm_config(k, n, dtype, facts, params)
    bm, bn, bk = cfg["blocksize_m"], cfg["blocksize_n"], cfg["blocksize_k"]
    tiles = batch * num_selected * cdiv(k, bk) * cdiv(n, bn)
    tma_store = _tma_store(cfg, bk, n, out_dtype, facts)
    return LaunchPlan(
        kernel=tgmm_kernel,
        grid=(_programs(tiles, cfg, facts),),
        **_group_inputs(dtype),
        scalars=(("m", m),),
        outputs=(Output("out_ptr", (batch * num_selected, k, n), out_dtype),),
        constexprs=(("K", k), ("N", n), ("NUM_GROUPS", num_groups), ("NUM_SELECTED", num_selected),
                    ("LHS_MK", bool(lhs_mk)), ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk),
                    ("DOT_PRECISION", _dot_precision(dtype, facts)), ("BATCH", batch), ("TMA_STORE", tma_store)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=True, global_scratch=tma_store,
    )


def _tma_store(cfg: dict, tile_rows: int, n: int, out_dtype: str, facts: DeviceFacts) -> bool:
    """Whether a kernel stores its [tile_rows, blocksize_n] output tiles through a tensor
    descriptor (TMA from shared memory, left in flight while the next tile's loads run). tgmm's
    output is a [k, n] matrix per expert, large at many experts: on an H200
    (scripts/probe_tgmm_store.py) 0.40 -> 0.38 ms at 64 experts x 512 rows, k 2048, n 1408, and
    0.42 -> 0.36 ms at 128 x 128 rows. It needs Hopper's TMA, a launcher that provides global
    scratch (``facts.gluon``), rows of whole 16-byte units, and shared memory for the tile beside
    the pipeline's buffers."""
    size, cols = itemsize(out_dtype), cfg["blocksize_n"]
    return (_has_tma(facts) and (n * size) % 16 == 0 and max(tile_rows, cols) <= 256 and cols * size >= 16
            and cfg["smem"] + tile_rows * cols * size <= facts.shared_memory)


def _has_tma(facts: DeviceFacts) -> bool:
    """Hopper's TMA, and a launcher that provides the global scratch its descriptors are made in."""
    return not facts.is_cpu and facts.gluon and facts.capability >= (9, 0)


def _tma_load(k: int, n: int, dtype: str, facts: DeviceFacts) -> bool:
    """Whether gmm reads lhs and rhs through tensor descriptors (TMA) rather than pointer loads
    (``cp.async``), for one problem: 16-bit inputs whose rows (k long in lhs, n or k in rhs) are
    whole 16-byte units. On an H200 (bf16, balanced, ``scripts/probe_gmm_tma.py``, side by side)
    TMA loads gave 1.00-1.055x the speed of pointer loads for the forward and d_lhs at 8-128
    experts of 128-8192 rows, with the same bits."""
    return _has_tma(facts) and itemsize(dtype) == 2 and k % 8 == 0 and n % 8 == 0


@functools.lru_cache(maxsize=512)  # asked on every tuning lookup of a weight gradient (tuning._tgmm_untuned)
def uses_gluon_tgmm(m: int, k: int, n: int, num_selected: int, lhs_mk: bool, dtype: str, out_dtype: str,
                    facts: DeviceFacts, params: FwdParams | None = None, batch: int = 1) -> bool:
    """Whether ``tgmm_plan`` picks ``gluon_grouped_matmul.tgmm_gluon_kernel``: on Hopper with a
    Triton that has Gluon (``facts.gluon``), for the gmm backward's weight gradient (``lhs_mk``,
    one problem) in fp16/bf16 with an output of the same dtype, k and n multiples of 8 (TMA's
    16-byte strides), without explicit ``fwd_params`` (those tune the Triton kernel), and at
    most ``GLUON_TGMM_MAX_ROWS`` rows an expert on average.

    Its loader runs ahead across output tiles, which pays where a tile sums few row steps. On an
    H200, bf16, balanced, against ``tgmm_kernel`` with its TMA store (scripts/probe_tgmm_store.py,
    probe_tgmm_gluon-*.json, best of two rounds; the same bits): 1.03-1.05x as fast at 128 rows
    an expert, 1.09x and 1.21x at 192, 1.00-1.02x at 512, 1.01x at 1024, but 0.96x at 8192 (8
    experts of 64k tokens), where the Triton kernel's main loop is the faster one."""
    return (facts.gluon and not facts.is_cpu and facts.capability == (9, 0) and lhs_mk and batch == 1
            and dtype in ("float16", "bfloat16") and out_dtype == dtype and params is None
            and min(m, k, n, num_selected) > 0 and k % 8 == 0 and n % 8 == 0
            and m <= GLUON_TGMM_MAX_ROWS * num_selected and _gluon_tgmm_smem(n, dtype) <= facts.shared_memory)


GLUON_TGMM_MAX_ROWS = 1024  # rows an expert, on average, up to which uses_gluon_tgmm picks the Gluon kernel


def _gluon_tgmm_smem(n: int, dtype: str) -> int:
    from . import gluon_grouped_matmul as ggm

    bn = _tgmm_block_n(n)
    ring = ggm.STAGES * ggm.STEP * (ggm.TILE_K + bn) * itemsize(dtype)
    return ring + ggm.TILE_K * bn * itemsize(dtype) + 1024  # + output staging, barriers


def _tgmm_gluon_plan(m: int, k: int, n: int, num_groups: int, num_selected: int, dtype: str,
                     facts: DeviceFacts) -> LaunchPlan:
    from . import gluon_grouped_matmul as ggm

    bn = _tgmm_block_n(n)
    tiles = num_selected * cdiv(k, ggm.TILE_K) * cdiv(n, bn)
    return LaunchPlan(
        kernel=ggm.tgmm_gluon_kernel,
        grid=(min(tiles, facts.num_sms),),
        **_group_inputs(dtype),
        scalars=(("m", m),),
        outputs=(Output("out_ptr", (num_selected, k, n), dtype),),
        constexprs=(("K", k), ("N", n), ("NUM_GROUPS", num_groups), ("NUM_SELECTED", num_selected),
                    ("BLOCK_N", bn), ("STAGES", ggm.STAGES)),
        num_warps=4, num_stages=1, maxnreg=ggm.MAXNREG,
    )
