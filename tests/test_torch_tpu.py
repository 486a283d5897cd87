"""ejkernel_torch.tpu: the Pallas TPU kernels called from torch through the DLPack bridge.

* torch-facing vs jax: the same jax computation under one ``jax.jit``, so outputs *and*
  gradients must be bit-identical to ``ejkernel_jax`` under ``jax.jit`` on the same inputs;
* both vs a float64 torch reference (relative error, bounds per dtype fixed below);
* bad input: TypeError / ValueError naming the argument, before anything is traced or run;
* trace counting (no retrace for new values or equal-but-distinct static objects);
* torch.compile: a documented graph break, right values and gradients.

Off TPU the kernels run in Pallas interpret mode, which compiles slowly, so shapes are tiny and
every expensive configuration is compiled in exactly one test; bigger shapes are ``slow``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ejkernel_jax.pallas.tpu import blocksparse_attention as jb
from ejkernel_jax.pallas.tpu import grouped_matmul as jg
from ejkernel_torch import reference, tpu
from examples.parity.tpu import blocksparse_attention_reference
from tests.frameworks import rel_error

# Relative error vs float64 (outputs and gradients), by input dtype.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}

_ATTN_STATIC = ("mask", "causal", "sliding_window", "chunk_size", "softmax_scale", "logits_soft_cap",
                "block_sizes", "interpret", "return_lse")


# -- helpers ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _jax_on_cpu(request):
    """The torch tensors here live on the CPU, so the bridge runs jax there: the direct jax calls
    they are compared with bit for bit must run there too, also where jax's default is a GPU (the
    gpu test places its arrays itself)."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _same_bits(t: torch.Tensor, a) -> bool:
    a = np.asarray(a)
    if str(a.dtype) != str(t.dtype).removeprefix("torch."):
        return False
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == a.tobytes()


def _f64(x) -> torch.Tensor:
    x = torch.as_tensor(np.asarray(x, dtype=np.float64)) if not isinstance(x, torch.Tensor) else x
    return x.detach().cpu().to(torch.float64)


def _check_ref(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str):
    err = rel_error(_f64(got).numpy(), _f64(want).numpy())  # NaN anywhere -> inf
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def _torch_and_jax(arrays: list[np.ndarray], dtype: torch.dtype, grad: int):
    """The same bits as torch tensors (the first ``grad`` requiring grad) and as jax arrays."""
    ts = [torch.from_numpy(a).to(dtype) if a.dtype.kind == "f" else torch.from_numpy(a) for a in arrays]
    ts = [t.requires_grad_(True) if i < grad else t for i, t in enumerate(ts)]
    js = [jnp.asarray(t.detach().float().numpy()).astype(str(dtype).removeprefix("torch."))
          if t.is_floating_point() else jnp.asarray(t.numpy()) for t in ts]
    return ts, js


def _traces(name: str) -> tuple[int, int]:
    info = tpu.cache_info()[name]
    return info["traces"], info["backward_traces"]


# -- blocksparse attention: bits vs jax, values vs float64, caching ------------------------------------


def test_attention_matches_jax_bitwise_and_float64(rng):
    """GQA, causal Mask object, soft cap, return_lse (two outputs, both with cotangents)."""
    B, S, H, Hkv, D = 1, 32, 2, 1, 16
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D))]
    do, dlse = rng.standard_normal((B, S, H, D)).astype(np.float32), rng.standard_normal((B, H, S)).astype(np.float32)
    opts = dict(mask=tpu.CausalMask((S, S)), logits_soft_cap=4.0, block_sizes=tpu.BlockSizes(16, 16), return_lse=True)
    (q, k, v), (jq, jk, jv) = _torch_and_jax(arrays, torch.float32, grad=3)

    out, lse = tpu.blocksparse_attention(q, k, v, **opts)
    torch.autograd.backward([out, lse], [torch.from_numpy(do), torch.from_numpy(dlse)])

    jitted = jax.jit(jb.blocksparse_attention, static_argnames=_ATTN_STATIC)
    (jout, jlse), pullback = jax.vjp(functools.partial(jitted, **opts), jq, jk, jv)
    jgrads = pullback((jnp.asarray(do), jnp.asarray(dlse)))
    for name, t, a in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), (jout, jlse, *jgrads)):
        assert _same_bits(t, a), f"{name} differs from jax"

    # float64 reference
    rq, rk, rv = (_f64(x).requires_grad_(True) for x in arrays)
    ropts = dict(opts, block_sizes=None)
    rout, rlse = blocksparse_attention_reference(rq, rk, rv, **ropts)
    torch.autograd.backward([rout, rlse], [_f64(do), _f64(dlse)])
    for name, got, want in (("out", out, rout), ("lse", lse, rlse), ("dq", q.grad, rq.grad),
                            ("dk", k.grad, rk.grad), ("dv", v.grad, rv.grad)):
        _check_ref(got, want, torch.float32, name)

    # New values and an equal (not identical) mask object: no retrace, forward or backward.
    before = _traces("blocksparse_attention")
    q2, k2, v2 = (torch.randn_like(x).requires_grad_(True) for x in (q, k, v))
    out2, lse2 = tpu.blocksparse_attention(q2, k2, v2, **dict(opts, mask=tpu.CausalMask((S, S))))
    (out2.sum() + lse2.sum()).backward()
    assert _traces("blocksparse_attention") == before
    assert torch.isfinite(q2.grad).all()


def test_attention_dynamic_mask_segments_gradients(rng):
    """A bool tensor mask (traced) with int64 segment ids (used as int32): forward bits vs jax,
    fwd + bwd vs float64. Rows cut off by the mask and the segments get 0 and zero gradients."""
    B, S, H, D = 2, 16, 2, 8
    arrays = [rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3)]
    keep = rng.random((H, S, S)) < 0.6
    keep[:, 3, :] = False  # a fully masked row
    seg = np.repeat(np.array([[0, 1], [7, -2]]), S // 2, axis=1)  # ids are plain labels, negatives too
    (q, k, v), (jq, jk, jv) = _torch_and_jax(arrays, torch.float32, grad=3)
    mask, seg_t = torch.from_numpy(keep), torch.from_numpy(seg)  # int64
    opts = dict(block_sizes=tpu.BlockSizes(8, 8))

    out = tpu.blocksparse_attention(q, k, v, mask=mask, q_segment_ids=seg_t, kv_segment_ids=seg_t, **opts)
    dynamic = tuple(n for n in _ATTN_STATIC if n != "mask")  # the mask is an array here
    jout = jax.jit(jb.blocksparse_attention, static_argnames=dynamic)(
        jq, jk, jv, mask=jnp.asarray(keep), q_segment_ids=jnp.asarray(seg, jnp.int32),
        kv_segment_ids=jnp.asarray(seg, jnp.int32), **opts)
    assert _same_bits(out.detach(), jout)
    cot = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    out.backward(cot)

    rq, rk, rv = (_f64(x).requires_grad_(True) for x in arrays)
    rout = blocksparse_attention_reference(rq, rk, rv, mask=mask, q_segment_ids=seg_t, kv_segment_ids=seg_t)
    rout.backward(_f64(cot))
    for name, got, want in (("out", out, rout), ("dq", q.grad, rq.grad), ("dk", k.grad, rk.grad),
                            ("dv", v.grad, rv.grad)):
        _check_ref(got, want, torch.float32, name)
    assert torch.all(out[:, 3] == 0) and torch.all(q.grad[:, 3] == 0)
    assert seg_t.grad is None and mask.grad is None


# -- grouped matmul -----------------------------------------------------------------------------------


def test_gmm_matches_jax_bitwise_and_float64(rng):
    """rhs holds groups [1, 3) of 4 through a traced group_offset tensor; an empty group; rows past
    sum(group_sizes) are zeros. Then: new sizes / offset values do not retrace."""
    m, k, n = 40, 24, 16
    sizes = np.array([9, 0, 17, 6], np.int32)  # sum 32 < m
    arrays = [rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((2, k, n)).astype(np.float32), sizes]
    (lhs, rhs, gs), (jl, jr, jgs) = _torch_and_jax(arrays, torch.float32, grad=2)
    offset = torch.tensor(1, dtype=torch.int32)
    opts = dict(tiling=(8, 8, 8))

    out = tpu.grouped_matmul(lhs, rhs, gs, group_offset=offset, **opts)
    cot = rng.standard_normal((m, n)).astype(np.float32)
    out.backward(torch.from_numpy(cot))
    jitted = jax.jit(jg.grouped_matmul, static_argnames=("tiling",))
    jout, pullback = jax.vjp(lambda a, b: jitted(a, b, jgs, group_offset=jnp.int32(1), **opts), jl, jr)
    jd_lhs, jd_rhs = pullback(jnp.asarray(cot))
    for name, t, a in (("out", out, jout), ("d_lhs", lhs.grad, jd_lhs), ("d_rhs", rhs.grad, jd_rhs)):
        assert _same_bits(t, a), f"{name} differs from jax"

    rl, rr = (_f64(x).requires_grad_(True) for x in arrays[:2])
    rout = reference.grouped_matmul(rl, rr, gs, group_offset=1)
    rout.backward(_f64(cot))
    for name, got, want in (("out", out, rout), ("d_lhs", lhs.grad, rl.grad), ("d_rhs", rhs.grad, rr.grad)):
        _check_ref(got, want, torch.float32, name)
    assert torch.all(out[:9] == 0) and torch.all(out[32:] == 0)  # group 0 not held; rows past the sum
    assert gs.grad is None and offset.grad is None

    before = _traces("grouped_matmul")
    lhs2, rhs2 = lhs.detach().clone().requires_grad_(True), rhs.detach().clone().requires_grad_(True)
    out2 = tpu.grouped_matmul(lhs2, rhs2, torch.tensor([3, 5, 5, 20], dtype=torch.int32),
                              group_offset=torch.tensor(2, dtype=torch.int32), **opts)
    out2.sum().backward()
    assert _traces("grouped_matmul") == before
    want = reference.grouped_matmul(_f64(lhs2), _f64(rhs2), torch.tensor([3, 5, 5, 20]), group_offset=2)
    _check_ref(out2, want, torch.float32, "out (second call)")


def test_tgmm_matches_jax_bitwise_and_float64(rng):
    m, k, n = 40, 16, 24
    sizes = np.array([12, 0, 20, 5], np.int32)
    arrays = [rng.standard_normal((k, m)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32), sizes]
    (lhs, rhs, gs), (jl, jr, jgs) = _torch_and_jax(arrays, torch.float32, grad=2)
    opts = dict(tiling=(8, 8, 8))

    out = tpu.transposed_grouped_matmul(lhs, rhs, gs, **opts)
    cot = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.from_numpy(cot))
    jitted = jax.jit(jg.transposed_grouped_matmul, static_argnames=("tiling",))
    jout, pullback = jax.vjp(lambda a, b: jitted(a, b, jgs, **opts), jl, jr)
    for name, t, a in zip(("out", "d_lhs", "d_rhs"), (out, lhs.grad, rhs.grad), (jout, *pullback(jnp.asarray(cot)))):
        assert _same_bits(t, a), f"{name} differs from jax"

    rl, rr = (_f64(x).requires_grad_(True) for x in arrays[:2])
    rout = reference.transposed_grouped_matmul(rl, rr, gs)
    rout.backward(_f64(cot))
    for name, got, want in (("out", out, rout), ("d_lhs", lhs.grad, rl.grad), ("d_rhs", rhs.grad, rr.grad)):
        _check_ref(got, want, torch.float32, name)
    assert torch.all(out[1] == 0)  # the empty group


def test_grouped_matmuls_under_torch_func_vmap_fail_loudly():
    """The bridge cannot run under torch.func transforms and says so, naming the argument. A
    vmap over group_sizes (or a group_offset tensor) failed earlier, in the value checks, with
    torch's "Cannot access data pointer of Tensor that doesn't have storage"."""
    lhs, rhs, rhs_t = torch.randn(9, 8), torch.randn(2, 8, 4), torch.randn(9, 4)
    sizes = torch.tensor([[3, 0, 6], [1, 4, 2]], dtype=torch.int32)
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    wrapped = r"argument '{}': the tensor is a torch.func .*jax.vmap"
    with pytest.raises(TypeError, match=wrapped.format("group_sizes")):
        torch.func.vmap(lambda g: tpu.grouped_matmul(lhs, rhs, g))(sizes)
    with pytest.raises(TypeError, match=wrapped.format("group_sizes")):
        torch.func.vmap(lambda g: tpu.transposed_grouped_matmul(lhs.T, rhs_t, g))(sizes)
    with pytest.raises(TypeError, match=wrapped.format("group_offset")):
        torch.func.vmap(lambda o: tpu.grouped_matmul(lhs, rhs, sizes[1], group_offset=o))(offsets)


def test_blocksparse_attention_under_torch_func_vmap_fails_loudly():
    """A vmap over int64 segment ids failed in their range check with torch's "vmap: It looks like
    you're calling .item() on a Tensor"; the bridge refuses them by name, as it does int32 ones."""
    q = torch.zeros(1, 8, 2, 8)
    wrapped = r"argument 'q_segment_ids': the tensor is a torch.func .*jax.vmap"
    for dtype in (torch.int64, torch.int32):
        ids = torch.zeros(2, 1, 8, dtype=dtype)
        with pytest.raises(TypeError, match=wrapped):
            torch.func.vmap(lambda s: tpu.blocksparse_attention(q, q, q, q_segment_ids=s, kv_segment_ids=s))(ids)


def test_group_offset_tensor_of_any_integer_dtype(monkeypatch):
    """uint16/32/64 offsets were refused as "must be an integer tensor, got torch.uint32" (the jax
    version and the Triton fronts take them). An offset whose value is not read (values_readable()
    False, as during CUDA graph capture) was narrowed to int32 unclamped: int64 2**32 became 0 and
    uint32 2**32 - 1 became -1, selecting groups [0, 2) silently; it is clamped to the last valid
    offset (1), as the jax version clamps a traced one."""
    lhs, rhs = torch.randn(8, 4), torch.randn(2, 4, 4)
    gs = torch.tensor([3, 2, 3], dtype=torch.int32)
    opts = dict(tiling=(8, 8, 8))
    gmm = lambda o: tpu.grouped_matmul(lhs, rhs, gs, group_offset=o, **opts)
    tgmm = lambda o: tpu.transposed_grouped_matmul(lhs.T, lhs, gs, group_offset=o, num_actual_groups=2, **opts)
    for op in (gmm, tgmm):
        want = op(1)
        for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.uint8, torch.int64):
            assert torch.equal(op(torch.tensor(1, dtype=dtype)), want), dtype
        with pytest.raises(ValueError, match=r"group_offset=2 selects groups \[2, 4\)"):
            op(torch.tensor(2, dtype=torch.uint32))
        monkeypatch.setattr(tpu, "values_readable", lambda *tensors: False)
        for big in (torch.tensor(2**32), torch.tensor(2**32 - 1, dtype=torch.uint32)):
            assert torch.equal(op(big), want), big
        monkeypatch.undo()


def test_ids_and_start_group_of_any_integer_dtype():
    """Segment ids and a start_group tensor of uint16/32/64 were refused as "must be an integer
    tensor, got torch.uint32" (the jax versions take every integer dtype); they are taken, and
    ids of a dtype wider than int32 are range-checked as int64 ones are."""
    q = torch.randn(1, 16, 1, 8)
    ids = torch.tensor([[0] * 5 + [1] * 6 + [2] * 5])
    want = tpu.blocksparse_attention(q, q, q, q_segment_ids=ids.int(), kv_segment_ids=ids.int())
    gs = torch.tensor([5, 0, 11], dtype=torch.int32)
    meta = lambda start: tpu.make_group_metadata(group_sizes=gs, m=16, tm=4, start_group=start, num_nonzero_groups=2)
    meta_want = jax.tree_util.tree_leaves(meta(1))
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int64):
        got = tpu.blocksparse_attention(q, q, q, q_segment_ids=ids.to(dtype), kv_segment_ids=ids.to(dtype))
        assert torch.equal(got, want), dtype
        got = jax.tree_util.tree_leaves(meta(torch.tensor(1, dtype=dtype)))
        assert all(torch.equal(a, b) for a, b in zip(got, meta_want, strict=True)), dtype
    past = torch.tensor([[0] * 15 + [2**31]], dtype=torch.uint32)
    with pytest.raises(ValueError, match=r"q_segment_ids holds values in \[0, 2147483648\]"):
        tpu.blocksparse_attention(q, q, q, q_segment_ids=past, kv_segment_ids=ids)


def test_uint64_values_past_2_63_are_not_wrapped(monkeypatch):
    """A uint64 past 2**63 was widened to a negative int64: a group_offset of 2**63 + 1 was
    refused as "group_offset=-9223372036854775807" and, unread, clamped to 0 (groups [0, 2)
    silently); such segment ids were reported as negative and a start_group raised torch's
    RuntimeError "value cannot be converted to type int64_t without overflow". Each is now read
    as itself, and an unread offset is clamped to the last valid one (1), as the jax version does.
    An unread int64 start_group of 2**32 was narrowed to 0 and visited group 0; it selects none."""
    big = torch.tensor(2**63 + 1, dtype=torch.uint64)
    lhs, rhs = torch.randn(8, 4), torch.randn(2, 4, 4)
    gs = torch.tensor([3, 2, 3], dtype=torch.int32)
    gmm = lambda o: tpu.grouped_matmul(lhs, rhs, gs, group_offset=o, tiling=(8, 8, 8))
    with pytest.raises(ValueError, match=r"group_offset=9223372036854775809 selects groups"):
        gmm(big)
    q = torch.zeros(1, 8, 1, 8)
    ids = torch.tensor([[0] * 7 + [2**63 + 1]], dtype=torch.uint64)
    with pytest.raises(ValueError, match=r"q_segment_ids holds values in \[0, 9223372036854775809\]"):
        tpu.blocksparse_attention(q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
    meta = lambda start: tpu.make_group_metadata(group_sizes=gs, m=8, tm=4, start_group=start, num_nonzero_groups=1)
    with pytest.raises(ValueError, match=r"got start_group=9223372036854775809, num_nonzero_groups=1"):
        meta(big)
    want = gmm(1)
    monkeypatch.setattr(tpu, "values_readable", lambda *tensors: False)  # as during CUDA graph capture
    assert torch.equal(gmm(big), want)
    for start in (torch.tensor(2**32), big):
        assert int(meta(start)[1]) == 0, start


def test_unread_64_bit_segment_ids_are_not_wrapped(monkeypatch):
    """int64/uint64 ids whose values are not read (values_readable() False, as during CUDA graph
    capture) were narrowed to int32 unchecked: 0 and 2**32 became one segment, silently. They are
    renumbered jointly on the device instead, as the jax version renumbers traced ones: the same
    bits as the equal pattern of int32 ids."""
    q = torch.randn(1, 16, 1, 8)
    halves = torch.tensor([[0] * 8 + [1] * 8], dtype=torch.int32)
    shifted = 1 - halves
    attend = lambda qs, ks: tpu.blocksparse_attention(q, q, q, q_segment_ids=qs, kv_segment_ids=ks)
    want = attend(halves, halves), attend(halves, shifted)
    assert not torch.equal(want[0], attend(halves * 0, halves * 0))  # the segments matter
    monkeypatch.setattr(tpu, "values_readable", lambda *tensors: False)
    for lo, hi, dtype in ((0, 2**32, torch.int64), (3, 2**63 + 3, torch.uint64), (-5, 2**40 - 5, torch.int64)):
        qs, ks = (torch.tensor([[lo] * 8 + [hi] * 8], dtype=dtype), torch.tensor([[hi] * 8 + [lo] * 8], dtype=dtype))
        assert torch.equal(attend(qs, qs), want[0]), (lo, hi)
        assert torch.equal(attend(qs, ks), want[1]), (lo, hi)
        assert torch.equal(attend(qs, None), want[0]), (lo, hi)  # one given: used for both


def test_make_group_metadata_matches_jax():
    sizes = np.array([5, 0, 11, 0, 7], np.int32)
    # jax side under jit too: eagerly it would compile each of its small ops separately
    jitted = jax.jit(jg.make_group_metadata, static_argnames=("m", "tm", "num_nonzero_groups", "visit_empty_groups"))
    for start, count, visit_empty in ((0, 5, True), (1, 3, False)):
        got = tpu.make_group_metadata(group_sizes=torch.from_numpy(sizes), m=30, tm=4, start_group=start,
                                      num_nonzero_groups=count, visit_empty_groups=visit_empty)
        want = jitted(group_sizes=jnp.asarray(sizes), m=30, tm=4, start_group=start,
                      num_nonzero_groups=count, visit_empty_groups=visit_empty)
        got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
        assert len(got_leaves) == len(want_leaves) == 4
        assert all(_same_bits(t, a) for t, a in zip(got_leaves, want_leaves))
    # a traced start group: a tensor works like an int
    as_tensor = tpu.make_group_metadata(group_sizes=torch.from_numpy(sizes), m=30, tm=4,
                                        start_group=torch.tensor(1), num_nonzero_groups=3, visit_empty_groups=False)
    assert all(torch.equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(as_tensor), jax.tree_util.tree_leaves(got)))


@pytest.mark.parametrize("is_dkv", [False, True])
def test_process_dynamic_mask_matches_jax(is_dkv):
    keep = np.stack([tpu.make_causal_mask((32, 32)), tpu.make_local_attention_mask((32, 32), (4, 4))])
    info, fn = tpu.process_dynamic_mask(torch.from_numpy(keep), (8, 16), is_dkv=is_dkv, head_shards=2)
    jitted = jax.jit(lambda m: jb.process_dynamic_mask(m, (8, 16), is_dkv=is_dkv, head_shards=2)[0])
    want = jitted(jnp.asarray(keep))
    assert fn is None and info.is_dynamic_mask is True and info.q_sequence is None
    for name in ("data_next", "mask_next", "block_mask", "partial_mask_blocks"):
        assert _same_bits(getattr(info, name), getattr(want, name)), name
    if is_dkv:  # the _dkv spelling is the same call
        dkv, _ = tpu.process_dynamic_mask_dkv(torch.from_numpy(keep), (8, 16), head_shards=2)
        assert all(torch.equal(a, b) for a, b in zip(dkv[:4], info[:4]))


def test_host_side_objects_are_the_jax_ones():
    # Masks, BlockSizes and the static MaskInfo helpers are numpy-level: one object for both faces.
    for name in ("Mask", "CausalMask", "LocalMask", "ChunkedCausalMask", "FullMask", "NumpyMask", "MultiHeadMask",
                 "LogicalAnd", "LogicalOr", "BlockSizes", "MaskInfo", "process_mask", "process_mask_dkv",
                 "make_causal_mask", "make_local_attention_mask", "make_chunk_attention_mask", "make_random_mask"):
        assert getattr(tpu, name) is getattr(jb, name), name
    assert set(tpu.__all__) >= set(jb.__all__) | {"grouped_matmul", "transposed_grouped_matmul", "make_group_metadata"}


def test_static_arguments_hash_by_value():
    # What the jit cache keys on: equal numpy masks give equal (hashable) masks; lists become tuples.
    causal = tpu.make_causal_mask((8, 8))
    m2, dyn = tpu._static_mask("f", causal)
    assert dyn is None and m2 == tpu.NumpyMask(causal.copy()) and hash(m2) == hash(tpu.NumpyMask(causal))
    m3, _ = tpu._static_mask("f", np.stack([causal, ~causal]))
    assert isinstance(m3, tpu.MultiHeadMask) and m3.shape == (2, 8, 8)
    assert tpu._hashable("f", "tiling", [8, 16, 8]) == (8, 16, 8)
    assert tpu._jax_dtype("f", "dtype", torch.bfloat16) == jnp.bfloat16
    mask = torch.ones(8, 8, dtype=torch.bool)
    assert tpu._static_mask("f", mask) == (None, mask)  # a tensor mask is traced, never static


def test_static_tuples_are_checked_on_every_call(fw):
    """A tuple argument is checked on each call, as jax checks it: the torch bridge's cache compares
    static arguments by ==, so after a refused (True, 8) a valid (1, 8) was refused naming True,
    and (1.0, 8) reused the trace of (1, 8) and was accepted."""
    ops = tpu if fw.name == "torch" else jb
    q = fw.asarray(np.zeros((1, 8, 1, 8)), "float32")
    mask = fw.asarray(np.ones((1, 8, 8), bool))
    calls = {
        "sliding_window": lambda w: ops.blocksparse_attention(q, q, q, sliding_window=w),
        r"block_shape\[0\]": lambda b: ops.process_dynamic_mask(mask, b),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"{name} must be an int, got True"):
            call((True, 8))
        call((1, 8))  # equal to (True, 8), and valid
        with pytest.raises(TypeError, match=f"{name} must be an int, got float 1.0"):
            call((1.0, 8))  # equal to (1, 8)


@pytest.mark.parametrize("shape", [(8,), (1, 1, 8, 8)])
def test_numpy_mask_of_wrong_rank(fw, shape):
    """Both fronts: a ValueError naming the shape (jax raised a TypeError saying the numpy bool
    array was not a numpy bool array)."""
    ops = tpu if fw.name == "torch" else jb
    q = fw.asarray(np.zeros((1, 8, 1, 8)), "float32")
    with pytest.raises(ValueError, match=r"'?mask'? as a numpy array must be 2-D or 3-D, got shape"):
        ops.blocksparse_attention(q, q, q, mask=np.ones(shape, bool))


@pytest.mark.parametrize("mask", [np.ones((8, 8), np.int32), np.ones((1, 8, 8), np.float32)])
def test_numpy_mask_of_wrong_dtype(fw, mask):
    """Both fronts name the argument: torch wrapped the array in NumpyMask first, whose error
    said 'array must be boolean'."""
    ops = tpu if fw.name == "torch" else jb
    q = fw.asarray(np.zeros((1, 8, 1, 8)), "float32")
    with pytest.raises(TypeError, match=rf"^(blocksparse_attention: argument )?'?mask'? must be boolean, got dtype "
                                        rf"{mask.dtype}$"):
        ops.blocksparse_attention(q, q, q, mask=mask)


def test_interpret_follows_the_tensors_device():
    assert tpu._interpret(None, torch.device("cpu")) is True
    assert tpu._interpret(None, torch.device("cuda", 0)) is True
    assert tpu._interpret(False, torch.device("cpu")) is False  # an explicit value wins
    with pytest.raises(TypeError, match="interpret must be None, a bool or a pltpu.InterpretParams, got 'no'"):
        tpu._interpret("no", torch.device("cpu"))  # was truthy: interpret mode
    # An XLA device is native only when torch_xla says it is a TPU (no torch_xla here: interpret).
    assert tpu._interpret(None, torch.device("xla", 0)) is (not tpu._xla_is_tpu(torch.device("xla", 0)))


# -- bad inputs: clear errors naming the argument, before any tracing --------------------------------

_q = torch.zeros(1, 8, 2, 8)
_lhs, _rhs, _gs = torch.zeros(8, 4), torch.zeros(2, 4, 4), torch.tensor([3, 5], dtype=torch.int32)
_meta = torch.device("meta")

BAD = {
    "q float64": (lambda: tpu.blocksparse_attention(_q.double(), _q, _q), TypeError,
                  r"'q' must be bfloat16, float16 or float32, got torch.float64"),
    "k int": (lambda: tpu.blocksparse_attention(_q, _q.int(), _q), TypeError, r"'k' must be bfloat16"),
    "v not a tensor": (lambda: tpu.blocksparse_attention(_q, _q, _q.numpy()), TypeError,
                       r"'v' must be a torch.Tensor, got ndarray"),
    "float mask tensor": (lambda: tpu.blocksparse_attention(_q, _q, _q, mask=torch.ones(8, 8)), TypeError,
                          r"'mask' must be a bool tensor"),
    "mask of another type": (lambda: tpu.blocksparse_attention(_q, _q, _q, mask=[[True]]), TypeError,
                             r"'mask' must be a Mask"),
    "float segment ids": (lambda: tpu.blocksparse_attention(_q, _q, _q, q_segment_ids=torch.zeros(1, 8)),
                          TypeError, r"'q_segment_ids' must be an integer tensor"),
    "int64 segment ids past int32": (lambda: tpu.blocksparse_attention(_q, _q, _q, q_segment_ids=torch.tensor(
        [[0] * 7 + [2**32]])), ValueError, r"q_segment_ids holds values in \[0, 4294967296\]"),
    "k on another device": (lambda: tpu.blocksparse_attention(_q, _q.to(_meta), _q), ValueError,
                            r"'k' is on meta but 'q' is on cpu"),
    "mask on another device": (lambda: tpu.blocksparse_attention(_q, _q, _q, mask=torch.ones(8, 8, dtype=torch.bool,
                                                                                               device=_meta)),
                               ValueError, r"'mask' is on meta but 'q' is on cpu"),
    "tensor softmax_scale": (lambda: tpu.blocksparse_attention(_q, _q, _q, softmax_scale=torch.tensor(0.5)),
                             TypeError, r"'softmax_scale' must be a float"),
    "string causal": (lambda: tpu.blocksparse_attention(_q, _q, _q, causal="no"), TypeError,
                      r"'causal' must be a bool, got 'no'"),  # "no" was causal
    "int return_lse": (lambda: tpu.blocksparse_attention(_q, _q, _q, return_lse=0), TypeError,
                       r"'return_lse' must be a bool, got 0"),
    "lhs float64": (lambda: tpu.grouped_matmul(_lhs.double(), _rhs, _gs), TypeError, r"'lhs' must be bfloat16"),
    "group_sizes int64": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs.long()), TypeError,
                          r"'group_sizes' must be int32, got torch.int64"),
    "transpose_rhs a string": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, transpose_rhs="false"), TypeError,
                               r"'transpose_rhs' must be a bool, got 'false'"),  # "false" transposed
    "group_sizes 2-D": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs[None]), ValueError, r"'group_sizes' must be 1-D"),
    "negative group size": (lambda: tpu.grouped_matmul(_lhs, _rhs, torch.tensor([-1, 5], dtype=torch.int32)),
                            ValueError, r"'group_sizes' must be non-negative"),
    "group sizes past m": (lambda: tpu.transposed_grouped_matmul(_lhs.T, _lhs, torch.tensor([4, 5],
                                                                                          dtype=torch.int32)),
                           ValueError, r"sum\(group_sizes\) = 9 exceeds the 8 rows"),
    "group_offset tensor out of range": (lambda: tpu.grouped_matmul(_lhs, _rhs[:1], _gs, group_offset=torch.tensor(2)),
                                         ValueError, r"group_offset=2 selects groups \[2, 3\)"),
    "int64 group_offset tensor past int32": (lambda: tpu.grouped_matmul(_lhs, _rhs[:1], _gs,
                                                                         group_offset=torch.tensor(2**32)),
                                             ValueError, r"group_offset=4294967296 selects groups"),
    "group_offset tensor with no groups": (lambda: tpu.grouped_matmul(_lhs, _rhs[:0], _gs[:0],
                                                                       group_offset=torch.tensor(5)),
                                           ValueError, r"group_offset=5 selects groups \[5, 5\) but group_sizes has 0"),
    "int group_offset out of range": (lambda: tpu.grouped_matmul(_lhs, _rhs[:1], _gs, group_offset=2), ValueError,
                                      r"group_offset=2 selects groups \[2, 3\)"),
    "negative int group_offset": (lambda: tpu.grouped_matmul(_lhs, _rhs[:1], _gs, group_offset=-1), ValueError,
                                  r"group_offset=-1 selects groups"),
    "int group_offset out of range, tgmm": (lambda: tpu.transposed_grouped_matmul(_lhs.T, _lhs, _gs, group_offset=1,
                                                                                 num_actual_groups=2),
                                            ValueError, r"group_offset=1 selects groups \[1, 3\)"),
    "float group_offset": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, group_offset=1.0), TypeError,
                           r"'group_offset' must be an int or an integer tensor"),
    "group_sizes on another device": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs.to(_meta)), ValueError,
                                      r"'group_sizes' is on meta but 'lhs' is on cpu"),
    "unhashable tiling": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, tiling=[[8], 8, 8]), TypeError,
                          r"'tiling' must be hashable"),
    "tm = 0": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8, tm=0, start_group=0, num_nonzero_groups=2),
               ValueError, r"'tm' must be a positive int"),
    # start groups past the end (or negative, traced into jax unchecked) were accepted, never visited
    "start_group past the groups": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8, tm=4, start_group=1,
                                                                    num_nonzero_groups=2), ValueError,
                                    r"start_group \+ num_nonzero_groups must be at most the 2 groups of group_sizes, "
                                    r"got start_group=1, num_nonzero_groups=2"),
    "start_group tensor past the groups": (lambda: tpu.make_group_metadata(
        group_sizes=_gs, m=8, tm=4, start_group=torch.tensor(2**32), num_nonzero_groups=0), ValueError,
        r"got start_group=4294967296, num_nonzero_groups=0"),
    "negative start_group tensor": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8, tm=4,
                                                                    start_group=torch.tensor(-1), num_nonzero_groups=1),
                                    ValueError, r"'start_group' must be a non-negative int, got -1"),
    # checked only when 0-d: jax's check in the bridge's trace named its tracer, "got JitTracer(int32[1])"
    "start_group tensor of shape [1]": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8, tm=4,
                                                                        start_group=torch.tensor([1]),
                                                                        num_nonzero_groups=1), TypeError,
                                        r"'start_group' must be an int or an integer scalar, got a tensor of shape "
                                        r"\(1,\)$"),
    "start_group tensor of shape [1, 1]": (lambda: tpu.make_group_metadata(
        group_sizes=_gs, m=8, tm=4, start_group=torch.tensor([[1]], dtype=torch.int32), num_nonzero_groups=1),
        TypeError, r"'start_group' must be an int or an integer scalar, got a tensor of shape \(1, 1\)$"),
    "float m": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8.0, tm=4, start_group=0, num_nonzero_groups=2),
                TypeError, r"'m' must be an int, got float 8.0"),
    "string visit_empty_groups": (lambda: tpu.make_group_metadata(group_sizes=_gs, m=8, tm=4, start_group=0,
                                                                  num_nonzero_groups=2, visit_empty_groups="no"),
                                  TypeError, r"'visit_empty_groups' must be a bool, got 'no'"),  # "no" was True
    "dynamic mask not bool": (lambda: tpu.process_dynamic_mask(torch.ones(1, 8, 8), (8, 8)), TypeError,
                              r"'mask' must be a bool tensor"),
    "string is_dkv": (lambda: tpu.process_dynamic_mask(torch.ones(1, 8, 8, dtype=torch.bool), (8, 8), is_dkv="no"),
                      TypeError, r"'is_dkv' must be a bool, got 'no'"),  # "no" was the dK/dV schedule
    "int shrink_grid": (lambda: tpu.process_dynamic_mask(torch.ones(1, 8, 8, dtype=torch.bool), (8, 8),
                                                         shrink_grid=0), TypeError, r"'shrink_grid' must be a bool"),
    "bool block size": (lambda: tpu.blocksparse_attention(_q, _q, _q, block_sizes={"block_q": True}), TypeError,
                        r"block_sizes.block_q must be an int, got True"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_before_tracing(case):
    call, exc, match = BAD[case]
    before = tpu.cache_info()
    with pytest.raises(exc, match=match):
        call()
    after = tpu.cache_info()
    assert {k: v["traces"] for k, v in after.items()} == {k: v["traces"] for k, v in before.items()}


JAX_CHECKED = {  # shape/dtype rules that jax checks while tracing: still before any kernel runs
    "kv head_dim mismatch": (lambda: tpu.blocksparse_attention(_q, _q[..., :4], _q[..., :4]), ValueError,
                             r"k shape .* does not match q shape"),
    "block size not dividing": (lambda: tpu.blocksparse_attention(_q, _q, _q, block_sizes={"block_q": 3}),
                                ValueError, r"block_sizes.block_q=3 must divide"),
    "head_dim 0": (lambda: tpu.blocksparse_attention(_q[..., :0], _q[..., :0], _q[..., :0]), ValueError,
                   r"q must have head_dim >= 1"),
    "no kv heads": (lambda: tpu.blocksparse_attention(_q, _q[:, :, :0], _q[:, :, :0]), ValueError,
                    r"k must have heads >= 1"),
    "string sliding_window": (lambda: tpu.blocksparse_attention(_q, _q, _q, sliding_window="ab"), TypeError,
                              r"sliding_window must be an int or a \(left, right\) pair"),
    "nan softmax_scale": (lambda: tpu.blocksparse_attention(_q, _q, _q, softmax_scale=float("nan")), ValueError,
                          r"softmax_scale must be finite, got nan"),  # an all-NaN output
    "float chunk_size": (lambda: tpu.blocksparse_attention(_q, _q, _q, chunk_size=2.5), TypeError,
                         r"chunk_size must be an int"),
    "float head_shards": (lambda: tpu.process_dynamic_mask(torch.ones(2, 8, 8, dtype=torch.bool), (8, 8),
                                                           head_shards=2.0),
                          TypeError, r"head_shards must be an int"),
    # a bool count, as the Triton fronts refuse it; with group_offset=2 it was refused as [2, 3) of 2 groups
    "bool num_actual_groups": (lambda: tpu.transposed_grouped_matmul(_lhs.T, _lhs, _gs, group_offset=2,
                                                                     num_actual_groups=True),
                               TypeError, r"num_actual_groups must be an int or None, got True"),
    "bool tile": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, tiling=(True, 8, 8)), TypeError,
                  r"tiling must be 3 positive ints \(tm, tk, tn\) or a callable, got \(True, 8, 8\)"),
    "lhs/rhs dtypes differ": (lambda: tpu.grouped_matmul(_lhs, _rhs.bfloat16(), _gs), TypeError,
                              r"lhs and rhs must have the same dtype"),
    "rhs k mismatch": (lambda: tpu.grouped_matmul(_lhs, _rhs[:, :3], _gs), ValueError, r"does not match lhs"),
    "None output dtype": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, preferred_element_type=None), TypeError,
                          r"preferred_element_type must be one of float16, bfloat16, float32, got None"),
    "complex output dtype": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, preferred_element_type=torch.complex64),
                             TypeError, r"preferred_element_type must be a float dtype"),
}


@pytest.mark.parametrize("case", list(JAX_CHECKED))
def test_jax_side_checks_surface_unchanged(case):
    call, exc, match = JAX_CHECKED[case]
    with pytest.raises(exc, match=match):
        call()



NAMED_BY_OP = {  # jax-side checks (and two torch-side ones) whose messages named no torch op
    "kv heads not dividing q heads": (lambda: tpu.blocksparse_attention(torch.zeros(1, 8, 3, 8), _q, _q), ValueError,
                                      r"^blocksparse_attention: q heads \(3\) must be a multiple of kv heads \(2\)$"),
    "zero tile": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, tiling=(0, 8, 8)), ValueError,
                  r"^grouped_matmul: tiling must be 3 positive ints \(tm, tk, tn\) or a callable, got \(0, 8, 8\)$"),
    "negative num_actual_groups": (lambda: tpu.transposed_grouped_matmul(_lhs.T, _lhs, _gs, num_actual_groups=-1),
                                   ValueError, r"^transposed_grouped_matmul: num_actual_groups must be an int in "
                                               r"\[0, 2\], got -1$"),
    "head_shards not dividing heads": (lambda: tpu.process_dynamic_mask(torch.ones(2, 8, 8, dtype=torch.bool), (8, 8),
                                                                        head_shards=3),
                                       ValueError, r"^process_dynamic_mask: head_shards=3 must divide the number of "
                                                   r"heads 2$"),
    "string interpret": (lambda: tpu.grouped_matmul(_lhs, _rhs, _gs, interpret="x"), TypeError,
                         r"^grouped_matmul: interpret must be None, a bool"),
    "misspelt block size": (lambda: tpu.blocksparse_attention(_q, _q, _q, block_sizes={"bq": 8}), TypeError,
                            r"^blocksparse_attention: .*unexpected keyword argument 'bq'$"),
}


@pytest.mark.parametrize("case", list(NAMED_BY_OP))
def test_errors_name_the_torch_op(case):
    call, exc, match = NAMED_BY_OP[case]
    with pytest.raises(exc, match=match):
        call()

# -- torch.compile ------------------------------------------------------------------------------------


def test_torch_compile_graph_breaks_with_right_values(rng):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    m, k, n = 16, 8, 8
    lhs = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    rhs = torch.from_numpy(rng.standard_normal((2, k, n)).astype(np.float32))
    gs = torch.tensor([6, 10], dtype=torch.int32)

    def f(lhs, rhs):
        return (tpu.grouped_matmul(lhs * 2, rhs, gs, tiling=(8, 8, 8)) + 1).square()

    counter = CompileCounter()
    got = torch.compile(f, backend=counter)(lhs, rhs)
    assert counter.frame_count == 2  # the graphs before and after the break; the op is not traced
    want = (reference.grouped_matmul(_f64(lhs) * 2, _f64(rhs), gs) + 1).square()
    _check_ref(got, want, torch.float32, "value")
    assert torch.equal(got, f(lhs, rhs))  # eager: the same call, the same bits

    with pytest.raises(Exception, match="(?i)disable|skip|graph break"):
        torch.compile(f, backend="eager", fullgraph=True)(lhs, rhs)


# -- GPU (cuda tensors -> jax GPU, interpret mode); run by the lead on the device ----------------------


def _device_errors(rng, devices) -> dict[str, float]:
    """Attention (fwd + bwd) and gmm (fwd + bwd: gmm and tgmm kernels) on each device, float32:
    relative error of every result vs the float64 reference and between the two devices."""
    labels = devices if len(set(devices)) == len(devices) else [f"{d}{i}" for i, d in enumerate(devices)]
    want, got = {}, {label: {} for label in labels}
    # blocksparse attention
    arrays = [rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(3)]
    cot = rng.standard_normal((1, 16, 2, 8)).astype(np.float32)
    opts = dict(causal=True, block_sizes=tpu.BlockSizes(8, 8))
    rq, rk, rv = (_f64(a).requires_grad_(True) for a in arrays)
    rout = blocksparse_attention_reference(rq, rk, rv, causal=True)
    rout.backward(_f64(cot))
    want.update({"attn out": rout, "attn dq": rq.grad, "attn dk": rk.grad, "attn dv": rv.grad})
    for label, device in zip(labels, devices):
        q, k, v = (torch.from_numpy(a).to(device).requires_grad_(True) for a in arrays)
        out = tpu.blocksparse_attention(q, k, v, **opts)
        out.backward(torch.from_numpy(cot).to(device))
        assert out.device.type == device and q.grad.device.type == device
        got[label].update({"attn out": out, "attn dq": q.grad, "attn dk": k.grad, "attn dv": v.grad})
    # grouped matmul (its backward runs gmm for d_lhs and tgmm for d_rhs)
    arrays = [rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((2, 8, 8)).astype(np.float32)]
    cot = rng.standard_normal((16, 8)).astype(np.float32)
    sizes = [6, 10]
    rl, rr = (_f64(a).requires_grad_(True) for a in arrays)
    rout = reference.grouped_matmul(rl, rr, torch.tensor(sizes))
    rout.backward(_f64(cot))
    want.update({"gmm out": rout, "gmm d_lhs": rl.grad, "gmm d_rhs": rr.grad})
    for label, device in zip(labels, devices):
        lhs, rhs = (torch.from_numpy(a).to(device).requires_grad_(True) for a in arrays)
        out = tpu.grouped_matmul(lhs, rhs, torch.tensor(sizes, dtype=torch.int32, device=device), tiling=(8, 8, 8))
        out.backward(torch.from_numpy(cot).to(device))
        assert out.device.type == device and lhs.grad.device.type == device
        got[label].update({"gmm out": out, "gmm d_lhs": lhs.grad, "gmm d_rhs": rhs.grad})

    errors = {}
    for name, ref in want.items():
        for label in labels:
            errors[f"{name} {label} vs float64"] = rel_error(_f64(got[label][name]).numpy(), _f64(ref).numpy())
        a, b = labels
        errors[f"{name} {b} vs {a}"] = rel_error(_f64(got[b][name]).numpy(), _f64(got[a][name]).numpy())
    return errors


def _assert_errors(errors: dict[str, float], bound: float):
    report = "\n".join(f"  {name}: {err:.3e}" for name, err in errors.items())
    print(f"relative errors (float32 bound {bound:.0e}):\n{report}")
    bad = [name for name, err in errors.items() if not err <= bound]
    assert not bad, f"{len(bad)} over the float32 bound {bound:.0e} ({', '.join(bad)}); all:\n{report}"


def test_device_comparison_on_cpu(rng):
    """The cuda test's harness run twice on cpu: within the float32 bound of float64, and the
    two runs bit-identical."""
    errors = _device_errors(rng, ("cpu", "cpu"))
    _assert_errors(errors, TOL[torch.float32])
    assert all(err == 0 for name, err in errors.items() if name.endswith("cpu1 vs cpu0")), errors
    assert sum(name.endswith("cpu1 vs cpu0") for name in errors) == 7


@pytest.mark.gpu
def test_cuda_tensors_match_cpu(rng):
    """cuda tensors run the kernels on jax's GPU, cpu tensors on jax's CPU, both in interpret mode.

    Both must be float32 math: the kernels' float32 dots are Precision.HIGHEST, so XLA:GPU does not
    use TF32 (~1e-3). So each device is held to the float32 bound vs float64, and the two devices to
    the same bound vs each other (both are ~1e-7 off here; they differ only in rounding order and
    exp/log ulps). Every measured error is printed and listed in the failure message."""
    _assert_errors(_device_errors(rng, ("cpu", "cuda")), TOL[torch.float32])


# -- bigger shapes / bf16 ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mask_kind", ["local", "chunked+window"])
def test_attention_bf16_larger(mask_kind, rng):
    B, S, H, Hkv, D = 1, 64, 4, 2, 32
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D))]
    if mask_kind == "local":
        opts = dict(sliding_window=(20, 6))
    else:
        opts = dict(causal=True, chunk_size=40, sliding_window=24)
    opts["block_sizes"] = tpu.BlockSizes(16, 32)
    (q, k, v), (jq, jk, jv) = _torch_and_jax(arrays, torch.bfloat16, grad=3)
    out = tpu.blocksparse_attention(q, k, v, **opts)
    cot = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32)).bfloat16()
    out.backward(cot)
    jout, pullback = jax.vjp(functools.partial(jax.jit(jb.blocksparse_attention, static_argnames=_ATTN_STATIC),
                                               **opts), jq, jk, jv)
    jgrads = pullback(jnp.asarray(cot.float().numpy()).astype(jnp.bfloat16))
    for t, a in zip((out, q.grad, k.grad, v.grad), (jout, *jgrads)):
        assert _same_bits(t, a)
    rq, rk, rv = (_f64(x).requires_grad_(True) for x in (q, k, v))
    rout = blocksparse_attention_reference(rq, rk, rv, **opts)
    rout.backward(_f64(cot))
    for name, got, want in (("out", out, rout), ("dq", q.grad, rq.grad), ("dk", k.grad, rk.grad),
                            ("dv", v.grad, rv.grad)):
        _check_ref(got, want, torch.bfloat16, name)


@pytest.mark.slow
def test_gmm_bf16_transposed_static_offset(rng):
    m, k, n = 96, 64, 48
    sizes = np.array([20, 0, 30, 25, 10], np.int32)
    arrays = [rng.standard_normal((m, k)).astype(np.float32),
              (rng.standard_normal((3, n, k)) / 8).astype(np.float32), sizes]
    (lhs, rhs, gs), _ = _torch_and_jax(arrays, torch.bfloat16, grad=2)
    out = tpu.grouped_matmul(lhs, rhs, gs, preferred_element_type=torch.bfloat16, tiling=(16, 32, 16),
                             group_offset=1, transpose_rhs=True)
    assert out.dtype == torch.bfloat16
    out.backward(torch.ones_like(out))
    rl, rr = (_f64(x).requires_grad_(True) for x in (lhs, rhs))
    rout = reference.grouped_matmul(rl, rr, gs, group_offset=1, transpose_rhs=True)
    rout.backward(torch.ones_like(rout))
    for name, got, want in (("out", out, rout), ("d_lhs", lhs.grad, rl.grad), ("d_rhs", rhs.grad, rr.grad)):
        _check_ref(got, want, torch.bfloat16, name)


def test_autocast_casts_operands_as_matmul_does(rng):
    """Under torch.autocast the bridged kernels take bf16 tokens with fp32 weights (and fp32 q/k/v)
    in the autocast dtype, as matmul and SDPA do: the same bits as on explicitly cast operands."""
    tokens = torch.from_numpy(rng.standard_normal((24, 16)).astype(np.float32)).bfloat16()
    weights = torch.from_numpy(rng.standard_normal((2, 16, 8)).astype(np.float32))
    sizes = torch.tensor([10, 14], dtype=torch.int32)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 16, 2, 8)).astype(np.float32)) for _ in range(3))
    calls = {
        "grouped_matmul": (lambda a, b: tpu.grouped_matmul(a, b, sizes, tiling=(8, 8, 8)), (tokens, weights)),
        "blocksparse_attention": (lambda *t: tpu.blocksparse_attention(*t, causal=True), (q, k, v)),
    }
    for name, (fn, args) in calls.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn(*args)
        want = fn(*(a.bfloat16() for a in args))
        assert torch.equal(got, want) and not torch.isnan(got).any(), name
