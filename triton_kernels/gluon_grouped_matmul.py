"""Warp-specialized, persistent grouped matmul (``gmm``) for Hopper (sm_90), written in Gluon.

The ``@triton.jit`` ``gmm_kernel`` loads its tiles with ``cp.async`` and a warpgroup that both
issues the loads and waits on the tensor cores. Here a CTA is split by role, as CUTLASS's
warp-specialized kernels are:

- a 1-warp loader partition copies each k-step's lhs rows (two 64-row boxes) and rhs block
  with TMA into a ring of shared-memory stages, signalling "ready" mbarriers, and refills a
  stage once both consumers have released it;
- two 4-warp consumer warpgroups each own 64 rows of a 128 x ``BLOCK_N`` output tile: they
  issue wgmma asynchronously, keep one in flight, release the previous stage, and store their
  rows straight from the accumulator, masked to the tile's group.

The tile order is ``gmm_kernel``'s (the module docstring of ``grouped_matmul``): the selected
groups' tiles, each group's starting at its first row, then the zero rows outside them. Every
partition walks it on its own from ``group_sizes`` (scalar loads); a program does the tiles
congruent to its id, so there is no host sync and no launch per group. Sizes are clamped the
same way. Rows of a tile past its group are read (the next group's rows, or TMA's zeros past
``m``) and never stored; k and n past the array are TMA's zeros.

TMA needs 16-byte row strides: ``grouped_matmul.uses_gluon`` routes only 16-bit inputs with k
and n multiples of 8. Gluon does not run in Triton's interpreter: CPU CI compiles these plans
for sm_90 ahead of time and the ``gpu`` tests run them.
"""
from __future__ import annotations

from .flash_attention.gluon_forward import AVAILABLE

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    from .flash_attention.gluon_forward import _barriers, _tma_load

ROWS = 64  # one warpgroup's wgmma covers 64 rows; a tile is two of them
BLOCK_M = 2 * ROWS
GROUP_M = 8  # row tiles that sweep the n-tiles together (rhs reuse from L2), as gmm_kernel
MAXNREG = 168  # 12 warps (the loader's warp counts as a warpgroup) x 32 lanes x 168 fits 64K


def stages(block_n: int, block_k: int, itemsize: int, shared_memory: int) -> int:
    """Ring stages that fit: as many as shared memory holds, up to 4."""
    per_stage = (BLOCK_M + block_n) * block_k * itemsize
    return max(2, min(4, (shared_memory - 4096) // per_stage))


if AVAILABLE:
    # Module constants as Gluon constexprs, which jit functions may read.
    _ROWS, _BLOCK_M, _GROUP_M = gl.constexpr(ROWS), gl.constexpr(BLOCK_M), gl.constexpr(GROUP_M)

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
    def _swizzle(local, tiles_m, tiles_n):
        # Runs of _GROUP_M row tiles sweep the n-tiles together, as grouped_matmul._swizzle.
        width = _GROUP_M * tiles_n
        first_m = (local // width) * _GROUP_M
        size_m = gl.minimum(tiles_m - first_m, _GROUP_M)
        return first_m + (local % width) % size_m, (local % width) // size_m

    @gluon.jit
    def _load_tile(lhs_desc, rhs_desc, a_smem, b_smem, ready, empty, row, index, n0, ring,
                   K: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, TRANSPOSE_RHS: gl.constexpr):
        """A tile's k-steps into the ring from position ``ring`` on."""
        nbytes: gl.constexpr = 2 * lhs_desc.block_type.nbytes + rhs_desc.block_type.nbytes
        for kk in range(gl.cdiv(K, BLOCK_K)):
            c = ring + kk
            stage = c % STAGES
            # A fresh mbarrier counts its phase 1 as complete: the first pass does not wait.
            mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            k0 = kk * BLOCK_K
            _tma_load(lhs_desc, [row, k0], bar, a_smem.index(2 * stage))
            _tma_load(lhs_desc, [row + _ROWS, k0], bar, a_smem.index(2 * stage + 1))
            if TRANSPOSE_RHS:
                _tma_load(rhs_desc, [index, n0, k0], bar, b_smem.index(stage))
            else:
                _tma_load(rhs_desc, [index, k0, n0], bar, b_smem.index(stage))

    @gluon.jit
    def _loader(lhs_desc, rhs_desc, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m,
                K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr,
                TRANSPOSE_RHS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """This program's tiles of the selected groups, in order; the zero tiles need no loads."""
        g0, row = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tile = gl.program_id(0)
        done = 0
        ring = 0
        for i in range(NUM_SELECTED):
            end = _group_end(row, group_sizes_ptr, g0 + i, m, NUM_GROUPS)
            tiles_m = gl.cdiv(end - row, _BLOCK_M)
            while tile < done + tiles_m * tiles_n:
                pm, pn = _swizzle(tile - done, tiles_m, tiles_n)
                _load_tile(lhs_desc, rhs_desc, a_smem, b_smem, ready, empty, row + pm * _BLOCK_M, i, pn * BLOCK_N,
                           ring, K, BLOCK_K, STAGES, TRANSPOSE_RHS)
                ring += gl.cdiv(K, BLOCK_K)
                tile += gl.num_programs(0)
            done += tiles_m * tiles_n
            row = end

    @gluon.jit
    def _multiply(a_smem, b_smem, ready, empty, ring, WG: gl.constexpr, K: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, TRANSPOSE_RHS: gl.constexpr):
        """Warpgroup ``WG``'s 64 x BLOCK_N product over the k-steps in the ring from ``ring`` on.
        One wgmma stays in flight; a stage is released once the wgmma reading it has finished."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        steps = gl.cdiv(K, BLOCK_K)
        for kk in range(steps):
            c = ring + kk
            stage = c % STAGES
            mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
            if TRANSPOSE_RHS:
                b = b_smem.index(stage).permute((1, 0))
            else:
                b = b_smem.index(stage)
            acc = warpgroup_mma(a_smem.index(2 * stage + WG), b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            if kk > 0:
                mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((ring + steps - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _store(out_ptr, acc, row0, row_end, n0, N: gl.constexpr):
        """Rows [row0, row_end) of a warpgroup's 64 (the rest belong to another group or past m)."""
        layout: gl.constexpr = acc.type.layout
        rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, layout))
        cols = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        ptrs = out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _zero_rows(out_ptr, tile, done, start, end, WG: gl.constexpr, N: gl.constexpr, BLOCK_N: gl.constexpr):
        """This program's tiles among rows [start, end) outside the selected groups: zeros."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        zeros = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tiles_m = gl.cdiv(end - start, _BLOCK_M)
        while tile < done + tiles_m * tiles_n:
            local = tile - done
            _store(out_ptr, zeros, start + (local // tiles_n) * _BLOCK_M + WG * _ROWS, end, (local % tiles_n) * BLOCK_N, N)
            tile += gl.num_programs(0)
        return tile, done + tiles_m * tiles_n

    @gluon.jit
    def _consumer(out_ptr, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m,
                  WG: gl.constexpr, K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr,
                  NUM_SELECTED: gl.constexpr, TRANSPOSE_RHS: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """Warpgroup ``WG``'s rows of this program's tiles, in the loader's order, then the zero
        rows before and after the selected groups."""
        g0, first_row = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
        tiles_n = gl.cdiv(N, BLOCK_N)
        tile = gl.program_id(0)
        done = 0
        ring = 0
        row = first_row
        for i in range(NUM_SELECTED):
            end = _group_end(row, group_sizes_ptr, g0 + i, m, NUM_GROUPS)
            tiles_m = gl.cdiv(end - row, _BLOCK_M)
            while tile < done + tiles_m * tiles_n:
                pm, pn = _swizzle(tile - done, tiles_m, tiles_n)
                acc = _multiply(a_smem, b_smem, ready, empty, ring, WG, K, BLOCK_N, BLOCK_K, STAGES, TRANSPOSE_RHS)
                _store(out_ptr, acc, row + pm * _BLOCK_M + WG * _ROWS, end, pn * BLOCK_N, N)
                ring += gl.cdiv(K, BLOCK_K)
                tile += gl.num_programs(0)
            done += tiles_m * tiles_n
            row = end
        tile, done = _zero_rows(out_ptr, tile, done, 0, first_row, WG, N, BLOCK_N)
        _zero_rows(out_ptr, tile, done, row, m, WG, N, BLOCK_N)

    @gluon.jit(do_not_specialize_on_alignment=["m"])
    def gmm_gluon_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m,
                         out_ptr,
                         K: gl.constexpr, N: gl.constexpr, NUM_GROUPS: gl.constexpr, NUM_SELECTED: gl.constexpr,
                         TRANSPOSE_RHS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         STAGES: gl.constexpr):
        """``gmm_kernel``'s product and outputs: ``out[rows_g] = lhs[rows_g] @ rhs[g - g0]``, zeros
        elsewhere; rhs is ``[NUM_SELECTED, K, N]``, or ``[NUM_SELECTED, N, K]`` with TRANSPOSE_RHS."""
        dtype: gl.constexpr = lhs_ptr.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, BLOCK_K], dtype)
        lhs_desc = tma.make_tensor_descriptor(lhs_ptr, [m, K], [K, 1], [_ROWS, BLOCK_K], a_layout)
        if TRANSPOSE_RHS:
            b_box: gl.constexpr = [BLOCK_N, BLOCK_K]
            rhs_desc = tma.make_tensor_descriptor(
                rhs_ptr, [NUM_SELECTED, N, K], [N * K, K, 1], [1, BLOCK_N, BLOCK_K],
                gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, BLOCK_K], dtype))
        else:
            b_box: gl.constexpr = [BLOCK_K, BLOCK_N]
            rhs_desc = tma.make_tensor_descriptor(
                rhs_ptr, [NUM_SELECTED, K, N], [K * N, N, 1], [1, BLOCK_K, BLOCK_N],
                gl.NVMMASharedLayout.get_default_for([1, BLOCK_K, BLOCK_N], dtype))
        a_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, _ROWS, BLOCK_K], a_layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES] + b_box, gl.NVMMASharedLayout.get_default_for(b_box, dtype))
        ready = _barriers(STAGES, 1)
        empty = _barriers(STAGES, 2)
        gl.warp_specialize([
            (_consumer, (out_ptr, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, 0, K, N,
                         NUM_GROUPS, NUM_SELECTED, TRANSPOSE_RHS, BLOCK_N, BLOCK_K, STAGES)),
            (_consumer, (out_ptr, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, 1, K, N,
                         NUM_GROUPS, NUM_SELECTED, TRANSPOSE_RHS, BLOCK_N, BLOCK_K, STAGES)),
            (_loader, (lhs_desc, rhs_desc, a_smem, b_smem, ready, empty, group_sizes_ptr, group_offset_ptr, m, K, N,
                       NUM_GROUPS, NUM_SELECTED, TRANSPOSE_RHS, BLOCK_N, BLOCK_K, STAGES)),
        ], [4, 1], [232, 24])
