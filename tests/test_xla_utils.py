"""xla_utils in both fronts: seed examples, loop references, torch-vs-jax parity, jit, bad input."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.frameworks import x64

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def xu(fw):
    if fw.name == "torch":
        from ejkernel_torch import xla_utils
    else:
        from ejkernel_jax import xla_utils
    return xla_utils


def ints(fw, values, dtype="int32"):
    return fw.asarray(np.asarray(values, dtype=dtype))


def np_of(fw, x):
    return fw.to_numpy(x)


# -- loop references (one Python loop per token/chunk: obviously right, slow) -------------------


def ref_tokens(cu, total):
    seq, pos = [-1] * total, [-1] * total
    for s in range(len(cu) - 1):
        for p, t in enumerate(range(cu[s], cu[s + 1])):
            seq[t], pos[t] = s, p
    return seq, pos


def ref_chunks(cu, chunk_size, total=None):
    rows = [(s, c) for s in range(len(cu) - 1) for c in range(-(-(cu[s + 1] - cu[s]) // chunk_size))]
    offsets = [0]
    for s in range(len(cu) - 1):
        offsets.append(offsets[-1] + -(-(cu[s + 1] - cu[s]) // chunk_size))
    total = len(rows) if total is None else total
    return rows + [(-1, -1)] * (total - len(rows)), offsets


def ref_mask_to_segment_ids(m):
    """First-appearance labels of distinct non-empty rows; a key takes the largest label seeing it."""
    Q, K = m.shape
    seen, q_ids = {}, []
    for i in range(Q):
        row = tuple(m[i])
        if not any(row):
            q_ids.append(-1)
            continue
        q_ids.append(seen.setdefault(row, len(seen) + 1))
    kv_ids = [max([q_ids[i] for i in range(Q) if m[i, j]], default=-1) for j in range(K)]
    return q_ids, kv_ids


def ref_segment_mask(q, kv):
    return np.array([[a == b and a > 0 and b > 0 for b in kv] for a in q], dtype=bool)


# Shapes come from a few buckets and sizes are static budgets: jax compiles once per shape, so
# free-ranging shapes would spend the test's time compiling rather than checking.
BUDGET = 64
lengths = st.sampled_from([0, 3, 6]).flatmap(lambda n: st.lists(st.integers(0, 9), min_size=n, max_size=n))
mask_shapes = st.sampled_from([(1, 1, 3), (1, 4, 4), (2, 5, 6)])


def cumsum0(lens):
    return [0, *np.cumsum(lens, dtype=np.int64).tolist()]


# -- seed examples ---------------------------------------------------------------------------------


def test_seed_examples(fw):
    x = xu(fw)
    assert np_of(fw, x.prepare_lens(ints(fw, [0, 5, 12, 18]))).tolist() == [5, 7, 6]
    cu = ints(fw, [0, 3, 5, 9])
    assert np_of(fw, x.prepare_position_ids(cu)).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert np_of(fw, x.prepare_sequence_ids(cu)).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert np_of(fw, x.prepare_token_indices(cu)).tolist() == [
        [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [2, 2], [2, 3]]
    mask = fw.asarray(np.array([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=bool))
    cu_from_mask = x.prepare_cu_seqlens_from_mask(mask)
    assert np_of(fw, cu_from_mask).tolist() == [0, 3, 5]
    assert np_of(fw, cu_from_mask).dtype == np.int32
    assert np_of(fw, x.prepare_lens_from_mask(mask)).tolist() == [3, 2]
    assert np_of(fw, x.prepare_chunk_offsets(ints(fw, [0, 100, 164]), 64)).tolist() == [0, 2, 3]
    assert np_of(fw, x.prepare_chunk_indices(ints(fw, [0, 100, 164]), 64)).tolist() == [[0, 0], [0, 1], [1, 0]]
    assert x.cdiv(10, 4) == 3 and x.cdiv(8, 4) == 2 and x.cdiv(0, 4) == 0


def test_plain_lists_and_empty_sequences(fw):
    x = xu(fw)
    assert np_of(fw, x.prepare_lens([0, 5, 12, 18])).tolist() == [5, 7, 6]
    cu = x.prepare_cu_seqlens_from_mask([[1, 1, 1, 0], [1, 1, 0, 0]], out_dtype="int32")
    assert np_of(fw, cu).tolist() == [0, 3, 5]
    cu = ints(fw, [0, 2, 2, 3])  # the middle sequence is empty: no token belongs to it
    assert np_of(fw, x.prepare_sequence_ids(cu)).tolist() == [0, 0, 2]
    assert np_of(fw, x.prepare_position_ids(ints(fw, [0]))).tolist() == []


# -- properties vs loops -------------------------------------------------------------------------------


@FAST
@given(lens=lengths, dtype=st.sampled_from(["int32", "int64"]))
def test_token_helpers_match_loops(fw, lens, dtype):
    x = xu(fw)
    cu_list = cumsum0(lens)
    cu = ints(fw, cu_list, dtype)
    seq, pos = ref_tokens(cu_list, BUDGET)  # slots past cu_seqlens[-1] are padding (-1)
    assert np_of(fw, x.prepare_lens(cu)).tolist() == list(lens)
    assert np_of(fw, x.prepare_sequence_ids(cu, total_tokens=BUDGET)).tolist() == seq
    assert np_of(fw, x.prepare_position_ids(cu, total_tokens=BUDGET)).tolist() == pos
    got = np_of(fw, x.prepare_token_indices(cu, total_tokens=BUDGET))
    assert got.tolist() == [list(r) for r in zip(seq, pos)]


@FAST
@given(lens=lengths, chunk_size=st.integers(1, 5))
def test_chunk_helpers_match_loops(fw, lens, chunk_size):
    x = xu(fw)
    cu_list = cumsum0(lens)
    cu = ints(fw, cu_list)
    rows, offsets = ref_chunks(cu_list, chunk_size, total=BUDGET)
    assert np_of(fw, x.prepare_chunk_offsets(cu, chunk_size)).tolist() == offsets
    got = np_of(fw, x.prepare_chunk_indices(cu, chunk_size, total_chunks=BUDGET))
    assert [tuple(r) for r in got.tolist()] == rows


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_chunk_size_past_the_lengths_dtype(fw, dtype):
    """A chunk_size beyond cu_seqlens' dtype is one chunk a sequence: torch cast it into int32 and
    wrapped (2**31 gave no chunks, 2**32 + 2 chunks of 2, 2**40 a division by zero); jax's jit
    raised OverflowError."""
    x = xu(fw)
    with x64(fw):
        cu = ints(fw, [0, 5, 7], dtype)
        assert str(cu.dtype).endswith(dtype)
        for chunk_size in (5, 2**31 - 1, 2**31, 2**32 + 2, 2**40):
            assert np_of(fw, x.prepare_chunk_offsets(cu, chunk_size)).tolist() == [0, 1, 2], chunk_size
            assert np_of(fw, x.prepare_chunk_indices(cu, chunk_size)).tolist() == [[0, 0], [1, 0]], chunk_size


@FAST
@given(shape=mask_shapes, data=st.data())
def test_mask_to_segment_ids_matches_loop(fw, shape, data):
    b, q, k = shape
    m = np.array(data.draw(st.lists(st.booleans(), min_size=b * q * k, max_size=b * q * k))).reshape(shape)
    q_ids, kv_ids = xu(fw).mask_to_segment_ids(fw.asarray(m))
    for i in range(b):
        ref_q, ref_kv = ref_mask_to_segment_ids(m[i])
        assert np_of(fw, q_ids)[i].tolist() == ref_q
        assert np_of(fw, kv_ids)[i].tolist() == ref_kv
    assert np_of(fw, q_ids).dtype == np.int32 and np_of(fw, kv_ids).dtype == np.int32


@FAST
@given(shape=mask_shapes, data=st.data())
def test_segment_mask_round_trip(fw, shape, data):
    """mask_to_segment_ids inverts segment_ids_to_mask (self- and cross-attention, with padding)."""
    b, q, k = shape
    ids = st.integers(-1, 3)
    q_ids = np.array(data.draw(st.lists(ids, min_size=b * q, max_size=b * q))).reshape(b, q)
    kv_ids = np.array(data.draw(st.lists(ids, min_size=b * k, max_size=b * k))).reshape(b, k)
    x = xu(fw)
    q_valid, kv_valid, mask = x.segment_ids_to_mask((ints(fw, q_ids), ints(fw, kv_ids)), return_separate_masks=True)
    mask = np_of(fw, mask)
    for i in range(b):
        assert mask[i].tolist() == ref_segment_mask(q_ids[i], kv_ids[i]).tolist()
    assert np_of(fw, q_valid).tolist() == (q_ids > 0).tolist()
    assert np_of(fw, kv_valid).tolist() == (kv_ids > 0).tolist()
    new_q, new_kv = x.mask_to_segment_ids(fw.asarray(mask))
    assert np_of(fw, x.segment_ids_to_mask((new_q, new_kv))).tolist() == mask.tolist()


def test_mask_to_segment_ids_shapes_and_heads(fw):
    x = xu(fw)
    per_head_ids = np.array([[[1, 1, 2, 2], [1, 2, 2, 0]], [[3, 3, 3, 0], [1, 1, 1, 1]]])  # [B, H, L]
    m = np.stack([[ref_segment_mask(h, h) for h in b] for b in per_head_ids])  # [B, H, L, L]
    q_ids, kv_ids = x.mask_to_segment_ids(fw.asarray(m), per_head=True)
    assert np_of(fw, q_ids).shape == (2, 2, 4) and np_of(fw, kv_ids).shape == (2, 2, 4)
    assert np_of(fw, q_ids).tolist() == [[[1, 1, 2, 2], [1, 2, 2, -1]], [[1, 1, 1, -1], [1, 1, 1, 1]]]
    # merged over heads: a key is visible when any head sees it
    q_ids, kv_ids = x.mask_to_segment_ids(fw.asarray(m))
    ref = [ref_mask_to_segment_ids(m[i].any(0)) for i in range(2)]
    assert np_of(fw, q_ids).tolist() == [r[0] for r in ref]
    assert np_of(fw, kv_ids).tolist() == [r[1] for r in ref]
    q2, kv2 = x.mask_to_segment_ids(fw.asarray(m[0, 0]))  # 2-D
    assert np_of(fw, q2).tolist() == [1, 1, 2, 2] and np_of(fw, kv2).tolist() == [1, 1, 2, 2]
    q0, kv0 = x.mask_to_segment_ids(fw.asarray(np.zeros((2, 0, 3), bool)))  # no queries
    assert np_of(fw, q0).shape == (2, 0) and np_of(fw, kv0).tolist() == [[-1] * 3] * 2


def test_segment_ids_to_mask_dtype_and_self_attention(fw):
    x = xu(fw)
    ids = ints(fw, [[1, 1, 2, 0], [1, 2, 0, -1]])
    mask = x.segment_ids_to_mask(ids, dtype=fw.dtype("float32"))
    assert str(mask.dtype).endswith("float32")
    expected = [ref_segment_mask(r, r) for r in [[1, 1, 2, 0], [1, 2, 0, -1]]]
    assert np_of(fw, mask).tolist() == np.array(expected, dtype=float).tolist()
    with pytest.raises(TypeError, match="dtype must be a dtype, got None"):  # jax's astype(None) made floats
        x.segment_ids_to_mask(ids, dtype=None)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_segment_ids_to_mask_unsigned_ids(fw, dtype):
    """torch has no > for uint16/32/64 (NotImplementedError "gt_cpu" not implemented for 'UInt32',
    naming no argument) nor == with another dtype; jax takes them: the mask of the same values,
    signed or not, with 0 as padding."""
    x = xu(fw)
    rows = [[1, 1, 2, 0], [3, 0, 3, 2]]
    want = np.array([ref_segment_mask(r, r) for r in rows])
    ids = ints(fw, rows, dtype)
    assert np_of(fw, x.segment_ids_to_mask(ids)).tolist() == want.tolist()
    assert np_of(fw, x.segment_ids_to_mask((ids, ints(fw, rows)))).tolist() == want.tolist()
    q_valid, _, mask = x.segment_ids_to_mask((ids, ids), dtype=fw.dtype("int32"), return_separate_masks=True)
    assert np_of(fw, q_valid).tolist() == [[1, 1, 1, 0], [1, 0, 1, 1]]
    assert np_of(fw, mask).tolist() == want.astype(int).tolist()
    if dtype == "uint64":
        with x64(fw):  # past 2**63: still positive ids, told apart
            big = np.array([2**63 + 1, 2**63 + 1, 2**64 - 1, 0], np.uint64)
            expected = [[True, True, False, False], [True, True, False, False], [False, False, True, False],
                        [False] * 4]
            assert np_of(fw, x.segment_ids_to_mask(big)).tolist() == expected


def test_flags_must_be_bools(fw):
    # read by truthiness: return_separate_masks="no" returned the three masks, per_head="no"
    # asked for per-head ids (and then refused a 3-D mask)
    x = xu(fw)
    ids = ints(fw, [[1, 1, 2, 0]])
    with pytest.raises(TypeError, match="return_separate_masks must be a bool, got 'no'"):
        x.segment_ids_to_mask(ids, return_separate_masks="no")
    with pytest.raises(TypeError, match="per_head must be a bool, got 'no'"):
        x.mask_to_segment_ids(fw.asarray(np.ones((1, 4, 4), bool)), per_head="no")
    assert len(x.segment_ids_to_mask(ids, return_separate_masks=np.True_)) == 3


def test_identity_dtype_convert(fw):
    x = xu(fw)
    identity = x.identity_dtype_convert(fw.dtype("bfloat16"))
    primal = fw.asarray(np.linspace(-2, 2, 7), "float32")
    assert np_of(fw, identity(primal)).tolist() == np_of(fw, primal).tolist()
    cot = np.array([1.00390625, 1 + 2**-10, 3.14159, -2.71828, 0.1, 1e-3, 7.0], dtype=np.float32)
    (grad,) = fw.vjp(identity, [primal], fw.asarray(cot, "float32"))
    rounded = fw.to_numpy(fw.asarray(cot, "bfloat16"))
    assert grad.tolist() == rounded.tolist() and not np.array_equal(rounded, cot)


def grad_dtype(fw, fn, x) -> str:
    """The dtype of d sum(fn(x)) / dx as the framework returns it (fw.vjp hands back float64)."""
    if fw.name == "torch":
        x = x.detach().requires_grad_(True)
        fn(x).sum().backward()
        return str(x.grad.dtype)
    import jax

    return str(jax.grad(lambda x: fn(x).sum())(x).dtype)


def test_identity_dtype_convert_gradient_keeps_input_dtype(fw):
    """The rounded gradient comes back in the input's dtype, so it adds to other paths' gradients
    of the same input (jax returned it as bfloat16, and x * identity(x) failed to differentiate)."""
    identity = xu(fw).identity_dtype_convert("bfloat16")
    primal = np.linspace(-2, 2, 7).astype(np.float32)
    cot = np.array([1.00390625, 1 + 2**-10, 3.14159, -2.71828, 0.1, 1e-3, 7.0], dtype=np.float32)
    x = fw.asarray(primal, "float32")
    assert grad_dtype(fw, identity, x).endswith("float32")
    (grad,) = fw.vjp(lambda x: identity(x) * x, [x], fw.asarray(cot, "float32"))
    direct = cot * primal  # float32, the cotangent reaching identity's output and x directly
    rounded = fw.to_numpy(fw.asarray(direct, "bfloat16")).astype(np.float32)
    assert grad.tolist() == (rounded + direct).tolist()


def test_identity_dtype_convert_is_an_autograd_function():
    import torch

    from ejkernel_torch import xla_utils

    x = torch.ones(3, requires_grad=True)
    y = xla_utils.identity_dtype_convert(torch.float16)(x)
    assert isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)


def test_identity_dtype_convert_under_torch_compile_and_func():
    """The gradient is rounded under torch.compile (inductor dropped the fp32 -> bf16 -> fp32 casts
    of the backward, so the rounding vanished) and under torch.func's grad and vmap (the autograd
    function lacked setup_context, which they require)."""
    import torch

    from ejkernel_torch import xla_utils

    identity = xla_utils.identity_dtype_convert(torch.bfloat16)
    cot = torch.tensor([1 + 2 ** -10, 3.14159, 0.1, -2.71828])
    rounded = cot.to(torch.bfloat16).float()
    assert not torch.equal(rounded, cot)
    for fn in (identity, torch.compile(identity, fullgraph=True)):
        x = torch.ones(4, requires_grad=True)
        fn(x).backward(cot)
        assert torch.equal(x.grad, rounded)
    assert torch.equal(torch.func.grad(lambda x: (identity(x) * cot).sum())(torch.ones(4)), rounded)
    per_row = torch.func.vmap(torch.func.grad(lambda x, c: (identity(x) * c).sum()))(torch.ones(2, 4), cot.repeat(2, 1))
    assert torch.equal(per_row, rounded.repeat(2, 1))


# -- torch vs jax ----------------------------------------------------------------------------------------


def test_parity_torch_vs_jax(torch_fw, jax_fw, rng):
    lens = rng.integers(0, 20, size=7)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    mask = rng.random((3, 9, 11)) < 0.4
    ids = rng.integers(-1, 4, size=(3, 9))

    def run(fw):
        x = xu(fw)
        c = fw.asarray(cu)
        out = [x.prepare_lens(c), x.prepare_position_ids(c), x.prepare_sequence_ids(c),
               x.prepare_token_indices(c, total_tokens=int(cu[-1]) + 3), x.prepare_chunk_offsets(c, 4),
               x.prepare_chunk_indices(c, 4), x.prepare_cu_seqlens_from_mask(fw.asarray(mask[0])),
               x.segment_ids_to_mask(fw.asarray(ids)), *x.mask_to_segment_ids(fw.asarray(mask))]
        return [fw.to_numpy(o) for o in out]

    for t, j in zip(run(torch_fw), run(jax_fw), strict=True):
        assert t.shape == j.shape and np.array_equal(t, j)


# -- jit ------------------------------------------------------------------------------------------------


def test_jit_needs_static_sizes():
    import jax

    from ejkernel_jax import xla_utils as x

    cu = np.array([0, 3, 3, 8], np.int32)
    for fn, arg in [(x.prepare_position_ids, "total_tokens"), (x.prepare_sequence_ids, "total_tokens"),
                    (x.prepare_token_indices, "total_tokens")]:
        with pytest.raises(ValueError, match=arg):
            jax.jit(fn)(cu)
        jitted = jax.jit(fn, static_argnames=arg)(cu, **{arg: 10})
        assert np.array_equal(jitted[:8], fn(cu)) and (np.asarray(jitted[8:]) == -1).all()
    with pytest.raises(ValueError, match="total_chunks"):
        jax.jit(x.prepare_chunk_indices, static_argnums=1)(cu, 2)
    jitted = jax.jit(x.prepare_chunk_indices, static_argnums=(1, 2))(cu, 2, 5)
    assert np.array_equal(jitted, x.prepare_chunk_indices(cu, 2))
    with pytest.raises(TypeError, match="total_tokens"):
        jax.jit(lambda c, n: x.prepare_position_ids(c, total_tokens=n))(cu, 8)


def test_jit_fixed_size_functions():
    import jax

    from ejkernel_jax import xla_utils as x

    mask = np.array([[[1, 1, 0], [1, 1, 0], [0, 0, 1]]], bool)
    for fn, arg in [(x.mask_to_segment_ids, mask), (x.prepare_cu_seqlens_from_mask, mask[0]),
                    (x.segment_ids_to_mask, np.array([[1, 1, 2]])), (x.prepare_lens, np.array([0, 2, 5])),
                    (lambda c: x.prepare_chunk_offsets(c, 2), np.array([0, 2, 5]))]:
        for eager, jitted in zip(jax.tree.leaves(fn(arg)), jax.tree.leaves(jax.jit(fn)(arg)), strict=True):
            assert np.array_equal(eager, jitted)


def test_vmap_over_cu_seqlens(fw):
    """torch.func.vmap failed in every cu_seqlens helper: the value checks read batched values
    (.item()), which jax.vmap skips for tracers. Mapped results equal per-sample calls; the output
    length must be given, as under jit; eager calls still check the values."""
    x = xu(fw)
    cus = np.array([[0, 3, 3, 8], [0, 1, 5, 6]], np.int32)
    calls = [x.prepare_lens, lambda c: x.prepare_chunk_offsets(c, 2),
             lambda c: x.prepare_position_ids(c, total_tokens=9), lambda c: x.prepare_sequence_ids(c, total_tokens=9),
             lambda c: x.prepare_token_indices(c, total_tokens=9),
             lambda c: x.prepare_chunk_indices(c, 2, total_chunks=6)]
    for call in calls:
        mapped = np_of(fw, fw.vmap(call, (0,))(ints(fw, cus)))
        assert mapped.shape[0] == len(cus)
        for row, cu in zip(mapped, cus, strict=True):
            np.testing.assert_array_equal(row, np_of(fw, call(ints(fw, cu))))
    with pytest.raises(ValueError, match="total_tokens"):
        fw.vmap(x.prepare_position_ids, (0,))(ints(fw, cus))
    with pytest.raises(ValueError, match="total_chunks"):
        fw.vmap(lambda c: x.prepare_chunk_indices(c, 2), (0,))(ints(fw, cus))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        x.prepare_lens(ints(fw, [1, 3]))
    with pytest.raises(ValueError, match="total_tokens=7 is smaller than the 8 cu_seqlens needs"):
        x.prepare_position_ids(ints(fw, cus[0]), total_tokens=7)



def test_torch_vmap_gives_searchsorted_contiguous_inputs():
    """Under torch.func.vmap, torch.searchsorted warned (and copied) in every helper that lays out
    tokens or chunks: the unmapped slots were expanded over the batch (stride 0), and a mapped
    cu_seqlens can be an expanded view. No warning now, and the results are the per-sample ones."""
    import torch

    from ejkernel_torch import xla_utils as x

    cus = torch.tensor([[0, 3, 3, 8], [0, 1, 5, 6]], dtype=torch.int32)
    calls = [lambda c: x.prepare_position_ids(c, total_tokens=9), lambda c: x.prepare_sequence_ids(c, total_tokens=9),
             lambda c: x.prepare_token_indices(c, total_tokens=9),
             lambda c: x.prepare_chunk_indices(c, 2, total_chunks=6)]
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # else torch warns once per process, maybe in an earlier test
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for call in calls:
                per_sample = torch.stack([call(cu) for cu in cus])
                assert torch.equal(torch.func.vmap(call)(cus), per_sample)
                assert torch.equal(torch.func.vmap(call, in_dims=1)(cus.T.contiguous()), per_sample)
                assert torch.equal(torch.func.vmap(call)(cus[:1].expand(3, 4)), per_sample[[0, 0, 0]])
    finally:
        torch.set_warn_always(warn_always)
    assert [str(w.message) for w in caught if "searchsorted" in str(w.message)] == []

# -- bad input ------------------------------------------------------------------------------------------------


def test_bad_input(fw):
    x = xu(fw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        x.prepare_lens(ints(fw, [[0, 1], [2, 3]]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        x.prepare_position_ids(fw.asarray(np.array([0.0, 2.0])))
    with pytest.raises(ValueError, match="non-decreasing"):
        x.prepare_sequence_ids(ints(fw, [0, 4, 2]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        x.prepare_lens(ints(fw, np.zeros(0, np.int32)))
    with pytest.raises(ValueError, match="cu_seqlens must hold at least one boundary"):  # not "float dtype"
        x.prepare_lens([])
    with pytest.raises(ValueError, match="total_tokens"):
        x.prepare_position_ids(ints(fw, [0, 4, 6]), total_tokens=5)
    with pytest.raises(ValueError, match="total_chunks"):
        x.prepare_chunk_indices(ints(fw, [0, 4, 6]), 2, total_chunks=2)
    with pytest.raises(ValueError, match="chunk_size"):
        x.prepare_chunk_offsets(ints(fw, [0, 4]), 0)
    with pytest.raises(ValueError, match="mask"):
        x.prepare_lens_from_mask(fw.asarray(np.ones((2, 2, 2), bool)))
    with pytest.raises(TypeError, match="mask"):
        x.prepare_cu_seqlens_from_mask(fw.asarray(np.ones((2, 2), np.float32)))
    with pytest.raises(TypeError, match="out_dtype"):
        x.prepare_cu_seqlens_from_mask(fw.asarray(np.ones((2, 2), bool)), out_dtype="float32")
    with pytest.raises(TypeError, match="segment_ids"):
        x.segment_ids_to_mask(fw.asarray(np.ones((1, 3), np.float32)))
    with pytest.raises(ValueError, match="batch dims"):
        x.segment_ids_to_mask((ints(fw, [[1, 2]]), ints(fw, [[1], [2]])))
    with pytest.raises(ValueError, match="mask"):
        x.mask_to_segment_ids(fw.asarray(np.ones(3, bool)))
    with pytest.raises(ValueError, match="per_head"):
        x.mask_to_segment_ids(fw.asarray(np.ones((1, 3, 3), bool)), per_head=True)


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint32"])
def test_cu_seqlens_must_be_int32_or_int64(fw, dtype):
    """Narrow or unsigned offsets wrap around (uint lengths of [0, 4, 2] were [4, 2**32 - 2]);
    torch could not index with them at all."""
    x = xu(fw)
    cu = ints(fw, [0, 4, 6], dtype)
    for call in (lambda: x.prepare_lens(cu), lambda: x.prepare_position_ids(cu, total_tokens=8),
                 lambda: x.prepare_token_indices(cu), lambda: x.prepare_chunk_indices(cu, 2)):
        with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
            call()


def test_cu_seqlens_must_start_at_0(fw):
    x = xu(fw)
    for values in ([-3, 2], [-5, -3], [1, 4, 6]):
        cu = ints(fw, values)
        for call in (lambda: x.prepare_lens(cu), lambda: x.prepare_position_ids(cu),
                     lambda: x.prepare_sequence_ids(cu, total_tokens=8), lambda: x.prepare_chunk_offsets(cu, 2)):
            with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
                call()


def test_cu_seqlens_from_mask_out_dtype(fw):
    """A narrow out_dtype overflowed into a decreasing cu_seqlens ([0, -56, -112] for int8)."""
    x = xu(fw)
    mask = fw.asarray(np.ones((3, 200), bool))
    for dtype in ("int8", "int16", "uint8", "bool"):
        with pytest.raises(TypeError, match="out_dtype must be int32 or int64"):
            x.prepare_cu_seqlens_from_mask(mask, out_dtype=dtype)
    for dtype in ("int32", "int64"):
        assert np_of(fw, x.prepare_cu_seqlens_from_mask(mask, out_dtype=dtype)).tolist() == [0, 200, 400, 600]


def test_int64_values_beyond_int32(fw):
    """jax without x64 narrows int64 to int32: values that do not fit are refused, not wrapped
    (lengths of [0, 2**32 + 3] were [3]; ids 1 and 2**32 + 1 were one segment). With 64-bit
    arrays both fronts give the exact answer; masks are compared with 0 before any narrowing."""
    x = xu(fw)
    cu = np.array([0, 2**32 + 3], np.int64)
    ids = np.array([1, 2**32 + 1], np.int64)
    with x64(fw):
        assert np_of(fw, x.prepare_lens(cu)).tolist() == [2**32 + 3]
        assert np_of(fw, x.segment_ids_to_mask(ids)).tolist() == [[True, False], [False, True]]
    if fw.name == "jax":
        with pytest.raises(ValueError, match="cu_seqlens"):
            x.prepare_lens(cu)
        with pytest.raises(ValueError, match="segment_ids"):
            x.segment_ids_to_mask(ids)
        with pytest.raises(ValueError, match="q_segment_ids"):
            x.segment_ids_to_mask((ids, ids))
    assert np_of(fw, x.prepare_lens(np.array([0, 2**31 - 1], np.int64))).tolist() == [2**31 - 1]
    assert np_of(fw, x.prepare_lens_from_mask(np.array([[2**32, 1, 0]], np.int64))).tolist() == [2]


def test_output_lengths_past_int32_raise(fw):
    """total_tokens=2**40 ran out of memory (jax allocated int32 ids that would wrap); the ids
    are int32-range token indices, as the varlen kernels read them."""
    x = xu(fw)
    cu = ints(fw, [0, 3, 5])
    for fn in (x.prepare_position_ids, x.prepare_sequence_ids, x.prepare_token_indices):
        with pytest.raises(ValueError, match=r"total_tokens must be at most 2147483647 \(int32"):
            fn(cu, total_tokens=2**40)
    with pytest.raises(ValueError, match=r"total_chunks must be at most 2147483647"):
        x.prepare_chunk_indices(cu, 2, total_chunks=2**40)
    with x64(fw):  # a boundary past int32 needs 64-bit cu_seqlens
        with pytest.raises(ValueError, match="the last cu_seqlens boundary .* at most 2147483647"):
            x.prepare_position_ids(ints(fw, [0, 2**40], "int64"))
    assert np_of(fw, x.prepare_position_ids(cu, total_tokens=6)).tolist() == [0, 1, 2, 0, 1, -1]


def test_sizes_must_be_ints_not_bools(fw):
    """True was read as chunk_size=1 / total_tokens=1."""
    x = xu(fw)
    cu = ints(fw, [0, 1])
    for value, error in ((True, "bool"), (np.bool_(True), "bool"), (2.0, "float")):
        with pytest.raises(TypeError, match=f"chunk_size must be an int, got .*{error}"):
            x.prepare_chunk_offsets(cu, value)
        with pytest.raises(TypeError, match=f"total_tokens must be an int, got .*{error}"):
            x.prepare_position_ids(cu, total_tokens=value)
        with pytest.raises(TypeError, match=f"total_chunks must be an int, got .*{error}"):
            x.prepare_chunk_indices(cu, 1, total_chunks=value)


# -- the use they exist for: packing documents --------------------------------------------------------------


def test_packed_documents_attention(fw, rng):
    """Pack three documents into one row; the segment mask from cu_seqlens gives each document
    exactly the attention it gets alone (the layout flash_attention_varlen consumes)."""
    x = xu(fw)
    docs = [rng.standard_normal((n, 4)) for n in (5, 2, 6)]
    packed = np.concatenate(docs)
    cu = ints(fw, np.cumsum([0] + [len(d) for d in docs]))
    segment_ids = x.prepare_sequence_ids(cu) + 1  # segment ids are positive; 0 is padding
    mask = np_of(fw, x.segment_ids_to_mask(segment_ids[None]))[0]
    positions = np_of(fw, x.prepare_position_ids(cu))
    assert positions.tolist() == [*range(5), *range(2), *range(6)]

    def attend(q, allowed):
        s = np.where(allowed, q @ q.T, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ q

    alone = np.concatenate([attend(d, np.ones((len(d), len(d)), bool)) for d in docs])
    np.testing.assert_allclose(attend(packed, mask), alone, rtol=1e-12)


@pytest.mark.parametrize("bad", [None, "nonsense"])
def test_bad_dtypes_are_named(fw, bad):
    # jax took identity_dtype_convert(None) as float64 (torch refused it), named out_dtype=None
    # "float64", and let numpy's "data type 'nonsense' not understood" name no argument.
    x = xu(fw)
    ids, mask = ints(fw, [[1, 1, 2, 0]]), fw.asarray(np.ones((2, 3), bool))
    with pytest.raises(TypeError, match=f"^dtype must be a dtype, got {bad!r}$"):
        x.identity_dtype_convert(bad)
    with pytest.raises(TypeError, match=f"^dtype must be a dtype, got {bad!r}$"):
        x.segment_ids_to_mask(ids, dtype=bad)
    with pytest.raises(TypeError, match=f"^out_dtype must be a dtype, got {bad!r}$"):
        x.prepare_cu_seqlens_from_mask(mask, out_dtype=bad)
