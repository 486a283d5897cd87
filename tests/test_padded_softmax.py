"""padded_softmax and padded_softmax_v vs float64, gradients, parity and bad input."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error, x64

DTYPES = ["float32", "float16", "bfloat16"]
GRAD_TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _case(fw, rng, batch, seq, dtype, head_dim=None):
    scores = fw.asarray(rng.standard_normal((batch, seq, seq)) * 2, dtype)
    n_pad_np = rng.integers(0, seq + 1, size=batch).astype(np.int32)
    n_pad_np[0] = 0  # always one unpadded sequence
    if batch > 1:
        n_pad_np[-1] = seq  # and one made entirely of padding
    case = dict(scores=scores, scores_np=fw.to_numpy(scores), n_pad=fw.asarray(n_pad_np), n_pad_np=n_pad_np)
    if head_dim:
        v = fw.asarray(rng.standard_normal((batch, seq, head_dim)), dtype)
        case.update(v=v, v_np=fw.to_numpy(v))
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 17), (2, 127), (3, 300)])
def test_padded_softmax_matches_float64(fw, rng, batch, seq, dtype):
    c = _case(fw, rng, batch, seq, dtype)
    y = fw.to_numpy(fw.ops.padded_softmax(c["scores"], c["n_pad"]))
    expected = ref.forward(ref.padded_softmax, c["scores_np"], c["n_pad_np"])
    assert rel_error(y, expected) < TOLERANCE[dtype]
    for b, pad in enumerate(c["n_pad_np"]):  # padding rows and columns are exactly zero
        assert not y[b, :pad].any() and not y[b, :, :pad].any()


def test_padded_softmax_long_rows(fw, rng):
    c = _case(fw, rng, 2, 1000, "float32")
    y = fw.to_numpy(fw.ops.padded_softmax(c["scores"], c["n_pad"]))
    assert rel_error(y, ref.forward(ref.padded_softmax, c["scores_np"], c["n_pad_np"])) < TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_softmax_gradient(fw, rng, dtype):
    c = _case(fw, rng, 3, 33, dtype)
    dy = fw.asarray(rng.standard_normal((3, 33, 33)), dtype)
    (ds,) = fw.vjp(lambda s: fw.ops.padded_softmax(s, c["n_pad"]), [c["scores"]], dy)
    (ds_ref,) = ref.vjp(ref.padded_softmax, [c["scores_np"], c["n_pad_np"]], fw.to_numpy(dy), n_diff=1)
    assert rel_error(ds, ds_ref) < GRAD_TOLERANCE[dtype]


@pytest.mark.parametrize("garbage", [np.nan, np.inf])
def test_padded_softmax_gradient_never_reads_constant_outputs(fw, rng, garbage):
    """Outside each row's window (padding rows and columns, keys after the query) the output is
    a constant 0, so the cotangent there does not matter: a NaN/inf there made the gradient of
    the whole row NaN (0 * NaN inside the row's sum), where the float64 reference gives 0."""
    batch, seq = 3, 23
    n_pad = np.array([0, 4, seq], np.int32)
    scores, dy = rng.standard_normal((2, batch, seq, seq))
    constant = np.triu(np.ones((seq, seq), bool), 1)[None] | np.zeros((batch, 1, 1), bool)
    for b, pad in enumerate(n_pad):
        constant[b, :pad] = constant[b, :, :pad] = True
    dirty = np.where(constant, garbage, dy)
    clean = np.where(constant, 0.0, dy)
    s_in, gs = fw.asarray(scores, "float32"), fw.asarray(n_pad)
    (got,) = fw.vjp(lambda s: fw.ops.padded_softmax(s, gs), [s_in], fw.asarray(dirty, "float32"))
    (want,) = ref.vjp(ref.padded_softmax, [scores, n_pad], clean, n_diff=1)
    assert not np.isnan(got).any() and rel_error(got, want) < GRAD_TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, head_dim", [(1, 1, 16), (3, 17, 24), (2, 127, 64), (2, 200, 3)])
def test_padded_softmax_v_matches_float64(fw, rng, batch, seq, head_dim, dtype):
    c = _case(fw, rng, batch, seq, dtype, head_dim)
    out = fw.to_numpy(fw.ops.padded_softmax_v(c["scores"], c["v"], c["n_pad"]))
    expected = ref.forward(ref.padded_softmax_v, c["scores_np"], c["v_np"], c["n_pad_np"])
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_softmax_v_gradient(fw, rng, dtype):
    c = _case(fw, rng, 3, 29, dtype, head_dim=40)
    dout = fw.asarray(rng.standard_normal((3, 29, 40)), dtype)
    grads = fw.vjp(lambda s, v: fw.ops.padded_softmax_v(s, v, c["n_pad"]), [c["scores"], c["v"]], dout)
    expected = ref.vjp(ref.padded_softmax_v, [c["scores_np"], c["v_np"], c["n_pad_np"]], fw.to_numpy(dout), n_diff=2)
    for got, want in zip(grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE[dtype]


@pytest.mark.parametrize("garbage", [np.nan, np.inf])
def test_padded_softmax_v_never_reads_padding(fw, rng, garbage):
    """Padding rows of v and of the cotangent, and scores of padding queries or keys, may hold
    anything: results are those of zero padding (a probability of 0 times a NaN row of v used
    to make every row of its sequence NaN)."""
    batch, seq, dim = 3, 37, 16
    n_pad = np.array([0, 5, 20], np.int32)
    scores, v, dout = rng.standard_normal((batch, seq, seq)), *rng.standard_normal((2, batch, seq, dim))
    dirty = [x.copy() for x in (scores, v, dout)]
    for b, pad in enumerate(n_pad):
        v[b, :pad] = dout[b, :pad] = scores[b, :pad] = scores[b, :, :pad] = 0.0
        dirty[1][b, :pad] = dirty[2][b, :pad] = dirty[0][b, :pad] = dirty[0][b, :, :pad] = garbage
    s_in, v_in, dout_in = (fw.asarray(x, "float32") for x in dirty)
    gs = fw.asarray(n_pad)
    out = fw.to_numpy(fw.ops.padded_softmax_v(s_in, v_in, gs))
    grads = fw.vjp(lambda s, v: fw.ops.padded_softmax_v(s, v, gs), [s_in, v_in], dout_in)
    assert rel_error(out, ref.forward(ref.padded_softmax_v, scores, v, n_pad)) < TOLERANCE["float32"]
    expected = ref.vjp(ref.padded_softmax_v, [scores, v, n_pad], dout, n_diff=2)
    for name, got, want in zip(("scores", "v"), grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"], name
        assert not np.isnan(got).any(), name
    for b, pad in enumerate(n_pad):
        assert not out[b, :pad].any() and not grads[1][b, :pad].any()


def test_padded_softmax_v_scores_near_float32_max(fw, rng):
    # Scores beyond 3.4e38 / log2(e) overflowed when turned into base-2 logits: NaN rows.
    scores = rng.standard_normal((1, 6, 6)).astype(np.float32)
    scores[0, 2, 1] = 3e38  # row 2 is all key 1
    scores[0, 3, :4] = [-3e38, -2.9e38, -3.3e38, -2.5e38]  # row 3 is all key 3
    scores[0, 5, :] = 2.5e38  # row 5 is uniform
    v = rng.standard_normal((1, 6, 8)).astype(np.float32)
    n_pad = np.zeros(1, np.int32)
    args = [fw.asarray(scores), fw.asarray(v)]
    out = fw.to_numpy(fw.ops.padded_softmax_v(*args, fw.asarray(n_pad)))
    assert rel_error(out, ref.forward(ref.padded_softmax_v, scores, v, n_pad)) < TOLERANCE["float32"]
    # The backward gets one float32 lse = max + log(sum) per row, which cannot hold log(6) beside
    # 2.5e38 (nor beside any max past ~2**24 * log(sum)): the uniform row is checked forward only,
    # as in every lse-based attention backward.
    scores[0, 5, :] = 0.0
    args[0] = fw.asarray(scores)
    dout = rng.standard_normal(out.shape)
    grads = fw.vjp(lambda s, v: fw.ops.padded_softmax_v(s, v, fw.asarray(n_pad)), args, fw.asarray(dout, "float32"))
    expected = ref.vjp(ref.padded_softmax_v, [scores, v, n_pad], dout, n_diff=2)
    for got, want in zip(grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"]


def test_torch_and_jax_agree(torch_fw, jax_fw, rng):
    scores = rng.standard_normal((3, 45, 45)).astype(np.float32)
    v = rng.standard_normal((3, 45, 32)).astype(np.float32)
    n_pad = np.array([0, 7, 45], np.int32)
    for op, args in [("padded_softmax", (scores, n_pad)), ("padded_softmax_v", (scores, v, n_pad))]:
        outs = [f.to_numpy(getattr(f.ops, op)(*(f.asarray(a) for a in args))) for f in (torch_fw, jax_fw)]
        assert np.max(np.abs(outs[0] - outs[1])) <= 1e-6, op


def _bad_scores_cases():
    ok = np.zeros((2, 5, 5), np.float32)
    return [
        (dict(scores=np.zeros((2, 5, 4), np.float32)), ValueError, "scores must be square"),
        (dict(scores=np.zeros((5, 5), np.float32)), ValueError, "scores must be 3-D"),
        (dict(scores=np.zeros((2, 5, 5), np.int32)), TypeError, "scores must be a float"),
        (dict(scores=ok, n_pad=np.array([0, 6], np.int32)), ValueError, r"n_pad values must lie in \[0, 5\]"),
        (dict(scores=ok, n_pad=np.array([-1, 0], np.int32)), ValueError, "n_pad values"),
        (dict(scores=ok, n_pad=np.array([0, 1, 2], np.int32)), ValueError, r"n_pad must have shape \(2,\)"),
        (dict(scores=ok, n_pad=np.array([0.0, 1.0], np.float32)), TypeError, "n_pad must be an integer"),
        # "an integer array, got uint32" named no dtype the op takes
        (dict(scores=ok, n_pad=np.array([0, 1], np.uint32)), TypeError,
         r"n_pad must be an integer array \(int8, int16, int32, int64, uint8\), got uint32"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_scores_cases())
def test_bad_input(fw, kwargs, error, match):
    args = dict(n_pad=np.zeros((kwargs["scores"].shape[0],), np.int32)) | kwargs
    with pytest.raises(error, match=match):
        fw.ops.padded_softmax(fw.asarray(args["scores"]), fw.asarray(args["n_pad"]))


def test_a_nan_in_the_window_makes_its_row_nan(fw):
    # A NaN the row attends poisons the row (as torch.softmax); one it does not attend (above the
    # diagonal, or in the padding) changes nothing.
    scores = np.zeros((1, 5, 5), np.float32)
    scores[0, 3, 1] = np.nan  # attended by row 3
    scores[0, 1, 4] = np.nan  # above the diagonal
    scores[0, 4, 0] = np.nan  # padding (n_pad = 1)
    y = fw.to_numpy(fw.ops.padded_softmax(fw.asarray(scores), fw.asarray(np.array([1], np.int32))))
    assert np.isnan(y[0, 3]).all()
    clean = np.nan_to_num(scores, nan=0.0)
    want = ref.forward(ref.padded_softmax, clean, np.array([1], np.int32))
    rows = [0, 1, 2, 4]
    np.testing.assert_allclose(y[0, rows], want[0, rows], rtol=1e-6)


def test_empty_sequence_gradients(fw):
    scores = fw.asarray(np.zeros((2, 0, 0), np.float32))
    n_pad = fw.asarray(np.zeros(2, np.int32))
    (ds,) = fw.vjp(lambda s: fw.ops.padded_softmax(s, n_pad), [scores], fw.asarray(np.zeros((2, 0, 0), np.float32)))
    assert ds.shape == (2, 0, 0)


def test_int64_n_pad_beyond_int32_is_an_error(fw):
    # jax without x64 would wrap 2**32 + 1 to 1 before the value check (a silent wrong answer).
    bad = np.array([2**32 + 1, 0], np.int64)
    scores = fw.asarray(np.zeros((2, 5, 5), np.float32))
    with pytest.raises(ValueError, match="n_pad"):
        fw.ops.padded_softmax(scores, bad if fw.name == "jax" else fw.asarray(bad))


def test_bad_values(fw):
    scores = fw.asarray(np.zeros((2, 5, 5), np.float32))
    n_pad = fw.asarray(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"v must have shape \[2, 5, head_dim\]"):
        fw.ops.padded_softmax_v(scores, fw.asarray(np.zeros((2, 4, 8), np.float32)), n_pad)
    with pytest.raises(TypeError, match="scores, v must share one dtype"):
        fw.ops.padded_softmax_v(scores, fw.asarray(np.zeros((2, 5, 8), np.float16)), n_pad)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(torch_fw, rng, dynamic):
    # torch.compile traced into the plan code and the interpreter, and read n_pad's values
    # (data-dependent): fullgraph=True failed for both ops. Under compile the kernels clamp n_pad.
    import torch

    import ejkernel_torch as ejk

    options = dict(backend="aot_eager", fullgraph=True, dynamic=dynamic)
    probs = torch.compile(ejk.padded_softmax, **options)
    probs_v = torch.compile(ejk.padded_softmax_v, **options)
    for seq in (6, 9):
        c = _case(torch_fw, rng, 3, seq, "float32", head_dim=8)
        scores = c["scores"].clone().requires_grad_()
        v = c["v"].clone().requires_grad_()
        y = probs(scores, c["n_pad"])
        assert rel_error(torch_fw.to_numpy(y), ref.forward(ref.padded_softmax, c["scores_np"], c["n_pad_np"])) \
            < TOLERANCE["float32"]
        out = probs_v(scores, v, c["n_pad"])
        dout = rng.standard_normal(out.shape).astype(np.float32)
        out.backward(torch_fw.asarray(dout))
        args = [c["scores_np"], c["v_np"], c["n_pad_np"]]
        assert rel_error(torch_fw.to_numpy(out), ref.forward(ref.padded_softmax_v, *args)) < TOLERANCE["float32"]
        ds_ref, dv_ref = ref.vjp(ref.padded_softmax_v, args, dout, n_diff=2)
        assert rel_error(torch_fw.to_numpy(scores.grad), ds_ref) < GRAD_TOLERANCE["float32"]
        assert rel_error(torch_fw.to_numpy(v.grad), dv_ref) < GRAD_TOLERANCE["float32"]


def test_traced_n_pad_wider_than_int32_is_clamped(fw, rng):
    # Traced n_pad values are not checked but clamped to [0, seq] by the kernels; int64 values
    # were first cast to int32 and wrapped: 2**32 + 2 padded 2 tokens, -2**32 + 1 padded one.
    c = _case(fw, rng, 2, 6, "float32")
    with x64(fw):
        n_pad = fw.asarray(np.array([2**32 + 2, -2**32 + 1], np.int64))
        if fw.name == "jax":
            import jax

            traced = jax.jit(fw.ops.padded_softmax)
        else:
            import torch

            traced = torch.compile(fw.ops.padded_softmax, backend="aot_eager", fullgraph=True)
        y = fw.to_numpy(traced(c["scores"], n_pad))
        expected = ref.forward(ref.padded_softmax, c["scores_np"], np.array([6, 0]))
        assert rel_error(y, expected) < TOLERANCE["float32"]
        # and a dtype narrower than the sequence (int8, seq 130) still runs, unclamped
        long = _case(fw, rng, 2, 130, "float32")
        y = fw.to_numpy(traced(long["scores"], fw.asarray(np.array([100, 3], np.int8))))
        expected = ref.forward(ref.padded_softmax, long["scores_np"], np.array([100, 3]))
        assert rel_error(y, expected) < TOLERANCE["float32"]


def test_vmap_over_n_pad(fw, rng):
    # torch.func.vmap over n_pad failed reading its values (".item() on a Tensor"); jax.vmap
    # worked. Batched values are not known, so the kernels clamp them, as under jax.jit.
    c = _case(fw, rng, 2, 6, "float32", head_dim=8)
    n_pads = np.array([[0, 2], [1, 6], [3, 9]], np.int32)
    if fw.name == "jax":
        import jax

        vmap = lambda f, in_dims: jax.vmap(f, in_axes=in_dims)  # noqa: E731
    else:
        import torch

        vmap = torch.func.vmap
    probs = vmap(fw.ops.padded_softmax, in_dims=(None, 0))(c["scores"], fw.asarray(n_pads))
    outs = vmap(fw.ops.padded_softmax_v, in_dims=(None, None, 0))(c["scores"], c["v"], fw.asarray(n_pads))
    for i, n_pad in enumerate(np.minimum(n_pads, 6)):
        expected = ref.forward(ref.padded_softmax, c["scores_np"], n_pad)
        assert rel_error(fw.to_numpy(probs)[i], expected) < TOLERANCE["float32"]
        expected = ref.forward(ref.padded_softmax_v, c["scores_np"], c["v_np"], n_pad)
        assert rel_error(fw.to_numpy(outs)[i], expected) < TOLERANCE["float32"]


@pytest.mark.parametrize("op", ["padded_softmax", "padded_softmax_v"])
def test_double_backward_raises(torch_fw, rng, op):
    # The backward kernels have no derivative: a second derivative silently dropped their terms.
    import torch

    import ejkernel_torch as ejk

    c = _case(torch_fw, rng, 2, 5, "float32", head_dim=4)
    scores = c["scores"].requires_grad_()
    args = (scores, c["n_pad"]) if op == "padded_softmax" else (scores, c["v"], c["n_pad"])
    loss = (getattr(ejk, op)(*args) * torch.arange(4.0, device=scores.device).repeat(2)[:args[0].shape[-1]]).pow(2).sum() \
        if op == "padded_softmax" else getattr(ejk, op)(*args).pow(2).sum()
    (grad,) = torch.autograd.grad(loss + scores.pow(3).sum(), scores, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad(grad.sum(), scores)


# Each op's plans, and the batch each was planned for (padded_softmax's backward is the row kernel).
_SEQ = 7
_PLANS = {"padded_softmax": {"padded_softmax_fwd_plan": lambda batch, *_: batch,
                             "softmax_bwd_plan": lambda rows, *_: rows // _SEQ},
          "padded_softmax_v": {"scores_v_fwd_plan": lambda v_shape, *_: v_shape[0],
                               "scores_v_bwd_plans": lambda v_shape, *_: v_shape[0]}}


def _record_plan_batches(fw, monkeypatch, op: str) -> list[int]:
    """The batch of every plan ``op``'s kernels get from now on, in order."""
    import importlib

    module = importlib.import_module(f"ejkernel_{fw.name}.ops.softmax")
    batches = []
    for name, batch_of in _PLANS[op].items():
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _batch=batch_of: (batches.append(_batch(*a)), _real(*a))[1])
    return batches


def _vmap_case(fw, rng, op: str, n_pad: np.ndarray):
    """Samples [n, batch, seq, seq] of scores (n, batch from ``n_pad``), a v shared by them, and
    what vmap takes: (scores, v, with_v, args, in_dims, argnums of the gradient, loss)."""
    n, b = n_pad.shape
    scores = rng.standard_normal((n, b, _SEQ, _SEQ)) * 2
    v = rng.standard_normal((b, _SEQ, 8))
    with_v = op == "padded_softmax_v"
    arrays, in_dims = ((scores, v, n_pad), (0, None, 0)) if with_v else ((scores, n_pad), (0, 0))
    args = [fw.asarray(x) for x in arrays]
    argnums = (0, 1) if with_v else (0,)

    def loss(*a):
        return (getattr(fw.ops, op)(*a) ** 2).sum()

    return scores, v, with_v, args, in_dims, argnums, loss


@pytest.mark.parametrize("op", ["padded_softmax", "padded_softmax_v"])
def test_vmap_folds_the_mapped_axis_into_the_batch(fw, rng, monkeypatch, op):
    # vmap ran the kernels once per sample (torch: its fallback for ops without a batching rule,
    # jax: the launches' lax.map). The mapped axis now folds into the batch: one launch of each
    # kernel, planned for n * batch rows, with each sample's values and gradients; v, the same
    # for every sample, broadcasts.
    batches = _record_plan_batches(fw, monkeypatch, op)
    n, b = 3, 2
    n_pad = np.array([[0, 7], [3, 1], [0, 5]], np.int32)
    scores, v, with_v, args, in_dims, argnums, loss = _vmap_case(fw, rng, op, n_pad)
    out = fw.vmap(getattr(fw.ops, op), in_dims)(*args)
    per_sample_grads = fw.vmap(fw.grad(loss, argnums), in_dims)
    grads = per_sample_grads(*args)
    # jax also traces the unfolded call (unless a trace is cached), never launched
    assert set(batches) <= {n * b, b} if fw.name == "jax" else set(batches) == {n * b}
    assert batches.count(n * b) >= 2  # the forward and the backward ran folded
    if fw.name == "jax":
        assert not fw.has_loop(per_sample_grads, *args)  # no per-sample loop left

    reference = getattr(ref, op)
    for i in range(n):
        sample = (scores[i], v, n_pad[i]) if with_v else (scores[i], n_pad[i])
        want = ref.forward(reference, *sample)
        assert rel_error(fw.to_numpy(out)[i], want) < TOLERANCE["float32"]
        for got, want_grad in zip(grads, ref.vjp(reference, sample, 2 * want, n_diff=len(argnums))):
            assert rel_error(fw.to_numpy(got)[i], want_grad) < GRAD_TOLERANCE["float32"]
        if fw.device == "cpu":  # bit for bit a per-sample call under the interpreter (unchecked on a GPU)
            sample = [fw.asarray(x) for x in sample]
            np.testing.assert_array_equal(fw.to_numpy(out)[i], fw.to_numpy(getattr(fw.ops, op)(*sample)))
            for got, want_grad in zip(grads, fw.grad(loss, argnums)(*sample)):
                np.testing.assert_array_equal(fw.to_numpy(got)[i], fw.to_numpy(want_grad))


@pytest.mark.parametrize("op", ["padded_softmax", "padded_softmax_v"])
def test_vmap_past_a_launch_limit_folds_in_several_launches(fw, rng, monkeypatch, op):
    # The folded batch (samples x batch) passed what one launch takes, where each sample's call
    # runs: padded_softmax_v's batch is its kernels' grid axis 1 (65535: "scores_v_fwd_kernel:
    # grid (1, 76800) exceeds CUDA's limits"), and padded_softmax's rows (batch * seq) are int32
    # ("padded_softmax_fwd_kernel: scalar n_rows=2147483648 does not fit int32"). Samples past
    # the limit now go to further launches. (The limits are lowered here, to 8 batch rows.)
    from triton_kernels import plan, softmax

    if op == "padded_softmax_v":
        monkeypatch.setattr(plan, "MAX_GRID", (2**31 - 1, 8, 8))
        too_big = "scores has batch 9, more than the 8 batch rows"
    else:
        monkeypatch.setattr(softmax, "MAX_ROWS", 8 * _SEQ)
        too_big = "scores has 63 rows \\(batch \\* seq\\), more than the 56"
    batches = _record_plan_batches(fw, monkeypatch, op)
    n = 5  # samples of 2 batch rows; folded: 10 rows, launched as 4 + 1 samples (8 + 2 rows)
    n_pad = np.array([[0, 7], [3, 1], [0, 5], [2, 0], [7, 4]], np.int32)
    scores, v, with_v, args, in_dims, argnums, loss = _vmap_case(fw, rng, op, n_pad)
    out = fw.to_numpy(fw.vmap(getattr(fw.ops, op), in_dims)(*args))
    grads = [fw.to_numpy(g) for g in fw.vmap(fw.grad(loss, argnums), in_dims)(*args)]
    assert batches and max(batches) <= 8 and 8 in batches
    reference = getattr(ref, op)
    for i in range(n):
        sample = (scores[i], v, n_pad[i]) if with_v else (scores[i], n_pad[i])
        want = ref.forward(reference, *sample)
        assert rel_error(out[i], want) < TOLERANCE["float32"]
        for got, want_grad in zip(grads, ref.vjp(reference, sample, 2 * want, n_diff=len(argnums))):
            assert rel_error(got[i], want_grad) < GRAD_TOLERANCE["float32"]
    # A call past the limit by itself is refused by name, before any kernel runs.
    big = [fw.asarray(rng.standard_normal((9, _SEQ, _SEQ))), fw.asarray(rng.standard_normal((9, _SEQ, 8))),
           fw.asarray(np.zeros(9, np.int32))]
    with pytest.raises(ValueError, match=too_big):
        getattr(fw.ops, op)(*(big if with_v else big[::2]))
