"""grouped_matmul / transposed_grouped_matmul: vs float64 loops of matmuls, gradients, group
selection, zero sizes, torch-vs-jax parity, bad input, jit/compile, and the Pallas cross-check.

Outputs are poisoned with NaN before every launch (conftest), so a row the kernels forget to
write, e.g. past sum(group_sizes), fails the comparisons.
"""
import re
import warnings

import numpy as np
import pytest

from tests import frameworks
from tests import references as ref
from tests.frameworks import TOLERANCE, registered_ops, rel_error

DTYPES = ["float32", "float16", "bfloat16"]
SMALL = {"blocksize_m": 16, "blocksize_n": 16, "blocksize_k": 16}  # many tiles from small shapes


def ragged_sizes(rng, m: int, groups: int, spare: int = 3) -> np.ndarray:
    """``groups`` sizes with empty groups and ragged ones, summing to ``m - spare`` (rows past
    the sum must come out as zeros)."""
    total = max(m - spare, 0)
    cuts = np.sort(rng.integers(0, total + 1, size=groups - 1)) if groups > 1 else np.array([], int)
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    if groups > 2:  # make sure some groups are empty and one holds the rest
        sizes[1] += sizes[0]
        sizes[0] = 0
    return sizes


def bounds(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)])


def _arrays(fw, rng, dtype, *shapes):
    xs = [fw.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return xs, [fw.to_numpy(x) for x in xs]


def _err(got, want, dtype):
    """Within the dtype's bound of the float64 reference, or, for float16, of that reference
    rounded to float16: an output in float16's subnormal range (a 1x1x1 product of two small
    draws) cannot be nearer than its rounding, which alone can exceed the bound."""
    if rel_error(got, want) < TOLERANCE[dtype]:
        return True
    return dtype == "float16" and rel_error(got, np.asarray(want).astype(np.float16)) < TOLERANCE[dtype]


# ---------------------------------------------------------------------------------------------
# gmm forward


def test_subnormal_float16_output_is_its_correct_rounding(fw):
    """-2.18e-6 is subnormal in float16 (spacing 6e-8): the kernel's output is the exact product's
    rounding, 1.2% off, which the float64 bound alone would refuse (a draw that failed CI once)."""
    lhs, rhs = np.array([[1.1e-3]], np.float16), np.array([[[-1.98e-3]]], np.float16)
    out = fw.to_numpy(fw.ops.grouped_matmul(fw.asarray(lhs), fw.asarray(rhs), fw.asarray(np.array([1], np.int32))))
    exact = lhs.astype(np.float64) * rhs[0].astype(np.float64)
    assert np.array_equal(out, exact.astype(np.float16)) and rel_error(out, exact) > TOLERANCE["float16"]
    assert _err(out, exact, "float16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, groups, transpose_rhs", [
    (1, 1, 1, 1, False), (37, 19, 23, 4, False), (100, 64, 96, 6, True), (130, 33, 70, 3, False),
])
def test_gmm_matches_float64(fw, rng, dtype, m, k, n, groups, transpose_rhs):
    sizes = ragged_sizes(rng, m, groups, spare=min(3, m - 1))
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, dtype, (m, k), rhs_shape)
    out = fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), transpose_rhs=transpose_rhs)
    assert str(out.dtype).endswith(dtype) and tuple(out.shape) == (m, n)
    out = fw.to_numpy(out)
    expected = ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes, transpose_rhs=transpose_rhs)
    assert _err(out, expected, dtype)
    assert not out[sizes.sum():].any()  # rows past sum(group_sizes): exact zeros


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_small_tiles(fw, rng, transpose_rhs):
    # 16-wide tiles: many row tiles per group, several k steps, ragged k and n edges.
    m, k, n, groups = 150, 50, 40, 5
    sizes = ragged_sizes(rng, m, groups)
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (m, k), rhs_shape)
    out = fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), transpose_rhs=transpose_rhs, fwd_params=SMALL)
    expected = ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes, transpose_rhs=transpose_rhs)
    assert _err(fw.to_numpy(out), expected, "float32")


@pytest.mark.parametrize("group_offset", [0, 2, 4])
def test_gmm_group_offset(fw, rng, group_offset):
    # rhs holds 3 of 7 groups (one shard's experts); every other row is zero.
    m, k, n, groups, held = 90, 24, 20, 7, 3
    sizes = ragged_sizes(rng, m, groups, spare=5)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (m, k), (held, k, n))
    for offset in (group_offset, np.int64(group_offset), fw.asarray(np.int32(group_offset))):  # numpy ints too
        out = fw.to_numpy(fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=offset, fwd_params=SMALL))
        expected = ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes, group_offset=group_offset)
        assert _err(out, expected, "float32")
        b = bounds(sizes)
        assert not out[:b[group_offset]].any() and not out[b[group_offset + held]:].any()


@pytest.mark.parametrize("dtype, out_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float32")])
def test_preferred_element_type(fw, rng, dtype, out_dtype):
    m, k, n, groups = 40, 32, 24, 3
    sizes = ragged_sizes(rng, m, groups)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, dtype, (m, k), (groups, k, n))
    out = fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), preferred_element_type=fw.dtype(out_dtype))
    assert str(out.dtype).endswith(out_dtype)
    # Accumulation is float32, so only the output rounding of out_dtype is allowed.
    worst = out_dtype if TOLERANCE[out_dtype] > TOLERANCE[dtype] else dtype
    assert _err(fw.to_numpy(out), ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes), worst)
    (lhs2, rhs2), (l2_np, r2_np) = _arrays(fw, rng, dtype, (k, m), (m, n))
    out = fw.ops.transposed_grouped_matmul(lhs2, rhs2, fw.asarray(sizes), preferred_element_type=fw.dtype(out_dtype))
    assert str(out.dtype).endswith(out_dtype)
    assert _err(fw.to_numpy(out), ref.forward(ref.transposed_grouped_matmul, l2_np, r2_np, sizes), worst)


# ---------------------------------------------------------------------------------------------
# tgmm forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, groups", [(1, 1, 1, 1), (45, 21, 17, 5), (140, 40, 72, 3)])
def test_tgmm_matches_float64(fw, rng, dtype, m, k, n, groups):
    sizes = ragged_sizes(rng, m, groups, spare=min(3, m - 1))
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, dtype, (k, m), (m, n))
    out = fw.ops.transposed_grouped_matmul(lhs, rhs, fw.asarray(sizes))
    assert tuple(out.shape) == (groups, k, n)
    out = fw.to_numpy(out)
    assert _err(out, ref.forward(ref.transposed_grouped_matmul, lhs_np, rhs_np, sizes), dtype)
    for g in np.flatnonzero(sizes == 0):  # empty groups: exact zeros
        assert not out[g].any()


@pytest.mark.parametrize("group_offset, num_actual_groups", [(0, 2), (3, 3), (1, 5), (6, 0)])
def test_tgmm_group_selection(fw, rng, group_offset, num_actual_groups):
    m, k, n, groups = 80, 30, 20, 6
    sizes = ragged_sizes(rng, m, groups)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (k, m), (m, n))
    out = fw.ops.transposed_grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=group_offset,
                                           num_actual_groups=num_actual_groups, fwd_params=SMALL)
    expected = ref.forward(ref.transposed_grouped_matmul, lhs_np, rhs_np, sizes, group_offset=group_offset,
                           num_actual_groups=num_actual_groups)
    assert fw.to_numpy(out).shape == (num_actual_groups, k, n)
    assert _err(fw.to_numpy(out), expected, "float32")


def test_tgmm_row_offsets_past_int32(torch_fw):
    # lhs [k, m] with (BLOCK_K - 1) * m >= 2**31: the k-row offsets were int32 and wrapped, so the
    # kernel read out of bounds (illegal address on an H100 at m = 20M, a segfault in the
    # interpreter). torch.empty leaves the pages untouched: only the last group's columns are
    # written (and read). The jax front launches the same kernel (its arrays would be real copies).
    import torch

    import ejkernel_torch as ejk

    m, k, n, rows = 34_200_000, 64, 16, 40  # the CPU plan's BLOCK_K is 64: 63 * m > 2**31
    g = torch.Generator().manual_seed(0)
    lhs = torch.empty(k, m, dtype=torch.bfloat16, device=torch_fw.device)
    rhs = torch.empty(m, n, dtype=torch.bfloat16, device=torch_fw.device)
    lhs[:, m - rows:] = torch.randn(k, rows, generator=g).to(lhs)
    rhs[m - rows:] = torch.randn(rows, n, generator=g).to(rhs)
    sizes = torch.tensor([m - rows, rows], dtype=torch.int32, device=torch_fw.device)
    out = ejk.transposed_grouped_matmul(lhs, rhs, sizes, group_offset=1, num_actual_groups=1)
    want = lhs[:, m - rows:].double().cpu().numpy() @ rhs[m - rows:].double().cpu().numpy()
    assert _err(out[0].float().cpu().numpy(), want, "bfloat16")


def test_other_groups_values_never_leak(fw, rng):
    # inf/NaN in rows outside a group must not reach that group's results (tiles straddle groups).
    m, k, n = 64, 16, 16
    sizes = np.array([20, 30, 10], np.int32)
    lhs_np = rng.standard_normal((m, k)).astype(np.float32)
    lhs_np[:20] = np.nan
    lhs_np[50:] = np.inf
    rhs_np = rng.standard_normal((m, n)).astype(np.float32)
    out = fw.to_numpy(fw.ops.transposed_grouped_matmul(fw.asarray(lhs_np.T), fw.asarray(rhs_np), fw.asarray(sizes),
                                                       group_offset=1, num_actual_groups=1))
    assert np.isfinite(out).all()
    assert _err(out[0], lhs_np[20:50].T.astype(np.float64) @ rhs_np[20:50], "float32")
    w = rng.standard_normal((1, k, n)).astype(np.float32)
    out = fw.to_numpy(fw.ops.grouped_matmul(fw.asarray(lhs_np), fw.asarray(w), fw.asarray(sizes), group_offset=1))
    assert np.isfinite(out).all() and not out[:20].any() and not out[50:].any()


def _interpretable(plan, **changes):
    """``plan`` with ``changes`` to its constexprs and the interpreter's dot precision."""
    return plan.with_constexprs(DOT_PRECISION="upcast", **changes)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_hopper_tma_plan_under_the_interpreter(fw, rng, transpose_rhs):
    """The gmm plan an sm_90 GPU with global scratch runs reads through tensor descriptors and
    stores whole tiles through one (TMA): its boxes run past a group's rows, past k and past n.
    The Triton interpreter runs that plan here, so that CPU CI checks its logic; only its dot
    precision is the interpreter's (under "tf32" the interpreter multiplies bf16 bit patterns).
    Rows outside the selected groups hold inf and NaN. Bitwise equal to the same plan with
    pointer loads and register stores."""
    if frameworks.cuda_available():
        pytest.skip("on a GPU, tests/test_gpu_grouped_matmul.py runs these plans compiled")
    from triton_kernels import HOPPER_GLUON
    from triton_kernels.grouped_matmul import gmm_plan

    m, k, n, held, offset = 700, 72, 200, 4, 1
    sizes = np.array([50, 120, 0, 230, 150, 100], np.int32)  # rows [50, 550) selected, 50 past the sum
    plan = gmm_plan(m, k, n, len(sizes), held, transpose_rhs, "bfloat16", "bfloat16", HOPPER_GLUON)
    c = plan.constexpr_dict
    assert c["TMA_LOAD"] and c["TMA_STORE"] and k % c["BLOCK_K"] and n % c["BLOCK_N"]

    lhs_np = rng.standard_normal((m, k))
    lhs_np[:50], lhs_np[550:] = np.inf, np.nan
    rhs_np = rng.standard_normal((held, n, k) if transpose_rhs else (held, k, n))
    args = (fw.asarray(lhs_np, "bfloat16"), fw.asarray(rhs_np, "bfloat16"), fw.asarray(sizes),
            fw.asarray(np.array([offset], np.int32)))
    (tma,) = fw.launch(_interpretable(plan), *args)
    (pointer,) = fw.launch(_interpretable(plan, TMA_LOAD=False, TMA_STORE=False), *args)
    got = fw.to_numpy(tma)
    want = ref.forward(ref.grouped_matmul, fw.to_numpy(args[0]), fw.to_numpy(args[1]), sizes,
                       transpose_rhs=transpose_rhs, group_offset=offset)  # slices the selected rows
    assert np.isfinite(got).all() and not got[:50].any() and not got[550:].any()
    assert _err(got, want, "bfloat16")
    assert np.array_equal(got, fw.to_numpy(pointer))


def test_hopper_tgmm_tma_store_plan_under_the_interpreter(fw, rng):
    """As above for the weight gradient's Triton kernel in the public ``[k, m]`` layout, which
    stores each expert's tiles through a descriptor of the ``[experts, k, n]`` output, clipped
    at k and n."""
    if frameworks.cuda_available():
        pytest.skip("on a GPU, tests/test_gpu_grouped_matmul.py runs these plans compiled")
    from triton_kernels import HOPPER_GLUON
    from triton_kernels.grouped_matmul import tgmm_plan

    m, k, n, held, offset = 700, 72, 200, 4, 1
    sizes = np.array([50, 120, 0, 230, 150, 100], np.int32)
    plan = tgmm_plan(m, k, n, len(sizes), held, False, "bfloat16", "bfloat16", HOPPER_GLUON)
    c = plan.constexpr_dict
    assert plan.name == "tgmm_kernel" and c["TMA_STORE"] and k % c["BLOCK_K"] and n % c["BLOCK_N"]

    lhs_np = rng.standard_normal((k, m))
    lhs_np[:, :50], lhs_np[:, 550:] = np.inf, np.nan
    args = (fw.asarray(lhs_np, "bfloat16"), fw.asarray(rng.standard_normal((m, n)), "bfloat16"), fw.asarray(sizes),
            fw.asarray(np.array([offset], np.int32)))
    (tma,) = fw.launch(_interpretable(plan), *args)
    (registers,) = fw.launch(_interpretable(plan, TMA_STORE=False), *args)
    got = fw.to_numpy(tma)
    want = ref.forward(ref.transposed_grouped_matmul, fw.to_numpy(args[0]), fw.to_numpy(args[1]), sizes,
                       group_offset=offset, num_actual_groups=held)
    assert np.isfinite(got).all() and not got[1].any()  # the empty expert
    assert _err(got, want, "bfloat16")
    assert np.array_equal(got, fw.to_numpy(registers))


# ---------------------------------------------------------------------------------------------
# zero sizes


@pytest.mark.parametrize("m, k, n, sizes", [
    (0, 8, 8, [0, 0]), (10, 0, 8, [4, 6]), (10, 8, 0, [4, 6]), (10, 8, 8, [0, 0, 0]), (10, 8, 8, []),
])
def test_zero_sizes(fw, rng, m, k, n, sizes):
    sizes = np.array(sizes, np.int32)
    g = len(sizes)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (m, k), (g, k, n))
    out = fw.to_numpy(fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes)))
    assert out.shape == (m, n)
    np.testing.assert_allclose(out, ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes), atol=1e-5)
    assert not np.isnan(out).any()
    (a, b), (a_np, b_np) = _arrays(fw, rng, "float32", (k, m), (m, n))
    out = fw.to_numpy(fw.ops.transposed_grouped_matmul(a, b, fw.asarray(sizes)))
    assert out.shape == (g, k, n) and not np.isnan(out).any()
    np.testing.assert_allclose(out, ref.forward(ref.transposed_grouped_matmul, a_np, b_np, sizes), atol=1e-5)
    cot = fw.asarray(np.ones((m, n), np.float32))
    grads = fw.vjp(lambda x, y: fw.ops.grouped_matmul(x, y, fw.asarray(sizes)), [lhs, rhs], cot)
    assert grads[0].shape == (m, k) and grads[1].shape == (g, k, n)
    assert all(not np.isnan(x).any() for x in grads)


# ---------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_gradients(fw, rng, dtype, transpose_rhs):
    m, k, n, groups, held, offset = 70, 24, 40, 5, 3, 1
    sizes = ragged_sizes(rng, m, groups)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, dtype, (m, k), (held, n, k) if transpose_rhs else (held, k, n))
    cot = fw.asarray(rng.standard_normal((m, n)), dtype)
    kwargs = dict(transpose_rhs=transpose_rhs, group_offset=offset)
    grads = fw.vjp(lambda x, y: fw.ops.grouped_matmul(x, y, fw.asarray(sizes), **kwargs), [lhs, rhs], cot)
    expected = ref.vjp(ref.grouped_matmul, [lhs_np, rhs_np, sizes], fw.to_numpy(cot), n_diff=2, **kwargs)
    for name, got, want in zip(("d_lhs", "d_rhs"), grads, expected):
        assert _err(got, want, dtype), name
    b = bounds(sizes)
    assert not grads[0][:b[offset]].any() and not grads[0][b[offset + held]:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tgmm_gradients(fw, rng, dtype):
    m, k, n, groups = 60, 20, 28, 4
    sizes = ragged_sizes(rng, m, groups)
    kwargs = dict(group_offset=1, num_actual_groups=2)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, dtype, (k, m), (m, n))
    cot = fw.asarray(rng.standard_normal((2, k, n)), dtype)
    grads = fw.vjp(lambda x, y: fw.ops.transposed_grouped_matmul(x, y, fw.asarray(sizes), **kwargs), [lhs, rhs], cot)
    expected = ref.vjp(ref.transposed_grouped_matmul, [lhs_np, rhs_np, sizes], fw.to_numpy(cot), n_diff=2, **kwargs)
    for name, got, want in zip(("d_lhs", "d_rhs"), grads, expected):
        assert _err(got, want, dtype), name


def test_gradients_with_preferred_element_type(fw, rng):
    # bf16 inputs, float32 output: the cotangent is rounded to bf16 for the backward kernels.
    m, k, n, groups = 50, 32, 16, 3
    sizes = ragged_sizes(rng, m, groups)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "bfloat16", (m, k), (groups, k, n))
    cot = rng.standard_normal((m, n)).astype(np.float32)
    f32 = fw.dtype("float32")
    grads = fw.vjp(lambda x, y: fw.ops.grouped_matmul(x, y, fw.asarray(sizes), preferred_element_type=f32),
                   [lhs, rhs], fw.asarray(cot))
    expected = ref.vjp(ref.grouped_matmul, [lhs_np, rhs_np, sizes], cot, n_diff=2)
    for got, want in zip(grads, expected):
        assert _err(got, want, "bfloat16")


@pytest.mark.parametrize("seed", range(8))
def test_random_problems(fw, seed):
    """Random sizes, group counts, shards, layouts and tiles: forward of both ops and gmm's gradients."""
    rng = np.random.default_rng(seed)
    m, k, n = (int(x) for x in rng.integers(1, [160, 70, 70]))
    groups = int(rng.integers(1, 9))
    held = int(rng.integers(0, groups + 1))
    offset = int(rng.integers(0, groups - held + 1))
    transpose_rhs = bool(rng.integers(2))
    params = [None, SMALL, {"blocksize_m": 32, "blocksize_k": 16}][seed % 3]
    sizes = ragged_sizes(rng, m, groups, spare=int(rng.integers(0, m)))
    kwargs = dict(transpose_rhs=transpose_rhs, group_offset=offset)
    (lhs, rhs, lhs_t), (lhs_np, rhs_np, lhs_t_np) = _arrays(
        fw, rng, "float32", (m, k), (held, n, k) if transpose_rhs else (held, k, n), (k, m))
    cot = rng.standard_normal((m, n)).astype(np.float32)
    fn = lambda x, y: fw.ops.grouped_matmul(x, y, fw.asarray(sizes), fwd_params=params, **kwargs)  # noqa: E731
    out = fw.to_numpy(fn(lhs, rhs))
    assert _err(out, ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes, **kwargs), "float32")
    grads = fw.vjp(fn, [lhs, rhs], fw.asarray(cot))
    if held:
        expected = ref.vjp(ref.grouped_matmul, [lhs_np, rhs_np, sizes], cot, n_diff=2, **kwargs)
    else:  # no group selected: the output is constant (torch's float64 reference has no graph)
        expected = [np.zeros_like(lhs_np), np.zeros_like(rhs_np)]
    for got, want in zip(grads, expected):
        assert got.shape == want.shape and _err(got, want, "float32")
    tout = fw.ops.transposed_grouped_matmul(lhs_t, fw.asarray(cot), fw.asarray(sizes), group_offset=offset,
                                            num_actual_groups=held, fwd_params=params)
    expected = ref.forward(ref.transposed_grouped_matmul, lhs_t_np, cot, sizes, group_offset=offset,
                           num_actual_groups=held)
    assert _err(fw.to_numpy(tout), expected, "float32")


def _second_order_reference(lhs, rhs, sizes, **kwargs):
    import torch

    a, b = (torch.from_numpy(x).double().requires_grad_(True) for x in (lhs, rhs))
    (ga,) = torch.autograd.grad((ref.grouped_matmul(a, b, torch.from_numpy(sizes), **kwargs) ** 2).sum(), a,
                                create_graph=True)
    (gb,) = torch.autograd.grad((ga ** 2).sum(), b)
    return gb.numpy()


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_second_order_gradients(fw, rng, transpose_rhs):
    # The backward is made of the differentiable ops, so gradients of gradients run on the kernels.
    m, k, n, groups = 30, 12, 10, 3
    sizes = ragged_sizes(rng, m, groups)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((groups, n, k) if transpose_rhs else (groups, k, n)).astype(np.float32)
    kwargs = dict(transpose_rhs=transpose_rhs, group_offset=0)
    if fw.name == "torch":
        import torch

        a, b = (torch.from_numpy(x).requires_grad_(True) for x in (lhs, rhs))
        out = fw.ops.grouped_matmul(a, b, torch.from_numpy(sizes), transpose_rhs=transpose_rhs)
        (ga,) = torch.autograd.grad((out ** 2).sum(), a, create_graph=True)
        (gb,) = torch.autograd.grad((ga ** 2).sum(), b)
        got = gb.numpy()
    else:
        import jax

        def inner(a, b):
            return (fw.ops.grouped_matmul(a, b, sizes, transpose_rhs=transpose_rhs) ** 2).sum()

        got = np.asarray(jax.grad(lambda b, a: (jax.grad(inner)(a, b) ** 2).sum())(rhs, lhs))
    assert _err(got, _second_order_reference(lhs, rhs, sizes, **kwargs), "float32")


# ---------------------------------------------------------------------------------------------
# torch vs jax


def test_torch_and_jax_agree(torch_fw, jax_fw, rng):
    m, k, n, groups = 77, 40, 33, 4
    sizes = ragged_sizes(rng, m, groups)
    data = [rng.standard_normal(s).astype(np.float32) for s in ((m, k), (groups, k, n), (m, n), (k, m))]
    results = []
    for f in (torch_fw, jax_fw):
        lhs, rhs, cot, lhs_t = (f.asarray(a, "bfloat16") for a in data)
        gs = f.asarray(sizes)
        out = f.ops.grouped_matmul(lhs, rhs, gs)
        grads = f.vjp(lambda x, y: f.ops.grouped_matmul(x, y, gs), [lhs, rhs], cot)
        tout = f.ops.transposed_grouped_matmul(lhs_t, cot, gs)
        results.append([f.to_numpy(out), *grads, f.to_numpy(tout)])
    for a, b in zip(*results):  # the same interpreter (or binary, on GPU) runs both
        assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------------------------
# bad input (checked before any kernel runs)


def _gmm_bad_cases():
    f32 = np.float32
    return [
        (dict(group_sizes=np.array([2, 3], np.int16)), TypeError, "group_sizes must be an int32"),
        (dict(group_sizes=np.array([2.0, 3.0], f32)), TypeError, "group_sizes must be an int32"),
        (dict(group_sizes=np.array([[2, 3]], np.int32)), ValueError, "group_sizes must be 1-D"),
        (dict(group_sizes=np.array([-1, 3], np.int32)), ValueError, "group_sizes must be non-negative"),
        (dict(group_sizes=np.array([4, 3], np.int32)), ValueError, r"sum\(group_sizes\) = 7 exceeds the 6 rows"),
        (dict(lhs=np.zeros((2, 6, 4), f32)), ValueError, "lhs must be 2-D"),
        (dict(rhs=np.zeros((8, 5), f32)), ValueError, "rhs must be 3-D"),
        (dict(rhs=np.zeros((2, 5, 5), f32)), ValueError, "does not match lhs"),
        (dict(rhs=np.zeros((2, 4, 5), np.float16)), TypeError, "lhs, rhs must share one dtype"),
        (dict(lhs=np.zeros((6, 4), np.int32)), TypeError, "lhs must be a float"),
        (dict(rhs=np.zeros((3, 4, 5), f32)), ValueError, "rhs has 3 groups but group_sizes only 2"),
        (dict(rhs=np.zeros((1, 4, 5), f32), group_offset=2), ValueError, r"group_offset=2 selects groups \[2, 3\)"),
        (dict(rhs=np.zeros((1, 4, 5), f32), group_offset=np.array(-1, np.int32)), ValueError, "group_offset=-1"),
        (dict(group_offset=np.array([0, 1], np.int32)), ValueError, "group_offset must be a scalar"),
        (dict(group_offset=np.array(0.0, f32)), TypeError, "group_offset must be an int"),
        (dict(preferred_element_type="int32"), TypeError, "preferred_element_type must be"),
        (dict(fwd_params={"blocksize_m": 8}), ValueError, "at least 16"),
        # read by truthiness before: "false" transposed (and then failed on the shapes)
        (dict(transpose_rhs="false"), TypeError, "transpose_rhs must be a bool, got 'false'"),
        (dict(transpose_rhs=None), TypeError, "transpose_rhs must be a bool"),
        (dict(check_values="no", group_sizes=np.array([4, 3], np.int32)), TypeError, "check_values must be a bool"),
        *_params_bad_cases(),
    ]


def _params_bad_cases():
    """fwd_params and autotune errors name them, and list only what grouped matmuls take."""
    return [
        (dict(fwd_params={"q_blocksize": 16}), ValueError,
         re.escape("fwd_params: field(s) ['q_blocksize'] do not apply")),
        (dict(fwd_params={"bogus": 1}), ValueError,
         re.escape("fwd_params: unknown field(s) ['bogus']; known: "
                   "['blocksize_k', 'blocksize_m', 'blocksize_n', 'num_stages', 'num_warps']") + "$"),
        (dict(fwd_params=[16]), TypeError, "fwd_params: expected FwdParams"),
        (dict(autotune="no"), TypeError, "autotune must be True, False or None, got 'no'"),
        (dict(autotune=1, fwd_params={"blocksize_m": 16}), TypeError, "autotune must be"),  # even when not read
    ]


@pytest.mark.parametrize("kwargs, error, match", _gmm_bad_cases())
def test_gmm_bad_input(fw, kwargs, error, match):
    args = dict(lhs=np.zeros((6, 4), np.float32), rhs=np.zeros((2, 4, 5), np.float32),
                group_sizes=np.array([2, 3], np.int32)) | kwargs
    options = {}
    for key in ("group_offset", "fwd_params", "preferred_element_type", "autotune", "transpose_rhs", "check_values"):
        if key in args:
            value = args.pop(key)
            options[key] = fw.asarray(value) if isinstance(value, np.ndarray) else value
    if options.get("preferred_element_type") is not None:
        options["preferred_element_type"] = fw.dtype(options["preferred_element_type"])
    with pytest.raises(error, match=match):
        fw.ops.grouped_matmul(*(fw.asarray(args[n]) for n in ("lhs", "rhs", "group_sizes")), **options)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rhs=np.zeros((7, 5), np.float32)), ValueError, "disagree on m"),
    (dict(num_actual_groups=3), ValueError, r"num_actual_groups must be in \[0, 2\]"),
    (dict(num_actual_groups=True), TypeError, "num_actual_groups must be a Python int"),
    (dict(num_actual_groups=1, group_offset=2), ValueError, "group_offset=2"),
    (dict(group_sizes=np.array([5, 3], np.int32)), ValueError, "exceeds the 6 rows"),
    (dict(lhs=np.zeros((4, 6, 1), np.float32)), ValueError, "lhs must be 2-D"),
    (dict(check_values="no"), TypeError, "check_values must be a bool, got 'no'"),
    *_params_bad_cases(),
])
def test_tgmm_bad_input(fw, kwargs, error, match):
    args = dict(lhs=np.zeros((4, 6), np.float32), rhs=np.zeros((6, 5), np.float32),
                group_sizes=np.array([2, 3], np.int32)) | kwargs
    options = {key: args.pop(key) for key in ("num_actual_groups", "group_offset", "fwd_params", "autotune",
                                              "check_values") if key in args}
    with pytest.raises(error, match=match):
        fw.ops.transposed_grouped_matmul(*(fw.asarray(args[n]) for n in ("lhs", "rhs", "group_sizes")), **options)


def test_torch_rejects_mixed_devices_and_non_tensors(torch_fw):
    import torch

    import ejkernel_torch as ejk

    lhs, rhs = torch.zeros(6, 4), torch.zeros(2, 4, 5)
    with pytest.raises(TypeError, match="group_sizes must be a torch.Tensor"):
        ejk.grouped_matmul(lhs, rhs, [2, 3])
    with pytest.raises(TypeError, match="preferred_element_type must be a torch.dtype"):
        ejk.grouped_matmul(lhs, rhs, torch.tensor([2, 3], dtype=torch.int32), preferred_element_type="float32")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="group_sizes is on"):
            ejk.grouped_matmul(lhs.cuda(), rhs.cuda(), torch.tensor([2, 3], dtype=torch.int32))
    # group_offset on another device is refused like group_sizes; it was moved silently (from
    # meta, which holds no value, it failed inside torch's copy, naming nothing)
    sizes, meta = torch.tensor([2, 3], dtype=torch.int32), torch.device("meta")
    with pytest.raises(ValueError, match="group_sizes is on meta but lhs is on cpu"):
        ejk.grouped_matmul(lhs, rhs, sizes.to(meta))
    with pytest.raises(ValueError, match="group_offset is on meta but lhs is on cpu"):
        ejk.grouped_matmul(lhs, rhs[:1], sizes, group_offset=torch.tensor(1, device=meta))
    with pytest.raises(ValueError, match="group_offset is on meta but lhs is on cpu"):
        ejk.transposed_grouped_matmul(lhs.T, lhs, sizes, group_offset=torch.tensor(1, device=meta),
                                      num_actual_groups=1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="group_offset is on cpu but lhs is on cuda"):
            ejk.grouped_matmul(lhs.cuda(), rhs[:1].cuda(), sizes.cuda(), group_offset=torch.tensor(1))


def test_check_values_false_skips_only_the_value_checks(fw, rng):
    """check_values=False does not read group_sizes / a tensor group_offset (the host sync on a
    GPU): valid values give the same bits as a checked call, bad values are not raised but
    clamped by the kernels, and shape/dtype checks still run."""
    m, k, n, held = 37, 20, 19, 2
    sizes = ragged_sizes(rng, m, 4)
    (lhs, rhs, lhs_t, rhs_t), _ = _arrays(fw, rng, "float32", (m, k), (held, k, n), (k, m), (m, n))
    for offset in (1, fw.asarray(np.int32(1))):
        gmm = [fw.to_numpy(fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=offset,
                                                   fwd_params=SMALL, check_values=check)) for check in (True, False)]
        tgmm = [fw.to_numpy(fw.ops.transposed_grouped_matmul(lhs_t, rhs_t, fw.asarray(sizes), group_offset=offset,
                                                             num_actual_groups=held, fwd_params=SMALL,
                                                             check_values=check)) for check in (True, False)]
        assert np.array_equal(*gmm) and np.array_equal(*tgmm)
    bad = fw.asarray(np.array([-5, 40, 40, 40], np.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        fw.ops.grouped_matmul(lhs, rhs, bad)
    with pytest.raises(ValueError, match="group_offset"):
        fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=fw.asarray(np.int32(7)))
    out = fw.ops.grouped_matmul(lhs, rhs, bad, group_offset=fw.asarray(np.int32(7)), check_values=False)
    assert np.isfinite(fw.to_numpy(out)).all()
    out = fw.ops.transposed_grouped_matmul(lhs_t, rhs_t, bad, check_values=False)
    assert np.isfinite(fw.to_numpy(out)).all()
    # Sizes whose int32 running sum wraps negative: no read before row 0 (it crashed the
    # interpreter); the rows past the first group come out as zeros.
    huge = fw.asarray(np.array([m - 3, 2**31 - 1, 5, 2**31 - 1], np.int32))
    out = fw.to_numpy(fw.ops.grouped_matmul(lhs, rhs, huge, group_offset=1, check_values=False))
    assert np.isfinite(out).all() and not out[:m - 3].any()
    out = fw.to_numpy(fw.ops.transposed_grouped_matmul(lhs_t, rhs_t, huge, num_actual_groups=held,
                                                       group_offset=2, check_values=False))
    assert not out.any()
    with pytest.raises(ValueError, match="group_offset=9"):  # an int offset costs nothing to check
        fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=9, check_values=False)
    with pytest.raises(TypeError, match="group_sizes must be an int32"):
        fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes.astype(np.int16)), check_values=False)


def test_check_values_false_skips_the_value_checks_on_the_pallas_path(jax_fw, rng):
    """check_values=False is documented to skip reading concrete group_sizes / group_offset (a
    device-to-host copy); with platform="tpu" the Pallas function read and checked them anyway,
    so bad sizes raised there (and on a TPU the copy it is meant to avoid still happened).
    Unchecked, they are clamped, as on the Triton path."""
    import jax.numpy as jnp

    import ejkernel_jax as ejk

    m, k, n, held = 37, 20, 19, 2
    sizes = ragged_sizes(rng, m, 4)
    (lhs, rhs, lhs_t, rhs_t), _ = _arrays(jax_fw, rng, "float32", (m, k), (held, k, n), (k, m), (m, n))
    bad, offset = jnp.asarray(np.array([-5, 40, 40, 40], np.int32)), jnp.asarray(np.int32(7))
    with pytest.raises(ValueError, match="group_sizes"):  # checked by default
        ejk.grouped_matmul(lhs, rhs, bad, platform="tpu")
    out = ejk.grouped_matmul(lhs, rhs, bad, group_offset=offset, check_values=False, platform="tpu")
    assert np.isfinite(jax_fw.to_numpy(out)).all()
    out = ejk.transposed_grouped_matmul(lhs_t, rhs_t, bad, group_offset=offset, num_actual_groups=held,
                                        check_values=False, platform="tpu")
    assert np.isfinite(jax_fw.to_numpy(out)).all()
    for check in (True, False):  # valid values: the same result either way
        out = ejk.grouped_matmul(lhs, rhs, jnp.asarray(sizes), group_offset=jnp.asarray(np.int32(1)),
                                 check_values=check, platform="tpu")
        want = ref.forward(ref.grouped_matmul, jax_fw.to_numpy(lhs), jax_fw.to_numpy(rhs), sizes, group_offset=1)
        assert _err(jax_fw.to_numpy(out), want, "float32")


@pytest.mark.parametrize("offset, dtype", [(2**31, "int64"), (2**32, "int64"), (2**40, "int64"),
                                           (2**63 + 1, "uint64")])
def test_wide_group_offset_is_clamped_not_wrapped(fw, rng, offset, dtype):
    # An int64 group_offset whose value the fronts do not read (traced under jax.jit, or
    # check_values=False) was cast to int32 before the kernels' clamp: 2**32 wrapped to 0 and
    # silently selected groups [0, 2). The torch front also widened a uint64 one to int64 (torch
    # has no clamp or min for uint64), wrapping 2**63 + 1 to -2**63 + 1: read, it was refused as
    # "group_offset=-9223372036854775807"; unread, clamped to 0. Now an offset is read as itself
    # and refused, and unread it is clamped into range, here to the last valid offset (1), in both
    # fronts and on the Pallas path.
    sizes = np.array([3, 2, 4], np.int32)
    (lhs, rhs, lhs_t, rhs_t), (lhs_np, rhs_np, lhs_t_np, rhs_t_np) = _arrays(
        fw, rng, "float32", (9, 8), (2, 8, 4), (8, 9), (9, 4))
    gmm_want = ref.forward(ref.grouped_matmul, lhs_np, rhs_np, sizes, group_offset=1)
    tgmm_want = ref.forward(ref.transposed_grouped_matmul, lhs_t_np, rhs_t_np, sizes, group_offset=1,
                            num_actual_groups=2)
    with frameworks.x64(fw):
        big = fw.asarray(np.array(offset, dtype))
        gmm = lambda o, **kw: fw.ops.grouped_matmul(lhs, rhs, fw.asarray(sizes), group_offset=o, **kw)
        tgmm = lambda o, **kw: fw.ops.transposed_grouped_matmul(lhs_t, rhs_t, fw.asarray(sizes), group_offset=o,
                                                                num_actual_groups=2, **kw)
        calls = [(gmm, gmm_want, {}), (tgmm, tgmm_want, {})]
        if fw.name == "jax":
            calls += [(gmm, gmm_want, {"platform": "tpu"}), (tgmm, tgmm_want, {"platform": "tpu"})]
        for op, want, kw in calls:
            outs = [op(big, check_values=False, **kw)]
            if fw.name == "jax":
                import jax

                outs.append(jax.jit(lambda o: op(o, **kw))(big))
            with pytest.raises(ValueError, match=f"group_offset={offset} selects groups"):  # read, it is refused
                op(big, **kw)
            for out in outs:
                assert _err(fw.to_numpy(out), want, "float32"), kw


# ---------------------------------------------------------------------------------------------
# tracing: jax.jit with traced group sizes / offset, torch.compile


def test_vmap_over_group_sizes(fw, rng):
    # torch.func.vmap over group_sizes (or a tensor group_offset) failed reading them for the
    # value checks ("Cannot access data pointer of Tensor that doesn't have storage"); jax.vmap
    # worked. Batched values are not read, as under jit: the results equal unbatched calls
    # (gmm's to rounding: its batch tiles a group's rows of all samples together, so a row may
    # be summed with other BLAS blocking in the interpreter).
    lhs, rhs, rhs_t = (fw.asarray(rng.standard_normal(s), "float32") for s in ((9, 8), (2, 8, 4), (9, 4)))
    sizes = fw.asarray(np.array([[3, 0, 6], [1, 4, 2], [0, 0, 9]], np.int32))
    offsets = fw.asarray(np.array([0, 1, 1], np.int32))
    gmm = fw.vmap(lambda g, o: fw.ops.grouped_matmul(lhs, rhs, g, group_offset=o), (0, 0))(sizes, offsets)
    tgmm = fw.vmap(lambda g: fw.ops.transposed_grouped_matmul(lhs.T, rhs_t, g), (0,))(sizes)
    for i in range(3):
        one = fw.ops.grouped_matmul(lhs, rhs, sizes[i], group_offset=offsets[i])
        want = ref.forward(ref.grouped_matmul, fw.to_numpy(lhs), fw.to_numpy(rhs), fw.to_numpy(sizes)[i],
                           group_offset=int(fw.to_numpy(offsets)[i]))
        assert _err(fw.to_numpy(gmm)[i], want, "float32") and _err(fw.to_numpy(one), want, "float32"), i
        one = fw.ops.transposed_grouped_matmul(lhs.T, rhs_t, sizes[i])
        np.testing.assert_array_equal(fw.to_numpy(tgmm)[i], fw.to_numpy(one))


def _vmap_case(fw, rng, shared_rhs: bool):
    """Three samples with their own routing (sizes, offsets; rows past the sum and groups
    outside the selection must be zeros), odd sizes, and expert weights per sample or shared."""
    n, m, k, width, groups, held = 3, 23, 10, 7, 5, 3
    sizes = np.stack([ragged_sizes(rng, m, groups, spare=spare) for spare in (0, 3, 7)])
    offsets = np.array([0, 2, 1], np.int32)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (n, m, k), (held, k, width) if shared_rhs
                                           else (n, held, k, width))
    return (lhs, rhs, fw.asarray(sizes), fw.asarray(offsets)), (lhs_np, rhs_np, sizes, offsets)


@pytest.mark.parametrize("shared_rhs", [False, True])
def test_vmap_gmm_matches_each_sample(fw, rng, shared_rhs):
    """vmap over every argument (rhs mapped, or one rhs for all samples, as per-sample gradients
    have it) gives each sample's float64 result. torch runs the samples as one launch's batch
    of problems (it ran one launch per sample, warning so; test_torch_func checks the warning)."""
    args, (lhs, rhs, sizes, offsets) = _vmap_case(fw, rng, shared_rhs)
    fn = lambda x, y, g, o: fw.ops.grouped_matmul(x, y, g, group_offset=o)  # noqa: E731
    out = fw.to_numpy(fw.vmap(fn, (0, None if shared_rhs else 0, 0, 0))(*args))
    for i in range(len(lhs)):
        want = ref.forward(ref.grouped_matmul, lhs[i], rhs if shared_rhs else rhs[i], sizes[i],
                           group_offset=int(offsets[i]))
        assert _err(out[i], want, "float32"), i


@pytest.mark.parametrize("chunk", [None, 2], ids=["one chunk", "chunks of 2 samples"])
def test_vmap_shared_rhs_matches_each_sample(fw, rng, monkeypatch, chunk):
    """With shared weights a group's rows of all samples are tiled as one run: one tile holds
    rows of several samples (they meet inside the interpreter's 64-row tiles here, and a run
    takes several tiles), and every row must land in its own sample's output. Batches past
    gm.GROUP_MAJOR_CHUNK samples run a chunk of them at a time: 16,385 samples (jacrev of a
    vmapped layer's 129 x 127 outputs, say) made a [64, 32768] tensor per tile, past Triton's
    2**20 elements, and failed to compile (test_aot_grouped_matmul compiles that plan). The
    chunk is lowered here, as the interpreter takes seconds per sample: 5 samples, 3 chunks."""
    from triton_kernels import grouped_matmul as gm
    from triton_kernels.plan import DeviceFacts

    n, m, k, width, groups = 5, 50, 9, 7, 3
    if chunk is not None:
        monkeypatch.setattr(gm, "GROUP_MAJOR_CHUNK", chunk)
        m = 47  # shapes of no other test: gmm_plan's cache holds no plan of them
    plan = gm.gmm_plan(m, k, width, groups, 2, False, "float32", "float32", DeviceFacts.cpu(), batch=n, shared_rhs=True)
    assert plan.constexpr_dict["GROUP_MAJOR"] and plan.constexpr_dict["BATCH_P2"] == (chunk or 8)
    sizes = np.stack([ragged_sizes(rng, m, groups, spare=spare) for spare in (0, 5, 1, 11, 3)])
    offsets = rng.integers(0, 2, size=n).astype(np.int32)
    (lhs, rhs), (lhs_np, rhs_np) = _arrays(fw, rng, "float32", (n, m, k), (2, k, width))
    fn = lambda x, g, o: fw.ops.grouped_matmul(x, rhs, g, group_offset=o)  # noqa: E731
    out = fw.to_numpy(fw.vmap(fn, (0, 0, 0))(lhs, fw.asarray(sizes), fw.asarray(offsets)))
    for i in range(n):
        want = ref.forward(ref.grouped_matmul, lhs_np[i], rhs_np, sizes[i], group_offset=int(offsets[i]))
        assert _err(out[i], want, "float32"), i


def test_vmap_tgmm_matches_each_sample(fw, rng):
    args, (lhs, rhs_unused, sizes, offsets) = _vmap_case(fw, rng, shared_rhs=False)
    lhs_t = fw.asarray(np.ascontiguousarray(lhs.transpose(0, 2, 1)))  # [n, k, m]: the public layout
    (rhs,), (rhs_np,) = _arrays(fw, rng, "float32", (len(lhs), lhs.shape[1], 6))
    fn = lambda x, y, g, o: fw.ops.transposed_grouped_matmul(x, y, g, group_offset=o, num_actual_groups=3)  # noqa: E731
    out = fw.to_numpy(fw.vmap(fn, (0, 0, 0, 0))(lhs_t, rhs, args[2], args[3]))
    assert out.shape == (len(lhs), 3, lhs.shape[2], 6)
    for i in range(len(lhs)):
        want = ref.forward(ref.transposed_grouped_matmul, lhs[i].T, rhs_np[i], sizes[i], group_offset=int(offsets[i]),
                           num_actual_groups=3)
        assert _err(out[i], want, "float32"), i


def test_vmap_per_sample_gradients(fw, rng):
    """vmap of grad with the expert weights shared: each sample's own d_lhs and d_rhs (float64),
    every kernel run once for all samples (jax ran them in a loop, torch warned of its own)."""
    args, (lhs, rhs, sizes, offsets) = _vmap_case(fw, rng, shared_rhs=True)
    (cot,), (cot_np,) = _arrays(fw, rng, "float32", (len(lhs), lhs.shape[1], rhs.shape[-1]))

    def loss(x, y, g, o, c):
        return (fw.ops.grouped_matmul(x, y, g, group_offset=o) * c).sum()

    per_sample_grads = fw.vmap(fw.grad(loss, (0, 1)), (0, None, 0, 0, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's fallback warns "There is a performance drop ..."
        grads = per_sample_grads(*args, cot)
    if fw.name == "jax":
        assert not fw.has_loop(per_sample_grads, *args, cot)
    for i in range(len(lhs)):
        want = ref.vjp(ref.grouped_matmul, [lhs[i], rhs, sizes[i]], cot_np[i], n_diff=2,
                       group_offset=int(offsets[i]))
        for name, got, w in zip(("d_lhs", "d_rhs"), grads, want):
            assert _err(fw.to_numpy(got)[i], w, "float32"), (name, i)


def test_vmap_nested_and_empty(fw, rng):
    """vmap of vmap (the inner samples' problems are batched again) gives the flat vmap's; a
    mapped axis of size 0 gives empty results (torch's fallback raised)."""
    args, _ = _vmap_case(fw, rng, shared_rhs=True)
    lhs, rhs, sizes, offsets = args
    fn = lambda x, y, g, o: fw.ops.grouped_matmul(x, y, g, group_offset=o)  # noqa: E731
    flat = fw.to_numpy(fw.vmap(fn, (0, None, 0, 0))(*args))
    pairs = [fw.asarray(np.stack([fw.to_numpy(a)] * 2, axis=1)) for a in (lhs, sizes, offsets)]  # [n, 2, ...]
    nested = fw.to_numpy(fw.vmap(fw.vmap(fn, (0, None, 0, 0)), (0, None, 0, 0))(pairs[0], rhs, pairs[1], pairs[2]))
    # To rounding: the nested batch's tiles hold other samples' rows (see test_vmap_over_group_sizes).
    assert _err(nested, np.stack([flat] * 2, axis=1), "float32")
    empty = fw.vmap(fn, (0, None, 0, 0))(lhs[:0], rhs, sizes[:0], offsets[:0])
    assert tuple(empty.shape) == (0, *lhs.shape[1:2], rhs.shape[-1])
    lhs_t = fw.asarray(np.zeros((0, 10, 23), np.float32))
    rhs_t = fw.asarray(np.zeros((0, 23, 6), np.float32))
    tgmm = fw.vmap(lambda x, y, g: fw.ops.transposed_grouped_matmul(x, y, g), (0, 0, 0))(lhs_t, rhs_t, sizes[:0])
    assert tuple(tgmm.shape) == (0, 5, 10, 6)


def test_jax_jit_with_traced_groups(jax_fw, rng):
    import jax

    import ejkernel_jax as ejk

    m, k, n, groups, held = 60, 16, 24, 5, 2
    sizes = ragged_sizes(rng, m, groups)
    lhs, rhs = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (held, k, n)))

    @jax.jit
    def f(lhs, rhs, sizes, offset):
        return ejk.grouped_matmul(lhs, rhs, sizes, group_offset=offset, fwd_params=SMALL)

    for offset in (0, 3):
        out = np.asarray(f(lhs, rhs, sizes, np.int32(offset)))
        expected = ref.forward(ref.grouped_matmul, lhs, rhs, sizes, group_offset=offset)
        assert _err(out, expected, "float32")
    # Traced bad values cannot be checked; the kernels clamp them: no crash, no NaN, no OOB.
    bad = np.array([-5, 40, 40, 40, 40], np.int32)
    assert np.isfinite(np.asarray(f(lhs, rhs, bad, np.int32(9)))).all()
    grads = jax.jit(jax.grad(lambda x, y: (f(x, y, sizes, np.int32(1)) ** 2).sum(), argnums=(0, 1)))(lhs, rhs)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_torch_compile_fullgraph(torch_fw, rng):
    import torch

    import ejkernel_torch as ejk

    m, k, n, groups = 40, 16, 16, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs = torch.randn(m, k, requires_grad=True)
    rhs = torch.randn(groups, k, n, requires_grad=True)
    fn = torch.compile(lambda a, b: ejk.grouped_matmul(a, b, sizes), backend="aot_eager", fullgraph=True)
    out = fn(lhs, rhs)
    out.sum().backward()
    expected = ref.forward(ref.grouped_matmul, lhs.detach().numpy(), rhs.detach().numpy(), sizes.numpy())
    assert _err(out.detach().numpy(), expected, "float32")
    want = ref.vjp(ref.grouped_matmul, [lhs.detach().numpy(), rhs.detach().numpy(), sizes.numpy()],
                   np.ones((m, n)), n_diff=2)
    assert _err(lhs.grad.numpy(), want[0], "float32") and _err(rhs.grad.numpy(), want[1], "float32")


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_bincount_group_sizes(torch_fw, rng, dynamic):
    # group_sizes counted from a router's choices, torch.bincount(ids, minlength=g), have a
    # length that depends on the values (max(g, max(ids) + 1)): torch.compile(fullgraph=True)
    # failed with "Could not extract specialized integer from data-dependent expression u0".
    # The kernels read groups [0, group_offset + num_selected) only, so the fronts cut the rest
    # off: the compiled step gives the eager step's bits, expert-sharded (group_offset) too.
    import torch

    import ejkernel_torch as ejk

    m, k, n, groups = 12, 8, 6, 4
    x, router = torch.randn(m, k), torch.randn(k, groups)

    def step(x, w, offset):
        ids = (x @ router).argmax(-1)
        order = ids.argsort()
        sizes = torch.bincount(ids, minlength=groups).to(torch.int32)
        y = ejk.grouped_matmul(x[order], w, sizes, group_offset=offset)
        w_grad = ejk.transposed_grouped_matmul(x[order].t(), y, sizes, group_offset=offset,
                                               num_actual_groups=w.shape[0])
        return y, w_grad

    def train(fn, w, offset):
        w = w.clone().requires_grad_(True)
        y, w_grad = fn(x, w, offset)
        (y.square().sum() + w_grad.sum()).backward()
        return y, w_grad, w.grad

    for held, offset in ((groups, 0), (2, 1)):
        w = torch.randn(held, k, n)
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        for got, want in zip(train(compiled, w, offset), train(step, w, offset), strict=True):
            assert torch.equal(got, want)

    def tensor_offset(x, w):
        return ejk.grouped_matmul(x, w, torch.bincount((x @ router).argmax(-1), minlength=groups).to(torch.int32),
                                  group_offset=torch.tensor(0))

    def all_groups(x, w):
        return ejk.transposed_grouped_matmul(x.t(), x, torch.bincount((x @ router).argmax(-1)).to(torch.int32))

    # Which groups a tensor offset selects cannot be known: refused by name. How many outputs tgmm
    # has without num_actual_groups cannot either: torch's data-dependent error, raised where
    # check_tgmm takes num_actual_groups (dynamo shows the unknown length as an int, so the front
    # cannot tell it from a known one to name it first).
    for fn, match in ((tensor_offset, "pass group_offset as an int"), (all_groups, "num_actual_groups")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(x, torch.randn(groups, k, n))
    # Too few groups for rhs: eager refuses them by name, the compiled graph asserts when run.
    few = lambda x, w, ids: ejk.grouped_matmul(x, w, torch.bincount(ids, minlength=2).to(torch.int32))
    ids = torch.tensor([0] * 5 + [1] * 7)
    torch._dynamo.reset()
    # (it names the failed expression, u0 >= 4: torch._check's message strict export cannot take)
    with pytest.raises(RuntimeError, match=r">= 4"):
        torch.compile(few, backend="aot_eager", fullgraph=True)(x, torch.randn(groups, k, n), ids)
    with pytest.raises(ValueError, match="rhs has 4 groups but group_sizes only 2"):
        few(x, torch.randn(groups, k, n), ids)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_bincount_group_sizes(torch_fw, rng, strict):
    # Strict torch.export of a router's bincount group sizes failed inside torch with
    # "AttributeError: 'function' object has no attribute 'is_quantized'": it took the message
    # function of the front's torch._check for a tensor constant. The exported program reads the
    # routing each call (nothing baked in) and gives the eager bits.
    import torch

    import ejkernel_torch as ejk

    m, k, n, groups = 12, 8, 6, 3

    class MoE(torch.nn.Module):
        def forward(self, x, w, ids):
            sizes = torch.bincount(ids, minlength=groups).to(torch.int32)
            y = ejk.grouped_matmul(x, w, sizes, check_values=False)
            return y, ejk.transposed_grouped_matmul(x.t(), y, sizes, num_actual_groups=groups, check_values=False)

    x, w = torch.randn(m, k), torch.randn(groups, k, n)
    program = torch.export.export(MoE(), (x, w, torch.tensor([0] * 4 + [1] * 4 + [2] * 4)), strict=strict).module()
    for ids in ([0] * 12, [0] * 2 + [2] * 10, [0] * 5 + [1] * 7):
        ids = torch.tensor(ids)
        for got, want in zip(program(x, w, ids), MoE()(x, w, ids), strict=True):
            assert torch.equal(got, want)


def test_torch_compile_fullgraph_with_fwd_params_dict(torch_fw, rng):
    # fwd_params as a dict failed to trace (dynamo cannot take dataclasses.fields() of a class);
    # only a FwdParams instance compiled.
    import torch

    import ejkernel_torch as ejk

    m, k, n, groups = 40, 16, 16, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs, rhs, lhs_t, rhs_t = torch.randn(m, k), torch.randn(groups, k, n), torch.randn(k, m), torch.randn(m, n)
    for params in (SMALL, {}):
        torch._dynamo.reset()
        gmm = torch.compile(lambda a, b: ejk.grouped_matmul(a, b, sizes, fwd_params=params), backend="aot_eager",
                            fullgraph=True)
        tgmm = torch.compile(lambda a, b: ejk.transposed_grouped_matmul(a, b, sizes, fwd_params=params),
                             backend="aot_eager", fullgraph=True)
        assert torch.equal(gmm(lhs, rhs), ejk.grouped_matmul(lhs, rhs, sizes, fwd_params=params))
        assert torch.equal(tgmm(lhs_t, rhs_t), ejk.transposed_grouped_matmul(lhs_t, rhs_t, sizes, fwd_params=params))


def test_torch_library_ops_pass_opcheck(torch_fw, rng):
    import torch

    import importlib

    mod = importlib.import_module("ejkernel_torch.ops.grouped_matmul")  # the module, not the op

    sizes = torch.tensor([3, 0, 4], dtype=torch.int32)
    offset = torch.zeros(1, dtype=torch.int32)
    lhs, rhs = torch.randn(9, 8, requires_grad=True), torch.randn(3, 8, 5, requires_grad=True)
    torch.library.opcheck(mod._gmm, (lhs, rhs, sizes, offset, False, torch.float32, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    lhs_t, rhs2 = torch.randn(8, 9), torch.randn(9, 5)
    torch.library.opcheck(mod._tgmm, (lhs_t, rhs2, sizes, offset, 3, False, torch.float32, None),
                          test_utils=("test_schema", "test_faketensor"))


def _gmm_step_with_second_order(lhs, rhs, sizes, cot):
    """Forward, both gradients, and a gradient of a gradient of gmm; tgmm's forward and both
    gradients."""
    import torch

    import ejkernel_torch as ejk

    a, b = lhs.clone().requires_grad_(True), rhs.clone().requires_grad_(True)
    out = ejk.grouped_matmul(a, b, sizes)
    ga, gb = torch.autograd.grad(out, (a, b), cot, create_graph=True)
    (ggb,) = torch.autograd.grad((ga ** 2).sum(), b)
    x, y = lhs.t().clone().requires_grad_(True), cot.clone().requires_grad_(True)
    t = ejk.transposed_grouped_matmul(x, y, sizes)
    gx, gy = torch.autograd.grad((t ** 2).sum(), (x, y))
    return [out, ga, gb, ggb, t, gx, gy]


def test_torch_eager_fast_path_matches_registered_ops(torch_fw, rng, monkeypatch):
    # Plain eager calls run the op bodies without the dispatcher: no registered op is called,
    # forward, backward or double backward. Under a torch-function mode the registered ops run.
    # Both give the same bits.
    import importlib

    import torch

    mod = importlib.import_module("ejkernel_torch.ops.grouped_matmul")
    m, k, n, groups = 33, 12, 10, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs, rhs, cot = torch.randn(m, k), torch.randn(groups, k, n), torch.randn(m, n)
    calls = []
    for name in ("_gmm", "_tgmm"):
        op = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _op=op, _name=name: calls.append(_name) or _op(*a))

    fast = _gmm_step_with_second_order(lhs, rhs, sizes, cot)
    assert calls == []

    with registered_ops():  # not plain eager: the registered ops
        dispatched = _gmm_step_with_second_order(lhs, rhs, sizes, cot)
    assert "_gmm" in calls and "_tgmm" in calls
    for got, want in zip(fast, dispatched, strict=True):
        assert torch.equal(got, want)


def test_torch_eager_plans_resolve_once_per_cache_generation(torch_fw, rng, isolated_config_cache, monkeypatch):
    """A plain eager training step memoizes each launch's plan (one config cache check a launch,
    nothing resolved or rebuilt) until the cache changes: an entry stored for the weight
    gradient (as another process would) is launched at the next step, and clear_memo is seen."""
    import importlib

    import torch

    import ejkernel_torch as ejk
    from ejkernel_torch.utils import device_fingerprint
    from triton_kernels import config_cache as cc
    from triton_kernels import grouped_matmul as gm
    from triton_kernels import tuning
    from triton_kernels.params import FwdParams

    mod = importlib.import_module("ejkernel_torch.ops.grouped_matmul")
    resolves, generations, plans = [], [], []
    real_resolve, real_generation = mod._tuning.resolve, cc.ConfigCache.generation
    monkeypatch.setattr(mod._tuning, "resolve", lambda t, *a: resolves.append(t.op) or real_resolve(t, *a))
    monkeypatch.setattr(cc.ConfigCache, "generation", lambda self: generations.append(1) or real_generation(self))
    monkeypatch.setattr(mod, "launch_traceable", lambda plan, *a, real=mod.launch_traceable: plans.append(plan)
                        or real(plan, *a))
    m, k, n, groups = 37, 24, 20, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs, rhs, cot = torch.randn(m, k), torch.randn(groups, k, n), torch.randn(m, n)

    def step():
        a, b = lhs.clone().requires_grad_(True), rhs.clone().requires_grad_(True)
        out = ejk.grouped_matmul(a, b, sizes, check_values=False)
        return [out, *torch.autograd.grad(out, (a, b), cot)]

    first = step()
    assert sorted(resolves) == ["grouped_matmul", "grouped_matmul", "transposed_grouped_matmul"]
    resolves.clear(), generations.clear(), plans.clear()
    assert all(torch.equal(a, b) for a, b in zip(step(), first, strict=True))
    assert resolves == [] and len(generations) == 3 and len(plans) == 3  # forward, d_lhs, d_rhs

    problem = gm.tgmm_problem((m, k), (m, n), (groups,), groups, True, "float32", "float32")
    tuned = FwdParams(blocksize_m=16, blocksize_n=32, blocksize_k=16)
    tuned_plan = gm.tgmm_plan(*problem, mod.device_facts(lhs.device), tuned)
    assert tuned_plan != plans[2]
    cc.ConfigCache(isolated_config_cache).store(tuning.TGMM.cache_key(problem, device_fingerprint(lhs.device)),
                                                tuned.to_dict())
    plans.clear()
    tuned_run = step()
    assert plans[2] == tuned_plan
    torch.testing.assert_close(tuned_run[2], first[2])
    resolves.clear()
    tuning.clear_memo()
    step()
    assert sorted(resolves) == ["grouped_matmul", "grouped_matmul", "transposed_grouped_matmul"]


def test_torch_lazy_negation_and_zero_tensors_are_read_as_values(torch_fw, rng):
    # A lazy negation (the neg bit) or a ZeroTensor keeps its values out of its memory; the
    # registered ops' dispatcher fallbacks materialise them, but the eager fast path read the
    # memory: a negated lhs, rhs or gradient gave the un-negated result silently, and a ZeroTensor
    # (as lhs, or as the incoming gradient) failed inside torch ("Attempted to access the data
    # pointer on an invalid python storage").
    import torch

    import ejkernel_torch as ejk

    m, k, n, groups = 20, 8, 6, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs, rhs, cot = torch.randn(m, k), torch.randn(groups, k, n), torch.randn(m, n)
    assert torch.equal(ejk.grouped_matmul(lhs._neg_view(), rhs, sizes), ejk.grouped_matmul(-lhs, rhs, sizes))
    assert torch.equal(ejk.grouped_matmul(lhs, rhs._neg_view(), sizes), ejk.grouped_matmul(lhs, -rhs, sizes))
    lhs_t = lhs.t().contiguous()
    assert torch.equal(ejk.transposed_grouped_matmul(lhs_t._neg_view(), cot, sizes),
                       ejk.transposed_grouped_matmul(-lhs_t, cot, sizes))
    zeros = torch._efficientzerotensor(m, k)
    assert torch.equal(ejk.grouped_matmul(zeros, rhs, sizes), torch.zeros(m, n))
    no_rows = torch._efficientzerotensor(groups, dtype=torch.int32)  # the value check read it ("unallocated storage")
    assert torch.equal(ejk.grouped_matmul(lhs, rhs, no_rows), torch.zeros(m, n))
    assert torch.equal(ejk.transposed_grouped_matmul(lhs_t, cot, no_rows), torch.zeros(groups, k, n))
    x = lhs.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(ejk.grouped_matmul(x, rhs, sizes), x, grad_outputs=cot._neg_view())
    (want,) = torch.autograd.grad(ejk.grouped_matmul(x, rhs, sizes), x, grad_outputs=-cot)
    assert torch.equal(got, want)
    (got,) = torch.autograd.grad(ejk.grouped_matmul(x, rhs, sizes), x, grad_outputs=torch._efficientzerotensor(m, n))
    assert torch.equal(got, torch.zeros(m, k))
    y = lhs_t.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(ejk.transposed_grouped_matmul(y, cot, sizes), y,
                                 grad_outputs=torch._efficientzerotensor(groups, k, n))
    assert torch.equal(got, torch.zeros(k, m))


def test_torch_reads_a_sizes_tensor_once_until_it_is_written(torch_fw, rng, monkeypatch):
    # An MoE layer passes one tensor of router counts to its gate, up and down projections; each
    # read of the values is a host sync. A tensor read before and not written since is not read
    # again, and one written in place is: a bad size written there is still refused by name.
    import torch

    import ejkernel_torch as ejk
    from ejkernel_torch.ops import _common

    reads = []
    real_values = _common._values
    monkeypatch.setattr(_common, "_values", lambda t: reads.append(t.tolist()) or real_values(t))
    device = torch_fw.device
    m, k, n = 20, 8, 6
    sizes = torch.tensor([7, 0, 10], dtype=torch.int32, device=device)
    lhs, rhs, cot = (torch.randn(*shape, device=device) for shape in ((m, k), (3, k, n), (m, n)))
    first = ejk.grouped_matmul(lhs, rhs, sizes)
    assert torch.equal(ejk.grouped_matmul(lhs, rhs, sizes), first)
    ejk.transposed_grouped_matmul(lhs.t().contiguous(), cot, sizes)
    assert reads == [[7, 0, 10]]
    sizes[0] = -1  # in place: torch moves the version counter
    with pytest.raises(ValueError, match="group_sizes must be non-negative, got a size of -1"):
        ejk.grouped_matmul(lhs, rhs, sizes)
    sizes[0] = 11  # 21 rows of 20
    with pytest.raises(ValueError, match="sum\\(group_sizes\\) = 21 exceeds the 20 rows"):
        ejk.transposed_grouped_matmul(lhs.t().contiguous(), cot, sizes)
    with pytest.raises(ValueError, match="sum\\(group_sizes\\) = 21 exceeds the 20 rows"):  # refused, not read
        ejk.grouped_matmul(lhs, rhs, sizes)
    assert reads == [[7, 0, 10], [-1, 0, 10], [11, 0, 10]]
    sizes[0] = 7
    same_values = sizes.clone()  # another tensor: read
    assert torch.equal(ejk.grouped_matmul(lhs, rhs, same_values), first)
    assert len(reads) == 4
    with torch.inference_mode():  # an inference tensor has no version counter: read every call
        counts = torch.tensor([7, 0, 10], dtype=torch.int32, device=device)
        ejk.grouped_matmul(lhs, rhs, counts)
        counts[1] = -2
        with pytest.raises(ValueError, match="got a size of -2"):
            ejk.grouped_matmul(lhs, rhs, counts)
    assert len(reads) == 6


def test_torch_func_functionalize(torch_fw, rng):
    # torch.func.functionalize differentiates nothing, yet the ops took their torch.func autograd
    # function there, which torch refuses ("NYI: Functionalize rule for custom_function_call");
    # the registered ops run under it (make_fx of a functionalized model too).
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import ejkernel_torch as ejk

    m, k, n, groups = 20, 8, 6, 3
    sizes = torch.from_numpy(ragged_sizes(rng, m, groups))
    lhs, rhs, cot = torch.randn(m, k), torch.randn(groups, k, n), torch.randn(m, n)

    def gmm(x, w, s):
        return ejk.grouped_matmul(x * 1, w, s, group_offset=torch.tensor(0))

    def tgmm(x, y, s):
        return ejk.transposed_grouped_matmul(x.t() * 1, y, s, group_offset=1, num_actual_groups=2)

    assert torch.equal(torch.func.functionalize(gmm)(lhs, rhs, sizes), gmm(lhs, rhs, sizes))
    assert torch.equal(torch.func.functionalize(tgmm)(lhs, cot, sizes), tgmm(lhs, cot, sizes))
    traced = make_fx(torch.func.functionalize(gmm))(lhs, rhs, sizes)
    assert torch.equal(traced(lhs, rhs, sizes), gmm(lhs, rhs, sizes))


# ---------------------------------------------------------------------------------------------
# Pallas TPU kernel (interpret mode) vs the Triton kernels (interpreter), same inputs


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_pallas_and_triton_agree(jax_fw, rng, transpose_rhs):
    import jax

    import ejkernel_jax as ejk

    m, k, n, groups, held, offset = 40, 16, 24, 5, 3, 1
    sizes = ragged_sizes(rng, m, groups)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((held, n, k) if transpose_rhs else (held, k, n)).astype(np.float32)
    cot = rng.standard_normal((m, n)).astype(np.float32)
    results = {}
    for platform in ("tpu", "cpu"):
        def f(x, y):
            return ejk.grouped_matmul(x, y, sizes, transpose_rhs=transpose_rhs, group_offset=offset,
                                      platform=platform)
        out, pullback = jax.vjp(f, lhs, rhs)
        results[platform] = [np.asarray(out), *(np.asarray(g) for g in pullback(cot))]
    for got, want in zip(results["tpu"], results["cpu"]):
        assert np.isfinite(want).all() and rel_error(got, want) < TOLERANCE["float32"]
    a, b = rng.standard_normal((k, m)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    t = [np.asarray(ejk.transposed_grouped_matmul(a, b, sizes, group_offset=1, num_actual_groups=3, platform=p))
         for p in ("tpu", "cpu")]
    assert rel_error(t[0], t[1]) < TOLERANCE["float32"]


def test_pallas_path_refuses_triton_only_fwd_params(jax_fw, rng):
    # On platform="tpu" fwd_params become the Pallas tiling (tm, tk, tn); num_warps/num_stages,
    # which that kernel does not have, were dropped silently. They are refused by name there
    # and still taken by the Triton path; block sizes still make the tiling.
    import ejkernel_jax as ejk

    sizes = np.array([3, 2, 4], np.int32)
    lhs, rhs, rhs_t = (rng.standard_normal(s).astype(np.float32) for s in ((9, 8), (3, 8, 4), (9, 4)))
    gmm = lambda **kw: ejk.grouped_matmul(lhs, rhs, sizes, **kw)
    tgmm = lambda **kw: ejk.transposed_grouped_matmul(lhs.T, rhs_t, sizes, **kw)
    for op in (gmm, tgmm):
        for params in ({"num_warps": 4}, {"blocksize_m": 16, "num_stages": 2}):
            with pytest.raises(ValueError, match=r"fwd_params: \['num_(warps|stages)'\] apply to the Triton kernel "
                                                 r"only; platform='tpu' runs the Pallas kernel, whose fwd_params are "
                                                 r"its tiling: \['blocksize_k', 'blocksize_m', 'blocksize_n'\]"):
                op(fwd_params=params, platform="tpu")
            op(fwd_params=params, platform="cpu")  # the Triton kernel has them
        op(fwd_params={"blocksize_m": 16, "blocksize_k": 8}, platform="tpu")  # the tiling


def test_bad_platform(jax_fw):
    import ejkernel_jax as ejk

    with pytest.raises(ValueError, match="platform must be one of"):
        ejk.grouped_matmul(np.zeros((2, 2), np.float32), np.zeros((1, 2, 2), np.float32), np.array([2], np.int32),
                           platform="rocm")
    for bad in (True, ["tpu"]):  # a wrong type was a ValueError (the fronts' TypeError for types)
        for fn, rhs in ((ejk.grouped_matmul, (1, 2, 2)), (ejk.transposed_grouped_matmul, (2, 2))):
            with pytest.raises(TypeError, match="platform must be a str or None"):
                fn(np.zeros((2, 2), np.float32), np.zeros(rhs, np.float32), np.array([2], np.int32), platform=bad)


@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    """benchmarks/grouped_matmul.py --smoke: tiny shapes on CPU, every method timed or its error recorded."""
    import json
    import os
    import math
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "gmm.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "grouped_matmul.py"), "--smoke", "--sweep",
                    "--routing", "skewed", "--out", str(out)], check=True, cwd=root, timeout=600)
    rows = json.loads(out.read_text())["results"]
    for row in rows:
        for name in ("ours_torch", "ours_jax", "dense_matmul", "jax.lax.ragged_dot"):
            assert f"fwd/{name}" in row["ms"] and f"fwd+bwd/{name}" in row["ms"], (name, row["errors"])
        assert len(row["sweep_fwd_ms"]) == 5
        # the torch methods but the loop were timed side by side, and their ratios come from the rounds
        rounds = row["rounds_ms"]
        assert set(rounds) == {k for k in row["ms"] if k.split("/")[1] in (
            "ours_torch", "ours_torch_unchecked", "torch._grouped_mm", "dense_matmul")}, (rounds, row["errors"])
        assert all(len(samples) == 2 for samples in rounds.values())
        for phase in ("fwd", "fwd+bwd"):
            ours, dense = rounds[f"{phase}/ours_torch"], rounds[f"{phase}/dense_matmul"]
            # two rounds, one of each order: the geometric mean of their ratios
            assert row[f"{phase}: ours_torch vs dense_matmul"] == pytest.approx(
                math.sqrt(dense[0] / ours[0] * dense[1] / ours[1]))
    assert (tmp_path / "gmm.svg").exists()


def test_benchmark_smoke_writes_outside_results():
    import os

    from benchmarks.grouped_matmul import default_out

    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    assert os.path.dirname(default_out(False, "nvidia-h100")) == results
    assert os.path.dirname(default_out(True, "cpu")) != results


def test_benchmark_can_leave_ragged_dot_out():
    """--no-ragged-dot: jax.lax.ragged_dot is not run (on an H200 its autotuner stalled a whole
    device run), and the row says why it has no time."""
    from benchmarks import grouped_matmul as bench

    rng = np.random.default_rng(0)
    sizes = np.array([7, 0, 10], np.int32)
    lhs, rhs = rng.standard_normal((20, 16), dtype=np.float32), rng.standard_normal((3, 16, 16), dtype=np.float32)
    times, errors = bench._bench_jax(lhs, rhs, sizes, "float32", True, rng, ragged_dot=False)
    assert set(times) == {"fwd/ours_jax", "fwd+bwd/ours_jax"}, times
    assert errors == {f"{p}/jax.lax.ragged_dot": "skipped (--no-ragged-dot)" for p in ("fwd", "fwd+bwd")}


@pytest.mark.parametrize("only", ["2", "-1"])
def test_benchmark_rejects_only_outside_the_shape_list(only, monkeypatch, capsys):
    # --only 2 with the two smoke shapes died with IndexError; --only -1 silently ran the last shape.
    import sys

    from benchmarks import grouped_matmul as bench

    monkeypatch.setattr(sys, "argv", ["grouped_matmul.py", "--smoke", "--only", "0", only])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert f"--only: [{only}] not indices into the 2 shapes of this run (0..1)" in capsys.readouterr().err

def test_jax_reference_matches_torch_reference(rng):
    """ejkernel_jax.reference's grouped matmuls (masks, traceable sizes) agree with the loops."""
    import jax

    from ejkernel_jax import reference as jref

    m, k, n, groups = 40, 12, 9, 5
    sizes = ragged_sizes(rng, m, groups)
    lhs, rhs_t = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((3, n, k)).astype(np.float32)
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 matmul is TF32
        got = jax.jit(lambda s: jref.grouped_matmul(lhs, rhs_t, s, transpose_rhs=True, group_offset=1))(sizes)
    want = ref.forward(ref.grouped_matmul, lhs, rhs_t, sizes, transpose_rhs=True, group_offset=1)
    assert _err(np.asarray(got), want, "float32")
    a, b = rng.standard_normal((k, m)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        got = jref.transposed_grouped_matmul(a, b, sizes, group_offset=2, num_actual_groups=3)
    want = ref.forward(ref.transposed_grouped_matmul, a, b, sizes, group_offset=2, num_actual_groups=3)
    assert _err(np.asarray(got), want, "float32")


def test_jax_typed_key_group_offset_is_refused_by_name(jax_fw):
    # A typed key's extended dtype cannot be read by jnp.dtype ("Cannot interpret 'key<fry>'").
    import jax

    ones = lambda *shape: jax_fw.asarray(np.ones(shape, np.float32))
    sizes = jax_fw.asarray(np.array([2, 2], np.int32))
    with pytest.raises(TypeError, match="group_offset must be an int or an integer scalar array, got key<fry>"):
        jax_fw.ops.grouped_matmul(ones(4, 3), ones(2, 3, 5), sizes, group_offset=jax.random.key(0))
