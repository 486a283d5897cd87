"""softmax: forward and backward vs float64, long rows, parity, bad input — for each framework."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error

DTYPES = ["float32", "float16", "bfloat16"]
SHAPES = [(1, 1), (17, 127), (5, 1000), (3, 2, 33)]
GRAD_TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _inputs(fw, rng, shape, dtype, scale=3.0):
    x = fw.asarray(rng.standard_normal(shape) * scale, dtype)
    return x, fw.to_numpy(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64(fw, rng, shape, dtype):
    x, x_np = _inputs(fw, rng, shape, dtype)
    y = fw.ops.softmax(x)
    assert str(y.dtype).endswith(dtype)
    assert rel_error(fw.to_numpy(y), ref.forward(ref.softmax, x_np)) < TOLERANCE[dtype]


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_any_axis(fw, rng, axis):
    x, x_np = _inputs(fw, rng, (7, 9, 11), "float32")
    y = fw.ops.softmax(x, axis=axis)
    assert rel_error(fw.to_numpy(y), ref.forward(ref.softmax, x_np, axis)) < TOLERANCE["float32"]


@pytest.mark.parametrize("n_cols", [32769, 100_000])
def test_rows_longer_than_one_block(fw, rng, n_cols):
    x, x_np = _inputs(fw, rng, (3, n_cols), "float32", scale=10.0)
    y = fw.ops.softmax(x)
    assert rel_error(fw.to_numpy(y), ref.forward(ref.softmax, x_np)) < TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17, 127), (2, 40_000)])
def test_gradient_matches_float64(fw, rng, shape, dtype):
    x, x_np = _inputs(fw, rng, shape, dtype)
    dy, dy_np = _inputs(fw, rng, shape, dtype, scale=1.0)
    (dx,) = fw.vjp(fw.ops.softmax, [x], dy)
    (dx_ref,) = ref.vjp(ref.softmax, [x_np], dy_np, n_diff=1)
    assert rel_error(dx, dx_ref) < GRAD_TOLERANCE[dtype]


def test_rows_of_only_minus_inf_give_zeros(fw):
    x = np.array([[-np.inf] * 5, [0.0, -np.inf, 1.0, -np.inf, 2.0]], np.float32)
    y = fw.to_numpy(fw.ops.softmax(fw.asarray(x)))
    assert np.array_equal(y[0], np.zeros(5))
    np.testing.assert_allclose(y[1], ref.forward(ref.softmax, x)[1], rtol=1e-6)


@pytest.mark.parametrize("n_cols", [5, 40_000])  # one pass and two passes over the row
def test_a_nan_makes_its_row_nan(fw, rng, n_cols):
    # As torch.softmax and the float64 reference: a NaN poisons its row's sum, so the whole row.
    x = rng.standard_normal((3, n_cols)).astype(np.float32)
    x[1, n_cols // 2] = np.nan
    y = fw.to_numpy(fw.ops.softmax(fw.asarray(x)))
    assert np.isnan(y[1]).all()
    keep = [0, 2]
    assert rel_error(y[keep], ref.forward(ref.softmax, x[keep])) < TOLERANCE["float32"]


def test_torch_and_jax_agree(torch_fw, jax_fw, rng):
    x = rng.standard_normal((33, 517)).astype(np.float32)
    yt = torch_fw.to_numpy(torch_fw.ops.softmax(torch_fw.asarray(x)))
    yj = jax_fw.to_numpy(jax_fw.ops.softmax(jax_fw.asarray(x)))
    assert np.max(np.abs(yt - yj)) <= 1e-6


def test_empty_rows_and_columns(fw):
    for shape in [(0, 5), (4, 0)]:
        y = fw.ops.softmax(fw.asarray(np.zeros(shape, np.float32)))
        assert tuple(y.shape) == shape


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (lambda fw: fw.asarray(np.ones((3, 4), np.int32)), TypeError, "x must be a float"),
        (lambda fw: fw.asarray(np.float32(1.0)), ValueError, "at least one dimension"),
        (lambda fw: [[1.0, 2.0]], TypeError, "x must be a"),
    ],
)
def test_bad_input(fw, bad, error, match):
    with pytest.raises(error, match=match):
        fw.ops.softmax(bad(fw))


def test_bad_axis(fw):
    x = fw.asarray(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="axis=2"):
        fw.ops.softmax(x, axis=2)
    with pytest.raises(TypeError, match="axis must be an int"):
        fw.ops.softmax(x, axis=1.0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(torch_fw, rng, dynamic):
    # torch.compile traced into the plan code and the interpreter: fullgraph=True failed
    # ("Unsupported context manager"), the default mode with an InternalTorchDynamoError.
    import torch

    import ejkernel_torch as ejk

    fn = torch.compile(lambda a: ejk.softmax(a, axis=1), backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for shape in [(3, 4, 5), (2, 9, 3)]:  # a second shape: recompiled or dynamic sizes
        x_np = rng.standard_normal(shape).astype(np.float32)
        x = torch_fw.asarray(x_np).requires_grad_()
        dy_np = rng.standard_normal(shape).astype(np.float32)
        fn(x).backward(torch_fw.asarray(dy_np))
        (dx_ref,) = ref.vjp(lambda a: ref.softmax(a, 1), [x_np], dy_np, n_diff=1)
        assert rel_error(torch_fw.to_numpy(fn(x)), ref.forward(ref.softmax, x_np, 1)) < TOLERANCE["float32"]
        assert rel_error(torch_fw.to_numpy(x.grad), dx_ref) < GRAD_TOLERANCE["float32"]


def test_vmap(fw, rng):
    # torch.func.vmap failed inside the launcher ("Cannot access storage of BatchedTensorImpl").
    x_np = rng.standard_normal((3, 4, 5)).astype(np.float32)
    if fw.name == "jax":
        import jax

        y = jax.vmap(lambda a: fw.ops.softmax(a, axis=0), in_axes=1)(fw.asarray(x_np))
    else:
        import torch

        y = torch.func.vmap(lambda a: fw.ops.softmax(a, axis=0), in_dims=1)(fw.asarray(x_np))
    expected = np.moveaxis(ref.forward(ref.softmax, x_np, 0), 1, 0)
    assert rel_error(fw.to_numpy(y), expected) < TOLERANCE["float32"]


def test_double_backward_raises(torch_fw, rng):
    # The backward kernel has no derivative: a second derivative silently dropped its terms.
    import torch

    import ejkernel_torch as ejk

    x = torch_fw.asarray(rng.standard_normal((3, 5)).astype(np.float32)).requires_grad_()
    loss = (ejk.softmax(x) * torch.arange(5.0, device=x.device)).pow(2).sum() + x.pow(3).sum()
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(NotImplementedError, match="no second derivative"):
        torch.autograd.grad(grad.sum(), x)


def test_vmap_folds_the_mapped_axis_into_the_rows(fw, rng, monkeypatch):
    # vmap ran the kernels once per sample (torch: its fallback for ops without a batching rule,
    # jax: the launches' lax.map). The mapped axis now folds into the rows: one launch of each
    # kernel, planned for n * rows rows, with each sample's values and gradients.
    import importlib

    module = importlib.import_module(f"ejkernel_{fw.name}.ops.softmax")
    planned = []
    for name in ("softmax_fwd_plan", "softmax_bwd_plan"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda rows, *a, _real=real: (planned.append(rows), _real(rows, *a))[1])
    n, rows, cols = 3, 4, 33
    x = rng.standard_normal((rows, cols, n)) * 3  # mapped over its last axis
    args = [fw.asarray(x)]

    def loss(x):
        return (fw.ops.softmax(x) ** 2).sum()

    y = fw.vmap(fw.ops.softmax, (2,))(*args)
    per_sample_grads = fw.vmap(fw.grad(loss, (0,)), (2,))
    (grad,) = per_sample_grads(*args)
    # jax also traces the unfolded call (unless a trace is cached), never launched
    assert set(planned) <= {n * rows, rows} if fw.name == "jax" else set(planned) == {n * rows}
    assert planned.count(n * rows) >= 2  # the forward and the backward ran folded
    if fw.name == "jax":
        assert not fw.has_loop(per_sample_grads, *args)  # no per-sample loop left

    for i in range(n):
        want = ref.forward(ref.softmax, x[..., i])
        assert rel_error(fw.to_numpy(y)[i], want) < TOLERANCE["float32"]
        (want_grad,) = ref.vjp(ref.softmax, [x[..., i]], 2 * want, n_diff=1)
        assert rel_error(fw.to_numpy(grad)[i], want_grad) < GRAD_TOLERANCE["float32"]
        if fw.device == "cpu":  # bit for bit a per-sample call under the interpreter (unchecked on a GPU)
            sample = fw.asarray(x[..., i])
            np.testing.assert_array_equal(fw.to_numpy(y)[i], fw.to_numpy(fw.ops.softmax(sample)))
            np.testing.assert_array_equal(fw.to_numpy(grad)[i], fw.to_numpy(fw.grad(loss, (0,))(sample)[0]))


def test_vmap_past_the_row_limit_folds_in_several_launches(fw, rng, monkeypatch):
    # The kernels count rows in int32: a vmap over 2 samples of 2**30 rows (each sample's call
    # runs) folded 2**31 rows and raised "softmax_fwd_kernel: scalar n_rows=2147483648 does not
    # fit int32" in both fronts. Samples past the limit now go to further launches. (The limit
    # is lowered here; test_row_limit_keeps_the_block_count_in_int32 traces the real one.)
    import importlib

    from triton_kernels import softmax

    monkeypatch.setattr(softmax, "MAX_ROWS", 8)
    module = importlib.import_module(f"ejkernel_{fw.name}.ops.softmax")
    planned = []
    for name in ("softmax_fwd_plan", "softmax_bwd_plan"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda rows, *a, _real=real: (planned.append(rows), _real(rows, *a))[1])
    n, rows, cols = 5, 4, 33  # folded: 20 rows, launched as 2 + 2 + 1 samples
    x = rng.standard_normal((rows, cols, n)) * 3  # mapped over its last axis
    args = [fw.asarray(x)]

    def loss(x):
        return (fw.ops.softmax(x) ** 2).sum()

    y = fw.to_numpy(fw.vmap(fw.ops.softmax, (2,))(*args))
    (grad,) = (fw.to_numpy(g) for g in fw.vmap(fw.grad(loss, (0,)), (2,))(*args))
    assert planned and max(planned) <= 8 and 8 in planned
    for i in range(n):
        want = ref.forward(ref.softmax, x[..., i])
        assert rel_error(y[i], want) < TOLERANCE["float32"]
        (want_grad,) = ref.vjp(ref.softmax, [x[..., i]], 2 * want, n_diff=1)
        assert rel_error(grad[i], want_grad) < GRAD_TOLERANCE["float32"]
    # A call past the limit by itself is refused by name, before any kernel runs.
    with pytest.raises(ValueError, match=r"x has 9 rows \(slices along axis 0\), more than the 8"):
        fw.ops.softmax(fw.asarray(rng.standard_normal((2, 3, 3))), axis=0)


def test_row_limit_keeps_the_block_count_in_int32(jax_fw):
    # The kernels loop over tl.cdiv(n_rows, BLOCK_M) = (n_rows + BLOCK_M - 1) // BLOCK_M blocks in
    # int32: for n_rows past 2**31 - BLOCK_M (up to 2**31 - 1, which the plans took) that wrapped
    # negative, and no row was written. Plans now stop at MAX_ROWS, where it cannot.
    import jax
    import jax.numpy as jnp

    from triton_kernels import softmax
    from triton_kernels.plan import HOPPER, DeviceFacts

    assert softmax.MAX_ROWS + softmax.MAX_BLOCK_M - 1 <= 2**31 - 1
    for facts in (DeviceFacts.cpu(), HOPPER):
        for cols in (1, 16, 33, 1000, 40000):
            plan = softmax.softmax_fwd_plan(softmax.MAX_ROWS, cols, "float16", facts)
            assert plan.constexpr_dict["BLOCK_M"] <= softmax.MAX_BLOCK_M
        with pytest.raises(ValueError, match="rows, more than the"):
            softmax.softmax_bwd_plan(2**31 - 1, 2, "float16", facts)
    # Traced only (eval_shape): a vmap over 2 samples of 2**30 rows runs in two launches, and a
    # call past the limit is refused by name.
    x = jax.ShapeDtypeStruct((2, 2**30, 2), jnp.float16)
    assert jax.eval_shape(jax.vmap(jax.grad(lambda x: jax_fw.ops.softmax(x)[:, 0].astype(jnp.float32).sum())),
                          x).shape == x.shape
    with pytest.raises(ValueError, match="x has 2147483647 rows"):
        jax.eval_shape(jax_fw.ops.softmax, jax.ShapeDtypeStruct((2**31 - 1, 1), jnp.float16))
