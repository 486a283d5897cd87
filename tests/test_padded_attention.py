"""padded_attention: forward and gradients vs float64, padding rows, parity, bad input."""
import warnings

import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error

DTYPES = ["float32", "float16", "bfloat16"]
GRAD_TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _case(fw, rng, batch, seq, head_dim, dtype):
    qkv = [fw.asarray(rng.standard_normal((batch, seq, head_dim)), dtype) for _ in range(3)]
    n_pad = rng.integers(0, seq + 1, size=batch).astype(np.int32)
    n_pad[0] = 0
    if batch > 1:
        n_pad[-1] = seq  # a sequence made only of padding
    return qkv, [fw.to_numpy(t) for t in qkv], fw.asarray(n_pad), n_pad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, head_dim", [(1, 1, 16), (3, 17, 24), (2, 127, 64), (2, 100, 3), (2, 65, 256)])
def test_forward_matches_float64(fw, rng, batch, seq, head_dim, dtype):
    qkv, qkv_np, n_pad, n_pad_np = _case(fw, rng, batch, seq, head_dim, dtype)
    out = fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad))
    expected = ref.forward(ref.padded_attention, *qkv_np, n_pad_np)
    assert rel_error(out, expected) < TOLERANCE[dtype]
    for b, pad in enumerate(n_pad_np):  # padding queries give exact zeros, never NaN
        assert not out[b, :pad].any()


def test_long_sequence(fw, rng):
    qkv, qkv_np, n_pad, n_pad_np = _case(fw, rng, 2, 1000, 32, "float32")
    out = fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad))
    assert rel_error(out, ref.forward(ref.padded_attention, *qkv_np, n_pad_np)) < TOLERANCE["float32"]


def test_softmax_scale(fw, rng):
    qkv, qkv_np, n_pad, n_pad_np = _case(fw, rng, 2, 33, 16, "float32")
    out = fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad, softmax_scale=0.7))
    expected = ref.forward(ref.padded_attention, *qkv_np, n_pad_np, softmax_scale=0.7)
    assert rel_error(out, expected) < TOLERANCE["float32"]
    # numpy's scalars are scales too (np.float32(0.7) was a TypeError); np.int64(1) is 1
    for numpy_scale, python_scale in ((np.float32(0.7), float(np.float32(0.7))), (np.int64(1), 1)):
        np.testing.assert_array_equal(fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad, softmax_scale=numpy_scale)),
                                      fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad, softmax_scale=python_scale)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, head_dim", [(3, 17, 24), (2, 130, 64), (1, 1, 16)])
def test_gradients_match_float64(fw, rng, batch, seq, head_dim, dtype):
    qkv, qkv_np, n_pad, n_pad_np = _case(fw, rng, batch, seq, head_dim, dtype)
    dout = fw.asarray(rng.standard_normal((batch, seq, head_dim)), dtype)
    grads = fw.vjp(lambda q, k, v: fw.ops.padded_attention(q, k, v, n_pad), qkv, dout)
    expected = ref.vjp(ref.padded_attention, [*qkv_np, n_pad_np], fw.to_numpy(dout), n_diff=3)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE[dtype], name
    for b, pad in enumerate(n_pad_np):  # padding tokens get exactly zero gradient
        for got in grads:
            assert not got[b, :pad].any()


def test_torch_and_jax_agree(torch_fw, jax_fw, rng):
    qkv = [rng.standard_normal((3, 77, 40)).astype(np.float32) for _ in range(3)]
    n_pad = np.array([0, 9, 77], np.int32)
    dout = rng.standard_normal((3, 77, 40)).astype(np.float32)
    results = []
    for f in (torch_fw, jax_fw):
        args = [f.asarray(a) for a in qkv]
        npad = f.asarray(n_pad)
        out = f.to_numpy(f.ops.padded_attention(*args, npad))
        grads = f.vjp(lambda q, k, v: f.ops.padded_attention(q, k, v, npad), args, f.asarray(dout))
        results.append([out, *grads])
    for a, b in zip(*results):
        assert np.max(np.abs(a - b)) <= 1e-6


def _bad_cases():
    q = np.zeros((2, 5, 8), np.float32)
    return [
        (dict(q=np.zeros((5, 8), np.float32)), ValueError, "q must be 3-D"),
        (dict(k=np.zeros((2, 6, 8), np.float32)), ValueError, "k must have the shape of q"),
        (dict(v=np.zeros((2, 5, 8), np.float16)), TypeError, "q, k, v must share one dtype"),
        (dict(q=q.astype(np.int32)), TypeError, "q must be a float"),
        (dict(q=np.zeros((2, 5, 300), np.float32), k=np.zeros((2, 5, 300), np.float32),
              v=np.zeros((2, 5, 300), np.float32)), ValueError, "head_dim must be between 1 and 256"),
        (dict(n_pad=np.array([0, 9], np.int32)), ValueError, r"n_pad values must lie in \[0, 5\]"),
        (dict(n_pad=np.array([[0, 1]], np.int32)), ValueError, r"n_pad must have shape \(2,\)"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_cases())
def test_bad_input(fw, kwargs, error, match):
    args = dict(q=np.zeros((2, 5, 8), np.float32), k=np.zeros((2, 5, 8), np.float32),
                v=np.zeros((2, 5, 8), np.float32), n_pad=np.zeros(2, np.int32)) | kwargs
    with pytest.raises(error, match=match):
        fw.ops.padded_attention(*(fw.asarray(args[n]) for n in ("q", "k", "v", "n_pad")))


def test_bad_scale(fw):
    x = fw.asarray(np.zeros((1, 4, 8), np.float32))
    n_pad = fw.asarray(np.zeros(1, np.int32))
    with pytest.raises(TypeError, match="softmax_scale"):
        fw.ops.padded_attention(x, x, x, n_pad, softmax_scale="big")
    # scale * log2(e) must stay a float32: 1e300 gave NaN, 10**400 an OverflowError.
    for scale in (1e300, 10**400, 2.4e38, float("-inf")):
        with pytest.raises(ValueError, match="softmax_scale must be finite"):
            fw.ops.padded_attention(x, x, x, n_pad, softmax_scale=scale)


def test_n_pad_captured_by_jit(jax_fw, rng):
    # A concrete n_pad closed over by a jitted function is checked, not traced (it crashed).
    import jax

    q = jax_fw.asarray(rng.standard_normal((2, 9, 8)), "float32")
    n_pad = jax_fw.asarray(np.array([0, 3], np.int32))
    eager = jax_fw.ops.padded_attention(q, q, q, n_pad)
    jitted = jax.jit(lambda q: jax_fw.ops.padded_attention(q, q, q, n_pad))(q)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(torch_fw, rng, dynamic):
    # torch.compile traced into the plan code, the interpreter and the config cache's device
    # fingerprint, and read n_pad's values: fullgraph=True failed, dynamic=True hit a RecursionError.
    import torch

    import ejkernel_torch as ejk

    fn = torch.compile(lambda q, k, v, n: ejk.padded_attention(q, k, v, n, fwd_params={"blocksize_m": 16}),
                       backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for seq in (6, 9):
        qkv, qkv_np, n_pad, n_pad_np = _case(torch_fw, rng, 3, seq, 8, "float32")
        qkv = [t.requires_grad_() for t in qkv]
        out = fn(*qkv, n_pad)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        out.backward(torch_fw.asarray(dout))
        assert rel_error(torch_fw.to_numpy(out), ref.forward(ref.padded_attention, *qkv_np, n_pad_np)) \
            < TOLERANCE["float32"]
        expected = ref.vjp(ref.padded_attention, [*qkv_np, n_pad_np], dout, n_diff=3)
        for name, t, want in zip("qkv", qkv, expected):
            assert rel_error(torch_fw.to_numpy(t.grad), want) < GRAD_TOLERANCE["float32"], name


def test_torch_compile_fullgraph_with_keys_as_values(torch_fw, rng):
    """One tensor as both k and v (cross-attention on a shared kv): dynamo refused the autograd
    function ("duplicate tensor input"), with fullgraph=True and in strict export."""
    import torch

    import ejkernel_torch as ejk

    fn = torch.compile(lambda q, kv, n: ejk.padded_attention(q, kv, kv, n), backend="aot_eager", fullgraph=True)
    (q, kv, _), (q_np, kv_np, _), n_pad, n_pad_np = _case(torch_fw, rng, 2, 7, 8, "float32")
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out = fn(q, kv, n_pad)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch_fw.asarray(dout))
    assert rel_error(torch_fw.to_numpy(out), ref.forward(ref.padded_attention, q_np, kv_np, kv_np, n_pad_np)) \
        < TOLERANCE["float32"]
    d_q, d_k, d_v = ref.vjp(ref.padded_attention, [q_np, kv_np, kv_np, n_pad_np], dout, n_diff=3)
    assert rel_error(torch_fw.to_numpy(q.grad), d_q) < GRAD_TOLERANCE["float32"]
    assert rel_error(torch_fw.to_numpy(kv.grad), d_k + d_v) < GRAD_TOLERANCE["float32"]  # both uses add up


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_program_takes_gradients(torch_fw, rng, strict):
    """Strict torch.export traced the op's autograd function under no_grad: the exported program
    recorded no gradient through it, so a loss with another term silently lacked the attention's
    share (and one through it alone raised "does not require grad"). The program's gradients are
    eager's, one tensor as both k and v and new n_pad values included."""
    import torch

    import ejkernel_torch as ejk

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, n_pad):
            h = self.proj(x)
            return ejk.padded_attention(h, x, x, n_pad).square().sum() + h.sum()

    model = Model()
    x = torch.randn(2, 7, 8)
    program = torch.export.export(model, (x, torch.tensor([0, 3], dtype=torch.int32)), strict=strict).module()
    for n_pad in ([0, 3], [6, 1]):
        n_pad = torch.tensor(n_pad, dtype=torch.int32)
        grads = []
        for fn, params in ((program, list(program.parameters())), (model, list(model.parameters()))):
            x_ = x.clone().requires_grad_()
            fn(x_, n_pad).backward()
            grads.append([x_.grad, *(p.grad for p in params)])
            for p in params:
                p.grad = None
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_double_backward_raises(torch_fw, rng):
    # The backward kernels have no derivative: a create_graph=True gradient had no graph through
    # them, so a second derivative silently dropped their terms (off by ~5 on this case).
    import torch

    import ejkernel_torch as ejk

    qkv, _, n_pad, _ = _case(torch_fw, rng, 2, 5, 8, "float32")
    q = qkv[0].requires_grad_()
    loss = ejk.padded_attention(q, q, q, n_pad).pow(2).sum() + q.pow(3).sum()
    (grad,) = torch.autograd.grad(loss, q, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad(grad.sum(), q)


def test_vmap_folds_the_mapped_axis_into_the_batch(fw, rng, monkeypatch):
    # vmap ran the kernels once per sample (torch: its fallback for ops without a batching rule,
    # jax: the launches' lax.map). The mapped axis now folds into the batch: one launch of each
    # kernel, planned for n * batch rows, with each sample's values and gradients; k, the same
    # for every sample, broadcasts.
    import importlib

    module = importlib.import_module(f"ejkernel_{fw.name}.ops.padded_attention")
    batches = []
    for name in ("attention_fwd_plan", "attention_bwd_plans"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda shape, *a, _real=real: (batches.append(shape[0]), _real(shape, *a))[1])
    n, b, seq, head_dim = 3, 2, 9, 16
    q, k = rng.standard_normal((n, b, seq, head_dim)), rng.standard_normal((b, seq, head_dim))
    v = rng.standard_normal((b, seq, head_dim, n))  # mapped over its last axis
    n_pad = np.array([[0, 9], [3, 1], [0, 5]], np.int32)
    in_dims = (0, None, 3, 0)
    args = [fw.asarray(x) for x in (q, k, v, n_pad)]

    def loss(q, k, v, n_pad):
        return (fw.ops.padded_attention(q, k, v, n_pad) ** 2).sum()

    out = fw.vmap(fw.ops.padded_attention, in_dims)(*args)
    per_sample_grads = fw.vmap(fw.grad(loss, (0, 1, 2)), in_dims)
    grads = per_sample_grads(*args)
    # jax also traces the unfolded call (unless a trace is cached), never launched
    assert set(batches) <= {n * b, b} if fw.name == "jax" else set(batches) == {n * b}
    assert batches.count(n * b) >= 2  # the forward and the backward ran folded
    if fw.name == "jax":
        assert not fw.has_loop(per_sample_grads, *args)  # no per-sample loop left

    for i in range(n):
        sample = (q[i], k, v[..., i], n_pad[i])
        want = ref.forward(ref.padded_attention, *sample)
        assert rel_error(fw.to_numpy(out)[i], want) < TOLERANCE["float32"]
        for got, want_grad in zip(grads, ref.vjp(ref.padded_attention, sample, 2 * want, n_diff=3)):
            assert rel_error(fw.to_numpy(got)[i], want_grad) < GRAD_TOLERANCE["float32"]
        if fw.device == "cpu":  # bit for bit a per-sample call under the interpreter (unchecked on a GPU)
            sample = [fw.asarray(x) for x in sample]
            np.testing.assert_array_equal(fw.to_numpy(out)[i], fw.to_numpy(fw.ops.padded_attention(*sample)))
            for got, want_grad in zip(grads, fw.grad(loss, (0, 1, 2))(*sample)):
                np.testing.assert_array_equal(fw.to_numpy(got)[i], fw.to_numpy(want_grad))


def test_vmap_past_the_grid_limit_folds_in_several_launches(fw, rng, monkeypatch):
    # The folded batch (samples x batch) is the kernels' grid axis 1, at most 65535: a vmap over
    # 300 samples of a batch-256 call raised "attention_fwd_kernel: grid (1, 76800) exceeds CUDA's
    # limits" in both fronts (forward and backward), where each sample's call runs. Samples past
    # the limit now go to further launches. (The limit is lowered here: 65536 programs are
    # minutes under the interpreter.)
    import importlib

    from triton_kernels import plan

    monkeypatch.setattr(plan, "MAX_GRID", (2**31 - 1, 8, 8))
    module = importlib.import_module(f"ejkernel_{fw.name}.ops.padded_attention")
    batches = []
    for name in ("attention_fwd_plan", "attention_bwd_plans"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda shape, *a, _real=real: (batches.append(shape[0]), _real(shape, *a))[1])
    n, b, seq, head_dim = 5, 2, 9, 16  # folded: 10 rows, launched as 4 + 1 samples (8 + 2 rows)
    q, k = rng.standard_normal((n, b, seq, head_dim)), rng.standard_normal((b, seq, head_dim))
    n_pad = np.array([[0, 9], [3, 1], [0, 5], [2, 0], [9, 4]], np.int32)
    in_dims = (0, None, 0)
    args = [fw.asarray(x) for x in (q, k, n_pad)]

    def attend(q, k, n_pad):
        return fw.ops.padded_attention(q, k, k, n_pad)

    def loss(q, k, n_pad):
        return (attend(q, k, n_pad) ** 2).sum()

    out = fw.to_numpy(fw.vmap(attend, in_dims)(*args))
    dq, dk = (fw.to_numpy(g) for g in fw.vmap(fw.grad(loss, (0, 1)), in_dims)(*args))
    assert batches and max(batches) <= 8 and 8 in batches
    for i in range(n):
        sample = (q[i], k, k, n_pad[i])
        want = ref.forward(ref.padded_attention, *sample)
        assert rel_error(out[i], want) < TOLERANCE["float32"]
        want_dq, want_dk, want_dv = ref.vjp(ref.padded_attention, sample, 2 * want, n_diff=3)
        assert rel_error(dq[i], want_dq) < GRAD_TOLERANCE["float32"]
        assert rel_error(dk[i], want_dk + want_dv) < GRAD_TOLERANCE["float32"]
    # A call past the limit by itself is refused by name, before any kernel runs.
    with pytest.raises(ValueError, match=r"q has batch 9, more than the 8 batch rows"):
        fw.ops.padded_attention(*(fw.asarray(rng.standard_normal((9, seq, head_dim))),) * 3,
                                fw.asarray(np.zeros(9, np.int32)))


def test_vmap_past_int32_rows_folds_in_several_launches(jax_fw):
    # The backward's delta kernel counts batch * seq rows in int32: a vmap of the gradient over
    # 2**15 samples of one 2**16-token sequence (each sample's call runs) folded 2**31 rows and
    # raised "attention_bwd_delta_kernel: scalar n_rows=2147483648 does not fit int32", after
    # the forward had run. Traced only (eval_shape): nothing is allocated or launched.
    import jax
    import jax.numpy as jnp

    def loss(q, n_pad):
        return jax_fw.ops.padded_attention(q, q, q, n_pad).astype(jnp.float32).sum()

    n, seq = 2**15, 2**16
    q, n_pad = jax.ShapeDtypeStruct((n, 1, seq, 16), jnp.float16), jax.ShapeDtypeStruct((n, 1), jnp.int32)
    dq = jax.eval_shape(jax.vmap(jax.grad(loss)), q, n_pad)
    assert dq.shape == q.shape
    # One call of 2**15 + 1 such rows is refused by name, before any kernel runs (its gradient failed).
    with pytest.raises(ValueError, match=r"q has batch 32769, more than the 32767 batch rows of seq 65536"):
        jax.eval_shape(loss, jax.ShapeDtypeStruct((n + 1, seq, 16), jnp.float16), jax.ShapeDtypeStruct((n + 1,), jnp.int32))


def test_sequences_past_int32_offsets_are_refused(fw):
    # The kernels address a sequence's elements with int32 offsets (row x width; the batch term is
    # int64): past 2**31 - 1 elements (padded_softmax_v's scores from seq 46341 on, q past 8M
    # tokens at head_dim 256) they wrapped and read and wrote elsewhere. Refused by name before
    # anything runs or is copied: torch gets stride-0 views, jax traces shapes only.
    from triton_kernels import padded_attention as pa

    def call(op, *shapes):
        dtypes = ["float16"] * (len(shapes) - 1) + ["int32"]  # the last is n_pad
        if fw.name == "jax":
            import jax

            structs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]
            return jax.eval_shape(getattr(fw.ops, op), *structs)
        import torch

        views = [torch.zeros((1,) * len(s), dtype=getattr(torch, d)).expand(s) for s, d in zip(shapes, dtypes)]
        return getattr(fw.ops, op)(*views)

    seq = 2**23 + 1
    with pytest.raises(ValueError, match=rf"^q has sequences of {seq} x 256 elements, past the 2147483647"):
        call("padded_attention", (1, seq, 256), (1, seq, 256), (1, seq, 256), (1,))
    with pytest.raises(ValueError, match=r"^scores has sequences of 46341 x 46341 elements"):
        call("padded_softmax_v", (1, 46341, 46341), (1, 46341, 8), (1,))
    pa.check_sequence("scores", 46340, 46340)  # the largest square that fits
    if fw.name == "jax":  # traced at that size: nothing runs
        assert call("padded_softmax_v", (1, 46340, 46340), (1, 46340, 8), (1,)).shape == (1, 46340, 8)


def _poison_padding(x: np.ndarray, n_pad: np.ndarray, value: float) -> np.ndarray:
    """``x`` [batch, seq, ...] with each sequence's padding rows set to ``value``."""
    x = x.copy()
    for b, pad in enumerate(n_pad):
        x[b, :pad] = value
    return x


@pytest.mark.parametrize("garbage", [np.nan, np.inf])
def test_padding_is_never_read(fw, rng, garbage):
    """Padding may hold anything (an uninitialized buffer's NaN): outputs and gradients are those
    of zero padding, padding rows and their gradients exact zeros. A masked probability of 0 times
    a NaN value or query row used to turn every row of the sequence into NaN. Off a GPU, where the
    kernels run in Triton's interpreter, numpy does not warn about that garbage either (a GPU
    computes it silently; the masks keep the right values)."""
    batch, seq, dim = 3, 37, 16
    n_pad = np.array([0, 5, 20], np.int32)  # 20: the padding spans a 16-row tile edge
    clean = [_poison_padding(rng.standard_normal((batch, seq, dim)), n_pad, 0.0) for _ in range(4)]
    q, k, v, dout = (fw.asarray(_poison_padding(x, n_pad, garbage), "float32") for x in clean)
    gs = fw.asarray(n_pad)
    tiles = dict(q_blocksize=16, kv_blocksize=16)
    attend = lambda q, k, v: fw.ops.padded_attention(q, k, v, gs, fwd_params=tiles, bwd_params=tiles)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = fw.to_numpy(attend(q, k, v))
        grads = fw.vjp(attend, [q, k, v], dout)
    assert rel_error(out, ref.forward(ref.padded_attention, *clean[:3], n_pad)) < TOLERANCE["float32"]
    expected = ref.vjp(ref.padded_attention, [*clean[:3], n_pad], clean[3], n_diff=3)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < GRAD_TOLERANCE["float32"], name
    for got in (out, *grads):
        assert not np.isnan(got).any()
        for b, pad in enumerate(n_pad):
            assert not got[b, :pad].any()


def test_huge_softmax_scale(fw, rng):
    # 1e38 (its scale * log2(e) fits float32) overflowed the float32 logits for any |q.k| > 2.4: a
    # NaN output. Refused before any kernel runs; the largest scale taken gives float64's output.
    qkv, qkv_np, n_pad, n_pad_np = _case(fw, rng, 2, 17, 8, "float32")
    for scale in (1e38, -1e38, 6.9e27):
        with pytest.raises(ValueError, match=r"\|softmax_scale\| must be <= 6.871e\+27 for head_dim 8, got"):
            fw.ops.padded_attention(*qkv, n_pad, softmax_scale=scale)
    out = fw.to_numpy(fw.ops.padded_attention(*qkv, n_pad, softmax_scale=6.8e27))
    expected = ref.forward(ref.padded_attention, *qkv_np, n_pad_np, softmax_scale=6.8e27)
    assert rel_error(out, expected) < TOLERANCE["float32"]
