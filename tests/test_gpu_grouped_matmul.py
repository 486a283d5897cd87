"""On a CUDA GPU: the compiled grouped-matmul kernels are right (vs float64 loops), and torch- and
jax-launched results are bitwise identical (same plan -> same PTX). Skipped without a GPU."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error
from tests.test_grouped_matmul import ragged_sizes

pytestmark = pytest.mark.gpu


def _skewed(rng, m, groups):
    # Half the tokens to one expert, a few empty experts, a tail of rows past the sum.
    p = rng.dirichlet(np.full(groups, 0.3))
    p[0] += 1.0
    sizes = np.floor(p / p.sum() * (m - 17)).astype(np.int32)
    sizes[1::5] = 0
    return sizes


def _cases(rng):
    # (m, k, n, sizes, held, offset, transpose_rhs): ragged and MoE-like, default GPU tiles.
    return [
        (37, 19, 23, ragged_sizes(rng, 37, 4), 4, 0, False),
        (1000, 256, 200, ragged_sizes(rng, 1000, 8), 8, 0, True),
        (4096, 512, 384, np.full(8, 512, np.int32), 8, 0, False),
        (4096, 512, 384, _skewed(rng, 4096, 16), 16, 0, False),
        (3000, 384, 1408 // 4, ragged_sizes(rng, 3000, 64), 64, 0, True),
        (2048, 256, 512, ragged_sizes(rng, 2048, 12), 4, 5, False),  # one expert-parallel shard
        (2048, 320, 1408, np.full(4, 512, np.int32), 4, 0, False),  # 256-wide tiles, a 128-wide last one
    ]


def _run(fw, case, dtype):
    m, k, n, sizes, held, offset, transpose_rhs = case
    rng = np.random.default_rng(m + k + n)
    lhs = fw.asarray(rng.standard_normal((m, k)), dtype)
    rhs = fw.asarray(rng.standard_normal((held, n, k) if transpose_rhs else (held, k, n)), dtype)
    cot = fw.asarray(rng.standard_normal((m, n)), dtype)
    gs = fw.asarray(sizes)
    kwargs = dict(transpose_rhs=transpose_rhs, group_offset=offset)
    out = fw.ops.grouped_matmul(lhs, rhs, gs, **kwargs)
    grads = fw.vjp(lambda x, y: fw.ops.grouped_matmul(x, y, gs, **kwargs), [lhs, rhs], cot)
    lhs_t = fw.asarray(rng.standard_normal((k, m)), dtype)
    tout = fw.ops.transposed_grouped_matmul(lhs_t, cot, gs, group_offset=offset, num_actual_groups=held)
    results = [fw.to_numpy(out), *grads, fw.to_numpy(tout)]
    inputs = [fw.to_numpy(a) for a in (lhs, rhs, cot, lhs_t)]
    return results, inputs, kwargs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_and_jax_are_bitwise_identical_on_gpu(torch_fw, jax_fw, rng, dtype):
    import jax

    assert jax.default_backend() == "gpu", "jax must see the GPU for this test"
    for case in _cases(rng):
        torch_results, inputs, kwargs = _run(torch_fw, case, dtype)
        jax_results, _, _ = _run(jax_fw, case, dtype)
        for i, (a, b) in enumerate(zip(torch_results, jax_results)):
            assert a.tobytes() == b.tobytes(), (case[:3], i, np.max(np.abs(a - b)))
        lhs, rhs, cot, lhs_t = inputs
        sizes, held, offset = case[3], case[4], case[5]
        out, d_lhs, d_rhs, tout = torch_results
        assert rel_error(out, ref.forward(ref.grouped_matmul, lhs, rhs, sizes, **kwargs)) < TOLERANCE[dtype]
        want = ref.vjp(ref.grouped_matmul, [lhs, rhs, sizes], cot, n_diff=2, **kwargs)
        assert rel_error(d_lhs, want[0]) < TOLERANCE[dtype] and rel_error(d_rhs, want[1]) < TOLERANCE[dtype]
        t_want = ref.forward(ref.transposed_grouped_matmul, lhs_t, cot, sizes, group_offset=offset,
                             num_actual_groups=held)
        assert rel_error(tout, t_want) < TOLERANCE[dtype]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        assert not out[:bounds[offset]].any() and not out[bounds[offset + held]:].any()


def test_large_moe_layer_bf16(torch_fw, rng):
    """A realistic layer (8 experts, k=4096, n=2048, 16k tokens, skewed) through torch, checked
    against a float64 loop on the GPU."""
    import torch

    import ejkernel_torch as ejk

    m, k, n, g = 16384, 4096, 2048, 8
    sizes = _skewed(rng, m, g)
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16) / 64
    out = ejk.grouped_matmul(lhs, rhs, torch.from_numpy(sizes).cuda())
    expected = torch.zeros(m, n, device="cuda", dtype=torch.float64)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(g):
        s, e = bounds[i], bounds[i + 1]
        expected[s:e] = lhs[s:e].double() @ rhs[i].double()
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < TOLERANCE["bfloat16"], err


def test_value_checks_read_what_the_stream_computed(torch_fw):
    """The checks read group_sizes with an asynchronous copy after the argument handling: they see
    values that kernels queued just before the call wrote (on a side stream too), and refuse bad
    ones by name before the grouped matmul runs."""
    import torch

    import ejkernel_torch as ejk

    m, k, n, g = 512, 64, 48, 8
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16)
    lhs_t = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs above
    with torch.cuda.stream(side):
        for bad, match in ((-1, "non-negative"), (m, "exceeds")):
            # a slow kernel ahead of the write: a read that did not wait for the stream would see 64s
            torch.cuda._sleep(10_000_000)
            sizes = torch.full((g,), m // g, dtype=torch.int32, device="cuda")
            sizes[3] = bad
            with pytest.raises(ValueError, match=match):
                ejk.grouped_matmul(lhs, rhs, sizes)
            with pytest.raises(ValueError, match=match):
                ejk.transposed_grouped_matmul(lhs_t, cot, sizes)
        torch.cuda._sleep(10_000_000)
        offset = torch.zeros((), dtype=torch.int64, device="cuda") + 5  # groups [5, 13) of 8
        with pytest.raises(ValueError, match="group_offset=5"):
            ejk.grouped_matmul(lhs, rhs, torch.full((g,), m // g, dtype=torch.int32, device="cuda"),
                               group_offset=offset)
        sizes = torch.bincount(torch.arange(m, device="cuda") % g, minlength=g).to(torch.int32)
        out = ejk.grouped_matmul(lhs, rhs, sizes)
    side.synchronize()
    rows = torch.arange(m, device="cuda") // (m // g)
    expected = torch.einsum("mk,mkn->mn", lhs.double(), rhs.double()[rows])
    assert ((out.double() - expected).norm() / expected.norm()).item() < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("m,k,n,groups", [(1000, 512, 1408, 16), (517, 19, 200, 5)])
def test_tma_stores_write_every_element(torch_fw, rng, m, k, n, groups):
    """On a Hopper GPU the kernels store through tensor descriptors (TMA): the forward and d_lhs
    their whole tiles (a group's partial last tile from registers), d_rhs every tile, clipped at
    each expert's k and n edges. Into NaN-poisoned outputs, with empty experts and rows past the
    sizes' sum, against float64 loops; the plans' flags are checked so that the path under test
    is the TMA one."""
    import torch

    import ejkernel_torch as ejk
    from ejkernel_torch.launch import device_facts
    from triton_kernels import debug
    from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan

    facts = device_facts(torch.device("cuda"))
    if facts.capability < (9, 0) or not facts.gluon:
        pytest.skip("needs Hopper's TMA and a Triton with Gluon")
    dt = "bfloat16"
    assert gmm_plan(m, k, n, groups, groups, False, dt, dt, facts).constexpr_dict["TMA_STORE"]
    assert gmm_plan(m, n, k, groups, groups, True, dt, dt, facts).constexpr_dict["TMA_STORE"] == ((k * 2) % 16 == 0)
    d_rhs_plan = tgmm_plan(m, k, n, groups, groups, True, dt, dt, facts)  # Gluon's stores are TMA ones too
    assert d_rhs_plan.is_gluon == (k % 8 == 0) and (d_rhs_plan.is_gluon or d_rhs_plan.constexpr_dict["TMA_STORE"])
    sizes = ragged_sizes(rng, m, groups)
    sizes[[1, groups - 2]] = 0
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rhs = torch.randn(groups, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with debug.poison_outputs():
        out = ejk.grouped_matmul(lhs, rhs, torch.from_numpy(sizes).cuda())
        grads = torch.autograd.grad(out, (lhs, rhs), cot)
    arrays = [lhs.detach().float().cpu().numpy(), rhs.detach().float().cpu().numpy(), sizes]
    want = [ref.forward(ref.grouped_matmul, *arrays),
            *ref.vjp(ref.grouped_matmul, arrays, cot.float().cpu().numpy(), n_diff=2)]
    for got, expected in zip([out, *grads], want, strict=True):
        got = got.detach().float().cpu().numpy()
        assert not np.isnan(got).any()
        assert rel_error(got, expected) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("m,k,n,groups,held,offset,transpose_rhs,out_dtype", [
    (6000, 512, 1408, 16, 16, 0, False, "bfloat16"),  # 128 x 256 tiles, a half-used last one; empty experts
    (2500, 200, 264, 12, 5, 4, True, "bfloat16"),  # one shard's experts; k and n not multiples of a tile
    (4000, 136, 1408, 10, 10, 0, False, "float32"),  # an f32 output: TMA loads, stores from registers
    (700, 128, 1024, 40, 40, 0, True, "bfloat16"),  # 64-row tiles (small experts)
])
def test_tma_loads_are_right_and_no_read_row_leaks(rng, m, k, n, groups, held, offset, transpose_rhs, out_dtype):
    """On Hopper gmm reads its operands through tensor descriptors: a tile's boxes cover whole
    ``BLOCK_M`` rows, past its group's end into the next group's rows (never stored), and read
    zeros past k and past the array. Rows outside the selected groups and past the sizes' sum hold
    inf and NaN here: their outputs must be zeros, and no other row's. Into NaN-poisoned outputs,
    against a float64 loop, and bitwise equal to the pointer-load kernel (same tiles, same order)."""
    import torch

    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import debug
    from triton_kernels.grouped_matmul import gmm_plan

    facts = device_facts(torch.device("cuda"))
    if facts.capability < (9, 0) or not facts.gluon:
        pytest.skip("needs Hopper's TMA and a Triton with Gluon")
    plan = gmm_plan(m, k, n, groups, held, transpose_rhs, "bfloat16", out_dtype, facts)
    pointer = plan.with_constexprs(TMA_LOAD=False)
    assert plan.constexpr_dict["TMA_LOAD"]
    sizes = ragged_sizes(rng, m, groups, spare=37)
    sizes[offset + 2] = 0
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    first, last = int(bounds[offset]), int(bounds[offset + held])
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    lhs[:first] = float("inf")
    lhs[last:] = float("nan")
    rhs = torch.randn((held, n, k) if transpose_rhs else (held, k, n), device="cuda", dtype=torch.bfloat16)
    args = (lhs, rhs, torch.from_numpy(sizes).cuda(), torch.tensor([offset], dtype=torch.int32, device="cuda"))
    with debug.poison_outputs():
        (got,) = launch(plan, *args)
        (beside,) = launch(pointer, *args)
    assert got.dtype == getattr(torch, out_dtype)
    want = ref.forward(ref.grouped_matmul, lhs.float().cpu().numpy(), rhs.float().cpu().numpy(), sizes,
                       transpose_rhs=transpose_rhs, group_offset=offset)  # slices the selected groups' rows
    got_np = got.float().cpu().numpy()
    assert not np.isnan(got_np).any()
    assert not got_np[:first].any() and not got_np[last:].any()
    assert rel_error(got_np, want) < TOLERANCE["bfloat16"]
    assert torch.equal(got, beside)


@pytest.mark.parametrize("m,k,n,groups,held,offset", [
    (3000, 512, 1408, 16, 16, 0),  # 256-wide tiles, a half-used last one; empty experts
    (2500, 264, 200, 12, 5, 4),  # one shard's experts; k and n not multiples of a tile
    (700, 128, 1024, 8, 8, 0),  # experts of fewer rows than the ring has stages
])
def test_gluon_weight_gradient_is_right_and_reads_no_other_rows(rng, m, k, n, groups, held, offset):
    """On Hopper the gmm backward's weight gradient runs ``tgmm_gluon_kernel``, whose TMA loads
    are bounded at each group's end row: rows of unselected groups and past the sizes' sum hold
    inf and NaN here and must not reach any sum. Into NaN-poisoned outputs, against a float64
    loop, and beside the Triton kernel (explicit params select it)."""
    import torch

    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import debug
    from triton_kernels.grouped_matmul import tgmm_plan
    from triton_kernels.params import FwdParams

    facts = device_facts(torch.device("cuda"))
    if facts.capability != (9, 0) or not facts.gluon:
        pytest.skip("needs an sm_90 GPU and a Triton with Gluon")
    dt = "bfloat16"
    plan = tgmm_plan(m, k, n, groups, held, True, dt, dt, facts)
    triton_plan = tgmm_plan(m, k, n, groups, held, True, dt, dt, facts, FwdParams())
    assert plan.is_gluon and not triton_plan.is_gluon
    sizes = ragged_sizes(rng, m, groups, spare=37)
    sizes[offset + 2] = 0
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    first, last = int(bounds[offset]), int(bounds[offset + held])
    for x in (lhs, rhs):
        x[:first] = float("inf")
        x[last:] = float("nan")
    args = (lhs, rhs, torch.from_numpy(sizes).cuda(), torch.tensor([offset], dtype=torch.int32, device="cuda"))
    with debug.poison_outputs():
        (got,) = launch(plan, *args)
        (beside,) = launch(triton_plan, *args)
    want = ref.forward(ref.transposed_grouped_matmul, lhs.float().cpu().numpy().T, rhs.float().cpu().numpy(), sizes,
                       group_offset=offset, num_actual_groups=held)  # slices each group's rows: no inf/NaN
    got, beside = got.float().cpu().numpy(), beside.float().cpu().numpy()
    assert not np.isnan(got).any()
    assert rel_error(got, want) < TOLERANCE[dt]
    assert rel_error(beside, want) < TOLERANCE[dt]
    assert not got[2].any()  # the empty expert
