"""flash_attention (both fronts): forward, lse and gradients vs float64 over a feature matrix,
fully masked rows, varlen, dropout masks, torch-vs-jax agreement, jax transforms, bad input."""
import numpy as np
import pytest

from tests import frameworks
from tests import references as ref
from tests.frameworks import TOLERANCE, lse_error, rel_error

GRAD_TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _segments(rng, batch, seq, n_ids=3):
    """Sorted ids 1..n_ids with a tail of padding (0) in every row but the first."""
    ids = np.sort(rng.integers(1, n_ids + 1, size=(batch, seq)), axis=1).astype(np.int32)
    for b in range(1, batch):
        ids[b, seq - rng.integers(1, seq + 1):] = 0
    return ids


def _make(fw, rng, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, dtype, bias=None, segments=False):
    """Framework arrays, the numpy values they hold (what the reference sees), and options."""
    shapes = [(batch, seq_q, heads_q, head_dim), (batch, seq_k, heads_kv, head_dim), (batch, seq_k, heads_kv, head_dim)]
    arrays = [fw.asarray(rng.standard_normal(s), dtype) for s in shapes]
    if bias is not None:
        arrays.append(fw.asarray(rng.standard_normal((*bias, seq_q, seq_k)), dtype))
    values = [fw.to_numpy(a) for a in arrays]
    extra, ref_extra = {}, {}
    if segments:
        q_seg = _segments(rng, batch, seq_q)
        kv_seg = q_seg if seq_q == seq_k else _segments(rng, batch, seq_k)
        extra = dict(q_segment_ids=fw.asarray(q_seg), kv_segment_ids=fw.asarray(kv_seg))
        ref_extra = dict(q_segment_ids=ref._t(q_seg), kv_segment_ids=ref._t(kv_seg))
    return arrays, values, extra, ref_extra


def _op(fw, options, extra):
    def run(q, k, v, bias=None, return_lse=False):
        return fw.ops.flash_attention(q, k, v, bias=bias, return_lse=return_lse, **options, **extra)
    return run


def _ref(options, extra):
    def run(q, k, v, bias=None, return_lse=False):
        return ref.flash_attention(q, k, v, bias=bias, return_lse=return_lse, **options, **extra)
    return run


def _check(fw, rng, shape, dtype, options, bias=None, segments=False):
    arrays, values, extra, ref_extra = _make(fw, rng, *shape, dtype, bias=bias, segments=segments)
    op, reference = _op(fw, options, extra), _ref(options, ref_extra)
    out, lse = op(*arrays, return_lse=True)
    out, lse = fw.to_numpy(out), fw.to_numpy(lse)
    want_out, want_lse = (t.numpy() for t in reference(*(ref._t(a) for a in values), return_lse=True))
    assert rel_error(out, want_out) < TOLERANCE[dtype]
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)  # -inf exactly where nothing is attended
    assert lse_error(lse[~empty], want_lse[~empty]) < 1e-5
    assert not out.transpose(0, 2, 1, 3)[empty].any()  # fully masked rows give exact zeros

    dout = rng.standard_normal(out.shape)
    grads = fw.vjp(op, arrays, fw.asarray(dout, dtype))
    expected = ref.flash_vjp(reference, values, out, fw.to_numpy(fw.asarray(dout, dtype)), n_diff=len(values))
    for name, got, want in zip(["dq", "dk", "dv", "dbias"], grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE[dtype], name
    assert not grads[0].transpose(0, 2, 1, 3)[empty].any()


# (batch, seq_q, seq_k, heads_q, heads_kv, head_dim), dtype, options, bias broadcast, segments
CASES = [
    ((1, 1, 1, 1, 1, 16), "float32", {}, None, False),
    ((2, 17, 17, 4, 2, 32), "float32", dict(causal=True), None, False),
    ((2, 17, 33, 2, 1, 80), "float16", dict(causal=True), None, False),
    ((1, 33, 17, 2, 2, 64), "bfloat16", dict(causal=True), None, False),  # first 16 queries see nothing
    ((2, 127, 127, 2, 2, 32), "float32", dict(sliding_window=[16, 8]), None, False),
    ((1, 40, 40, 3, 1, 96), "bfloat16", dict(causal=True, sliding_window=7), None, False),
    ((2, 33, 33, 2, 2, 32), "float32", dict(logits_soft_cap=5.0, softmax_scale=0.4), None, False),
    ((2, 17, 23, 4, 2, 32), "float32", {}, (1, 4), False),
    ((2, 20, 20, 2, 1, 24), "float16", dict(causal=True, logits_soft_cap=2.0), (2, 1), False),
    ((2, 29, 29, 2, 1, 48), "float32", dict(causal=True), None, True),
    ((2, 18, 31, 2, 2, 16), "bfloat16", {}, (2, 2), True),
    ((1, 17, 17, 1, 1, 256), "float16", dict(causal=True), None, False),
    ((1, 20, 20, 2, 2, 192), "bfloat16", {}, None, False),
    ((1, 65, 65, 2, 2, 128), "float32", dict(sliding_window=(None, 3)), None, False),
    ((2, 12, 12, 2, 2, 3), "float16", dict(causal=True), None, False),
]


@pytest.mark.parametrize("shape, dtype, options, bias, segments", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}-{'-'.join(c[2]) or 'plain'}"
                              f"{'-bias' if c[3] else ''}{'-seg' if c[4] else ''}" for c in CASES])
def test_matches_float64(fw, rng, shape, dtype, options, bias, segments):
    _check(fw, rng, shape, dtype, options, bias=bias, segments=segments)


# Long sequences cost ~30-100 s a case under the interpreter: one dtype per head_dim, and one front
# per case (both run the same kernels; their agreement is checked on small shapes above).
@pytest.mark.slow
@pytest.mark.parametrize("front, seq_q, seq_k, head_dim, dtype", [
    ("torch", 1000, 1000, 32, "float32"), ("jax", 1000, 1000, 64, "bfloat16"), ("torch", 1000, 1000, 80, "float16"),
    ("jax", 1000, 1000, 128, "float32"), ("torch", 127, 1000, 64, "float16"), ("jax", 1000, 17, 128, "bfloat16"),
])
def test_long_sequences(rng, front, seq_q, seq_k, head_dim, dtype):
    _check(frameworks.get(front), rng, (1, seq_q, seq_k, 2, 1, head_dim), dtype, dict(causal=True))


@pytest.mark.slow
def test_long_sequence_all_features(torch_fw, rng):
    options = dict(sliding_window=100, logits_soft_cap=10.0, causal=True)
    _check(torch_fw, rng, (1, 1000, 1000, 2, 2, 64), "bfloat16", options, bias=(1, 2), segments=True)


def test_padding_rows_are_zero_with_zero_gradients(fw, rng):
    arrays, values, _, _ = _make(fw, rng, 2, 9, 9, 2, 1, 16, "float32")
    seg = np.array([[1] * 9, [0] * 9], np.int32)  # the second row is all padding
    op = _op(fw, {}, dict(q_segment_ids=fw.asarray(seg), kv_segment_ids=fw.asarray(seg)))
    out, lse = (fw.to_numpy(t) for t in op(*arrays, return_lse=True))
    assert not out[1].any() and np.isneginf(lse[1]).all() and np.isfinite(lse[0]).all()
    grads = fw.vjp(op, arrays, fw.asarray(rng.standard_normal(out.shape), "float32"))
    for g in grads:
        assert np.isfinite(g).all() and not g[1].any()


def test_int64_segment_ids_are_compared_exactly(fw, rng):
    # Truncated to int32, 1 and 1 + 2**32 would be one segment, 2**31 padding and 3 - 2**32 a
    # real segment. jax has int64 arrays only with x64 enabled.
    ids = np.array([1, 1 + 2**32, 2**31, 3 - 2**32, 5], np.int64)
    seg = np.stack([rng.choice(ids, 21), rng.choice(ids, 21)])
    with frameworks.x64(fw):
        arrays, values, _, _ = _make(fw, rng, 2, 21, 21, 2, 1, 16, "float32")
        extra = dict(q_segment_ids=fw.asarray(seg), kv_segment_ids=fw.asarray(seg))
        assert str(extra["q_segment_ids"].dtype).endswith("int64")
        op = _op(fw, {}, extra)
        out = fw.to_numpy(op(*arrays))
        dout = rng.standard_normal(out.shape)
        grads = fw.vjp(op, arrays, fw.asarray(dout, "float32"))
    reference = _ref({}, dict(q_segment_ids=ref._t(seg), kv_segment_ids=ref._t(seg)))
    assert rel_error(out, reference(*(ref._t(a) for a in values)).numpy()) < TOLERANCE["float32"]
    for name, got, want in zip(["dq", "dk", "dv"], grads, ref.vjp(reference, values, dout, n_diff=3)):
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"], name


def test_rows_emptied_by_a_neg_inf_bias_have_zero_gradients(fw, rng):
    # seq 32 = a whole CPU key tile: the backward takes its unmasked path, where the lse of an
    # emptied row (-inf) once gave exp2(-inf - (-inf)) = NaN in every gradient.
    arrays, values, _, _ = _make(fw, rng, 1, 32, 32, 2, 1, 16, "float32", bias=(1, 1))
    bias = values[3].copy()
    bias[..., 3, :] = -np.inf  # query 3 attends nothing
    arrays[3] = fw.asarray(bias, "float32")
    op, reference = _op(fw, {}, {}), _ref({}, {})
    out, lse = (fw.to_numpy(t) for t in op(*arrays, return_lse=True))
    assert not out[0, 3].any() and np.isneginf(lse[0, :, 3]).all() and np.isfinite(lse[0, :, :3]).all()
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = fw.vjp(op, arrays, fw.asarray(dout, "float32"))
    expected = ref.vjp(reference, [*values[:3], bias], dout, n_diff=4)
    for name, got, want in zip(["dq", "dk", "dv", "dbias"], grads, expected):
        assert np.isfinite(got).all(), name
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"], name
    assert not grads[0][0, 3].any()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_negative_softmax_scale(fw, rng, dtype):
    # A scale < 0 turns the row max into the row min: the forward's plain-tile shortcut (scale
    # the max, not the tile) must not be taken. seq 32 is one whole CPU tile.
    _check(fw, rng, (1, 32, 32, 1, 1, 32), dtype, dict(softmax_scale=-0.5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_huge_softmax_scale(fw, rng, dtype):
    # 1e38 (its scale * log2(e) fits float32) overflowed the float32 logits for any |q.k| > 2.4: the
    # online softmax took inf - inf, a NaN output. Such scales are refused before any kernel runs;
    # the largest taken gives float64's forward, and a soft cap (which bounds the logits) takes 1e38.
    # Forward only: an lse-based backward loses the logits' low bits far below these scales.
    q = fw.asarray(rng.standard_normal((1, 16, 1, 32)), dtype)
    for scale in (1e38, -1e38, 1.8e27):
        with pytest.raises(ValueError, match=r"\|softmax_scale\| must be <= 1.718e\+27 for head_dim 32, got"):
            fw.ops.flash_attention(q, q, q, softmax_scale=scale)
    for options in (dict(softmax_scale=1.7e27), dict(softmax_scale=-1.7e27),
                    dict(softmax_scale=1e38, logits_soft_cap=1.0)):
        arrays, values, _, _ = _make(fw, rng, 1, 16, 16, 1, 1, 32, dtype)
        out, lse = (fw.to_numpy(a) for a in _op(fw, options, {})(*arrays, return_lse=True))
        want_out, want_lse = (t.numpy() for t in _ref(options, {})(*map(ref._t, values), return_lse=True))
        assert rel_error(out, want_out) < TOLERANCE[dtype], options
        assert lse_error(lse, want_lse) < 1e-5, options


@pytest.mark.parametrize("cap", [128.0, 1e4, 1e6, 1e30, 1e36, 1e38])
def test_large_soft_cap_keeps_float32_accuracy(fw, rng, cap):
    # tanh(s / cap) at small arguments: its exp2 form (1 - e) / (1 + e) cancels, an error of about
    # cap * 3e-8 in the logits (out 7e-5 off at cap 1e4, 7e-3 at 1e6). Caps above 128 take the
    # precise form; 128 is the largest that keeps the fast one. From 1e30 times the scale a cap is
    # no cap: scale / cap was subnormal, which jax's CPU callbacks flush to 0 (0.72 off at 1e38).
    _check(fw, rng, (1, 16, 16, 2, 2, 32), "float32", dict(logits_soft_cap=cap, causal=True))


def test_only_large_soft_caps_take_the_precise_tanh():
    from triton_kernels import HOPPER
    from triton_kernels import flash_attention as fa

    def mode(cap):
        spec = fa.dense_spec((1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), ("bfloat16",) * 3, logits_soft_cap=cap)
        plans = [fa.forward_plan(spec, HOPPER), *fa.backward_plans(spec, HOPPER, False, False)]
        return {dict(p.constexprs).get("USE_SOFTCAP") for p in plans} - {None}

    assert [mode(c) for c in (None, 30.0, 128.0, 128.5, 1e6, 64**-0.5 * 1e30)] == [{0}, {1}, {1}, {2}, {2}, {0}]


def test_lse_gradient(fw, rng):
    arrays, values, _, _ = _make(fw, rng, 2, 19, 25, 2, 1, 32, "float32")
    c_out, c_lse = rng.standard_normal((2, 19, 2, 32)), rng.standard_normal((2, 2, 19))

    def loss(op, q, k, v, c1, c2):
        out, lse = op(q, k, v, return_lse=True)
        return (out * c1).sum() + (lse * c2).sum()

    op = _op(fw, dict(causal=True), {})
    c1, c2 = fw.asarray(c_out), fw.asarray(c_lse)
    grads = fw.vjp(lambda q, k, v: loss(op, q, k, v, c1, c2), arrays, fw.asarray(np.float32(1.0)))
    t1, t2 = ref._t(c_out), ref._t(c_lse)
    expected = ref.vjp(lambda q, k, v: loss(_ref(dict(causal=True), {}), q, k, v, t1, t2), values, 1.0, n_diff=3)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"], name


# -- varlen -----------------------------------------------------------------------------------------


def _varlen_case(fw, rng, dtype, cu_q, cu_k, heads_q=4, heads_kv=2, head_dim=32):
    total_q, total_k = cu_q[-1], cu_k[-1]
    shapes = [(total_q, heads_q, head_dim), (total_k, heads_kv, head_dim), (total_k, heads_kv, head_dim)]
    arrays = [fw.asarray(rng.standard_normal(s), dtype) for s in shapes]
    cu = [fw.asarray(np.array(c, np.int32)) for c in (cu_q, cu_k)]
    max_q, max_k = max(np.diff(cu_q)), max(np.diff(cu_k))
    return arrays, [fw.to_numpy(a) for a in arrays], cu, (int(max_q), int(max_k))


@pytest.mark.parametrize("dtype, options", [("float32", dict(causal=True)), ("bfloat16", dict(sliding_window=(5, 2))),
                                            ("float16", dict(logits_soft_cap=3.0))])
def test_varlen_matches_float64(fw, rng, dtype, options):
    cu_q, cu_k = [0, 5, 5, 22, 40], [0, 7, 9, 20, 45]  # an empty query sequence, seq_q != seq_k
    arrays, values, cu, maxes = _varlen_case(fw, rng, dtype, cu_q, cu_k)

    def op(q, k, v, return_lse=False):
        return fw.ops.flash_attention_varlen(q, k, v, *cu, *maxes, return_lse=return_lse, **options)

    def reference(q, k, v, return_lse=False):
        return ref.flash_attention_varlen(q, k, v, ref._t(np.array(cu_q)), ref._t(np.array(cu_k)), *maxes,
                                          return_lse=return_lse, **options)

    out, lse = (fw.to_numpy(t) for t in op(*arrays, return_lse=True))
    want_out, want_lse = (t.numpy() for t in reference(*(ref._t(a) for a in values), return_lse=True))
    assert rel_error(out, want_out) < TOLERANCE[dtype]
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert lse_error(lse[finite], want_lse[finite]) < 1e-5
    dout = fw.asarray(rng.standard_normal(out.shape), dtype)
    grads = fw.vjp(op, arrays, dout)
    expected = ref.flash_vjp(reference, values, out, fw.to_numpy(dout), n_diff=3, varlen=True)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE[dtype], name


def test_varlen_equals_dense_for_equal_lengths(fw, rng):
    """Same lengths everywhere: varlen is the dense op on a reshape, dropout mask included."""
    arrays, _, _, _ = _make(fw, rng, 3, 11, 11, 2, 2, 32, "float32")
    cu = fw.asarray(np.arange(0, 34, 11, dtype=np.int32))
    opts = dict(causal=True, dropout_p=0.25, dropout_seed=7)
    dense = fw.to_numpy(fw.ops.flash_attention(*arrays, **opts))
    flat = [a.reshape(33, 2, 32) for a in arrays]
    packed = fw.to_numpy(fw.ops.flash_attention_varlen(*flat, cu, cu, 11, 11, **opts))
    np.testing.assert_array_equal(packed.reshape(dense.shape), dense)


# -- dropout ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_matches_reference_with_the_kernel_mask(fw, rng, dtype):
    p, seed = 0.3, 1234
    arrays, values, _, _ = _make(fw, rng, 2, 23, 30, 4, 2, 32, dtype)
    mask = fw.to_numpy(fw.ops.flash_attention_dropout_mask(seed, 2, 4, 23, 30, p))
    assert abs(mask.mean() - (1 - p)) < 0.03
    opts = dict(causal=True, dropout_p=p)

    def op(q, k, v):
        return fw.ops.flash_attention(q, k, v, dropout_seed=seed, **opts)

    def reference(q, k, v):
        return ref.flash_attention(q, k, v, dropout_mask=ref._t(mask), **opts)

    out = fw.to_numpy(op(*arrays))
    assert rel_error(out, ref.forward(reference, *values)) < TOLERANCE[dtype]
    dout = fw.asarray(rng.standard_normal(out.shape), dtype)
    grads = fw.vjp(op, arrays, dout)  # the backward regenerates the same mask
    for name, got, want in zip("qkv", grads, ref.vjp(reference, values, fw.to_numpy(dout), n_diff=3)):
        assert rel_error(got, want) < GRAD_TOLERANCE[dtype], name


def test_dropout_seed_changes_the_mask(fw):
    a = fw.to_numpy(fw.ops.flash_attention_dropout_mask(1, 1, 2, 16, 16, 0.5))
    b = fw.to_numpy(fw.ops.flash_attention_dropout_mask(2, 1, 2, 16, 16, 0.5))
    assert (a != b).any() and (a == fw.to_numpy(fw.ops.flash_attention_dropout_mask(1, 1, 2, 16, 16, 0.5))).all()


# -- torch vs jax -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(causal=True), dict(dropout_p=0.2, dropout_seed=99, sliding_window=(9, 4),
                                                             logits_soft_cap=4.0)])
def test_torch_and_jax_agree(torch_fw, jax_fw, rng, options):
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 37, 4, 40), (2, 45, 2, 40), (2, 45, 2, 40),
                                                                  (1, 4, 37, 45)]]
    dout = rng.standard_normal((2, 37, 4, 40)).astype(np.float32)
    seg = _segments(rng, 2, 37), _segments(rng, 2, 45)
    results = []
    for f in (torch_fw, jax_fw):
        args = [f.asarray(a) for a in inputs]
        extra = dict(q_segment_ids=f.asarray(seg[0]), kv_segment_ids=f.asarray(seg[1]), **options)
        op = _op(f, extra, {})
        out, lse = op(*args, return_lse=True)
        results.append([f.to_numpy(out), f.to_numpy(lse), *f.vjp(op, args, f.asarray(dout))])
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        finite = ~np.isneginf(a)
        assert np.max(np.abs(a[finite] - b[finite]), initial=0) <= 1e-6


def test_dropout_mask_needs_a_seed(fw):
    # The mask reproduces a given seed's: torch drew a random seed for None (a mask of no known
    # call), where jax raised.
    with pytest.raises(TypeError, match="dropout_seed must be an int or an integer array, got None"):
        fw.ops.flash_attention_dropout_mask(None, 1, 1, 4, 4, 0.5)


def test_dropout_masks_agree(torch_fw, jax_fw):
    masks = [f.to_numpy(f.ops.flash_attention_dropout_mask(-5, 2, 3, 33, 70, 0.1)) for f in (torch_fw, jax_fw)]
    np.testing.assert_array_equal(*masks)


def _record_plan_batches(monkeypatch) -> list[int]:
    """The batch of every flash plan made from now on (forward and backward), in order."""
    from triton_kernels import flash_attention as fa

    batches = []
    for name in ("forward_plan", "backward_plans"):
        real = getattr(fa, name)
        monkeypatch.setattr(fa, name, lambda spec, *a, _real=real: (batches.append(spec.batch), _real(spec, *a))[1])
    return batches


@pytest.mark.parametrize("bias_mapped", [False, True], ids=["shared-bias", "mapped-bias"])
def test_vmap_folds_the_mapped_axis_into_the_batch(fw, rng, monkeypatch, bias_mapped):
    # vmap ran the kernels once per sample (torch: its fallback for ops without a batching rule,
    # jax: the launches' lax.map). A dense call without dropout now folds the mapped axis into the
    # batch: one launch of each kernel, made for n * batch rows, with the per-sample values.
    n, b, sq, sk, h, d = 3, 2, 9, 11, 2, 16
    batches = _record_plan_batches(monkeypatch)
    q = rng.standard_normal((n, b, sq, h, d))
    k = rng.standard_normal((b, sk, h, d))  # the same for every sample
    v = rng.standard_normal((b, sk, h, d, n))  # mapped over its last axis
    bias = rng.standard_normal((n, 1, h, sq, sk) if bias_mapped else (1, h, sq, sk))
    in_dims = (0, 4, 0 if bias_mapped else None)

    def loss(q, v, bias):
        return (fw.ops.flash_attention(q, fw.asarray(k), v, causal=True, bias=bias) ** 2).sum()

    args = [fw.asarray(x) for x in (q, v, bias)]
    if fw.name == "torch":
        import torch

        grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=in_dims)(*args)
    else:
        import jax

        grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_dims)(*args)
        jaxpr = str(jax.make_jaxpr(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_dims))(*args))
        assert "scan[" not in jaxpr and "while[" not in jaxpr  # no per-sample loop left
    # jax also traces the unfolded call (unless a trace is cached), never launched
    assert set(batches) <= {n * b, b} if fw.name == "jax" else set(batches) == {n * b}
    assert batches.count(n * b) >= 2  # the forward and the backward ran folded

    for i in range(n):  # each sample's gradients, the shared bias's too
        qi, vi = ref._t(q[i]).requires_grad_(), ref._t(v[..., i]).requires_grad_()
        bi = ref._t(bias[i] if bias_mapped else bias).requires_grad_()
        (ref.flash_attention(qi, ref._t(k), vi, causal=True, bias=bi) ** 2).sum().backward()
        for got, want in zip(grads, (qi, vi, bi)):
            assert rel_error(fw.to_numpy(got)[i], want.grad.numpy()) < GRAD_TOLERANCE["float32"]


def test_vmap_over_an_empty_axis(fw, rng):
    # The fold rules recovered each sample's batch by dividing by the number of samples: a vmap
    # over an axis of size 0 raised ZeroDivisionError in both fronts, forward and backward.
    q = fw.asarray(rng.standard_normal((0, 2, 5, 2, 16)))
    bias = fw.asarray(rng.standard_normal((1, 2, 5, 5)))  # unmapped, differentiated

    def loss(q, bias):
        return (fw.ops.flash_attention(q, q, q, causal=True, bias=bias) ** 2).sum()

    out = fw.vmap(lambda q: fw.ops.flash_attention(q, q, q, causal=True, bias=bias), (0,))(q)
    dq, dbias = fw.vmap(fw.grad(loss, (0, 1)), (0, None))(q, bias)
    assert tuple(out.shape) == tuple(dq.shape) == (0, 2, 5, 2, 16)
    assert tuple(dbias.shape) == (0, 1, 2, 5, 5)


@pytest.mark.parametrize("bias_mapped", [False, True], ids=["shared-bias", "mapped-bias"])
def test_vmap_past_the_grid_limit_folds_in_several_launches(fw, rng, monkeypatch, bias_mapped):
    # The folded batch (samples x batch) is a grid axis, at most 65535: a vmap over 300 samples of
    # a batch-256 call raised "batch (76800) and heads (1) must each be <= 65535" in both fronts,
    # where each sample's call runs. Samples past the limit now go to further launches. (The limit
    # is lowered here: 65536 programs are minutes under the interpreter.)
    from triton_kernels import flash_attention as fa

    monkeypatch.setattr(fa.plan, "MAX_GRID_YZ", 8)
    n, b, s, h, d = 5, 2, 6, 2, 16  # folded: 10 rows, launched as 4 + 1 samples (8 + 2 rows)
    batches = _record_plan_batches(monkeypatch)
    q = rng.standard_normal((n, b, s, h, d))
    k = rng.standard_normal((b, s, h, d))  # the same for every sample
    bias = rng.standard_normal((n, 1, h, s, s) if bias_mapped else (1, h, s, s))
    in_dims = (0, 0 if bias_mapped else None)

    def attend(q, bias):
        return fw.ops.flash_attention(q, fw.asarray(k), fw.asarray(k), causal=True, bias=bias)

    def loss(q, bias):
        return (attend(q, bias) ** 2).sum()

    args = [fw.asarray(x) for x in (q, bias)]
    out = fw.to_numpy(fw.vmap(attend, in_dims)(*args))
    dq, dbias = (fw.to_numpy(g) for g in fw.vmap(fw.grad(loss, (0, 1)), in_dims)(*args))
    assert batches and max(batches) <= 8 and 8 in batches
    for i in range(n):
        qi, bi = ref._t(q[i]).requires_grad_(), ref._t(bias[i] if bias_mapped else bias).requires_grad_()
        want = ref.flash_attention(qi, ref._t(k), ref._t(k), causal=True, bias=bi)
        assert rel_error(out[i], want.detach().numpy()) < TOLERANCE["float32"]
        (want ** 2).sum().backward()
        assert rel_error(dq[i], qi.grad.numpy()) < GRAD_TOLERANCE["float32"]
        assert rel_error(dbias[i], bi.grad.numpy()) < GRAD_TOLERANCE["float32"]


# -- jax transforms ---------------------------------------------------------------------------------


def test_jax_eager_calls_skip_the_vmap_rules(jax_fw, rng, monkeypatch):
    # A custom_vmap function traces itself on every eager call: the fold and launch rules cost an
    # eager call about 0.2 ms each on CPU. Concrete inputs cannot be vmapped, so they skip both.
    import sys

    import jax.numpy as jnp

    import ejkernel_jax as ejj

    fa_ops, launch = sys.modules["ejkernel_jax.ops.flash_attention"], sys.modules["ejkernel_jax.launch"]
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 16)), jnp.float32) for _ in range(3))
    want = ejj.flash_attention(q, k, v, causal=True)

    def refuse(*_):
        raise AssertionError("an eager call went through a vmap rule")
    monkeypatch.setattr(fa_ops, "_folding", refuse)
    monkeypatch.setattr(launch, "_batchable", refuse)
    np.testing.assert_array_equal(np.asarray(ejj.flash_attention(q, k, v, causal=True)), np.asarray(want))


def test_jax_jit_grad_vmap(jax_fw, rng):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ejj

    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, 13, 2, 16)), jnp.float32) for _ in range(3))
    seed = jnp.asarray([11, 12, 13], jnp.int32)

    def loss(q, k, v, s):
        return (ejj.flash_attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=s) ** 2).sum()

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, seed)  # traced seeds too
    for i in range(3):
        one = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], int(seed[i]))
        for a, b in zip(grads, one):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_jax_bias_gradient_only_when_needed(jax_fw, rng):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ejj

    q, k, v = (jnp.asarray(rng.standard_normal((1, 9, 2, 16)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 1, 9, 9)), jnp.float32)
    scratch = "f32[1,2,9,9]"  # the [batch, heads_q, seq_q, seq_k] dS a bias gradient needs
    assert scratch not in str(jax.make_jaxpr(jax.grad(lambda q: ejj.flash_attention(q, k, v, bias=bias).sum()))(q))
    grad_bias = jax.grad(lambda b: ejj.flash_attention(q, k, v, bias=b).sum())
    assert scratch in str(jax.make_jaxpr(grad_bias)(bias))
    dbias = grad_bias(bias)
    assert dbias.shape == bias.shape


# -- bad input --------------------------------------------------------------------------------------


def _bad_cases():
    f32 = np.float32
    return [
        (dict(q=np.zeros((3, 5, 4, 16), f32)), ValueError, "k/v .* must match q"),
        (dict(q=np.zeros((5, 2, 16), f32)), ValueError, "q must be 4-D"),
        (dict(v=np.zeros((2, 6, 2, 16), f32)), ValueError, "k and v must have one shape"),
        (dict(v=np.zeros((2, 5, 2, 16), np.float16)), TypeError, "q, k, v must share one dtype"),
        (dict(q=np.zeros((2, 5, 4, 16), np.int32)), TypeError, "q must be a float"),
        (dict(q=np.zeros((2, 5, 3, 16), f32)), ValueError, "multiple of heads of k/v"),
        (dict(q=np.zeros((2, 5, 4, 300), f32), k=np.zeros((2, 5, 2, 300), f32), v=np.zeros((2, 5, 2, 300), f32)),
         ValueError, "head_dim must be between 1 and 256"),
        (dict(sliding_window=-1), ValueError, "sliding_window must be >= 0"),
        (dict(sliding_window=(2, 3, 4)), ValueError, "sliding_window must be an int or a"),
        (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be a finite number > 0"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(bias=np.zeros((2, 3, 5, 5), f32)), ValueError, "bias must broadcast"),
        (dict(q_segment_ids=np.zeros((2, 5), np.int32)), ValueError, "pass both q_segment_ids and kv_segment_ids"),
        (dict(q_segment_ids=np.zeros((2, 4), np.int32), kv_segment_ids=np.zeros((2, 5), np.int32)), ValueError,
         r"q_segment_ids must have shape \(2, 5\)"),
        (dict(q_segment_ids=np.zeros((2, 5), f32), kv_segment_ids=np.zeros((2, 5), f32)), TypeError,
         "q_segment_ids must be an integer"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(softmax_scale=True), TypeError, "softmax_scale must be a float or None, got True"),
        (dict(softmax_scale=np.True_), TypeError, "softmax_scale must be a float or None"),
        (dict(logits_soft_cap="5"), TypeError, "logits_soft_cap must be a float or None"),
        (dict(dropout_p=np.bool_(False)), TypeError, "dropout_p must be a float"),
        (dict(sliding_window=np.float32(2)), TypeError, r"sliding_window \(left\) must be an int"),
        (dict(sliding_window=(True, 2)), TypeError, r"sliding_window \(left\) must be an int"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale=3e38), ValueError, r"\|softmax_scale\| <= 2.359e\+38 \(float32\), got 3e\+38"),
        (dict(softmax_scale=1e38, logits_soft_cap=1e-3), ValueError,
         r"softmax_scale=1e\+38 \(logits_soft_cap=0.001\) gives a logit scale beyond float32.s range"),
        (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap must be a finite number > 0"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_cases())
def test_bad_input(fw, kwargs, error, match):
    f32 = np.float32
    args = dict(q=np.zeros((2, 5, 4, 16), f32), k=np.zeros((2, 5, 2, 16), f32), v=np.zeros((2, 5, 2, 16), f32))
    args |= {n: kwargs[n] for n in "qkv" if n in kwargs}
    options = {n: fw.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items() if n not in "qkv"}
    with pytest.raises(error, match=match):
        fw.ops.flash_attention(*(fw.asarray(args[n]) for n in "qkv"), **options)


@pytest.mark.parametrize("numpy_options, python_options", [
    (dict(causal=np.True_), dict(causal=True)),
    (dict(softmax_scale=np.float32(0.5)), dict(softmax_scale=0.5)),
    (dict(softmax_scale=np.int64(1)), dict(softmax_scale=1)),
    (dict(logits_soft_cap=np.float32(2.0)), dict(logits_soft_cap=2.0)),
    (dict(sliding_window=np.int64(1)), dict(sliding_window=1)),
    (dict(sliding_window=(np.int32(2), np.int64(0))), dict(sliding_window=(2, 0))),
    (dict(dropout_p=np.float32(0.5), dropout_seed=3), dict(dropout_p=0.5, dropout_seed=3)),
    (dict(autotune=np.False_), dict(autotune=False)),
])
def test_numpy_scalar_options(fw, numpy_options, python_options):
    # numpy scalars (from np.linspace, a config array, np.float32 arithmetic) are what Python's
    # are: np.float32(0.5) as softmax_scale or np.int64(1) as a window side was a TypeError.
    x = fw.asarray(np.random.default_rng(0).standard_normal((1, 6, 2, 16)), "float32")
    expected = fw.to_numpy(fw.ops.flash_attention(x, x, x, **python_options))
    np.testing.assert_array_equal(fw.to_numpy(fw.ops.flash_attention(x, x, x, **numpy_options)), expected)
    packed, cu = x[0], fw.asarray(np.array([0, 2, 6], np.int32))
    expected = fw.to_numpy(fw.ops.flash_attention_varlen(packed, packed, packed, cu, cu, 4, 4, **python_options))
    np.testing.assert_array_equal(
        fw.to_numpy(fw.ops.flash_attention_varlen(packed, packed, packed, cu, cu, 4, 4, **numpy_options)), expected)


def test_checks_do_not_depend_on_earlier_calls(fw):
    # 1 == True == 1.0 hash alike: a cached good call must not let a bad type through afterwards.
    x = fw.asarray(np.zeros((1, 8, 2, 16), np.float32))
    for bad, good in ((dict(causal=1), dict(causal=True)), (dict(softmax_scale=True), dict(softmax_scale=1.0)),
                      (dict(sliding_window=(True, 2)), dict(sliding_window=(1, 2))),
                      (dict(return_lse="no"), dict(return_lse=False))):
        fw.ops.flash_attention(x, x, x, **good)
        with pytest.raises(TypeError):
            fw.ops.flash_attention(x, x, x, **bad)
    packed, cu = fw.asarray(np.zeros((8, 2, 16), np.float32)), fw.asarray(np.array([0, 8], np.int32))
    fw.ops.flash_attention_varlen(packed, packed, packed, cu, cu, 8, 8)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got float"):
        fw.ops.flash_attention_varlen(packed, packed, packed, cu, cu, 8.0, 8)


@pytest.mark.parametrize("options, match", [
    (dict(causal=np.array(True)), "causal must be a bool"),
    (dict(softmax_scale=np.array(0.5)), "softmax_scale must be a float or None"),
    (dict(logits_soft_cap=[5.0]), "logits_soft_cap must be a float or None"),
    (dict(dropout_p=np.array(0.1), dropout_seed=1), "dropout_p must be a float"),
    (dict(sliding_window={}), r"sliding_window \(left\) must be an int"),
])
def test_unhashable_options_are_named(fw, options, match):
    # The spec cache hashed the options first: "TypeError: unhashable type: 'numpy.ndarray'",
    # naming no argument.
    x, cu = fw.asarray(np.zeros((1, 4, 1, 16), np.float32)), fw.asarray(np.array([0, 4], np.int32))
    with pytest.raises(TypeError, match=match):
        fw.ops.flash_attention(x, x, x, **options)
    with pytest.raises(TypeError, match=match):
        fw.ops.flash_attention_varlen(x[0], x[0], x[0], cu, cu, 4, 4, **options)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got list"):
        fw.ops.flash_attention_varlen(x[0], x[0], x[0], cu, cu, [4], 4)


def test_jax_traced_options_are_named(jax_fw):
    # Options are static: a traced one failed in the spec cache ("unhashable type: 'DynamicJaxprTracer'").
    # The error also says why a traced value is refused (it showed only "got JitTracer(~float32[])").
    import jax

    static = r"got a traced value .*the option is static: pass a Python value"

    x, cu = jax_fw.asarray(np.zeros((1, 4, 1, 16), np.float32)), jax_fw.asarray(np.array([0, 4], np.int32))
    for name, value, match in (("causal", True, "causal must be a bool"),
                               ("softmax_scale", 0.5, "softmax_scale must be a float or None"),
                               ("logits_soft_cap", 5.0, "logits_soft_cap must be a float or None"),
                               ("sliding_window", 2, r"sliding_window \(left\) must be an int")):
        with pytest.raises(TypeError, match=f"{match}.*{static}"):
            jax.jit(lambda o: jax_fw.ops.flash_attention(x, x, x, **{name: o}))(value)
    with pytest.raises(TypeError, match=f"max_seqlen_q must be an int, {static}"):
        jax.jit(lambda n: jax_fw.ops.flash_attention_varlen(x[0], x[0], x[0], cu, cu, n, 4))(4)


@pytest.mark.parametrize("max_seqlen, error, message", [
    (np.int64(8), None, None),  # numpy ints are ints, as elsewhere
    (-1, ValueError, r"max_seqlen_k must be in \[0, 2\*\*31\), got -1"),
    (2**40, ValueError, r"max_seqlen_k must be in \[0, 2\*\*31\), got 1099511627776"),
    (True, TypeError, "max_seqlen_k must be an int, got a bool"),
])
def test_max_seqlen_values(fw, max_seqlen, error, message):
    packed, cu = fw.asarray(np.ones((8, 2, 16), np.float32)), fw.asarray(np.array([0, 3, 8], np.int32))
    call = lambda: fw.ops.flash_attention_varlen(packed, packed, packed, cu, cu, 5, max_seqlen)
    if error is None:
        out = fw.to_numpy(call())  # v is all ones: every row that attends anything gives ones
        assert np.array_equal(out, np.ones_like(out))
    else:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize("max_seqlen_k", [2**31 - 12, 2**31 - 1])
@pytest.mark.parametrize("options", [dict(causal=True), dict(sliding_window=(1, None))])
def test_varlen_window_with_a_huge_max_seqlen(fw, rng, max_seqlen_k, options):
    # An unbounded window side became max_seqlen_q + max_seqlen_k: past 2**31 - 1 the launch failed
    # naming an internal scalar ('scalar win_left=2147483654 does not fit int32'), and just below it
    # the kernels' int32 window sums wrapped and every row came out 0, silently. The lengths are
    # also bounded by the packed token counts, which keep the sides small.
    q = fw.asarray(rng.standard_normal((8, 2, 16)), "float32")
    k, v = (fw.asarray(rng.standard_normal((3, 1, 16)), "float32") for _ in range(2))
    cu_q, cu_k = fw.asarray(np.array([0, 8], np.int32)), fw.asarray(np.array([0, 3], np.int32))
    out = fw.to_numpy(fw.ops.flash_attention_varlen(q, k, v, cu_q, cu_k, 8, max_seqlen_k, **options))
    want = ref.flash_attention(*(ref._t(fw.to_numpy(x))[None] for x in (q, k, v)), **options)[0].numpy()
    assert rel_error(out, want) < TOLERANCE["float32"]
    dv = fw.vjp(lambda v: fw.ops.flash_attention_varlen(q, k, v, cu_q, cu_k, 8, max_seqlen_k, **options), [v],
                fw.asarray(np.ones(out.shape), "float32"))[0]
    reference = lambda v: ref.flash_attention(*(ref._t(fw.to_numpy(x))[None] for x in (q, k)), v[None], **options)[0]
    assert rel_error(dv, ref.vjp(reference, [fw.to_numpy(v)], np.ones(out.shape), n_diff=1)[0]) < 2e-5


def test_varlen_grids_cover_the_packed_tokens_only():
    # Programs past the packed tokens return at once, but a generous max_seqlen (2**31 - 1 is
    # accepted) launched millions of them: hours a call in the interpreter, for 8 tokens.
    from triton_kernels import HOPPER
    from triton_kernels import flash_attention as fa
    from triton_kernels.plan import DeviceFacts

    spec = fa.varlen_spec((8, 2, 16), (3, 1, 16), (3, 1, 16), ("bfloat16",) * 3, (2,), "int32", (2,), "int32",
                          2**31 - 1, 2**31 - 1, causal=True)
    for facts in (HOPPER, DeviceFacts.cpu()):
        plans = [fa.forward_plan(spec, facts), *fa.backward_plans(spec, facts, False, False)]
        assert [p.grid for p in plans] == [(1, 2, 1), (1, 2, 1), (1, 1, 1)], facts  # forward, dq, dk/dv


def check_dq_plan(fw, rng, plan, spec, q_shape, kv_shape, cu=None) -> None:
    """Runs a dq plan (``plan``: what ``backward_plans(..., use_dlse=True).dq`` gives) on random
    bf16 q, k, v, o, dO and float32 lse, dlse, and checks the dq and delta it returns against
    ``references.flash_dq_delta``: every row (outputs are poisoned), delta to 1e-6."""
    from triton_kernels import flash_attention as fa

    q, k, v, o, do = (fw.asarray(rng.standard_normal(shape), "bfloat16")
                      for shape in (q_shape, kv_shape, kv_shape, q_shape, q_shape))
    lse = fw.asarray(rng.standard_normal(spec.lse_shape) + 3.0, "float32")
    dlse = fw.asarray(rng.standard_normal(spec.lse_shape), "float32")
    features = [q, k, v] + [fw.asarray(np.zeros(1), dtype) for dtype in fa.feature_dtypes(spec)[3:]]
    if cu is not None:
        features[6] = features[7] = fw.asarray(cu)
    arrays = fa.backward_inputs(features, o, do, lse, dlse)
    got = dict(zip(plan.result_names, fw.launch(plan, *plan.inputs_from(arrays))))
    want_dq, want_delta = ref.flash_dq_delta(*(fw.to_numpy(x) for x in (q, k, v, o, do, lse, dlse)),
                                             spec.softmax_scale, spec.window is not None, cu)
    assert rel_error(fw.to_numpy(got["delta_ptr"]), want_delta) < 1e-6
    assert rel_error(fw.to_numpy(got["dq_ptr"]), want_dq) < GRAD_TOLERANCE["bfloat16"]


@pytest.mark.parametrize("varlen", [False, True])
def test_triton_dq_stores_delta_for_every_row(fw, rng, varlen):
    """The Triton dq kernel runs before dk/dv and stores delta = rowsum(o * do) - dlse (the lse
    layout) for them, with the dq made from it (``check_dq_plan``). Odd sizes, GQA."""
    from triton_kernels import flash_attention as fa
    from triton_kernels.plan import DeviceFacts

    heads_q, heads_kv, head_dim = 3, 1, 40
    cu = None
    if varlen:
        lengths = [13, 1, 22]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        q_shape, kv_shape = (int(cu[-1]), heads_q, head_dim), (int(cu[-1]), heads_kv, head_dim)
        spec = fa.varlen_spec(q_shape, kv_shape, kv_shape, ("bfloat16",) * 3, cu.shape, "int32", cu.shape, "int32",
                              max(lengths), max(lengths), causal=True)
    else:
        q_shape, kv_shape = (2, 37, heads_q, head_dim), (2, 29, heads_kv, head_dim)
        spec = fa.dense_spec(q_shape, kv_shape, kv_shape, ("bfloat16",) * 3, causal=True)
    plans = fa.backward_plans(spec, DeviceFacts.cpu(), False, True)
    assert list(plans) == [plans.dq, plans.dkdv]  # dq first: it computes delta
    check_dq_plan(fw, rng, plans.dq, spec, q_shape, kv_shape, cu)


def test_uint32_dropout_seed_is_read_as_its_bits(fw):
    # jax.random.bits gives uint32 seeds; they select the same mask as the int32 of the same bits.
    x = fw.asarray(np.random.default_rng(0).standard_normal((1, 16, 1, 16)), "float32")
    seed = np.uint32(3_000_000_000)
    a = fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=fw.asarray(np.array([seed])))
    b = fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=int(seed))
    np.testing.assert_array_equal(fw.to_numpy(a), fw.to_numpy(b))


def test_numpy_integer_dropout_seed_is_an_int(fw):
    # Seeds drawn with numpy (rng.integers, np.random.randint) are numpy integers: the same mask as
    # the Python int, not a TypeError (jax's said "must be a jax.Array").
    x = fw.asarray(np.random.default_rng(0).standard_normal((1, 16, 1, 16)), "float32")
    want = fw.to_numpy(fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=3_000_000_000))
    # numpy arrays too, read on the host as ints (torch refused them; an int64 one past int32
    # raised in jax but wrapped in torch)
    for seed in (np.int64(3_000_000_000), np.uint32(3_000_000_000), np.array(3_000_000_000),
                 np.array([3_000_000_000], np.uint32)):
        got = fw.to_numpy(fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=seed))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"dropout_seed must be an integer array \(.*uint32\), got float64"):
        fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=np.array(5.0))  # jax named float32
    mask = fw.to_numpy(fw.ops.flash_attention_dropout_mask(np.int32(5), 1, 1, 4, 4, 0.5))
    np.testing.assert_array_equal(mask, fw.to_numpy(fw.ops.flash_attention_dropout_mask(5, 1, 1, 4, 4, 0.5)))
    for bad in (5.0, np.bool_(True), "5"):
        for p in (0.5, 0.0):  # an unused seed is still checked (a bad one passed silently at p=0)
            with pytest.raises(TypeError, match="dropout_seed must be an int or an integer array"):
                fw.ops.flash_attention(x, x, x, dropout_p=p, dropout_seed=bad)


@pytest.mark.parametrize("sizes, error, match", [
    ((-1, 2, 4, 4), ValueError, "batch must be >= 0, got -1"), ((1, 2, -4, 4), ValueError, "seq_q must be >= 0"),
    ((1, 2, 4, -4), ValueError, "seq_k must be >= 0"), ((1, 1.5, 4, 4), TypeError, "heads must be an int"),
    ((1, 2, 4.0, 4), TypeError, "seq_q must be an int"), ((True, 2, 4, 4), TypeError, "batch must be an int"),
    # named, not "grid (1, 70000, 1) exceeds CUDA's limits"
    ((1, 70_000, 4, 4), ValueError, "heads must be <= 65535 .*got 70000"),
    ((70_000, 1, 4, 4), ValueError, "batch must be <= 65535 .*got 70000"),
])
def test_bad_dropout_mask_sizes(fw, sizes, error, match):
    # Were unchecked: "bad grid (1, 2, -1)", torch.empty's or jax's shape errors, or a float size
    # taken when a plan for equal ints was cached.
    fw.ops.flash_attention_dropout_mask(1, 1, 2, 4, 4, 0.5)
    with pytest.raises(error, match=match):
        fw.ops.flash_attention_dropout_mask(1, *sizes, 0.5)
    assert fw.to_numpy(fw.ops.flash_attention_dropout_mask(1, np.int64(1), 2, 4, 4, 0.5)).shape == (1, 2, 4, 4)


def _bad_varlen_cases():
    return [
        (dict(cu_q=np.array([0, 5, 3, 10], np.int32)), ValueError, "cu_seqlens_q must be non-decreasing"),
        (dict(cu_q=np.array([0, 5, 8, 10], np.int16)), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_k=np.array([1, 5, 8, 10], np.int32)), ValueError, "cu_seqlens_k must start at 0"),
        (dict(cu_k=np.array([0, 5, 8, 12], np.int32)), ValueError, "cu_seqlens_k ends at 12"),
        (dict(max_q=3), ValueError, "length 5 > max_seqlen 3"),
        (dict(cu_k=np.array([0, 5, 10], np.int32)), ValueError, "must have one shape"),
        (dict(bias=np.zeros((1, 1, 5, 5), np.float32)), ValueError, "takes no bias"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_varlen_cases())
def test_bad_varlen_input(fw, kwargs, error, match):
    x = fw.asarray(np.zeros((10, 2, 16), np.float32))
    args = dict(cu_q=np.array([0, 5, 8, 10], np.int32), cu_k=np.array([0, 5, 8, 10], np.int32), max_q=5,
                max_k=5) | kwargs
    bias = args.get("bias")
    with pytest.raises(error, match=match):
        fw.ops.flash_attention_varlen(x, x, x, fw.asarray(args["cu_q"]), fw.asarray(args["cu_k"]), args["max_q"],
                                      args["max_k"], bias=None if bias is None else fw.asarray(bias))


def test_torch_varlen_reads_cu_seqlens_once_until_written(torch_fw, monkeypatch):
    # Every attention layer of a packed batch gets the same cu_seqlens; each read is a host sync.
    # Read once per tensor and version: a bad value written in place is still refused by name.
    import torch

    from ejkernel_torch.ops import _common

    reads = []
    real_values = _common._values
    monkeypatch.setattr(_common, "_values", lambda t: reads.append(t.tolist()) or real_values(t))
    x = torch.randn(10, 2, 16, device=torch_fw.device)
    cu = torch.tensor([0, 5, 8, 10], dtype=torch.int32, device=torch_fw.device)
    first = torch_fw.ops.flash_attention_varlen(x, x, x, cu, cu, 5, 5)
    assert torch.equal(torch_fw.ops.flash_attention_varlen(x, x, x, cu, cu, 5, 5), first)
    assert reads == [[0, 5, 8, 10]] * 2  # one read of the two arguments, in the first call
    with pytest.raises(ValueError, match="length 5 > max_seqlen 4"):  # checked again on the values read
        torch_fw.ops.flash_attention_varlen(x, x, x, cu, cu, 4, 5)
    cu[2] = 4
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        torch_fw.ops.flash_attention_varlen(x, x, x, cu, cu, 5, 5)
    assert len(reads) == 4


def test_varlen_vmap_over_cu_seqlens(fw, rng):
    # torch.func.vmap over cu_seqlens failed reading them for the value checks ("Cannot access
    # data pointer of Tensor that doesn't have storage"); jax.vmap worked. Batched values are not
    # read, as under jit: the results equal unbatched calls.
    q = fw.asarray(rng.standard_normal((6, 2, 16)), "float32")
    cu = fw.asarray(np.array([[0, 2, 6], [0, 6, 6], [0, 3, 6]], np.int32))
    out = fw.vmap(lambda c: fw.ops.flash_attention_varlen(q, q, q, c, c, 6, 6, causal=True), (0,))(cu)
    for i in range(3):
        one = fw.ops.flash_attention_varlen(q, q, q, cu[i], cu[i], 6, 6, causal=True)
        np.testing.assert_array_equal(fw.to_numpy(out)[i], fw.to_numpy(one))


def test_dropout_needs_a_seed_in_jax(jax_fw):
    x = jax_fw.asarray(np.zeros((1, 4, 1, 16), np.float32))
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        jax_fw.ops.flash_attention(x, x, x, dropout_p=0.5)


def test_jax_typed_keys_are_refused_by_name(jax_fw):
    # A typed key (jax.random.key, Flax NNX's rngs) has an extended dtype: reading its name failed
    # with "Cannot interpret 'key<fry>' as a data type", naming no argument.
    import jax

    x, key = jax_fw.asarray(np.zeros((1, 4, 1, 16), np.float32)), jax.random.key(0)
    with pytest.raises(TypeError, match=r"dropout_seed must be an integer array \(.*\), got key<fry>"):
        jax_fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=key)
    with pytest.raises(TypeError, match=r"dropout_seed must be an integer array \(.*\), got key<fry>"):
        jax_fw.ops.flash_attention_dropout_mask(key, 1, 1, 4, 4, 0.5)
    with pytest.raises(TypeError, match="q must be a float16, bfloat16 or float32 array, got key<fry>"):
        jax_fw.ops.flash_attention(jax.random.split(key, (1, 4, 1, 16)), x, x)


def test_mismatched_devices_or_types(torch_fw):
    import torch

    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        torch_fw.ops.flash_attention(x, np.zeros((1, 4, 1, 16)), x)
    with pytest.raises(ValueError, match="meta"):
        torch_fw.ops.flash_attention(x, x.to("meta"), x)


_JAX_DEVICES_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ejkernel_jax as ek

d0, d1 = jax.devices()
on0 = lambda x: jax.device_put(np.asarray(x), d0)  # committed to that device
on1 = lambda x: jax.device_put(np.asarray(x), d1)
x = np.random.default_rng(0).standard_normal((2, 4, 2, 16)).astype(np.float32)
q, q1, x3 = on0(x), on1(x), on0(x[:, :, 0])
cu, n_pad, sizes = np.array([0, 3, 4], np.int32), np.array([0, 1], np.int32), np.array([5, 3], np.int32)
lhs, rhs = on0(np.ones((8, 16), np.float32)), np.ones((2, 16, 4), np.float32)
both = jax.device_put(x, NamedSharding(Mesh(np.array([d0, d1]), ("b",)), P("b")))
cases = [
    (lambda: ek.flash_attention(q, q1, q), "k is on cpu:1 but q is on cpu:0"),
    (lambda: ek.flash_attention(q, q, q, bias=on1(np.zeros((1, 2, 4, 4), np.float32))), "bias is on cpu:1"),
    (lambda: ek.flash_attention(q, q, q, q_segment_ids=on1(np.ones((2, 4), np.int32)),
                                kv_segment_ids=np.ones((2, 4), np.int32)), "q_segment_ids is on cpu:1"),
    (lambda: ek.flash_attention(q, q, q, dropout_p=0.5, dropout_seed=on1(np.int32(3))), "dropout_seed is on cpu:1"),
    (lambda: ek.flash_attention(both, q1, q1), "k is on cpu:1 but q is on [cpu:0, cpu:1]"),
    (lambda: ek.flash_attention_varlen(q[0], q[0], q[0], cu, on1(cu), 3, 3), "cu_seqlens_k is on cpu:1 but q"),
    # the other jax ops share the check
    (lambda: ek.padded_attention(x3, x3, on1(x[:, :, 0]), n_pad), "v is on cpu:1 but q is on cpu:0"),
    (lambda: ek.padded_softmax(on0(x[:, :, 0, :4]), on1(n_pad)), "n_pad is on cpu:1 but scores is on cpu:0"),
    (lambda: ek.padded_softmax_v(on0(x[:, :, 0, :4]), q1[:, :, 0], n_pad), "v is on cpu:1 but scores"),
    (lambda: ek.grouped_matmul(lhs, on1(rhs), sizes), "rhs is on cpu:1 but lhs is on cpu:0"),
    (lambda: ek.transposed_grouped_matmul(lhs.T, lhs, on1(sizes)), "group_sizes is on cpu:1 but lhs"),
]
for call, match in cases:
    try:
        call()
    except ValueError as e:
        assert match in str(e) and "device_put" in str(e), str(e)
    else:
        raise AssertionError(f"no error: {match}")
# One committed device (uncommitted arrays follow it) or one device set: runs, as before.
want = np.asarray(ek.flash_attention(x, x, x))
for args in [(q1, q1, q1), (q1, x, jnp.asarray(x)), (both, jax.device_put(x, both.sharding), both)]:
    np.testing.assert_array_equal(np.asarray(ek.flash_attention(*args)), want)
"""


def test_jax_arrays_on_different_devices_are_named():
    # Concrete arrays committed to different devices failed in jax with "Received incompatible
    # devices for jitted computation. Got argument args[0] of pure_callback ...", naming no
    # argument. Two host CPU devices need a flag set before jax is imported: a subprocess.
    frameworks.run_on_two_host_devices(_JAX_DEVICES_SCRIPT)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_non_dense_tensors_are_refused_by_name(torch_fw):
    # The kernels read strided memory. A jagged nested tensor (SDPA takes them) passed the checks
    # with its ragged size and failed in the dispatcher ("NotImplementedError:
    # ejkernel.flash_attention_fwd.default"); sparse, mkldnn and strided nested ones failed inside
    # torch ("unsupported memory format option Contiguous", ...), none naming the argument.
    import torch

    x = torch.zeros(1, 4, 1, 16)
    jagged = torch.nested.nested_tensor([torch.zeros(3, 1, 16), torch.zeros(5, 1, 16)], layout=torch.jagged)
    nested = torch.nested.nested_tensor([torch.zeros(3, 1, 16), torch.zeros(5, 1, 16)])
    with pytest.raises(TypeError, match="q must be a dense tensor .*got a nested tensor"):
        torch_fw.ops.flash_attention(jagged, jagged, jagged)
    for name, bad, match in (("k", jagged, "a nested tensor"), ("q", nested, "a nested tensor"),
                             ("v", x.to_sparse(), "layout torch.sparse_coo"),
                             ("q", x.to_mkldnn(), "layout torch._mkldnn")):
        args = dict(q=x, k=x, v=x) | {name: bad}
        with pytest.raises(TypeError, match=f"{name} must be a dense tensor .*got {match}"):
            torch_fw.ops.flash_attention(**args)
    for name, kwargs in (("bias", dict(bias=torch.zeros(1, 1, 4, 4).to_sparse())),
                         ("q_segment_ids", dict(q_segment_ids=torch.ones(1, 4, dtype=torch.int32).to_sparse(),
                                                kv_segment_ids=torch.ones(1, 4, dtype=torch.int32))),
                         ("dropout_seed", dict(dropout_p=0.5, dropout_seed=torch.tensor([3]).to_sparse()))):
        with pytest.raises(TypeError, match=f"{name} must be a dense tensor"):
            torch_fw.ops.flash_attention(x, x, x, **kwargs)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a dense tensor"):
        torch_fw.ops.flash_attention_varlen(x[0], x[0], x[0], cu.to_sparse(), cu, 4, 4)


def test_dropout_mask_seed_on_another_device_names_device(torch_fw):
    # flash_attention_dropout_mask has no q: a seed tensor on another device than device= (a CUDA
    # seed with the default device="cpu") said "dropout_seed is on cuda:0 but q is on cpu".
    import torch

    with pytest.raises(ValueError, match="dropout_seed is on meta but device= is cpu"):
        torch_fw.ops.flash_attention_dropout_mask(torch.tensor([3], device="meta"), 1, 1, 4, 4, 0.5)
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="dropout_seed is on meta but q is on cpu"):  # flash_attention has a q
        torch_fw.ops.flash_attention(x, x, x, dropout_p=0.5, dropout_seed=torch.tensor([3], device="meta"))


@pytest.mark.parametrize("seq_k", [0, 7])
def test_jax_flash_reference_matches_torch_reference(jax_fw, rng, seq_k):
    # ejkernel_jax.reference.flash_attention (the torch reference's mirror) failed without keys:
    # "ValueError: zero-size array to reduction operation max which has no identity", where the
    # torch reference and both fronts' kernels give 0 and lse -inf.
    import jax
    import jax.numpy as jnp

    from ejkernel_jax import reference as jax_ref

    q, k = rng.standard_normal((2, 5, 4, 16)), rng.standard_normal((2, seq_k, 2, 16))
    bias = rng.standard_normal((1, 4, 5, seq_k))
    opts = dict(causal=True, logits_soft_cap=3.0)
    with jax.enable_x64(True):
        out, lse = jax_ref.flash_attention(*map(jnp.asarray, (q, k, k)), bias=jnp.asarray(bias), return_lse=True,
                                           **opts)
        dq = jax.grad(lambda q: jax_ref.flash_attention(q, *map(jnp.asarray, (k, k)), bias=jnp.asarray(bias),
                                                        **opts).sum())(jnp.asarray(q))
    want_out, want_lse = ref.flash_attention(*map(ref._t, (q, k, k)), bias=ref._t(bias), return_lse=True, **opts)
    want_dq = ref.vjp(lambda q: ref.flash_attention(q, ref._t(k), ref._t(k), bias=ref._t(bias), **opts), [q],
                      np.ones(q.shape), n_diff=1)[0]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse.numpy()))
    finite = ~np.isneginf(want_lse.numpy())
    assert lse_error(np.asarray(lse)[finite], want_lse.numpy()[finite]) < 1e-12
    assert rel_error(np.asarray(out), want_out.numpy()) < 1e-12 if seq_k else not np.asarray(out).any()
    assert rel_error(np.asarray(dq), want_dq) < 1e-12 if seq_k else not np.asarray(dq).any()


def test_jax_flash_varlen_reference_matches_torch_reference(jax_fw, rng):
    # ejkernel_jax.reference ("plain jnp references for every op") had no flash_attention_varlen,
    # which ejkernel_torch.reference has. Sequences of 3, 0 and 4 queries, 2 padding tokens past the
    # last one, GQA, causal, soft cap and a dropout mask of the padded problem.
    import jax
    import jax.numpy as jnp
    import torch

    from ejkernel_jax import reference as jax_ref

    cu_q, cu_k = np.array([0, 3, 3, 7], np.int32), np.array([0, 2, 5, 9], np.int32)
    q, k, v = rng.standard_normal((9, 4, 16)), rng.standard_normal((9, 2, 16)), rng.standard_normal((9, 2, 16))
    mask = rng.random((3, 4, 4, 4)) > 0.3
    opts = dict(causal=True, logits_soft_cap=3.0, dropout_p=0.3)
    with jax.enable_x64(True):
        out, lse = jax_ref.flash_attention_varlen(*map(jnp.asarray, (q, k, v, cu_q, cu_k)), 4, 4,
                                                  dropout_mask=jnp.asarray(mask), return_lse=True, **opts)
    want_out, want_lse = ref.flash_attention_varlen(*map(ref._t, (q, k, v)), torch.tensor(cu_q), torch.tensor(cu_k),
                                                    4, 4, dropout_mask=torch.tensor(mask), return_lse=True, **opts)
    assert out.dtype == jnp.float64 and out.shape == (9, 4, 16) and lse.shape == (4, 9)
    np.testing.assert_allclose(np.asarray(out), want_out.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse.numpy(), rtol=1e-12, atol=1e-12)  # -inf rows, 0 tail
    assert not np.asarray(out)[7:].any()
