"""Warp-specialized, persistent flash-attention forward for Hopper (sm_90), written in Gluon.

The ``@triton.jit`` forward leaves Hopper's tensor cores idle while a warpgroup computes its
softmax. This kernel splits a CTA by role, as FlashAttention-3 does:

- a 1-warp loader partition copies each query tile (into one of two buffers) and each
  K/V block (into a ring of shared-memory stages) with TMA, signalling "ready" mbarriers, and
  refills a buffer or stage when every consumer has freed it;
- two 4-warp consumer warpgroups (three at head_dim 64 without a causal mask:
  ``forward_consumers``) each own 64 rows of the query tile and read the same K/V stages; inside
  each, QK^T of block j is issued asynchronously together with PV of block j-1, so the softmax
  of block j runs while the tensor cores do PV;
- registers move from the loader to the consumers (``worker_num_regs``, ``maxnreg``).
- a tile's output leaves with a TMA store from shared memory: from its query buffer without a
  causal mask, from a buffer of its own with one.

The grid is persistent: one program an SM walks schedule units (``_slot_tile``) in a static
round robin, and the loader fetches the next tile while the consumers finish the current one.
Under a causal mask the forward and dq deal the last, partial round's heads tile by tile instead
(``_tail_slot_tile``). In short causal calls, and at head_dim 64 without a mask, the forward's
programs claim their tiles in that order from a counter instead (``_claim_tiles``,
``schedule.claims_tiles``).
So a short sequence no longer pays, per tile, a program's start (barriers, descriptors, the
first loads) and its epilogue: at seq 1024 that was 10-35% of the time.

On by default where Triton has Gluon (``enabled``; ``EJKERNEL_GLUON=0`` turns it off). It covers
the plain calls (no bias, soft cap, segments, dropout or varlen; dense or bottom-right causal
with seq_q <= seq_k, so that no row is fully masked; head_dim 64 or 128; fp16/bf16; a positive
scale): ``plan.uses_gluon`` decides. Its outputs match ``flash_fwd_kernel``'s:
the output in q's layout and the natural log-sum-exp ``[batch, heads_q, seq_q]``.

The kernel takes plain pointers and builds its TMA descriptors per program, each in the
partition that uses it (``_loader_making_descriptors``), in the global scratch the launcher provides
(torch: an allocator scoped to the launch; jax: jaxlib's Triton custom call), so both fronts
launch one binary. Gluon does not run in Triton's interpreter:
CPU CI compiles it for sm_90 ahead of time, and the ``gpu`` tests run it.
"""
from __future__ import annotations

import os

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except ImportError:  # a Triton without Gluon: the plans never pick this kernel
    AVAILABLE = False
else:
    AVAILABLE = True

ROWS = 64  # one warpgroup's wgmma covers 64 rows; a CTA's query tile is one a consumer warpgroup
TILE_M = 2 * ROWS  # the query tile of two consumers: dq's, and the forward's where forward_consumers gives 2
BLOCK_N = 128
RUNTIME_INTS = ["seq_q", "seq_k"]


def forward_stages(head_dim: int) -> int:
    """K/V ring stages of the forward: 2 at head_dim 128 (3 do not fit beside two query
    tiles), 3 at 64, where they were 0-3% faster than 2 on an H100 (probe_flash_gluon_fwd)."""
    return 2 if head_dim == 128 else 3


def forward_consumers(head_dim: int, causal: bool, seq_q: int, seq_k: int) -> int:
    """Consumer warpgroups of the forward, 64 query rows each. Three at head_dim 64 without a
    causal mask, where a block's matmuls are short beside its softmax and a third warpgroup keeps
    the tensor cores busier (FlashAttention-3 uses 192-row tiles there too): on an H100, bf16,
    best of two runs, 1.08x (seq 2048) to 1.17x (16384) faster than two and 1.06-1.15x cuDNN's
    throughput (probe_gluon_forward_consumers-nvidia-h100-80gb-hbm3.json). Whatever seq_q: a
    last tile's parts wholly past it only release the ring (``_consume_tile``), so 192-row tiles
    compute no more rows than 128-row ones (seq 1024 on an H200: 1.07x two, 1.06x cuDNN;
    probe_gluon_forward_consumers-skip-nvidia-h200.json; before that skip three were 0.5-4%
    slower there and took only shapes they padded by at most 5%). Two where seq_k leaves a
    partial key block: that build's masked softmax spills with three (triton 3.9: 96 stores,
    171 loads), and it was not timed; at head_dim 128, where a third does not fit in the
    register file; and with a causal mask, where three took 1.05-1.7x the time up to seq 4096."""
    if head_dim != 64 or causal or seq_k % BLOCK_N:
        return 2
    return 3


def forward_maxnreg(consumers: int) -> int:
    """Registers a thread at launch: the 64K-register file over the program's warps (4 a
    consumer, 4 for the loader's warpgroup). ``setmaxnreg`` then moves them: the loader keeps
    24, worker consumers take 232 (two consumers) or 160 (three), and the default partition
    (consumer 0) what is left."""
    return 65536 // (32 * 4 * (consumers + 1)) // 8 * 8


def enabled() -> bool:
    """Whether the fronts may run Gluon kernels: a Triton with Gluon, unless ``EJKERNEL_GLUON=0``
    (read once per process, with the device facts) turns them off, e.g. to compare with the
    Triton forward or to rule the Gluon kernel out when chasing a problem."""
    return AVAILABLE and os.environ.get("EJKERNEL_GLUON", "1") != "0"

if AVAILABLE:
    # Triton 3.6 names the TMA copies async_copy_global_to_shared and async_copy_shared_to_global,
    # later versions async_load and async_store;
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # and the barrier of a CTA's (a partition's) threads thread_barrier; later versions barrier.
    _thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def _barriers(N: gl.constexpr, COUNT: gl.constexpr):
        """``N`` mbarriers in shared memory, each expecting ``COUNT`` arrivals a phase."""
        bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(bars.index(i), count=COUNT)
        return bars

    @gluon.jit
    def _rings(dtype: gl.constexpr, STAGES: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
               layout: gl.constexpr, CONSUMERS: gl.constexpr):
        """Two rings of STAGES [BLOCK, head_dim] shared-memory stages that the loader fills in step
        (K and V, or q and dO), with their "ready" barriers (the loader's one arrival and the TMA
        bytes) and "empty" barriers (every one of the CONSUMERS releases a stage)."""
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], layout)
        ready_a, ready_b = _barriers(STAGES, 1), _barriers(STAGES, 1)
        return a_smem, b_smem, ready_a, ready_b, _barriers(STAGES, CONSUMERS), _barriers(STAGES, CONSUMERS)

    @gluon.jit
    def _mask(s, row0, col0, seq_k, causal_offset, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr):
        """-inf where a row may not see a key: past its diagonal (bottom-right aligned: row r sees
        keys up to r + seq_k - seq_q, < seq_k) with ``CAUSAL``, else past seq_k."""
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:
            rows = row0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
            return gl.where(cols[None, :] <= rows[:, None] + causal_offset, s, -float("inf"))
        return gl.where(cols[None, :] < seq_k, s, -float("inf"))

    @gluon.jit
    def _softmax(s, m_i, l_i, logit_scale, row0, col0, seq_k, causal_offset, s_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """Fold one block of raw scores into the running max and normaliser (base 2). Every row
        attends key 0 (the plans guarantee it), so the running max is finite after block 0."""
        if MASK:
            s = _mask(s, row0, col0, seq_k, causal_offset, s_layout, BLOCK_N, CAUSAL)
        # Scale the row max, not the tile (equal for a positive scale), so scale-and-subtract is one FMA.
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * logit_scale)
        p = gl.exp2(s * logit_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _softmax_at(s, m_i, l_i, logit_scale, row0, j, first_masked, seq_k, causal_offset, s_layout: gl.constexpr,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, ONE_COPY: gl.constexpr):
        """``_softmax`` of key block ``j``, masked from block ``first_masked`` on. Without a causal
        mask or a partial last block (``KEY_TAIL``) no block needs one, and the masked code is not
        compiled at all: 1.5-4.5% less time at head_dim 128 on an H100, 0-3% at 64
        (probe_gluon_forward_variants-key-tail-*.json). Where one does, the branch holds either
        the mask alone (``ONE_COPY``: one copy of the softmax's code) or a whole masked softmax
        beside the unmasked one (two copies, but no scores carried out of a branch). On an H100 the
        one copy took 0.95-0.97x the time at head_dim 64 (causal, or seq_k not a multiple of the
        block: 0.94-0.95x), and 1.0-1.03x at 128, where it stays off; the code is the cost there,
        more than the mask's arithmetic (probe_gluon_forward_variants-causal-mask-*.json)."""
        col0 = j * BLOCK_N
        if CAUSAL or KEY_TAIL:
            if ONE_COPY:
                if j >= first_masked:
                    s = _mask(s, row0, col0, seq_k, causal_offset, s_layout, BLOCK_N, CAUSAL)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, logit_scale, row0, col0, seq_k, causal_offset, s_layout,
                                              BLOCK_N, False, CAUSAL)
            elif j >= first_masked:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, logit_scale, row0, col0, seq_k, causal_offset, s_layout,
                                              BLOCK_N, True, CAUSAL)
            else:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, logit_scale, row0, col0, seq_k, causal_offset, s_layout,
                                              BLOCK_N, False, CAUSAL)
        else:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, logit_scale, row0, col0, seq_k, causal_offset, s_layout,
                                          BLOCK_N, False, CAUSAL)
        return p, m_i, l_i, alpha

    @gluon.jit
    def _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, q_empty, logit_scale, row0, seq_q, seq_k,
                n_blocks, first_masked, ring, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, RELEASE_Q: gl.constexpr):
        """One warpgroup's 64 query rows (``q``, in shared memory) against key blocks 0..n_blocks-1,
        which the loader puts in the ring from position ``ring`` on. With ``RELEASE_Q``, arrives on
        ``q_empty`` once the last QK^T is done with ``q``. Returns the unnormalised output and the
        running max and normaliser (base 2)."""
        ROWS: gl.constexpr = q.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q.dtype
        ONE_COPY: gl.constexpr = HEAD_DIM == 64  # _softmax_at

        causal_offset = seq_k - seq_q
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))

        # Block 0: S only; its PV is issued together with S of block 1.
        stage = ring % STAGES
        mbarrier.wait(k_ready.index(stage), (ring // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        p, m_i, l_i, alpha = _softmax_at(s, m_i, l_i, logit_scale, row0, 0, first_masked, seq_k, causal_offset,
                                         s_layout, BLOCK_N, CAUSAL, KEY_TAIL, ONE_COPY)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_blocks):
            c = ring + j
            stage = c % STAGES
            prev = (c - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # alpha belongs to block j-1, whose PV is issued next: rescale while QK^T runs.
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            # Wait for S only (PV may stay in flight), so the softmax overlaps PV.
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(stage), count=1)
            p, m_i, l_i, alpha = _softmax_at(s, m_i, l_i, logit_scale, row0, j, first_masked, seq_k, causal_offset,
                                             s_layout, BLOCK_N, CAUSAL, KEY_TAIL, ONE_COPY)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if RELEASE_Q:
            mbarrier.arrive(q_empty, count=1)

        c = ring + n_blocks - 1
        last = c % STAGES
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(last), (c // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _stage_rows(o_desc, lse_ptr, o_smem, acc, m_i, l_i, row0, seq_q, b, col, lse_base, BLOCK_N: gl.constexpr):
        """Normalise a warpgroup's output rows into ``o_smem`` and send them out (q's layout) with a
        TMA store, which clips rows past seq_q, left in flight (``tma.store_wait`` before reusing
        ``o_smem``); store their natural log-sum-exp."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        # One reciprocal a row, then products: `acc / l` divided each element (div.full, ~3 SASS
        # instructions an element): 88 instructions a consumer at head_dim 64, 188 at 128, and
        # calls 1.01-1.05x as fast (H200; probe_gluon_forward_variants-recip-skew-nvidia-h200.json).
        # Every row has l >= 1: it attends key 0, whose term is exp2(0).
        inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, acc.type.layout))
        o_smem.store((acc * inv_l[:, None]).to(o_smem.dtype))
        fence_async_shared()  # the generic-proxy writes above, before the TMA engine reads them
        _thread_barrier()  # every thread's rows are in o_smem before one thread starts the copy
        _tma_store(o_desc, [b, row0, col], o_smem)
        _store_lse(lse_ptr, m_i, l_i, row0, seq_q, lse_base, s_layout)

    @gluon.jit
    def _store_lse(lse_ptr, m_i, l_i, row0, seq_q, lse_base, s_layout: gl.constexpr):
        """A warpgroup's rows of the natural log-sum-exp, as flash_fwd_kernel writes it."""
        lse_rows = row0 + gl.arange(0, m_i.shape[0], layout=gl.SliceLayout(1, s_layout))
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(lse_ptr + lse_base + lse_rows, lse, mask=lse_rows < seq_q)

    @gluon.jit
    def _block_counts(m0, seq_q, seq_k, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(key blocks the tile reads, the first of them that needs a mask)."""
        if CAUSAL:
            offset = seq_k - seq_q
            last_row = gl.minimum(m0 + TILE_M, seq_q) - 1
            n_blocks = gl.cdiv(last_row + offset + 1, BLOCK_N)
            # A block is unmasked for the whole tile when its last key is visible to the tile's first row.
            first_masked = gl.minimum((m0 + offset + 1) // BLOCK_N, n_blocks)
        else:
            n_blocks = gl.cdiv(seq_k, BLOCK_N)
            first_masked = seq_k // BLOCK_N  # only a partial last block needs the seq_k mask
        return n_blocks, first_masked

    @gluon.jit
    def _slots(n_units, PAIRS: gl.constexpr):
        """How many tiles this program walks: schedule units pid, pid + G, ... (G programs) of
        ``n_units``, each one tile or, with ``PAIRS``, two (``_slot_tile``)."""
        units = gl.cdiv(n_units - gl.program_id(0), gl.num_programs(0))
        return 2 * units if PAIRS else units

    @gluon.jit
    def _pair_tile(unit, first, n_tiles, per_head):
        """(batch x heads row, tile, whether it exists) of pair unit ``unit``'s ``first`` tile
        (``n_tiles - 1 - p``) or its second (``p``)."""
        bh = unit // per_head
        p = unit % per_head
        if first:
            t = n_tiles - 1 - p
            exists = True
        else:
            t = p
            exists = 2 * p + 1 < n_tiles  # the middle tile of an odd count is alone in its unit
        return bh, t, exists

    @gluon.jit
    def _tail_tile(i, paired, n_units, per_head, n_tiles):
        """(batch x heads row, tile) of the ``i``-th tile after the ``paired`` units: the remaining
        rows' tiles, largest (last) first, row after row."""
        first_row = paired // per_head
        tail_rows = n_units // per_head - first_row
        return first_row + i % tail_rows, n_tiles - 1 - i // tail_rows

    @gluon.jit
    def _slot_tile(slot, n_tiles, per_head, HEADS: gl.constexpr, TILE: gl.constexpr, PAIRS: gl.constexpr):
        """(first row, head, batch row, whether it exists) of this program's ``slot``-th tile. A
        schedule unit is one tile of ``TILE`` rows, or with ``PAIRS`` (a causal mask) a pair of
        tiles of one head: tile ``n_tiles - 1 - p`` then tile ``p``, whose work sums to the same for
        every p (query tiles see more keys the later they are, key tiles fewer queries). So a static
        round robin over units gives every program the same work.

        One runtime loop over slots, not a loop over units with the pair's two tiles unrolled: the
        unrolled loop doubled the partitions' code, and the causal forward ran 1.2x slower at seq
        1024 on an H100 (probe_gluon_forward_variants, "dyn_half"; instruction fetch, we think)."""
        UNIT: gl.constexpr = 2 if PAIRS else 1
        unit = gl.program_id(0) + (slot // UNIT) * gl.num_programs(0)
        if PAIRS:
            bh, t, exists = _pair_tile(unit, slot % 2 == 0, n_tiles, per_head)
        else:
            bh = unit // per_head
            t = unit % per_head
            exists = True
        return t * TILE, bh % HEADS, bh // HEADS, exists

    @gluon.jit
    def _paired_units(n_units, per_head):
        """With ``_tail_slots``: the units walked in pairs, whole heads up to the last full round;
        the rest of the heads (the tail) go out as single tiles. Mirrored by
        ``schedule.query_walk``, which tests that the walk covers every tile once."""
        rounds = n_units // gl.num_programs(0)
        return (rounds * gl.num_programs(0)) // per_head * per_head

    @gluon.jit
    def _tail_slots(n_units, per_head, n_tiles, PAIRS: gl.constexpr):
        """``_slots`` for ``_tail_slot_tile``'s schedule."""
        if PAIRS:
            pid = gl.program_id(0)
            G = gl.num_programs(0)
            paired = _paired_units(n_units, per_head)
            tail_tiles = (n_units - paired) // per_head * n_tiles
            last = tail_tiles // G  # the last, partial snake round
            lane = gl.where(last % 2 == 0, G - 1 - pid, pid)
            return 2 * gl.cdiv(paired - pid, G) + last + (lane < tail_tiles % G).to(gl.int32)
        else:
            return _slots(n_units, PAIRS)

    @gluon.jit
    def _tail_slot_tile(slot, n_tiles, per_head, n_units, HEADS: gl.constexpr, TILE: gl.constexpr,
                        PAIRS: gl.constexpr):
        """``_slot_tile`` with the round robin's last rounds balanced: with ``PAIRS``, units in
        pairs as ``_slot_tile`` up to the last full round (``_paired_units``), then the remaining
        heads' tiles one by one, largest first, dealt in snake order (program G-1 to 0, then 0 to
        G-1, ...), so that the programs a paired round left lighter get the largest. Pairs alone
        leave the busiest program a whole unit above the mean whenever the units do not divide by
        the grid (72 key blocks against 69.8 at causal seq 1024, head_dim 128; 71 with the tail).
        On an H100 the causal forward ran 1.006-1.033x faster (seq 1024-4096, head_dim 64 and
        128; probe_gluon_forward_variants-causal-tail-k0-*.json), and dq 1.007-1.022x in 5 of 6
        shapes (0.998x at head_dim 64 seq 4096; probe_gluon_backward_variants-dq-tail-*.json,
        same bits). Splitting one round earlier (more heads in the tail) measured the same."""
        if PAIRS:
            pid = gl.program_id(0)
            G = gl.num_programs(0)
            paired = _paired_units(n_units, per_head)
            pair_slots = 2 * gl.cdiv(paired - pid, G)
            if slot < pair_slots:
                m0, h, b, exists = _slot_tile(slot, n_tiles, per_head, HEADS, TILE, PAIRS)
            else:
                s = slot - pair_slots
                bh, t = _tail_tile(s * G + gl.where(s % 2 == 0, G - 1 - pid, pid), paired, n_units, per_head,
                                   n_tiles)
                m0 = t * TILE
                h = bh % HEADS
                b = bh // HEADS
                exists = True
        else:
            m0, h, b, exists = _slot_tile(slot, n_tiles, per_head, HEADS, TILE, PAIRS)
        return m0, h, b, exists

    @gluon.jit
    def _claimed_tile(claim, n_tiles, per_head, n_units, HEADS: gl.constexpr, TILE: gl.constexpr,
                      PAIRS: gl.constexpr):
        """(first row, head, batch row, whether it exists) of the ``claim``-th tile of the dynamic
        schedule, where each program's loader claims its next tile from a counter all share
        (``_claim_tiles``): a program that runs ahead takes more tiles, so programs finish
        together however fast their SMs run. The order is ``_tail_slot_tile``'s, without the
        programs: with ``PAIRS``, claims 2u and 2u + 1 are unit u's two tiles up to the last full
        round (``_paired_units``), then the remaining heads' tiles one by one, largest first;
        without, tile after tile of each head. Clock stamps had put what the causal forward lost
        at seq 1024 in the static walk's last round: programs with equal work ended up to 12 us
        apart. ``schedule.claims_tiles`` says where it runs; ``schedule.claim_order`` is the order in
        Python (tests: every tile once, the tail largest first)."""
        if PAIRS:
            paired = _paired_units(n_units, per_head)
            if claim < 2 * paired:
                bh, t, exists = _pair_tile(claim // 2, claim % 2 == 0, n_tiles, per_head)
            else:
                bh, t = _tail_tile(claim - 2 * paired, paired, n_units, per_head, n_tiles)
                exists = True
        else:
            bh = claim // per_head
            t = claim % per_head
            exists = True
        return t * TILE, bh % HEADS, bh // HEADS, exists

    @gluon.jit
    def _claimable(n_units, per_head, n_tiles, PAIRS: gl.constexpr):
        """How many claims ``_claimed_tile`` numbers."""
        if PAIRS:
            paired = _paired_units(n_units, per_head)
            return 2 * paired + (n_units - paired) // per_head * n_tiles
        else:
            return n_units

    @gluon.jit
    def _post(claims, i, value):
        """From the loader's warp: ``claims[i] = value``, every lane's store done before one of
        them arrives on the barrier that publishes it."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        claims.index(i).store(gl.full([1], value, gl.int32, layout))
        _thread_barrier()

    @gluon.jit
    def _read_post(claims, i):
        """``claims[i]`` in a consumer warpgroup, after the barrier that published it."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.max(claims.index(i).load(layout), axis=0)

    @gluon.jit
    def _kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b, col, n_blocks, ring,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Key/value blocks 0..n_blocks-1 of batch row ``b`` (the head at column ``col``) into the
        ring from position ``ring`` on: a stage is refilled once every consumer has arrived on its
        "empty" barrier."""
        for j in range(n_blocks):
            c = ring + j
            stage = c % STAGES
            # A fresh mbarrier counts its phase 1 as complete: the first pass through the ring does not wait.
            phase = ((c // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, j * BLOCK_N, col], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, j * BLOCK_N, col], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units, HEADS_Q: gl.constexpr, GROUP: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                PAIRS: gl.constexpr, WITH_DO: gl.constexpr):
        """This program's tiles in turn: a tile's query parts, one a consumer (and with ``WITH_DO``,
        for dq, its dO parts), into the free one of two buffers, then its key/value blocks through
        the ring (``ring`` counts the blocks streamed so far). The forward passes q's for dO's
        arguments."""
        PARTS: gl.constexpr = q_smem.shape[0] // 2
        TILE_M: gl.constexpr = PARTS * q_smem.shape[1]
        ring = 0
        tiles = 0
        for slot in range(_tail_slots(n_units, per_head, n_m, PAIRS)):
            m0, h, b, exists = _tail_slot_tile(slot, n_m, per_head, n_units, HEADS_Q, TILE_M, PAIRS)
            if exists:
                n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
                buf = tiles % 2
                mbarrier.wait(q_empty.index(buf), ((tiles // 2) & 1) ^ 1)
                bar = q_ready.index(buf)
                mbarrier.expect(bar, (2 * PARTS if WITH_DO else PARTS) * q_desc.block_type.nbytes)
                for i in gl.static_range(PARTS):
                    row = m0 + i * q_smem.shape[1]
                    _tma_load(q_desc, [b, row, h * HEAD_DIM], bar, q_smem.index(PARTS * buf + i))
                    if WITH_DO:
                        _tma_load(do_desc, [b, row, h * HEAD_DIM], bar, do_smem.index(PARTS * buf + i))
                _kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b,
                           (h // GROUP) * HEAD_DIM, n_blocks, ring, BLOCK_N, STAGES)
                ring += n_blocks
                tiles += 1

    @gluon.jit
    def _loader_making_descriptors(q_ptr, do_ptr, k_ptr, v_ptr, batch, q_smem, do_smem, k_smem, v_smem, q_ready,
                                   q_empty, k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units,
                                   HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                   PAIRS: gl.constexpr, WITH_DO: gl.constexpr):
        """``_loader``, making its TMA descriptors first: the forward's (``WITH_DO`` false; it
        passes q's pointer and buffers for dO's) and the dq kernel's.

        Each partition makes the descriptors it uses (the forward's consumers make the output's).
        A descriptor made in the kernel is a global write with a release and an acquire fence,
        close to a microsecond; with all four made before the warp-specialized region, a program
        spent 3.8 us before it at every shape (0.4 us without them), 2% of a call at seq 1024
        (clock stamps, H100). Made here, the output's alongside, the forward's first tile starts
        2.8 us sooner, and a call takes 0.96-1.00x the time
        (probe_gluon_forward_variants-descriptors-in-partitions-*.json). Splitting the loader in
        two (queries; keys and values), so that each first load waits for fewer descriptors, was
        slower at head_dim 128 without a mask (0.98x at seq 1024). For the backward, with dk/dv's
        loader changed alike: dq 1.00-1.02x, dk/dv 1.06x and 1.10x causal at head_dim 128 (seq
        1024, 2048), 0.99-1.02x elsewhere; outputs bit for bit the same
        (probe_gluon_backward_variants-descriptors-*.json)."""
        ROWS: gl.constexpr = q_smem.shape[1]
        q_desc = _batch_heads(q_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, ROWS)
        if WITH_DO:
            do_desc = _batch_heads(do_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, ROWS)
        else:
            do_desc = q_desc
        k_desc = _batch_heads(k_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N)
        v_desc = _batch_heads(v_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N)
        _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units, HEADS_Q, HEADS_Q // HEADS_KV, HEAD_DIM,
                BLOCK_N, STAGES, CAUSAL, PAIRS, WITH_DO)

    @gluon.jit
    def _claim_tiles(next_tile_ptr, claims, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                     v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units, HEADS_Q: gl.constexpr,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, PAIRS: gl.constexpr):
        """``_loader`` for the dynamic schedule: tiles are claimed in ``_claimed_tile``'s order from
        a counter all programs share (``next_tile_ptr``, zero at launch and left zero), the next
        one as soon as a tile's query loads are out. Each tile's first row and batch x heads row
        go to the consumers in ``claims`` beside its query parts; a first row of -1 ends their loop."""
        ROWS: gl.constexpr = q_smem.shape[1]
        PARTS: gl.constexpr = q_smem.shape[0] // 2
        TILE_M: gl.constexpr = PARTS * ROWS
        total = _claimable(n_units, per_head, n_m, PAIRS)
        ring = 0
        tiles = 0
        # Relaxed claims: a claim only needs its own number, and orders no other memory. The
        # default acq_rel put MEMBAR.GPU, ERRBAR and an L1 invalidation before each; relaxed, the
        # consumers' code is unchanged and calls ran 0.999-1.010x as fast (causal, head_dim 64 and
        # 128, seq 1024 and 2048, H200; probe_gluon_forward_variants-relaxed-claim-nvidia-h200.json).
        claim = gl.atomic_add(next_tile_ptr, 1, sem="relaxed")
        while claim < total:
            m0, h, b, exists = _claimed_tile(claim, n_m, per_head, n_units, HEADS_Q, TILE_M, PAIRS)
            if exists:
                n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
                buf = tiles % 2
                mbarrier.wait(q_empty.index(buf), ((tiles // 2) & 1) ^ 1)
                _post(claims, buf, m0)
                _post(claims, 2 + buf, b * HEADS_Q + h)
                bar = q_ready.index(buf)
                mbarrier.expect(bar, PARTS * q_desc.block_type.nbytes)
                for i in gl.static_range(PARTS):
                    _tma_load(q_desc, [b, m0 + i * ROWS, h * HEAD_DIM], bar, q_smem.index(PARTS * buf + i))
                # the next claim's latency hides behind this tile's blocks
                claim = gl.atomic_add(next_tile_ptr, 1, sem="relaxed")
                _kv_blocks(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, b,
                           (h // GROUP) * HEAD_DIM, n_blocks, ring, BLOCK_N, STAGES)
                ring += n_blocks
                tiles += 1
            else:
                claim = gl.atomic_add(next_tile_ptr, 1, sem="relaxed")
        # Every program ends on one claim past the tiles, so the launch's last claim is this one:
        # put the counter back to zero, and a launcher may keep it for the stream's next launch.
        if claim == total + gl.num_programs(0) - 1:
            gl.atomic_xchg(next_tile_ptr, 0)
        buf = tiles % 2
        mbarrier.wait(q_empty.index(buf), ((tiles // 2) & 1) ^ 1)
        _post(claims, buf, -1)
        mbarrier.arrive(q_ready.index(buf), count=1)

    @gluon.jit
    def _forward_loader(next_tile_ptr, claims, q_ptr, k_ptr, v_ptr, batch, q_smem, k_smem, v_smem, q_ready, q_empty,
                        k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units,
                        HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PAIRS: gl.constexpr,
                        DYNAMIC: gl.constexpr):
        """The forward's loader partition: ``_claim_tiles`` with ``DYNAMIC``, else the static walk
        of ``_loader_making_descriptors`` (which passes q's pointer and buffers for dO's)."""
        if DYNAMIC:
            ROWS: gl.constexpr = q_smem.shape[1]
            q_desc = _batch_heads(q_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, ROWS)
            k_desc = _batch_heads(k_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N)
            v_desc = _batch_heads(v_ptr, batch, seq_k, HEADS_KV, HEAD_DIM, BLOCK_N)
            _claim_tiles(next_tile_ptr, claims, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                         k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head, n_units, HEADS_Q,
                         HEADS_Q // HEADS_KV, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS)
        else:
            _loader_making_descriptors(q_ptr, q_ptr, k_ptr, v_ptr, batch, q_smem, q_smem, k_smem, v_smem, q_ready,
                                       q_empty, k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head,
                                       n_units, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS, False)

    @gluon.jit
    def _consumer(state, WG: gl.constexpr, HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr, PAIRS: gl.constexpr,
                  DYNAMIC: gl.constexpr):
        """Warpgroup ``WG``'s 64 rows of each of this program's tiles, in the loader's order: the
        static walk (``_tail_slot_tile``), or with ``DYNAMIC`` the tiles the loader claimed, read
        from ``claims`` (``_claim_tiles``). ``state`` holds the runtime values all consumers share
        (pointers, buffers, barriers, sizes)."""
        (o_ptr, batch, lse_ptr, q_smem, o_smem, k_smem, v_smem, claims, q_ready, q_empty, k_ready, v_ready, k_empty,
         v_empty, logit_scale, seq_q, seq_k, n_m, per_head, n_units) = state
        ROWS: gl.constexpr = q_smem.shape[1]
        o_desc = _batch_heads(o_ptr, batch, seq_q, HEADS_Q, HEAD_DIM, ROWS)  # see _loader_making_descriptors
        PARTS: gl.constexpr = q_smem.shape[0] // 2
        TILE_M: gl.constexpr = PARTS * ROWS
        ring = 0
        tiles = 0
        if DYNAMIC:
            mbarrier.wait(q_ready.index(0), 0)
            m0 = _read_post(claims, 0)
            while m0 >= 0:
                bh = _read_post(claims, 2 + tiles % 2)
                n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
                _consume_tile(state, o_desc, m0, bh % HEADS_Q, bh // HEADS_Q, n_blocks, first_masked, ring, tiles,
                              WG, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL)
                ring += n_blocks
                tiles += 1
                mbarrier.wait(q_ready.index(tiles % 2), (tiles // 2) & 1)
                m0 = _read_post(claims, tiles % 2)
        else:
            for slot in range(_tail_slots(n_units, per_head, n_m, PAIRS)):
                m0, h, b, exists = _tail_slot_tile(slot, n_m, per_head, n_units, HEADS_Q, TILE_M, PAIRS)
                if exists:
                    n_blocks, first_masked = _block_counts(m0, seq_q, seq_k, TILE_M, BLOCK_N, CAUSAL)
                    mbarrier.wait(q_ready.index(tiles % 2), (tiles // 2) & 1)
                    _consume_tile(state, o_desc, m0, h, b, n_blocks, first_masked, ring, tiles, WG, HEADS_Q, HEAD_DIM,
                                  BLOCK_N, STAGES, CAUSAL, KEY_TAIL)
                    ring += n_blocks
                    tiles += 1
        tma.store_wait(0)

    @gluon.jit
    def _consume_tile(state, o_desc, m0, h, b, n_blocks, first_masked, ring, tiles, WG: gl.constexpr,
                      HEADS_Q: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, KEY_TAIL: gl.constexpr):
        """One tile of ``_consumer``, its query parts ready (the ``tiles``-th of this program).

        A tile's output leaves through shared memory with a TMA store (``_stage_rows``). Stored
        from registers, 64-bit addresses and 4-byte stores a thread, it took 3-8% more time
        without a mask at head_dim 128, 0-4% at 64 (H100); with a causal mask, where clock stamps
        put that epilogue at 4k cycles a tile against 1.5k for the staged one, 1.02-1.07x the
        time (probe_gluon_forward_variants-causal-ostore-*.json). Without a mask the rows go through
        the tile's query buffer, which goes back to the loader at the next tile's start, once the
        store has read it. A causal tile gives its query buffer back after its last QK^T, so that
        the loader can fetch the next tile's sooner, and stages its rows in ``o_smem``, a buffer
        of its own (as fast as the query buffer without a mask: 0.99-1.02x)."""
        (o_ptr, batch, lse_ptr, q_smem, o_smem, k_smem, v_smem, claims, q_ready, q_empty, k_ready, v_ready, k_empty,
         v_empty, logit_scale, seq_q, seq_k, n_m, per_head, n_units) = state
        ROWS: gl.constexpr = q_smem.shape[1]
        PARTS: gl.constexpr = q_smem.shape[0] // 2
        buf = tiles % 2
        if not CAUSAL:  # the previous tile's output store has read its buffer: release it
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index((tiles + 1) % 2), count=1, pred=tiles > 0)
        row0 = m0 + WG * ROWS
        # A part wholly past seq_q (3 consumers: seq 1024 pads to 1152 rows, two parts of the last
        # tile empty) only releases the ring. Two-consumer builds keep one path (a runtime branch
        # made the head_dim-128 build spill on triton 3.9).
        if PARTS == 3 and WG > 0:
            empty = row0 >= seq_q
        else:
            empty = False  # a Python bool: the branch below is resolved while compiling
        if empty:
            _pass_blocks(k_ready, v_ready, k_empty, v_empty, q_empty.index(buf), n_blocks, ring, STAGES, CAUSAL)
        else:
            acc, m_i, l_i = _attend(q_smem.index(PARTS * buf + WG), k_smem, v_smem, k_ready, v_ready, k_empty,
                                    v_empty, q_empty.index(buf), logit_scale, row0, seq_q, seq_k, n_blocks,
                                    first_masked, ring, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, CAUSAL)
            lse_base = (b.to(gl.int64) * HEADS_Q + h) * seq_q
            if CAUSAL:
                tma.store_wait(0)  # the previous tile's store has read o_smem
                o_rows = o_smem.index(WG)
            else:
                o_rows = q_smem.index(PARTS * buf + WG)
            _stage_rows(o_desc, lse_ptr, o_rows, acc, m_i, l_i, row0, seq_q, b, h * HEAD_DIM, lse_base, BLOCK_N)

    @gluon.jit
    def _pass_blocks(k_ready, v_ready, k_empty, v_empty, q_empty, n_blocks, ring, STAGES: gl.constexpr,
                     RELEASE_Q: gl.constexpr):
        """``_attend``'s barrier protocol without its work, for a warpgroup whose rows all lie past
        seq_q: every consumer releases every ring stage. Each release waits for the stage's fill,
        so that it cannot count towards the stage's previous use."""
        for j in range(n_blocks):
            c = ring + j
            stage = c % STAGES
            mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
            mbarrier.arrive(k_empty.index(stage), count=1)
            mbarrier.wait(v_ready.index(stage), (c // STAGES) & 1)
            mbarrier.arrive(v_empty.index(stage), count=1)
        if RELEASE_Q:
            mbarrier.arrive(q_empty, count=1)

    @gluon.jit
    def _batch_heads(ptr, batch, seq, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
        """TMA descriptor of a [batch, seq, heads, head_dim] array seen as [batch, seq, heads * head_dim],
        in boxes of one batch row, BLOCK rows and one head (the column offset picks it). TMA bounds
        each batch row's sequence: rows past it read as zeros."""
        row: gl.constexpr = HEADS * HEAD_DIM
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK, HEAD_DIM], ptr.dtype.element_ty)
        # to_tensor: seq may be the constant 1 (Triton specializes it).
        return tma.make_tensor_descriptor(ptr, [batch, seq, row], [gl.to_tensor(seq).to(gl.int64) * row, row, 1],
                                          [1, BLOCK, HEAD_DIM], layout)

    @gluon.jit(do_not_specialize_on_alignment=RUNTIME_INTS + ["batch"])
    def flash_fwd_gluon_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, q_seg_ptr, kv_seg_ptr, cu_q_ptr, cu_k_ptr, seed_ptr,
                               batch, seq_q, seq_k, logit_scale,
                               o_ptr, lse_ptr, next_tile_ptr,
                               HEADS_Q: gl.constexpr, HEADS_KV: gl.constexpr, HEAD_DIM: gl.constexpr,
                               CAUSAL: gl.constexpr, PAIRS: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, KEY_TAIL: gl.constexpr, CONSUMERS: gl.constexpr,
                               DYNAMIC: gl.constexpr):
        """Query tiles of 64 rows a consumer warpgroup (``CONSUMERS`` of them: 2 or 3) against the
        keys they see, a program per SM walking the schedule units of ``_slot_tile``. Takes the
        nine feature arrays every flash forward takes and reads q, k and v (the plans route calls
        that use the others to ``flash_fwd_kernel``); ``logit_scale`` is the softmax scale times
        log2(e); ``KEY_TAIL``: seq_k is not a multiple of ``BLOCK_N``, so the last key block needs a
        mask."""
        ROWS: gl.constexpr = 64
        TILE_M: gl.constexpr = CONSUMERS * ROWS
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

        q_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, ROWS, HEAD_DIM], q_layout)  # two tiles' parts
        if CAUSAL:  # output staging (_consumer); 224 KB in all at head_dim 128
            o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_layout)
        else:
            o_smem = q_smem
        q_ready = _barriers(2, 1)
        q_empty = _barriers(2, CONSUMERS)
        if DYNAMIC:  # the claimed tiles' first rows and batch x heads rows, one of each a query buffer
            claims = gl.allocate_shared_memory(gl.int32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            claims = q_ready  # not read
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _rings(dtype, STAGES, BLOCK_N, HEAD_DIM, kv_layout,
                                                                    CONSUMERS)

        n_m = gl.cdiv(seq_q, TILE_M)
        per_head = (n_m + 1) // 2 if PAIRS else n_m
        n_units = batch * HEADS_Q * per_head
        # The default partition is consumer 0; it gets the registers the workers leave (forward_maxnreg).
        # Only runtime values travel in a tuple: constexprs in one arrive as tensors.
        state = (o_ptr, batch, lse_ptr, q_smem, o_smem, k_smem, v_smem, claims, q_ready, q_empty, k_ready, v_ready,
                 k_empty, v_empty, logit_scale, seq_q, seq_k, n_m, per_head, n_units)
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_consumer, (state, 0, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, PAIRS, DYNAMIC)),
                (_consumer, (state, 1, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, PAIRS, DYNAMIC)),
                (_consumer, (state, 2, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, PAIRS, DYNAMIC)),
                (_forward_loader, (next_tile_ptr, claims, q_ptr, k_ptr, v_ptr, batch, q_smem, k_smem, v_smem, q_ready,
                                    q_empty, k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head,
                                    n_units, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS, DYNAMIC)),
            ], [4, 4, 1], [160, 160, 24])
        else:
            gl.warp_specialize([
                (_consumer, (state, 0, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, PAIRS, DYNAMIC)),
                (_consumer, (state, 1, HEADS_Q, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KEY_TAIL, PAIRS, DYNAMIC)),
                (_forward_loader, (next_tile_ptr, claims, q_ptr, k_ptr, v_ptr, batch, q_smem, k_smem, v_smem, q_ready,
                                    q_empty, k_ready, v_ready, k_empty, v_empty, seq_q, seq_k, n_m, per_head,
                                    n_units, HEADS_Q, HEADS_KV, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PAIRS, DYNAMIC)),
            ], [4, 1], [232, 24])
