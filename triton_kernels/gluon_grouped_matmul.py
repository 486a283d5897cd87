"""Warp-specialized, persistent weight gradient (``tgmm``) for Hopper (sm_90), written in Gluon.

``tgmm_kernel`` sums few row steps per output tile at many experts (eight 64-row steps at 64
experts of 512 rows), and Triton's pipeline fills and drains once per tile: the first loads of a
tile wait for the previous tile's epilogue. Here a CTA is split by role:

- a 1-warp loader partition walks the program's tiles and copies each row step (two 64-column
  boxes of ``lhs`` and one box of ``rhs``) with TMA into a ring of shared-memory stages, running
  ahead across tiles while the consumers finish one;
- two 4-warp consumer warpgroups each own 64 rows (of k) of a 128 x ``BLOCK_N`` output tile:
  wgmma over the ring's stages (``lhs``'s box read transposed from shared memory), then the tile
  leaves with a TMA store from shared memory, left in flight.

The tile order is ``tgmm_kernel``'s: group-major, a program takes every ``num_programs``-th tile,
so the programs work on about one group at a time and its rows stay in L2. Each partition walks
the order on its own from ``group_sizes`` (scalar loads), with the same clamping as
``grouped_matmul``.

Rows of other groups must not reach a group's sum, on either operand (inf or NaN there would
give NaN through a zero). The loader bounds each tile's descriptors at the group's end row, so TMA
reads the rows past it as zeros. A tile's descriptors are made in one of two global-scratch slots,
alternating tile by tile; a slot is rewritten only once the consumers have released the last stage
loaded through it (``_load_tile``).

Routing (``grouped_matmul.uses_gluon_tgmm``): 16-bit inputs and output of the same dtype, ``lhs``
as ``[m, k]`` (the gmm backward's layout), one problem (no vmap batch), k and n multiples of 8
(TMA's 16-byte strides). Gluon does not run in Triton's interpreter: CPU CI compiles these plans
for sm_90 ahead of time and the ``gpu`` tests run them.
"""
from __future__ import annotations

from .flash_attention.gluon_forward import AVAILABLE

ROWS = 64  # one warpgroup's wgmma covers 64 rows; an output tile is two of them (of k)
TILE_K = 2 * ROWS
STEP = 64  # rows (of m) summed per ring stage
STAGES = 3  # 48 KB a stage at BLOCK_N 256, beside 64 KB of output staging
MAXNREG = 168  # 12 warps (the loader's warp counts as a warpgroup) x 32 lanes x 168 fits 64K

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from .flash_attention.gluon_forward import _barriers, _thread_barrier, _tma_load, _tma_store

    _ROWS, _TILE_K, _STEP = gl.constexpr(ROWS), gl.constexpr(TILE_K), gl.constexpr(STEP)

    @gluon.jit
    def _group_end(start, group_sizes_ptr, g, m, NUM_GROUPS: gl.constexpr):
        # As grouped_matmul._group_end: negative or out-of-range sizes are empty, the group is cut
        # at row m before the addition (no int32 wrap).
        size = gl.load(group_sizes_ptr + g, mask=g < NUM_GROUPS, other=0)
        return start + gl.minimum(gl.maximum(size, 0), m - start)

    @gluon.jit
    def _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr):
        """(g0, first row of group g0): the clamped offset and the sum of the sizes before it."""
        g0 = gl.load(group_offset_ptr)
        g0 = gl.minimum(gl.maximum(g0, 0), NUM_GROUPS - NUM_SELECTED)
        row = gl.to_tensor(0)
        for g in range(0, g0):
            row = _group_end(row, group_sizes_ptr, g, m, NUM_GROUPS)
        return g0, row

    @gluon.jit
    def _walk_start(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr):
        """Where every partition's walk starts: (g0, index 0 among the selected, its start and end rows)."""
        g0, start = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
        return g0, gl.to_tensor(0), start, _group_end(start, group_sizes_ptr, g0, m, NUM_GROUPS)

    @gluon.jit
    def _walk(tile, per_group, current, start, end, g0, group_sizes_ptr, m, NUM_GROUPS: gl.constexpr):
        """The group of ``tile`` (tiles only move forward): (its index among the selected, start
        row, end row)."""
        index = tile // per_group
        while current < index:
            current += 1
            start = end
            end = _group_end(start, group_sizes_ptr, g0 + current, m, NUM_GROUPS)
        return current, start, end

    @gluon.jit
    def _load_tile(lhs_ptr, rhs_ptr, a_smem, b_smem, ready, empty, start, end, k0, n0, ring, last,
                   K: gl.constexpr, N: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A tile's row steps into the ring from position ``ring`` on, through descriptors bounded at
        the group's ``end`` row. ``last``: the ring position last loaded through this call site's
        descriptor slot (-1: none); the slot is rewritten once that stage is released, which it
        already is unless the other slot's tile had fewer than STAGES steps. Returns (the next
        ring position, the last one loaded here)."""
        steps = gl.cdiv(end - start, _STEP)
        if steps > 0:
            if last >= 0:
                if ring <= last + STAGES:  # else the wait before loading position last + STAGES covered it
                    mbarrier.wait(empty.index(last % STAGES), (last // STAGES) & 1)
            dtype: gl.constexpr = lhs_ptr.dtype.element_ty
            a_desc = tma.make_tensor_descriptor(lhs_ptr, [end, K], [K, 1], [_STEP, _ROWS],
                                                gl.NVMMASharedLayout.get_default_for([_STEP, _ROWS], dtype))
            b_desc = tma.make_tensor_descriptor(rhs_ptr, [end, N], [N, 1], [_STEP, BLOCK_N],
                                                gl.NVMMASharedLayout.get_default_for([_STEP, BLOCK_N], dtype))
            nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
            for s in range(steps):
                c = ring + s
                stage = c % STAGES
                # A fresh mbarrier counts its phase 1 as complete: the first pass does not wait.
                mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, nbytes)
                row = start + s * _STEP
                _tma_load(a_desc, [row, k0], bar, a_smem.index(2 * stage))
                _tma_load(a_desc, [row, k0 + _ROWS], bar, a_smem.index(2 * stage + 1))
                _tma_load(b_desc, [row, n0], bar, b_smem.index(stage))
            last = ring + steps - 1
        return ring + steps, last

    @gluon.jit
    def _loader(lhs_ptr, rhs_ptr, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m,
                K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """This program's tiles, two at a time: each of the two ``_load_tile`` calls has its own
        descriptor slot."""
        g0, current, start, end = _walk_start(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
        tiles_n: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        per_group: gl.constexpr = (K + _TILE_K - 1) // _TILE_K * tiles_n  # an expert's output tiles
        programs = gl.num_programs(0)
        ring = gl.to_tensor(0)
        last_a = gl.to_tensor(-1)
        last_b = gl.to_tensor(-1)
        for tile in range(gl.program_id(0), NUM_SELECTED * per_group, 2 * programs):
            current, start, end = _walk(tile, per_group, current, start, end, g0, group_sizes_ptr, m, NUM_GROUPS)
            local = tile % per_group
            ring, last_a = _load_tile(lhs_ptr, rhs_ptr, a_smem, b_smem, ready, empty, start, end,
                                      (local // tiles_n) * _TILE_K, (local % tiles_n) * BLOCK_N, ring, last_a,
                                      K, N, BLOCK_N, STAGES)
            second = tile + programs
            if second < NUM_SELECTED * per_group:
                current, start, end = _walk(second, per_group, current, start, end, g0, group_sizes_ptr, m, NUM_GROUPS)
                local = second % per_group
                ring, last_b = _load_tile(lhs_ptr, rhs_ptr, a_smem, b_smem, ready, empty, start, end,
                                          (local // tiles_n) * _TILE_K, (local % tiles_n) * BLOCK_N, ring, last_b,
                                          K, N, BLOCK_N, STAGES)

    @gluon.jit
    def _multiply(a_smem, b_smem, ready, empty, ring, steps, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
        """Warpgroup ``WG``'s 64 x BLOCK_N sum over ``steps`` row steps from ring position ``ring``
        on. One wgmma stays in flight; a stage is released once the wgmma reading it is done."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        for s in range(steps):
            c = ring + s
            stage = c % STAGES
            mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
            # lhs's [rows, k] box, read as the [k, rows] operand
            acc = warpgroup_mma(a_smem.index(2 * stage + WG).permute((1, 0)), b_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if s > 0:
                mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if steps > 0:
            mbarrier.arrive(empty.index((ring + steps - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _consumer(out_ptr, a_smem, b_smem, o_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m,
                  WG: gl.constexpr, K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr,
                  NUM_SELECTED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Warpgroup ``WG``'s rows of this program's tiles, in the loader's order. An empty group's
        tiles are zeros."""
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        out_desc = tma.make_tensor_descriptor(
            out_ptr, [NUM_SELECTED, K, N], [gl.to_tensor(K).to(gl.int64) * N, N, 1], [1, _ROWS, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([1, _ROWS, BLOCK_N], dtype))
        g0, current, start, end = _walk_start(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
        tiles_n: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        per_group: gl.constexpr = (K + _TILE_K - 1) // _TILE_K * tiles_n  # an expert's output tiles
        ring = gl.to_tensor(0)
        o_rows = o_smem.index(WG)
        for tile in range(gl.program_id(0), NUM_SELECTED * per_group, gl.num_programs(0)):
            current, start, end = _walk(tile, per_group, current, start, end, g0, group_sizes_ptr, m, NUM_GROUPS)
            steps = gl.cdiv(end - start, _STEP)
            acc = _multiply(a_smem, b_smem, ready, empty, ring, steps, WG, BLOCK_N, STAGES)
            ring += steps
            local = tile % per_group
            tma.store_wait(0)  # the previous tile's store has read o_rows
            o_rows.store(acc.to(dtype))
            fence_async_shared()  # the generic-proxy writes above, before the TMA engine reads them
            _thread_barrier()  # every thread's rows are in o_rows before one thread starts the copy
            _tma_store(out_desc, [current, (local // tiles_n) * _TILE_K + WG * _ROWS, (local % tiles_n) * BLOCK_N],
                       o_rows)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize_on_alignment=["m"])
    def tgmm_gluon_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
                          out_ptr,
                          K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """``tgmm_kernel``'s product with ``LHS_MK``: ``out[i] = lhs[rows_g].T @ rhs[rows_g]``,
        ``g = g0 + i``; lhs ``[m, K]``, rhs ``[m, N]``, out ``[NUM_SELECTED, K, N]``."""
        dtype: gl.constexpr = lhs_ptr.dtype.element_ty
        a_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, _STEP, _ROWS],
                                           gl.NVMMASharedLayout.get_default_for([_STEP, _ROWS], dtype))
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, _STEP, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([_STEP, BLOCK_N], dtype))
        o_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([_ROWS, BLOCK_N], dtype))
        ready = _barriers(STAGES, 1)
        empty = _barriers(STAGES, 2)
        gl.warp_specialize([
            (_consumer, (out_ptr, a_smem, b_smem, o_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, 0, K, N,
                         NUM_GROUPS, NUM_SELECTED, BLOCK_N, STAGES)),
            (_consumer, (out_ptr, a_smem, b_smem, o_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, 1, K, N,
                         NUM_GROUPS, NUM_SELECTED, BLOCK_N, STAGES)),
            (_loader, (lhs_ptr, rhs_ptr, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, K, N,
                       NUM_GROUPS, NUM_SELECTED, BLOCK_N, STAGES)),
        ], [4, 1], [232, 24])
