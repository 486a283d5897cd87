"""Warp-specialized flash-attention dq kernel for Hopper (sm_90), written in Gluon.

The backward's dq pass has the forward's shape: a query tile stays in shared memory while the key
and value blocks stream past. So it reuses the forward's split (``gluon_forward``): a 1-warp TMA
loader fills a ring of K/V stages, and two 4-warp consumer warpgroups each own 64 rows of a
128-row tile. Per key block a consumer computes S = Q K^T and dP = dO V^T, then
dS = P * (dP - delta) with P recomputed from the saved log-sum-exp, and adds dS K to dq. The
dS K product of block j-1 stays in flight on the tensor cores while the consumer computes dS of
block j.

The plans use it at head_dim 128 for the calls the Gluon forward covers (``plan.uses_gluon_dq``).
Like the ``@triton.jit`` dq kernel it replaces there, it is deterministic (no atomics), and it
adds dS K over the keys in the same order of 16-key steps: on every input measured its dq
equals that kernel's bit for bit. dk/dv stay with ``flash_bwd_dkdv_kernel``.
"""
from __future__ import annotations

from .gluon_forward import AVAILABLE

BLOCK_N = 64  # S and dP ([64, BLOCK_N] fp32) live beside dq ([64, head_dim]): 128 was 1.1-1.6x slower
STAGES = 3  # with 2 it stalls on loads (1.3-1.6x slower on an H100); 4 gains at most 4%
MAXNREG = 168
RUNTIME_INTS = ["seq_q", "seq_k"]

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_forward import _barriers, _block_counts, _head_rows, _kv_ring, _load_halves, _program_tile

    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                   k_empty, v_empty, m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        _load_halves(q_desc, q_smem, q_bar, m0)
        _load_halves(do_desc, do_smem, q_bar, m0)
        _kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, n_blocks, BLOCK_N, STAGES)

    @gluon.jit
    def _dlogits(s, dp, lse2, delta, logit_scale, row0, col0, seq_k, causal_offset, s_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """dS = P * (dP - delta) of one block, P = exp2(S * scale * log2(e) - lse2) (0 where masked)."""
        p = gl.exp2(s * logit_scale - lse2[:, None])
        if MASK:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if CAUSAL:
                rows = row0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
                keep = cols[None, :] <= rows[:, None] + causal_offset
            else:
                keep = cols[None, :] < seq_k
            p = gl.where(keep, p, 0.0)
        return p * (dp - delta[:, None])

    @gluon.jit
    def _dq_consumer(dq_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                     k_empty, v_empty, logit_scale, sm_scale, m0, seq_q, seq_k, n_blocks, first_masked, dq_base,
                     lse_base, WG: gl.constexpr, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        ROWS: gl.constexpr = q_smem.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype

        q = q_smem.index(WG)
        do = do_smem.index(WG)
        row0 = m0 + WG * ROWS
        causal_offset = seq_k - seq_q
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        # Rows past seq_q read lse = delta = 0 (their q and dO rows are TMA zeros, so dS is 0).
        lse2 = gl.load(lse_ptr + lse_base + rows, mask=rows < seq_q, other=0.0) * LOG2E
        delta = gl.load(delta_ptr + lse_base + rows, mask=rows < seq_q, other=0.0)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)

        # Block 0: S and dP only; its dS K is issued together with S and dP of block 1.
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(0), 0)
        dp = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        mbarrier.arrive(v_empty.index(0), count=1)
        if first_masked == 0:
            ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, 0, seq_k, causal_offset, s_layout, BLOCK_N, True,
                          CAUSAL)
        else:
            ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, 0, seq_k, causal_offset, s_layout, BLOCK_N, False,
                          CAUSAL)
        ds_op = gl.convert_layout(ds.to(dtype), ds_layout)

        for j in range(1, n_blocks):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(stage), phase)
            s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(stage), phase)
            dp = warpgroup_mma(do, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            # Wait for S and dP only (dS K of block j-1 may stay in flight), so dS overlaps it.
            s, dp = warpgroup_mma_wait(1, deps=(s, dp))
            mbarrier.arrive(v_empty.index(stage), count=1)
            if j >= first_masked:
                ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, j * BLOCK_N, seq_k, causal_offset, s_layout,
                              BLOCK_N, True, CAUSAL)
            else:
                ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, j * BLOCK_N, seq_k, causal_offset, s_layout,
                              BLOCK_N, False, CAUSAL)
            # ds_op's registers feed the product in flight: overwrite them only once it is done.
            dq = warpgroup_mma_wait(0, deps=(dq,))
            mbarrier.arrive(k_empty.index(prev), count=1)
            ds_op = gl.convert_layout(ds.to(dtype), ds_layout)

        last = (n_blocks - 1) % STAGES
        dq = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(k_empty.index(last), count=1)

        out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
        ptrs = dq_ptr + dq_base + out_rows.to(gl.int64)[:, None] * (HEADS_Q * HEAD_DIM) + cols[None, :]
        gl.store(ptrs, (dq * sm_scale).to(dtype), mask=(out_rows < seq_q)[:, None])

    @gluon.jit(do_not_specialize_on_alignment=RUNTIME_INTS)
    def flash_bwd_dq_gluon_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                                  do_ptr, lse_ptr, delta_ptr,
                                  seq_q, seq_k, logit_scale, sm_scale,
                                  dq_ptr,
                                  HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """dq of one 128-row query tile of one (head, batch row). Takes the inputs of
        ``flash_bwd_dq_kernel`` (the nine feature arrays, dO, the natural lse and delta) and reads
        q, k, v, dO, lse and delta; ``logit_scale`` is the softmax scale times log2(e)."""
        ROWS: gl.constexpr = 64
        TILE_M: gl.constexpr = 2 * ROWS
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        m0, h, b = _program_tile(TILE_M, CAUSAL)
        h_kv = h // (HEADS_Q // HEADS_KV)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_desc = _head_rows(q_ptr, b, h, seq_q, HEADS_Q, HEAD_DIM, ROWS, q_layout)
        do_desc = _head_rows(do_ptr, b, h, seq_q, HEADS_Q, HEAD_DIM, ROWS, q_layout)
        k_desc = _head_rows(k_ptr, b, h_kv, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N, kv_layout)
        v_desc = _head_rows(v_ptr, b, h_kv, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N, kv_layout)

        q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar = _barriers(1, 1)
        k_ready = _barriers(STAGES, 1)
        v_ready = _barriers(STAGES, 1)
        k_empty = _barriers(STAGES, 2)  # both consumers release a stage
        v_empty = _barriers(STAGES, 2)

        n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
        q_base = b * seq_q * (HEADS_Q * HEAD_DIM) + h * HEAD_DIM  # dq's (b, h) slice
        lse_base = (b * HEADS_Q + h) * seq_q
        gl.warp_specialize([
            (_dq_consumer, (dq_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, q_bar.index(0), k_ready,
                            v_ready, k_empty, v_empty, logit_scale, sm_scale, m0, seq_q, seq_k, n_blocks,
                            first_masked, q_base, lse_base, 0, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
            (_dq_consumer, (dq_ptr, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, q_bar.index(0), k_ready,
                            v_ready, k_empty, v_empty, logit_scale, sm_scale, m0, seq_q, seq_k, n_blocks,
                            first_masked, q_base, lse_base, 1, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
            (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar.index(0), k_ready,
                          v_ready, k_empty, v_empty, m0, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [232, 24])
