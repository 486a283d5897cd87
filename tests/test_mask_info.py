"""MaskInfo: every schedule rebuilds exactly the mask it came from."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel_jax.pallas.tpu.blocksparse_attention import info as I
from ejkernel_jax.pallas.tpu.blocksparse_attention import masks as M

SEQ = 64
BLOCKS = [(8, 8), (16, 32), (32, 16), (64, 64), (8, 64)]
SHARDS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)]
HEADS = 4


def rebuild(info, fn, shape, block_shape, *, is_dkv, head_shards=1, q_seq_shards=1):
    """Dense [heads, q, kv] mask described by a MaskInfo, visiting the schedule the way
    the kernels do.  Also checks that no block is visited twice."""
    heads, q_len, kv_len = shape
    bq, bkv = block_shape
    nq = q_len // bq
    qps = nq // q_seq_shards  # q blocks per shard
    rows = info.block_mask.shape[0]
    assert rows in (1, head_shards, heads)
    out = np.zeros(shape, bool)
    partial = None if info.partial_mask_blocks is None else np.asarray(info.partial_mask_blocks)
    for h in range(heads):
        row = 0 if rows == 1 else (h if rows == heads else h // (heads // head_shards))
        bm, dn = np.asarray(info.block_mask[row], np.int64), np.asarray(info.data_next[row], np.int64)
        mn = None if info.mask_next is None else np.asarray(info.mask_next[row], np.int64)
        steps = bm.shape[0] // q_seq_shards if is_dkv else bm.shape[1]
        seen = set()
        for a, b in itertools.product(range(bm.shape[0]), range(bm.shape[1])):
            if bm[a, b] == I.EMPTY:
                continue
            if is_dkv:  # a = q step (per shard), b = kv block; data_next is shard-local
                shard = a // steps
                i, j = shard * qps + dn[a, b], b
            else:  # a = q block, b = kv step
                shard = a // qps
                i, j = a, dn[a, b]
            assert (i, j) not in seen
            seen.add((i, j))
            window = out[h, i * bq : (i + 1) * bq, j * bkv : (j + 1) * bkv]
            if bm[a, b] == I.FULL:
                window[:] = True
            elif fn is not None:
                q_ids = np.asarray(info.q_sequence)[i * bq : (i + 1) * bq, None]
                kv_ids = np.arange(j * bkv, (j + 1) * bkv)[None, :]
                window[:] = fn(*np.broadcast_arrays(q_ids, kv_ids))
            else:
                blocks = partial
                if info.is_dynamic_mask:  # per (head shard, q shard) local numbering
                    hps = heads // head_shards
                    hs = h // hps
                    blocks = partial[hs * hps : (hs + 1) * hps, shard * qps : (shard + 1) * qps]
                    blocks = blocks.reshape(-1, *partial.shape[-2:])
                block = blocks[mn[a, b]]
                window[:] = block.T if is_dkv else block
    return out


def head_masks(shape):
    rand = [M.NumpyMask(M.make_random_mask(shape, 0.7, s)) for s in range(2)]
    structured = M.NumpyMask(M.make_causal_mask(shape) & ~M.make_local_attention_mask(shape, (20, None)))
    return {
        "full": M.FullMask(shape),
        "causal": M.CausalMask(shape),
        "causal_offset": M.CausalMask(shape, offset=-13),
        "local": M.LocalMask(shape, (10, 3)),
        "local_offset": M.LocalMask(shape, (4, 4), offset=20),
        "chunked": M.ChunkedCausalMask(shape, 24),
        "numpy_random": rand[0],
        "numpy_structured": structured,
        "and": M.CausalMask(shape) & M.LocalMask(shape, (9, None)),
        "or": M.CausalMask(shape, offset=-30) | rand[1],
        "mixed_heads": [M.CausalMask(shape), rand[0], M.LocalMask(shape, (5, 5)), rand[0]],
        "per_shard_heads": [M.CausalMask(shape), M.CausalMask(shape), rand[1], rand[1]],
    }


def as_multi_head(m):
    return M.MultiHeadMask(m if isinstance(m, list) else [m] * HEADS)


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
@pytest.mark.parametrize("name", list(head_masks((SEQ, SEQ))))
def test_rebuild_static(name, is_dkv):
    mask = as_multi_head(head_masks((SEQ, SEQ))[name])
    dense = mask[:, :, :]
    for block, (hs, qs), shrink, downcast in itertools.product(BLOCKS, SHARDS, (True, False), (True, False)):
        if (SEQ // block[0]) % qs:
            continue
        info, fn = I.process_mask(
            mask,
            block,
            is_dkv=is_dkv,
            head_shards=hs,
            q_seq_shards=qs,
            shrink_grid=shrink,
            downcast_smem_data=downcast,
        )
        ctx = (name, block, hs, qs, shrink, downcast)
        assert info.is_dynamic_mask is False
        assert set(np.unique(info.block_mask)) <= {0, 1, 2}, ctx
        assert info.data_next.shape == info.block_mask.shape, ctx
        assert info.mask_next is None or info.mask_next.shape == info.block_mask.shape, ctx
        assert (info.q_sequence is None) == (fn is None), ctx
        assert info.partial_mask_blocks is None or fn is None, ctx
        np.testing.assert_array_equal(
            rebuild(info, fn, mask.shape, block, is_dkv=is_dkv, head_shards=hs, q_seq_shards=qs),
            dense,
            err_msg=str(ctx),
        )


def test_reference_shapes_and_dtypes():
    shape = (128, 256)
    mask = M.MultiHeadMask([M.NumpyMask(M.make_causal_mask(shape, offset=128))] * 2)
    info, fn = I.process_mask(mask, (32, 64), shrink_grid=False)
    assert fn is None and info.q_sequence is None
    assert info.block_mask.shape == (1, 4, 4)
    # Causal with offset 128: the diagonal crosses kv block 2 (q blocks 0, 1) and 3 (q blocks 2, 3).
    np.testing.assert_array_equal(
        info.block_mask[0], [[2, 2, 1, 0], [2, 2, 1, 0], [2, 2, 2, 1], [2, 2, 2, 1]]
    )
    # Identical partial blocks are stored once: two distinct shapes of diagonal tiles.
    assert info.partial_mask_blocks.shape == (2, 32, 64)
    assert info.partial_mask_blocks.dtype == np.bool_
    for a in (info.data_next, info.block_mask, info.mask_next):
        assert a.dtype == np.int8

    dkv, _ = I.process_mask_dkv(mask, (32, 64), shrink_grid=False)
    assert dkv.partial_mask_blocks.shape == (2, 64, 32)  # transposed for the dKV kernel
    # dKV's data_next holds q block indices.
    np.testing.assert_array_equal(dkv.data_next[0][dkv.block_mask[0] > 0], np.nonzero(dkv.block_mask[0])[0])


def test_dedup_of_partial_blocks():
    seq, block = 512, 32
    causal = M.MultiHeadMask([M.NumpyMask(M.make_causal_mask((seq, seq)))] * 8)
    info, _ = I.process_mask(causal, (block, block))
    assert info.partial_mask_blocks.shape == (1, block, block)  # 16 diagonal tiles, one stored
    assert info.block_mask.shape[0] == 1  # one mask for every head: one schedule row
    np.testing.assert_array_equal(info.mask_next[info.block_mask == 1], 0)
    # Distinct masks share identical tiles across heads, too.
    two = M.MultiHeadMask(
        [M.NumpyMask(M.make_causal_mask((seq, seq))), M.NumpyMask(M.make_causal_mask((seq, seq), 64))]
    )
    info, _ = I.process_mask(two, (block, block))
    assert info.block_mask.shape[0] == 2
    assert info.partial_mask_blocks.shape[0] == 1
    # All partial blocks are distinct.
    rand = M.MultiHeadMask([M.NumpyMask(M.make_random_mask((64, 64), 0.95, 0))])
    info, _ = I.process_mask(rand, (8, 8))
    flat = info.partial_mask_blocks.reshape(info.partial_mask_blocks.shape[0], -1)
    assert len(np.unique(flat, axis=0)) == len(flat)


def test_downcast():
    # 200 kv blocks: data_next needs int16; block_mask always fits int8.
    mask = M.MultiHeadMask([M.CausalMask((1600, 1600))])
    info, _ = I.process_mask(mask, (8, 8), shrink_grid=False)
    assert info.data_next.dtype == np.int16 and info.block_mask.dtype == np.int8
    assert int(info.data_next.max()) == 199
    info, _ = I.process_mask(mask, (8, 8), shrink_grid=False, downcast_smem_data=False)
    assert info.data_next.dtype == np.int32 and info.block_mask.dtype == np.int32
    # > 127 distinct partial blocks: mask_next needs int16.
    rand = M.MultiHeadMask([M.NumpyMask(M.make_random_mask((128, 128), 0.5, 0))])
    info, _ = I.process_mask(rand, (8, 8))
    assert info.partial_mask_blocks.shape[0] == 256 and info.mask_next.dtype == np.int16
    # Dynamic masks downcast from static bounds.
    dyn, _ = I.process_dynamic_mask(jnp.ones((2, 64, 64), bool), (8, 8))
    assert (dyn.data_next.dtype, dyn.mask_next.dtype, dyn.block_mask.dtype) == (jnp.int8, jnp.int8, jnp.int8)
    dyn, _ = I.process_dynamic_mask(jnp.ones((2, 64, 64), bool), (8, 8), downcast_smem_data=False)
    assert dyn.data_next.dtype == jnp.int32


def test_leading_dimension():
    shape = (64, 64)
    a, b = M.CausalMask(shape), M.NumpyMask(M.make_random_mask(shape, 0.5, 1))
    # One mask per head shard -> one schedule row per shard.
    info, _ = I.process_mask(M.MultiHeadMask([a, a, b, b]), (16, 16), head_shards=2)
    assert info.block_mask.shape[0] == 2
    # Mixed masks inside a shard -> one row per head.
    info, _ = I.process_mask(M.MultiHeadMask([a, a, b, b]), (16, 16), head_shards=1)
    assert info.block_mask.shape[0] == 4
    info, _ = I.process_mask(M.MultiHeadMask([a] * 4), (16, 16), head_shards=4)
    assert info.block_mask.shape[0] == 4  # rows = head shards, all identical
    assert len({r.tobytes() for r in info.block_mask}) == 1


def test_computable_masks_skip_mask_blocks():
    mask = M.MultiHeadMask([M.CausalMask((64, 64))] * 2)
    info, fn = I.process_mask(mask, (16, 16))
    assert fn is mask.masks[0].mask_function
    np.testing.assert_array_equal(info.q_sequence, np.arange(64))
    assert info.partial_mask_blocks is None and info.mask_next is None
    # Two different computable masks cannot share one function: blocks are loaded.
    two = M.MultiHeadMask([M.CausalMask((64, 64)), M.LocalMask((64, 64), (4, 4))])
    info, fn = I.process_mask(two, (16, 16))
    assert fn is None and info.partial_mask_blocks is not None
    # No partial block at all: nothing to compute or load.
    info, fn = I.process_mask(M.MultiHeadMask([M.FullMask((64, 64))]), (16, 16))
    assert fn is None and info.partial_mask_blocks is None and info.mask_next is None
    assert (info.block_mask == 2).all()


def test_shrink_grid():
    seq, block = 256, 32
    local = M.MultiHeadMask([M.LocalMask((seq, seq), (40, 0))])
    fwd, _ = I.process_mask(local, (block, block))
    assert fwd.block_mask.shape == (1, seq // block, 3)  # at most 3 kv blocks per q row
    full, _ = I.process_mask(local, (block, block), shrink_grid=False)
    assert full.block_mask.shape == (1, seq // block, seq // block)
    dkv, _ = I.process_mask_dkv(local, (block, block))
    assert dkv.block_mask.shape == (1, 3, seq // block)  # at most 3 q blocks per kv column
    # Sharded along q: each shard is shrunk on its own, then padded to the longest.
    dkv2, _ = I.process_mask_dkv(local, (block, block), q_seq_shards=2)
    assert dkv2.block_mask.shape == (1, 2 * 3, seq // block)
    # An all-empty mask keeps one (empty) step.
    empty = M.MultiHeadMask([M.NumpyMask(np.zeros((64, 64), bool))])
    info, _ = I.process_mask(empty, (16, 16))
    assert info.block_mask.shape == (1, 4, 1) and not info.block_mask.any()


def test_prefetch_targets_next_working_step(rng):
    """Steps without work point at the block of the next working step (wrapping)."""
    dense = rng.random((64, 64)) < 0.3
    dense[:, 16:32] = False  # whole empty kv column of blocks
    dense[40:48] = False  # and an empty q row
    mask = M.MultiHeadMask([M.NumpyMask(dense)])
    for is_dkv, shrink in itertools.product((False, True), (False, True)):
        info, _ = I.process_mask(mask, (8, 8), is_dkv=is_dkv, shrink_grid=shrink)
        bm, dn, mn = (np.asarray(x[0], np.int64) for x in (info.block_mask, info.data_next, info.mask_next))
        if is_dkv:  # kernel order: kv-major
            bm, dn, mn = bm.T, dn.T, mn.T
        bm, dn, mn = bm.ravel(), dn.ravel(), mn.ravel()
        work = np.flatnonzero(bm)
        part = np.flatnonzero(bm == 1)
        for p in range(bm.size):
            nxt = work[work >= p][0] if (work >= p).any() else work[0]
            assert dn[p] == dn[nxt], (is_dkv, shrink, p)
            nxt = part[part >= p][0] if (part >= p).any() else part[0]
            assert mn[p] == mn[nxt], (is_dkv, shrink, p)


def test_matches_splash_block_classification():
    """Extra oracle: JAX's splash attention classifies blocks the same way."""
    splash_info = pytest.importorskip(
        "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info"
    )
    splash_mask = pytest.importorskip(
        "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask"
    )
    shape = (128, 128)
    dense = [M.make_random_mask(shape, 0.8, 5), M.make_local_attention_mask(shape, (20, 5))]
    ours = M.MultiHeadMask([M.NumpyMask(d) for d in dense])
    theirs = splash_mask.MultiHeadMask([splash_mask.NumpyMask(d) for d in dense])
    for is_dkv in (False, True):
        a, _ = I.process_mask(ours, (16, 32), is_dkv=is_dkv, shrink_grid=False)
        b, _ = splash_info._process_mask(theirs, (16, 32), is_dkv, shrink_grid=False)
        np.testing.assert_array_equal(a.block_mask, b.block_mask)
        assert a.partial_mask_blocks.shape == b.partial_mask_blocks.shape
        work = a.block_mask > 0  # on working steps both point at the same data block
        np.testing.assert_array_equal(a.data_next[work], b.data_next[work])


def test_cache():
    mask = M.MultiHeadMask([M.CausalMask((64, 64))] * 2)
    first = I.process_mask(mask, (16, 16))
    assert I.process_mask(M.MultiHeadMask([M.CausalMask((64, 64))] * 2), (16, 16)) is first  # equal mask: hit
    assert I.process_mask(mask, (16, 16), shrink_grid=False) is not first  # other options: miss
    assert I.process_mask(mask, (16, 32)) is not first
    info = first[0]
    for a in (info.data_next, info.block_mask, info.q_sequence):
        with pytest.raises(ValueError):
            a[(0,) * a.ndim] = 1  # cached results are read-only


@pytest.mark.parametrize("is_dkv", [False, True], ids=["fwd", "dkv"])
def test_rebuild_dynamic(is_dkv, rng):
    dense = rng.random((HEADS, SEQ, SEQ)) < 0.6
    dense[:, :16, 32:] = False  # empty blocks
    dense[:, 40:56, :16] = True  # full blocks
    process = jax.jit(
        lambda m, block, hs, qs: I.process_dynamic_mask(
            m, block, is_dkv=is_dkv, head_shards=hs, q_seq_shards=qs
        )[0],
        static_argnums=(1, 2, 3),
    )
    # Each case compiles once; a few cover the sharding / block-shape corners.
    for block, (hs, qs) in [((8, 8), (1, 1)), ((16, 32), (2, 2)), ((32, 16), (4, 2))]:
        info = process(jnp.asarray(dense), block, hs, qs)  # traceable under jit
        assert info.is_dynamic_mask and info.q_sequence is None
        nq, nkv = SEQ // block[0], SEQ // block[1]
        tile = block[::-1] if is_dkv else block
        assert info.partial_mask_blocks.shape == (HEADS, nq, nkv, *tile)
        assert info.block_mask.shape == (HEADS, nq, nkv)
        np.testing.assert_array_equal(
            rebuild(info, None, dense.shape, block, is_dkv=is_dkv, head_shards=hs, q_seq_shards=qs),
            dense,
            err_msg=str((block, hs, qs)),
        )
        static, _ = I.process_mask(dense, block, is_dkv=is_dkv, shrink_grid=False)
        np.testing.assert_array_equal(np.asarray(info.block_mask), static.block_mask)


def test_invalid_inputs_raise():
    mask = M.MultiHeadMask([M.CausalMask((64, 64))] * 4)
    rank = r"mask must be a MultiHeadMask or a 3-D numpy bool array \[heads, q_len, kv_len\], got "
    with pytest.raises(ValueError, match=rank + r"CausalMask with shape \(64, 64\)"):
        I.process_mask(M.CausalMask((64, 64)), (16, 16))  # 2-D: wrong rank
    with pytest.raises(ValueError, match=rank + r"ndarray with shape \(64, 64\)"):
        I.process_mask(np.ones((64, 64), bool), (16, 16))
    for process in (I.process_mask, I.process_mask_dkv):  # named "array" (NumpyMask's argument)
        with pytest.raises(TypeError, match="^mask must be boolean, got dtype int32"):
            process(np.ones((4, 64, 64), np.int32), (16, 16))
    with pytest.raises(ValueError, match=r"block_shape\[0\]=24 must divide q_len=64"):
        I.process_mask(mask, (24, 16))
    with pytest.raises(ValueError, match=r"block_shape\[1\]=48 must divide kv_len=64"):
        I.process_mask_dkv(mask, (16, 48))
    with pytest.raises(ValueError, match=r"block_shape must be a \(block_q, block_kv\) pair, got \(16,\)"):
        I.process_mask(mask, (16,))
    with pytest.raises(ValueError, match=r"block_shape entries must be positive, got \(0, 16\)"):
        I.process_mask(mask, (0, 16))
    with pytest.raises(ValueError, match="head_shards=3 must divide the number of heads 4"):
        I.process_mask(mask, (16, 16), head_shards=3)
    with pytest.raises(ValueError, match="q_seq_shards=3 must divide the number of q blocks 4"):
        I.process_mask(mask, (16, 16), q_seq_shards=3)
    with pytest.raises(ValueError, match="q_seq_shards=4 must divide the number of q blocks 2"):
        I.process_mask(mask, (32, 16), q_seq_shards=4)  # 2 q blocks cannot split 4 ways
    with pytest.raises(ValueError, match=r"mask must be 3-D \[heads, q_len, kv_len\], got shape \(64, 64\)"):
        I.process_dynamic_mask(jnp.ones((64, 64), bool), (16, 16))
    with pytest.raises(TypeError, match="mask must be boolean, got dtype int32"):  # a dtype: was a ValueError
        I.process_dynamic_mask(jnp.ones((2, 64, 64), jnp.int32), (16, 16))
    with pytest.raises(TypeError, match="use process_mask"):  # was an AttributeError on .dtype
        I.process_dynamic_mask(M.MultiHeadMask([M.CausalMask((64, 64))]), (16, 16))
    with pytest.raises(TypeError, match="got list"):  # said "got shape ()"
        I.process_dynamic_mask([[[True]]], (16, 16))
    with pytest.raises(ValueError, match=r"block_shape\[0\]"):
        I.process_dynamic_mask_dkv(jnp.ones((2, 64, 64), bool), (24, 16))
    with pytest.raises(ValueError, match="head_shards"):
        I.process_dynamic_mask(jnp.ones((2, 64, 64), bool), (16, 16), head_shards=4)


@pytest.mark.parametrize("bad", [2.0, 2.5, "2", True])
def test_integer_arguments_are_not_truncated(bad):
    """Shard counts and block shapes are ints: no int() truncation, no unrelated errors."""
    static = M.MultiHeadMask([M.CausalMask((64, 64))] * 4)
    dynamic = jnp.ones((4, 64, 64), bool)
    for name, kwargs in [
        ("head_shards", dict(block_shape=(16, 16), head_shards=bad)),
        ("q_seq_shards", dict(block_shape=(16, 16), q_seq_shards=bad)),
        (r"block_shape\[0\]", dict(block_shape=(bad, 16))),
        (r"block_shape\[1\]", dict(block_shape=(16, bad))),
    ]:
        for process in (I.process_mask, I.process_mask_dkv):
            with pytest.raises(TypeError, match=f"{name} must be an int"):
                process(static, **kwargs)
        for process in (I.process_dynamic_mask, I.process_dynamic_mask_dkv):
            with pytest.raises(TypeError, match=f"{name} must be an int"):
                process(dynamic, **kwargs)
