"""Mask library of the Pallas blocksparse attention: values, slicing, algebra, hashing."""

from __future__ import annotations

import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel_jax.pallas.tpu.blocksparse_attention import info as info_lib
from ejkernel_jax.pallas.tpu.blocksparse_attention import masks as M

SHAPES = [(64, 64), (40, 72), (72, 40)]


def dense_cases(shape):
    """(mask object, dense numpy equivalent) pairs."""
    q_len, kv_len = shape
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    rand = M.make_random_mask(shape, 0.6, 3)
    return {
        "full": (M.FullMask(shape), np.ones(shape, bool)),
        "causal": (M.CausalMask(shape), q >= kv),
        "causal_offset": (M.CausalMask(shape, offset=kv_len - q_len), q + kv_len - q_len >= kv),
        "causal_negative_offset": (M.CausalMask(shape, offset=-5), q - 5 >= kv),
        "local": (M.LocalMask(shape, (7, 3), offset=2), (q + 2 - 7 <= kv) & (kv <= q + 2 + 3)),
        "local_left_only": (M.LocalMask(shape, (5, None)), q - 5 <= kv),
        "local_right_only": (M.LocalMask(shape, (None, 0)), kv <= q),
        "local_unbounded": (M.LocalMask(shape, (None, None)), np.ones(shape, bool)),
        "chunked": (M.ChunkedCausalMask(shape, 12), (q // 12 == kv // 12) & (q >= kv)),
        "chunked_offset": (
            M.ChunkedCausalMask(shape, 16, offset=9),
            ((q + 9) // 16 == kv // 16) & (q + 9 >= kv),
        ),
        "numpy": (M.NumpyMask(rand), rand),
        "and": (M.CausalMask(shape) & M.LocalMask(shape, (6, None)), (q >= kv) & (q - 6 <= kv)),
        "or": (M.CausalMask(shape, offset=-20) | M.NumpyMask(rand), (q - 20 >= kv) | rand),
        "nested": (
            (M.ChunkedCausalMask(shape, 8) | M.LocalMask(shape, (2, 2))) & M.FullMask(shape),
            ((q // 8 == kv // 8) & (q >= kv)) | ((q - 2 <= kv) & (kv <= q + 2)),
        ),
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_masks_match_dense(shape, rng):
    for name, (mask, dense) in dense_cases(shape).items():
        assert mask.shape == shape, name
        full = mask[:, :]
        assert full.dtype == np.bool_ and full.shape == shape, name
        np.testing.assert_array_equal(full, dense, err_msg=name)
        # Random windows, including empty and negative-index ones.
        for _ in range(10):
            q0, q1 = sorted(rng.integers(0, shape[0] + 1, 2))
            k0, k1 = sorted(rng.integers(0, shape[1] + 1, 2))
            np.testing.assert_array_equal(mask[q0:q1, k0:k1], dense[q0:q1, k0:k1], err_msg=name)
        np.testing.assert_array_equal(mask[-3:, :-2], dense[-3:, :-2], err_msg=name)
        np.testing.assert_array_equal(mask[5], dense[5], err_msg=name)
        np.testing.assert_array_equal(mask[:, 7], dense[:, 7], err_msg=name)
        assert mask[2, 3] == dense[2, 3], name
        np.testing.assert_array_equal(mask[...], dense, err_msg=name)


def test_dense_helpers():
    shape = (33, 50)
    q, kv = np.arange(33)[:, None], np.arange(50)[None, :]
    np.testing.assert_array_equal(M.make_causal_mask(shape, offset=3), q + 3 >= kv)
    np.testing.assert_array_equal(
        M.make_local_attention_mask(shape, (4, 1), offset=-2), (q - 2 - 4 <= kv) & (kv <= q - 2 + 1)
    )
    np.testing.assert_array_equal(M.make_chunk_attention_mask(shape, 5), (q // 5 == kv // 5) & (q >= kv))
    a, b = M.make_random_mask((200, 300), 0.25, 7), M.make_random_mask((200, 300), 0.25, 7)
    np.testing.assert_array_equal(a, b)  # deterministic per seed
    assert a.dtype == np.bool_ and abs(a.mean() - 0.75) < 0.02
    assert not np.array_equal(a, M.make_random_mask((200, 300), 0.25, 8))
    assert M.make_random_mask((8, 8), 1.0, 0).sum() == 0


def test_mask_functions_agree_on_jax_arrays():
    """The kernel evaluates mask functions on jax int32 arrays: same answer as numpy."""
    shape = (48, 80)
    q_ids, kv_ids = np.broadcast_arrays(
        np.arange(48, dtype=np.int32)[:, None], np.arange(80, dtype=np.int32)[None, :]
    )
    for name, (mask, dense) in dense_cases(shape).items():
        if mask.mask_function is None:
            continue
        np.testing.assert_array_equal(
            np.asarray(mask.mask_function(jnp.asarray(q_ids), jnp.asarray(kv_ids))), dense, err_msg=name
        )


def test_huge_windows_and_chunks_are_unbounded():
    """A window side or chunk beyond every position is unbounded (as flash attention's
    sliding_window): numpy raised an OverflowError naming no argument, on int32 token ids."""
    shape, huge = (24, 40), 2**40
    q, kv = np.arange(24)[:, None] + 16, np.arange(40)[None, :]  # offset 16: bottom-right
    causal, window = q >= kv, (q - 3 <= kv) & (kv <= q)
    cases = [
        (M.LocalMask(shape, (huge, 0), 16), M.make_local_attention_mask(shape, (huge, 0), offset=16), causal),
        (M.LocalMask(shape, (3, huge), 16), M.make_local_attention_mask(shape, (3, huge), offset=16), q - 3 <= kv),
        (M.ChunkedCausalMask(shape, huge, offset=16), M.make_chunk_attention_mask(shape, huge, offset=16), causal),
        (M.LocalMask(shape, (3, 0), 16) & M.ChunkedCausalMask(shape, huge, offset=16), None, window),
        # Just reaching every key / holding every position is the same mask as beyond it.
        (
            M.LocalMask(shape, (39, 23), 16),
            M.make_local_attention_mask(shape, (39, 23), offset=16),
            np.ones(shape, bool),
        ),
        (M.ChunkedCausalMask(shape, 40, offset=16), M.make_chunk_attention_mask(shape, 40, offset=16), causal),
    ]
    q_ids, kv_ids = np.broadcast_arrays(q - 16, kv)
    for mask, dense, want in cases:
        np.testing.assert_array_equal(mask[:, :], want, err_msg=repr(mask))
        on_jax = mask.mask_function(jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
        np.testing.assert_array_equal(on_jax, want, err_msg=repr(mask))
        if dense is not None:
            np.testing.assert_array_equal(dense, want, err_msg=repr(mask))
    assert M.LocalMask(shape, (huge, 0), 16) == M.LocalMask(shape, (None, 0), 16)
    assert M.LocalMask(shape, (huge, 0), 16).window_size == (huge, 0)  # as given


def _calls_with_offset(shape, offset) -> list:
    """Every mask class and maker that takes an offset, called with ``offset``."""
    return [
        lambda: M.CausalMask(shape, offset),
        lambda: M.LocalMask(shape, (2, 0), offset),
        lambda: M.ChunkedCausalMask(shape, 4, offset=offset),
        lambda: M.make_causal_mask(shape, offset),
        lambda: M.make_local_attention_mask(shape, (2, 0), offset=offset),
        lambda: M.make_chunk_attention_mask(shape, 4, offset=offset),
    ]


@pytest.mark.parametrize("offset", [2**40, 2**31 - 5, -(2**31) - 1, -(2**40)])
def test_offsets_beyond_int32_positions_raise(offset):
    """Query positions i + offset are int32 token ids: an offset past that raised numpy's
    OverflowError naming no argument, or (2**31 - 5) wrapped into a wrong mask."""
    shape = (8, 8)
    for call in _calls_with_offset(shape, offset):
        with pytest.raises(ValueError, match="offset"):
            call()
    # The extremes that keep every position an int32 still work.
    assert M.CausalMask(shape, 2**31 - 8)[:, :].all()
    assert not M.CausalMask(shape, -(2**31))[:, :].any()
    with pytest.raises(ValueError, match="shape"):
        M.CausalMask((8, 2**31))
    with pytest.raises(ValueError, match="window_size"):
        M.LocalMask(shape, (0, 2**31 + 3), -(2**31))  # binding for query 0, yet not an int32


def test_chunk_reaching_the_last_int32_position_is_causal():
    """With the last query at position 2**31 - 1 a chunk holding every position is 2**31 long,
    no int32: ChunkedCausalMask and make_chunk_attention_mask raised numpy's OverflowError
    naming no argument, on a valid mask (CausalMask takes that offset)."""
    shape, offset = (8, 8), 2**31 - 8
    for chunk_size in (2**31, 2**40):
        mask = M.ChunkedCausalMask(shape, chunk_size, offset=offset)
        np.testing.assert_array_equal(mask[:, :], np.ones(shape, bool))
        q_ids, kv_ids = np.broadcast_arrays(np.arange(8, dtype=np.int32)[:, None], np.arange(8, dtype=np.int32))
        on_jax = mask.mask_function(jnp.asarray(q_ids), jnp.asarray(kv_ids))
        np.testing.assert_array_equal(on_jax, np.ones(shape, bool))
        np.testing.assert_array_equal(M.make_chunk_attention_mask(shape, chunk_size, offset=offset),
                                      np.ones(shape, bool))
    # One short of it still splits the last position off into its own chunk.
    want = np.ones(shape, bool)
    want[-1] = False
    np.testing.assert_array_equal(M.ChunkedCausalMask(shape, 2**31 - 1, offset=offset)[:, :], want)
    np.testing.assert_array_equal(M.make_chunk_attention_mask(shape, 2**31 - 1, offset=offset), want)


def test_computable_flags():
    shape = (32, 32)
    cases = dense_cases(shape)
    for name in ("full", "causal", "local", "chunked", "and", "nested"):
        mask = cases[name][0]
        assert mask.mask_function is not None, name
        np.testing.assert_array_equal(mask.q_sequence, np.arange(32))
    for name in ("numpy", "or"):  # anything touching a NumpyMask is loaded, not computed
        assert cases[name][0].mask_function is None and cases[name][0].q_sequence is None, name


def test_hash_and_equality():
    shape = (48, 64)  # q_len != kv_len, so no two cases coincide
    a, b = dense_cases(shape), dense_cases(shape)  # fresh, equal objects
    for name in a:
        assert a[name][0] == b[name][0], name
        assert hash(a[name][0]) == hash(b[name][0]), name
    objs = [m for m, _ in a.values()]
    for i, x in enumerate(objs):
        for j, y in enumerate(objs):
            if i != j:
                assert x != y, (x, y)
    assert len({m for m, _ in a.values()} | {m for m, _ in b.values()}) == len(a)
    assert M.CausalMask(shape, offset=1) != M.CausalMask(shape)
    assert M.CausalMask(shape) != M.CausalMask((48, 65))
    assert M.LocalMask(shape, (3, 1)) != M.LocalMask(shape, (3, 2))
    assert M.ChunkedCausalMask(shape, 8) != M.ChunkedCausalMask(shape, 16)
    # shard_count only validates, it does not change the mask.
    assert M.CausalMask(shape, shard_count=4) == M.CausalMask(shape)
    x = M.make_random_mask(shape, 0.5, 1)
    y = x.copy()
    y[3, 4] = not y[3, 4]
    assert M.NumpyMask(x) == M.NumpyMask(x.copy()) and M.NumpyMask(x) != M.NumpyMask(y)
    assert M.MultiHeadMask([M.CausalMask(shape)] * 2) == M.MultiHeadMask([M.CausalMask(shape)] * 2)
    assert M.MultiHeadMask([M.CausalMask(shape)] * 2) != M.MultiHeadMask([M.CausalMask(shape)] * 3)
    assert {M.MultiHeadMask([M.NumpyMask(x)]): 1}[M.MultiHeadMask([M.NumpyMask(x.copy())])] == 1


def test_numpy_mask_is_a_snapshot():
    arr = np.zeros((8, 8), bool)
    mask = M.NumpyMask(arr)
    h = hash(mask)
    arr[:] = True  # later edits of the caller's array do not leak into the (hashed) mask
    assert not mask[:, :].any() and hash(mask) == h
    with pytest.raises(ValueError):
        mask.array[0, 0] = True


def test_multi_head_mask():
    shape = (24, 40)
    heads = [M.CausalMask(shape), M.NumpyMask(M.make_random_mask(shape, 0.5, 0)), M.LocalMask(shape, (3, 3))]
    mh = M.MultiHeadMask(heads)
    assert mh.shape == (3, 24, 40)
    dense = np.stack([m[:, :] for m in heads])
    np.testing.assert_array_equal(mh[:, :, :], dense)
    np.testing.assert_array_equal(mh[1], dense[1])
    np.testing.assert_array_equal(mh[-1, 3:9, 10:], dense[-1, 3:9, 10:])
    np.testing.assert_array_equal(mh[1:, :5, 2:30], dense[1:, :5, 2:30])
    for empty in ((slice(1, 1),), (slice(5, None), 3), (slice(2, 1), slice(None), 4)):  # no heads, as numpy
        np.testing.assert_array_equal(mh[empty], dense[empty])
        assert mh[empty].shape == dense[empty].shape
    assert mh.mask_function is None


def test_invalid_masks_raise():
    shape = (16, 16)
    with pytest.raises(TypeError, match="array must be boolean, got dtype int32"):  # a dtype: was a ValueError
        M.NumpyMask(np.zeros((4, 4), np.int32))
    with pytest.raises(TypeError, match="both operands must be Masks, got CausalMask and ndarray"):
        M.CausalMask(shape) & np.ones(shape, bool)  # was a ValueError
    with pytest.raises(ValueError, match="array"):
        M.NumpyMask(np.zeros((2, 4, 4), bool))
    for empty in ((0, 4), (4, 0)):  # process_mask failed inside numpy on these
        with pytest.raises(ValueError, match="positive"):
            M.NumpyMask(np.ones(empty, bool))
    with pytest.raises(ValueError, match="shape"):
        M.CausalMask((16,))
    with pytest.raises(ValueError, match="shape"):
        M.FullMask((0, 16))
    with pytest.raises(ValueError, match="window_size"):
        M.LocalMask(shape, (-1, 2))
    with pytest.raises(ValueError, match="window_size"):
        M.LocalMask(shape, 3)
    with pytest.raises(ValueError, match="chunk_size"):
        M.ChunkedCausalMask(shape, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        M.make_chunk_attention_mask(shape, -2)
    with pytest.raises(ValueError, match="shard_count"):
        M.CausalMask((12, 16), shard_count=8)
    with pytest.raises(ValueError, match="shape"):
        M.CausalMask(shape) & M.CausalMask((16, 17))
    with pytest.raises(ValueError, match="shape"):
        M.CausalMask(shape) | M.FullMask((8, 16))
    with pytest.raises(ValueError, match="masks"):
        M.MultiHeadMask([])
    with pytest.raises(ValueError, match="shape"):
        M.MultiHeadMask([M.CausalMask(shape), M.CausalMask((16, 8))])
    with pytest.raises(ValueError, match="nested"):
        M.MultiHeadMask([M.MultiHeadMask([M.CausalMask(shape)])])
    with pytest.raises(TypeError, match="masks must be Mask objects, got ndarray"):  # was a ValueError
        M.MultiHeadMask([np.ones(shape, bool)])
    with pytest.raises(ValueError, match="sparsity"):
        M.make_random_mask(shape, 1.5, 0)
    with pytest.raises(TypeError, match="&"):
        bool(M.CausalMask(shape))
    with pytest.raises(IndexError, match="step"):
        M.CausalMask(shape)[::2, :]
    with pytest.raises(IndexError):
        M.CausalMask(shape)[16, :]
    with pytest.raises(IndexError):
        M.CausalMask(shape)[1, 2, 3]


@pytest.mark.parametrize("bad", [2.5, "4", True, 4.0])
def test_integer_arguments_are_not_truncated(bad):
    """int() would build chunks of 2 from 2.5, parse "4" and take True as 1: TypeError."""
    shape = (8, 8)
    cases = {
        "chunk_size": [lambda: M.ChunkedCausalMask(shape, bad), lambda: M.make_chunk_attention_mask(shape, bad)],
        "window_size": [lambda: M.LocalMask(shape, (bad, 0)), lambda: M.make_local_attention_mask(shape, (1, bad))],
        "offset": _calls_with_offset(shape, bad),
        "shard_count": [lambda: M.FullMask(shape, bad), lambda: M.CausalMask(shape, shard_count=bad)],
        "shape": [lambda: M.CausalMask((8, bad))],
    }
    for name, calls in cases.items():
        for call in calls:
            with pytest.raises(TypeError, match=f"{name}.* must be an int"):
                call()
    with pytest.raises(IndexError):
        M.CausalMask(shape)[2.5, :]  # a float index, not row 2


@pytest.mark.parametrize("index", [True, False, np.True_, (slice(None), True)])
def test_bool_indices_are_refused(index):
    """mask[True] was row 1 (numpy reads it as a new axis); np.True_ was refused already."""
    with pytest.raises(IndexError, match="indexed by ints and slices"):
        M.CausalMask((8, 8))[index]
    with pytest.raises(IndexError, match="indexed by ints and slices"):
        M.MultiHeadMask([M.CausalMask((8, 8))])[index]


@pytest.mark.parametrize("sparsity, seed, error, match", [
    (True, 0, TypeError, "sparsity must be a float, got True"),  # was 1.0: an empty mask
    (np.False_, 0, TypeError, "sparsity must be a float"),
    ("0.5", 0, TypeError, "sparsity must be a float, got '0.5'"),
    (0.5, True, TypeError, "seed must be an int"),  # was seed 1
    (0.5, 1.5, TypeError, "seed must be an int"),
    (0.5, -1, ValueError, "seed must be >= 0"),
])
def test_make_random_mask_arguments_are_checked(sparsity, seed, error, match):
    with pytest.raises(error, match=match):
        M.make_random_mask((4, 4), sparsity, seed)
    assert M.make_random_mask((4, 4), np.float32(0.5), np.int64(2)).shape == (4, 4)
    assert M.make_random_mask((4, 4), 1, 0).sum() == 0


def test_numpy_integers_are_ints():
    mask = M.ChunkedCausalMask((8, 8), np.int64(4), np.int32(2), offset=np.int16(0))
    assert mask == M.ChunkedCausalMask((np.int64(8), 8), 4)
    np.testing.assert_array_equal(M.make_causal_mask((8, 8), np.int64(1)), M.make_causal_mask((8, 8), 1))


def test_computable_masks_never_materialize():
    """Slicing a huge computable mask costs the window only, and processing one into a
    MaskInfo works a row of blocks at a time (peak memory far below the full mask)."""
    huge = M.CausalMask((1 << 22, 1 << 22)) & M.LocalMask((1 << 22, 1 << 22), (1000, 0))
    block = huge[(1 << 21) : (1 << 21) + 64, (1 << 21) - 32 : (1 << 21) + 32]
    assert block.shape == (64, 64) and block[0, 32] and not block[0, 33]

    seq = 8192  # the dense mask would be 64 MiB of bools
    mask = M.MultiHeadMask([M.LocalMask((seq, seq), (700, 0), shard_count=2)])
    tracemalloc.start()
    try:
        info, fn = info_lib.process_mask(mask, (256, 512), shrink_grid=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fn is not None and info.partial_mask_blocks is None
    assert peak < 16 * 2**20, peak
    assert info.block_mask.shape == (1, seq // 256, 3)  # shrunk: at most 3 kv blocks per row
