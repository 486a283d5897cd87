"""Warp-specialized flash-attention backward kernels for Hopper (sm_90), written in Gluon: dq,
and dk/dv.

Both reuse the forward's split (``gluon_forward``): a 1-warp TMA loader fills a ring of
shared-memory stages, and two 4-warp consumer warpgroups each own 64 rows of a 128-row tile
that stays in shared memory.

- dq (``flash_bwd_dq_gluon_kernel``) has the forward's shape: a query tile stays while key and
  value blocks stream past. Per key block a consumer computes S = Q K^T and dP = dO V^T, then
  dS = P * (dP - delta) with P recomputed from the saved log-sum-exp, and adds dS K to dq. The
  dS K product of block j-1 stays in flight while the consumer computes dS of block j. Like
  the forward it is persistent (a program per SM walks the forward's schedule units), with two
  buffers of q and dO so the next tile's load overlaps the current tile's end. It runs first
  and makes delta = rowsum(O * dO) - dlse for dk/dv: a consumer reads its rows of O from global
  memory as a tile starts, and sums them with dO while block 0's S and dP are in the tensor
  cores. A separate delta kernel cost 43 us a backward at 16k tokens x 2048 channels on an
  H200; folded in, dq itself runs 2-4% longer, and the backward took 0-3% less up to seq 4096,
  the same within noise at 8192-16384 (``benchmarks/README.md``, session 51).
- dk/dv (``flash_bwd_dkdv_gluon_kernel``) turns it around: a 128-key tile of K and V stays while
  the query, dO, lse and delta blocks of every query head of its group stream past. A consumer
  works on transposed tiles (its 64 keys down, 64 queries across): S^T = K Q^T and
  dP^T = V dO^T, so P^T and dS^T are register operands of dV += P^T dO and dK += dS^T Q, with
  no transpose. dV is in flight while dS^T is computed. It is persistent too, over key tiles
  and kv heads, with two K/V buffers.

The plans use them for the calls the Gluon forward covers (``plan.uses_gluon_dq``,
``plan.uses_gluon_dkdv``). Like the ``@triton.jit`` kernels they replace, they are deterministic
(no atomics: dk/dv sum a GQA group's heads in the program), and they add the products over
keys (dq) or queries (dk, dv) in the same order of 16-element steps: on every input measured
their outputs equal those kernels' bit for bit.
"""
from __future__ import annotations

from .gluon_forward import AVAILABLE

BLOCK_N = 64  # S and dP ([64, BLOCK_N] fp32) live beside dq ([64, head_dim]): 128 was 1.1-1.6x slower
STAGES = 3  # with 2 it stalls on loads (1.3-1.6x slower on an H100); 4 gains at most 4%
MAXNREG = 168
TILE_N = 128  # dk/dv: keys a CTA holds, 64 a consumer warpgroup
BLOCK_M = 64  # dk/dv: queries a step (S^T and dP^T, [64, 64] fp32, live beside dk and dv)


def dkdv_stages(head_dim: int, causal: bool) -> int:
    """Ring stages of the dk/dv kernel. On an H100 (probe_flash_gluon_dkdv-persistent) 2 stages
    are up to 4% faster than 3, or within 2%, except at head_dim 128 without a mask, where 3
    are 1-4% faster."""
    return 3 if head_dim == 128 and not causal else 2


RUNTIME_INTS = ["seq_q", "seq_k"]

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_forward import (_barriers, _batch_heads, _block_counts, _loader_making_descriptors, _rings, _slot_tile,
                                _slots, _tail_slot_tile, _tail_slots, _tma_load)

    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _tile_buffers(dtype: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """Two arrays' resident 128-row tiles (q and dO for dq, K and V for dk/dv), twice over so
        that the next tile loads while the consumers finish this one: [4, ROWS, head_dim] each
        (tile ``buf``'s halves at 2 buf and 2 buf + 1), with the loader's "ready" barriers and the
        consumers' "empty" ones."""
        a_smem = gl.allocate_shared_memory(dtype, [4, ROWS, HEAD_DIM], layout)
        b_smem = gl.allocate_shared_memory(dtype, [4, ROWS, HEAD_DIM], layout)
        return a_smem, b_smem, _barriers(2, 1), _barriers(2, 2)

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
    def _dq_tile(q, do, o, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_empty, lse2, dlse_ptr, delta_ptr,
                 lse_base, logit_scale, row0, seq_q, seq_k, n_blocks, first_masked, ring, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, USE_DLSE: gl.constexpr):
        """dq (unscaled) of one warpgroup's 64 query rows (``q`` and ``do`` in shared memory, ``o`` in
        registers) over key blocks 0..n_blocks-1, read from the ring from position ``ring`` on; their
        delta (``_tile_delta``) on the way. Arrives on ``q_empty`` once the last S and dP are done
        with ``q`` and ``do``."""
        ROWS: gl.constexpr = q.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        dtype: gl.constexpr = q.dtype

        causal_offset = seq_k - seq_q
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)

        # Block 0: S and dP only; its dS K is issued together with S and dP of block 1.
        stage = ring % STAGES
        phase = (ring // STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do, v_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # delta while block 0's S and dP are computed: their products hide the wait for o.
        delta = _tile_delta(o, do, dlse_ptr, delta_ptr, lse_base, row0, seq_q, s_layout, USE_DLSE)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        mbarrier.arrive(v_empty.index(stage), count=1)
        if first_masked == 0:
            ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, 0, seq_k, causal_offset, s_layout, BLOCK_N, True,
                          CAUSAL)
        else:
            ds = _dlogits(s, dp, lse2, delta, logit_scale, row0, 0, seq_k, causal_offset, s_layout, BLOCK_N, False,
                          CAUSAL)
        ds_op = gl.convert_layout(ds.to(dtype), ds_layout)

        for j in range(1, n_blocks):
            c = ring + j
            stage = c % STAGES
            prev = (c - 1) % STAGES
            phase = (c // STAGES) & 1
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
        mbarrier.arrive(q_empty, count=1)

        last = (ring + n_blocks - 1) % STAGES
        dq = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(k_empty.index(last), count=1)
        return dq

    @gluon.jit
    def _load_tile(ptr, b64, h, row0, seq_q, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
        """Rows row0.. row0 + ROWS - 1 of head ``h`` of a [batch, seq_q, HEADS_Q, HEAD_DIM] array (0 past
        seq_q), in 16-byte pieces, each warp holding 16 whole rows as the MMA layouts do (so that a
        row sum moves to them within the warp)."""
        ACROSS: gl.constexpr = HEAD_DIM // 8
        layout: gl.constexpr = gl.BlockedLayout([16 * ACROSS // 32, 8], [32 // ACROSS, ACROSS], [4, 1], [1, 0])
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        base = ptr + b64 * seq_q * (HEADS_Q * HEAD_DIM) + h * HEAD_DIM
        return gl.load(base + rows.to(gl.int64)[:, None] * (HEADS_Q * HEAD_DIM) + cols[None, :],
                       mask=(rows < seq_q)[:, None], other=0.0)

    @gluon.jit
    def _tile_delta(o, do_tile, dlse_ptr, delta_ptr, at, row0, seq_q, s_layout: gl.constexpr,
                    USE_DLSE: gl.constexpr):
        """delta = rowsum(o * dO) - dlse of a warpgroup's rows row0.. (``o`` in registers, dO in shared
        memory), stored at ``delta_ptr + at + rows`` for dk/dv and returned along S's rows. Rows
        past seq_q have o = dO = 0, so delta = 0 there."""
        do = do_tile.load(o.type.layout)
        delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1), gl.SliceLayout(1, s_layout))
        rows = row0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, s_layout))
        if USE_DLSE:  # d lse / d logits = p, so a gradient on lse folds into delta
            delta -= gl.load(dlse_ptr + at + rows, mask=rows < seq_q, other=0.0)
        gl.store(delta_ptr + at + rows, delta, mask=rows < seq_q)
        return delta

    @gluon.jit
    def _dq_consumer(dq_ptr, delta_ptr, o_ptr, lse_ptr, dlse_ptr, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty,
                     k_ready, v_ready, k_empty, v_empty, logit_scale, sm_scale, seq_q, seq_k, n_m, per_head, n_units,
                     WG: gl.constexpr, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, PAIRS: gl.constexpr, USE_DLSE: gl.constexpr):
        """Warpgroup ``WG``'s 64 rows of dq (and of delta) for each of this program's tiles, in the
        loader's order."""
        ROWS: gl.constexpr = q_smem.shape[1]
        TILE_M: gl.constexpr = 2 * ROWS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        ring = 0
        tiles = 0
        for slot in range(_tail_slots(n_units, per_head, n_m, PAIRS)):
            m0, h, b, exists = _tail_slot_tile(slot, n_m, per_head, n_units, HEADS_Q, TILE_M, PAIRS)
            if exists:
                n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
                b64 = b.to(gl.int64)
                row0 = m0 + WG * ROWS
                o = _load_tile(o_ptr, b64, h, row0, seq_q, HEADS_Q, HEAD_DIM, ROWS)  # used after block 0's products
                rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
                # Rows past seq_q read lse = 0 and make delta = 0 (their q, dO and o rows are zeros, so dS is 0).
                lse_base = (b64 * HEADS_Q + h) * seq_q
                lse2 = gl.load(lse_ptr + lse_base + rows, mask=rows < seq_q, other=0.0) * LOG2E
                buf = tiles % 2
                mbarrier.wait(q_ready.index(buf), (tiles // 2) & 1)
                dq = _dq_tile(q_smem.index(2 * buf + WG), do_smem.index(2 * buf + WG), o, k_smem, v_smem, k_ready,
                              v_ready, k_empty, v_empty, q_empty.index(buf), lse2, dlse_ptr, delta_ptr, lse_base,
                              logit_scale, row0, seq_q, seq_k, n_blocks, first_masked, ring, HEAD_DIM, BLOCK_N,
                              STAGES, CAUSAL, USE_DLSE)
                out_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
                cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
                ptrs = (dq_ptr + b64 * seq_q * (HEADS_Q * HEAD_DIM) + h * HEAD_DIM
                        + out_rows.to(gl.int64)[:, None] * (HEADS_Q * HEAD_DIM) + cols[None, :])
                gl.store(ptrs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=(out_rows < seq_q)[:, None])
                ring += n_blocks
                tiles += 1

    @gluon.jit(do_not_specialize_on_alignment=RUNTIME_INTS + ["batch"])
    def flash_bwd_dq_gluon_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                                  do_ptr, lse_ptr, o_ptr, dlse_ptr,
                                  batch, seq_q, seq_k, logit_scale, sm_scale,
                                  dq_ptr, delta_ptr,
                                  HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                                  CAUSAL: gl.constexpr, PAIRS: gl.constexpr, BLOCK_N: gl.constexpr,
                                  STAGES: gl.constexpr, USE_DLSE: gl.constexpr):
        """dq of 128-row query tiles, a persistent program per SM walking the forward's schedule
        (``gluon_forward._tail_slot_tile``). Takes the inputs and gives the outputs of
        ``flash_bwd_dq_kernel`` (the nine feature arrays, dO, the natural lse, o and dlse; dq and
        delta = rowsum(o * dO) - dlse, which dk/dv read after it); ``logit_scale`` is the softmax
        scale times log2(e)."""
        ROWS: gl.constexpr = 64
        TILE_M: gl.constexpr = 2 * ROWS
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

        q_smem, do_smem, q_ready, q_empty = _tile_buffers(dtype, ROWS, HEAD_DIM, q_layout)
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _rings(dtype, STAGES, BLOCK_N, HEAD_DIM, kv_layout, 2)

        n_m = gl.cdiv(seq_q, TILE_M)
        per_head = (n_m + 1) // 2 if PAIRS else n_m
        n_units = batch * HEADS_Q * per_head
        gl.warp_specialize([
            (_dq_consumer, (dq_ptr, delta_ptr, o_ptr, lse_ptr, dlse_ptr, q_smem, do_smem, k_smem, v_smem, q_ready,
                            q_empty, k_ready, v_ready, k_empty, v_empty, logit_scale, sm_scale, seq_q, seq_k, n_m,
                            per_head, n_units, 0, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS, USE_DLSE)),
            (_dq_consumer, (dq_ptr, delta_ptr, o_ptr, lse_ptr, dlse_ptr, q_smem, do_smem, k_smem, v_smem, q_ready,
                            q_empty, k_ready, v_ready, k_empty, v_empty, logit_scale, sm_scale, seq_q, seq_k, n_m,
                            per_head, n_units, 1, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS, USE_DLSE)),
            (_loader_making_descriptors, (q_ptr, do_ptr, k_ptr, v_ptr, batch, q_smem, do_smem, k_smem, v_smem,
                                          q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m,
                                          per_head, n_units, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_N, STAGES, CAUSAL,
                                          PAIRS, True)),
        ], [4, 1], [232, 40])  # holding four descriptors, a 24-register loader spilled with Triton 3.9 (not 3.6)

    # -- dk/dv -------------------------------------------------------------------------------------

    @gluon.jit
    def _query_blocks(n0, seq_q, seq_k, TILE_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """(first query block that sees the key tile at n0, how many blocks from it to the end,
        how many of those need the causal mask)."""
        n_all = gl.cdiv(seq_q, BLOCK_M)
        if CAUSAL:
            offset = seq_k - seq_q
            j_lo = gl.maximum(n0 - offset, 0) // BLOCK_M
            # A block is unmasked when its first query sees the tile's last key.
            j_full = gl.minimum(gl.cdiv(gl.maximum(n0 + TILE_N - 1 - offset, 0), BLOCK_M), n_all)
            return j_lo, n_all - j_lo, j_full - j_lo
        return 0, n_all, 0

    @gluon.jit
    def _query_stream(q_desc, do_desc, lse_ptr, delta_ptr, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
                      q_empty, do_empty, b, h_first, lse_first, seq_q, j_lo, n_q, ring, GROUP: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The query and dO blocks j_lo.. of each query head of a group (heads outer, as
        ``flash_bwd_dkdv_kernel`` sums them) into the ring from position ``ring`` on. A stage also
        holds its queries' base-2 lse and delta, copied by this warp: loaded per thread, they would
        cost each consumer thread 16 pointers a vector (the columns it holds), and spill."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[2]
        row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        for t in range(GROUP * n_q):
            row = (j_lo + t % n_q) * BLOCK_M
            rows = row + gl.arange(0, BLOCK_M, layout=row_layout)
            at = lse_first + (t // n_q) * seq_q + rows
            # Queries past seq_q get lse = delta = 0; their q/dO rows are TMA zeros, so they add nothing.
            lse2 = gl.load(lse_ptr + at, mask=rows < seq_q, other=0.0) * LOG2E
            delta = gl.load(delta_ptr + at, mask=rows < seq_q, other=0.0)
            col = (h_first + t // n_q) * HEAD_DIM
            c = ring + t
            stage = c % STAGES
            phase = ((c // STAGES) & 1) ^ 1  # the first pass through the ring does not wait
            mbarrier.wait(q_empty.index(stage), phase)
            lse_smem.index(stage).store(lse2)
            delta_smem.index(stage).store(delta)
            # This arrival releases the stores above to the consumers that wait on the barrier.
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, row, col], q_ready.index(stage), q_smem.index(stage))
            mbarrier.wait(do_empty.index(stage), phase)
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
            _tma_load(do_desc, [b, row, col], do_ready.index(stage), do_smem.index(stage))

    @gluon.jit
    def _dkdv_loader_making_descriptors(k_ptr, v_ptr, q_ptr, do_ptr, batch, lse_ptr, delta_ptr, k_smem, v_smem, q_smem,
                                        do_smem, lse_smem, delta_smem, kv_ready, kv_empty, q_ready, do_ready, q_empty,
                                        do_empty, seq_q, seq_k, n_n, per_head, n_units, HEADS_Q: gl.constexpr,
                                        HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
        """``_dkdv_loader``, making its TMA descriptors in its own partition (see
        ``gluon_forward._loader_making_descriptors``)."""
        ROWS: gl.constexpr = k_smem.shape[1]
        k_desc = _batch_heads(k_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, ROWS)
        v_desc = _batch_heads(v_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, ROWS)
        q_desc = _batch_heads(q_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, BLOCK_M)
        do_desc = _batch_heads(do_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, BLOCK_M)
        _dkdv_loader(k_desc, v_desc, q_desc, do_desc, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem, lse_smem,
                     delta_smem, kv_ready, kv_empty, q_ready, do_ready, q_empty, do_empty, seq_q, seq_k, n_n,
                     per_head, n_units, HEADS_Q, HEADS_KV, BLOCK_M, STAGES, CAUSAL, PAIRS)

    @gluon.jit
    def _dkdv_loader(k_desc, v_desc, q_desc, do_desc, lse_ptr, delta_ptr, k_smem, v_smem, q_smem, do_smem, lse_smem,
                     delta_smem, kv_ready, kv_empty, q_ready, do_ready, q_empty, do_empty, seq_q, seq_k, n_n,
                     per_head, n_units, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, BLOCK_M: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
        """This program's key tiles in turn: a tile's K and V halves into the free one of two
        buffers, then its query blocks through the ring (``ring`` counts the blocks so far)."""
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[2]
        ROWS: gl.constexpr = k_smem.shape[1]
        TILE_N: gl.constexpr = 2 * ROWS
        GROUP: gl.constexpr = HEADS_Q // HEADS_KV
        ring = 0
        tiles = 0
        for slot in range(_slots(n_units, PAIRS)):
            n0, h_kv, b, exists = _slot_tile(slot, n_n, per_head, HEADS_KV, TILE_N, PAIRS)
            if exists:
                j_lo, n_q, n_masked = _query_blocks(n0, seq_q, seq_k, TILE_N, BLOCK_M, CAUSAL)
                buf = tiles % 2
                mbarrier.wait(kv_empty.index(buf), ((tiles // 2) & 1) ^ 1)
                bar = kv_ready.index(buf)
                mbarrier.expect(bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
                for i in gl.static_range(2):
                    _tma_load(k_desc, [b, n0 + i * ROWS, h_kv * HEAD_DIM], bar, k_smem.index(2 * buf + i))
                    _tma_load(v_desc, [b, n0 + i * ROWS, h_kv * HEAD_DIM], bar, v_smem.index(2 * buf + i))
                h_first = h_kv * GROUP
                lse_first = (b.to(gl.int64) * HEADS_Q + h_first) * seq_q
                _query_stream(q_desc, do_desc, lse_ptr, delta_ptr, q_smem, do_smem, lse_smem, delta_smem, q_ready,
                              do_ready, q_empty, do_empty, b, h_first, lse_first, seq_q, j_lo, n_q, ring, GROUP,
                              BLOCK_M, STAGES)
                ring += GROUP * n_q
                tiles += 1

    @gluon.jit
    def _dkdv_tile(k, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, q_empty, do_empty, kv_empty,
                   logit_scale, key0, seq_q, seq_k, j_lo, n_q, n_masked, ring, GROUP: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        """dk (unscaled) and dv of one warpgroup's 64 keys (``k`` and ``v`` in shared memory) over the
        query blocks of every head of the group, read from the ring from position ``ring`` on.
        Works on transposed tiles (keys down, queries across): S^T = K Q^T and dP^T = V dO^T, so
        P^T and dS^T are the register operands of dV += P^T dO and dK += dS^T Q without a
        transpose. Arrives on ``kv_empty`` once the last products are done with ``k`` and ``v``."""
        ROWS: gl.constexpr = k.shape[0]
        HEAD_DIM: gl.constexpr = k.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype

        keys = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        causal_offset = seq_k - seq_q
        s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, acc_layout)
        for t in range(GROUP * n_q):
            i = t % n_q
            c = ring + t
            stage = c % STAGES
            phase = (c // STAGES) & 1
            mbarrier.wait(q_ready.index(stage), phase)
            s = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(stage), phase)
            dp = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse2 = lse_smem.index(stage).load(gl.SliceLayout(0, s_layout))
            s = warpgroup_mma_wait(1, deps=(s,))
            p = gl.exp2(s * logit_scale - lse2[None, :])
            if CAUSAL:
                if i < n_masked:  # bottom-right aligned: query r sees keys up to r + seq_k - seq_q
                    cols = (j_lo + i) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                    p = gl.where(keys[:, None] <= cols[None, :] + causal_offset, p, 0.0)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_smem.index(stage), dv, is_async=True)
            delta = delta_smem.index(stage).load(gl.SliceLayout(0, s_layout))
            dp = warpgroup_mma_wait(1, deps=(dp,))  # dV may stay in flight while dS is computed
            ds_op = gl.convert_layout((p * (dp - delta[None, :])).to(dtype), op_layout)
            dk = warpgroup_mma(ds_op, q_smem.index(stage), dk, is_async=True)
            # The operands' registers feed the products in flight: keep them until both are done.
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
            mbarrier.arrive(q_empty.index(stage), count=1)
            mbarrier.arrive(do_empty.index(stage), count=1)
        mbarrier.arrive(kv_empty, count=1)
        return dk, dv

    @gluon.jit
    def _dkdv_consumer(dk_ptr, dv_ptr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_empty,
                       q_ready, do_ready, q_empty, do_empty, logit_scale, sm_scale, seq_q, seq_k, n_n, per_head,
                       n_units, WG: gl.constexpr, HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
        """Warpgroup ``WG``'s 64 keys of dk and dv for each of this program's key tiles, in the
        loader's order."""
        ROWS: gl.constexpr = k_smem.shape[1]
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        TILE_N: gl.constexpr = 2 * ROWS
        GROUP: gl.constexpr = HEADS_Q // HEADS_KV
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        dtype: gl.constexpr = q_smem.dtype
        ring = 0
        tiles = 0
        for slot in range(_slots(n_units, PAIRS)):
            n0, h_kv, b, exists = _slot_tile(slot, n_n, per_head, HEADS_KV, TILE_N, PAIRS)
            if exists:
                j_lo, n_q, n_masked = _query_blocks(n0, seq_q, seq_k, TILE_N, BLOCK_M, CAUSAL)
                buf = tiles % 2
                mbarrier.wait(kv_ready.index(buf), (tiles // 2) & 1)
                key0 = n0 + WG * ROWS
                dk, dv = _dkdv_tile(k_smem.index(2 * buf + WG), v_smem.index(2 * buf + WG), q_smem, do_smem,
                                    lse_smem, delta_smem, q_ready, do_ready, q_empty, do_empty,
                                    kv_empty.index(buf), logit_scale, key0, seq_q, seq_k, j_lo, n_q, n_masked,
                                    ring, GROUP, BLOCK_M, STAGES, CAUSAL)
                rows = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
                dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
                kv_base = b.to(gl.int64) * seq_k * (HEADS_KV * HEAD_DIM) + h_kv * HEAD_DIM
                offsets = kv_base + rows.to(gl.int64)[:, None] * (HEADS_KV * HEAD_DIM) + dims[None, :]
                gl.store(dk_ptr + offsets, (dk * sm_scale).to(dtype), mask=(rows < seq_k)[:, None])
                gl.store(dv_ptr + offsets, dv.to(dtype), mask=(rows < seq_k)[:, None])
                ring += GROUP * n_q
                tiles += 1

    @gluon.jit(do_not_specialize_on_alignment=RUNTIME_INTS + ["batch"])
    def flash_bwd_dkdv_gluon_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr,
                                    seed_ptr, do_ptr, lse_ptr, delta_ptr,
                                    batch, seq_q, seq_k, logit_scale, sm_scale,
                                    dk_ptr, dv_ptr, ds_ptr,
                                    HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                                    CAUSAL: gl.constexpr, PAIRS: gl.constexpr, BLOCK_M: gl.constexpr,
                                    STAGES: gl.constexpr):
        """dk and dv of 128-key tiles, each summed over the query heads of its group, a persistent
        program per SM walking schedule units of key tiles (``gluon_forward._slot_tile`` over key
        tiles and kv heads; with a causal mask a unit pairs the light tile n_n-1-p with the heavy p).
        Takes the inputs and outputs of ``flash_bwd_dkdv_kernel`` (``ds_ptr`` is the one-element
        stand-in: these calls have no bias)."""
        ROWS: gl.constexpr = 64
        TILE_N: gl.constexpr = 2 * ROWS
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

        k_smem, v_smem, kv_ready, kv_empty = _tile_buffers(dtype, ROWS, HEAD_DIM, kv_layout)
        q_smem, do_smem, q_ready, do_ready, q_empty, do_empty = _rings(dtype, STAGES, BLOCK_M, HEAD_DIM, q_layout, 2)
        row_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)  # filled with q's stage
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)

        n_n = gl.cdiv(seq_k, TILE_N)
        per_head = (n_n + 1) // 2 if PAIRS else n_n
        n_units = batch * HEADS_KV * per_head
        # The worker consumer's registers; the default one gets what is left of the launch's pool
        # (248 or 240). Without a mask 240 spill less (Triton 3.6, head_dim 128: 11 spill stores,
        # not 16) and ran 1.015-1.019x faster at head_dim 128, seq 1024-4096, with the same bits
        # (H200; head_dim 64 0.993-1.003x); with one, 0.987-1.002x: it keeps 232
        # (probe_gluon_backward_variants-dkdv240-*.json).
        gl.warp_specialize([
            (_dkdv_consumer, (dk_ptr, dv_ptr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready,
                              kv_empty, q_ready, do_ready, q_empty, do_empty, logit_scale, sm_scale, seq_q, seq_k, n_n,
                              per_head, n_units, 0, HEADS_Q, HEADS_KV, BLOCK_M, STAGES, CAUSAL, PAIRS)),
            (_dkdv_consumer, (dk_ptr, dv_ptr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready,
                              kv_empty, q_ready, do_ready, q_empty, do_empty, logit_scale, sm_scale, seq_q, seq_k, n_n,
                              per_head, n_units, 1, HEADS_Q, HEADS_KV, BLOCK_M, STAGES, CAUSAL, PAIRS)),
            (_dkdv_loader_making_descriptors, (k_ptr, v_ptr, q_ptr, do_ptr, batch, lse_ptr, delta_ptr, k_smem,
                                               v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_empty,
                                               q_ready, do_ready, q_empty, do_empty, seq_q, seq_k, n_n, per_head,
                                               n_units, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, PAIRS)),
        ], [4, 1], [232 if CAUSAL else 240, 24])
