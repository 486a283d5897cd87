"""Every grouped-matmul plan at realistic MoE shapes (forward and both backward kernels, the
benchmark's configs too) compiles ahead of time for Hopper (sm_90) and fits its shared memory."""
import dataclasses
import re

import pytest

from benchmarks.grouped_matmul import SWEEP_CONFIGS
from triton_kernels import HOPPER, HOPPER_GLUON
from triton_kernels.aot import compile_plan, distinct_plans
from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan
from triton_kernels.plan import DeviceFacts
from triton_kernels.tuning import GMM

# (tokens m, k, n, experts g): bf16 MoE layers of the sizes the benchmark runs, plus odd ones.
SHAPES = [(65536, 4096, 2048, 8), (16384, 4096, 2048, 64), (8192, 4096, 2048, 128),
          (32768, 7168, 1408, 16), (8192, 2048, 4096, 128), (1000, 4096, 2048, 8),
          (32768, 2048, 1408, 64)]  # n = 1408: 256-wide tiles and a 128-wide last one


def _training_plans(m, k, n, g, dtype, transpose_rhs=False, params=None, facts=HOPPER):
    """The kernels one training step of a grouped matmul runs: forward, d_lhs, d_rhs."""
    yield gmm_plan(m, k, n, g, g, transpose_rhs, dtype, dtype, facts, params)
    yield gmm_plan(m, n, k, g, g, not transpose_rhs, dtype, dtype, facts)  # d_lhs
    yield tgmm_plan(m, n if transpose_rhs else k, k if transpose_rhs else n, g, g, True, dtype, dtype, facts)


def _plans():
    for m, k, n, g in SHAPES:
        yield from _training_plans(m, k, n, g, "bfloat16")
        yield tgmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER)  # public [k, m] layout
    m, k, n, g = SHAPES[1]
    yield from _training_plans(m, k, n, g, "bfloat16", transpose_rhs=True)
    yield from _training_plans(m, k, n, g, "float16")
    yield from _training_plans(4096, 1024, 512, 8, "float32")
    yield gmm_plan(m, k, n, g, g, False, "bfloat16", "float32", HOPPER)  # preferred_element_type
    yield gmm_plan(m, k, n, 2 * g, g, False, "bfloat16", "bfloat16", HOPPER)  # an expert-parallel shard
    yield gmm_plan(37, 19, 23, 4, 4, False, "bfloat16", "bfloat16", HOPPER)  # ragged k and n
    yield tgmm_plan(37, 19, 23, 4, 4, True, "bfloat16", "bfloat16", HOPPER)
    # torch.func.vmap's batches of problems
    yield gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER, batch=8)
    yield gmm_plan(m, k, n, g, g, True, "bfloat16", "bfloat16", HOPPER, batch=8, shared_rhs=True)
    yield gmm_plan(64, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER, batch=16385, shared_rhs=True)  # jacrev's
    yield tgmm_plan(m, k, n, g, g, True, "bfloat16", "bfloat16", HOPPER, batch=8)
    yield tgmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER, batch=8)
    for params in SWEEP_CONFIGS:  # what benchmarks/grouped_matmul.py --sweep tries
        yield gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER, params)
    # stores through tensor descriptors (fronts that provide global scratch)
    for m, k, n, g in SHAPES[-2:]:
        yield from _training_plans(m, k, n, g, "bfloat16", facts=HOPPER_GLUON)
    yield tgmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER_GLUON, batch=8)
    yield gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER_GLUON, batch=8)
    yield gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", HOPPER_GLUON, batch=8, shared_rhs=True)
    yield tgmm_plan(37, 19, 24, 4, 4, True, "bfloat16", "bfloat16", HOPPER_GLUON)  # k and n past the tile
    yield gmm_plan(37, 24, 200, 4, 4, False, "bfloat16", "bfloat16", HOPPER_GLUON)  # TMA loads past k and n
    yield gmm_plan(m, k, n, g, g, False, "bfloat16", "float32", HOPPER_GLUON)  # TMA loads, stores from registers
    problem = (m, k, n, g, g, False, "bfloat16", "bfloat16")
    for params in GMM.candidate_params(problem, HOPPER_GLUON):  # the autotuner's, with TMA loads and stores
        yield gmm_plan(*problem, HOPPER_GLUON, params)
    yield from _training_plans(4096, 1024, 512, 8, "float32", facts=HOPPER_GLUON)


PLANS = distinct_plans(_plans())


def _id(plan):
    c = plan.constexpr_dict
    if plan.is_gluon:  # tgmm_gluon_kernel: [m, k] lhs, one problem, fixed tiles
        return (f"{plan.name}-{plan.input_dtypes[0]}-K{c['K']}-N{c['N']}-G{c['NUM_GROUPS']}-S{c['NUM_SELECTED']}"
                f"-{c['BLOCK_N']}-s{c['STAGES']}")
    layout = f"T{int(c['TRANSPOSE_RHS'])}" if "TRANSPOSE_RHS" in c else f"MK{int(c['LHS_MK'])}"
    batch = (f"-b{c['BATCH']}" + "-shared" * c.get("SHARED_RHS", False) + "-groupmajor" * c.get("GROUP_MAJOR", False)
             if c["BATCH"] > 1 else "")
    return (f"{plan.name}-{plan.input_dtypes[0]}-{plan.outputs[0].dtype}-K{c['K']}-N{c['N']}-G{c['NUM_GROUPS']}"
            f"-S{c['NUM_SELECTED']}-{layout}-{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}-w{plan.num_warps}"
            f"-s{plan.num_stages}{batch}" + "-tma" * c.get("TMA_STORE", False) + "-tmaload" * c.get("TMA_LOAD", False))


SM_SHARED = 228 * 1024  # shared memory of one H100 SM, shared by its resident programs


@pytest.mark.parametrize("plan", PLANS, ids=_id)
def test_compiles_for_hopper(plan):
    kernel = compile_plan(plan)
    # a Gluon plan's num_warps is its default partition's: two consumer warpgroups and the loader's
    assert kernel.metadata.num_warps == (3 * plan.num_warps if plan.is_gluon else plan.num_warps)
    assert kernel.metadata.shared <= HOPPER.shared_memory, (kernel.metadata.shared, HOPPER.shared_memory)
    # The persistent grid assumes its programs are all resident at once: check the real usage.
    per_sm = -(-plan.grid[0] // HOPPER.num_sms)
    assert per_sm * (kernel.metadata.shared + 1024) <= SM_SHARED, (per_sm, kernel.metadata.shared)
    assert "cubin" in kernel.asm
    if plan.input_dtypes[0] != "float32":
        assert "wgmma" in kernel.asm["ptx"]  # Hopper tensor cores, not a fallback
    # TMA stores and loads exactly where the plan asks for them (the Gluon kernel's are all TMA),
    # and global scratch for their descriptors
    c, ptx = plan.constexpr_dict, kernel.asm["ptx"]
    stores = re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx) is not None
    loads = re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx) is not None
    assert stores == (plan.is_gluon or c.get("TMA_STORE", False))
    assert loads == (plan.is_gluon or c.get("TMA_LOAD", False))
    assert (stores or loads) == plan.needs_scratch == (kernel.metadata.global_scratch_size > 0)


def test_kernels_store_through_tma_where_a_front_provides_scratch():
    tma = [p for p in PLANS if p.constexpr_dict.get("TMA_STORE")]
    assert {p.input_dtypes[0] for p in tma} == {"bfloat16", "float32"}
    assert {p.name for p in tma} == {"gmm_kernel", "tgmm_kernel"} and all(p.global_scratch for p in tma)
    # gmm's group-major walk (a vmapped call with one rhs) gathers rows of several problems: no box
    assert not any(p.constexpr_dict.get("GROUP_MAJOR") for p in tma)
    assert any(p.constexpr_dict.get("GROUP_MAJOR") and p.global_scratch is False for p in PLANS
               if p.name == "gmm_kernel" and p.constexpr_dict["BATCH"] == 8)

    def tma_store(m, k, n, out_dtype="bfloat16", facts=HOPPER_GLUON, **kw):  # the public [k, m] layout
        return tgmm_plan(m, k, n, 64, 64, False, "bfloat16", out_dtype, facts, **kw).constexpr_dict["TMA_STORE"]

    assert tma_store(32768, 2048, 1408)
    assert any(p.constexpr_dict.get("TMA_LOAD") and not p.constexpr_dict["TMA_STORE"] for p in PLANS)  # f32 out
    assert not tma_store(32768, 2048, 1408, facts=HOPPER)  # the launcher provides no scratch
    assert not tma_store(32768, 2048, 1408, facts=dataclasses.replace(HOPPER_GLUON, capability=(8, 0)))  # no TMA
    assert not tma_store(32768, 2048, 1404)  # rows of 2808 bytes: not whole 16-byte units
    assert not tma_store(32768, 2048, 1408, "float32")  # a 128 KB tile beside the pipeline's buffers: no room
    assert not tma_store(64, 32, 32, facts=DeviceFacts.cpu())
    rows = 2**30  # a batch of two problems of as many rows: row coordinates past int32
    assert gmm_plan(rows, 64, 64, 8, 8, False, "bfloat16", "bfloat16", HOPPER_GLUON).global_scratch
    assert not gmm_plan(rows, 64, 64, 8, 8, False, "bfloat16", "bfloat16", HOPPER_GLUON, batch=2).global_scratch


def test_gmm_loads_through_tma_for_one_16bit_problem_where_a_front_provides_scratch():
    def tma_load(m=32768, k=2048, n=1408, transpose_rhs=False, dtype="bfloat16", out_dtype=None, facts=HOPPER_GLUON,
                 **kw):
        plan = gmm_plan(m, k, n, 64, 64, transpose_rhs, dtype, out_dtype or dtype, facts, **kw)
        c = plan.constexpr_dict
        assert not c["TMA_LOAD"] or plan.global_scratch  # descriptors are made in global scratch
        return c["TMA_LOAD"]

    assert tma_load() and tma_load(transpose_rhs=True) and tma_load(dtype="float16") and tma_load(m=700, k=264, n=200)
    assert tma_load(out_dtype="float32")  # its tile has no room for a TMA store; the loads do not need one
    assert [p.name for p in PLANS if p.constexpr_dict.get("TMA_LOAD")]  # and the AOT test compiles some
    assert not tma_load(facts=HOPPER)  # no launcher with global scratch (jax-triton)
    assert not tma_load(facts=dataclasses.replace(HOPPER_GLUON, capability=(8, 0)))  # no TMA
    assert not tma_load(dtype="float32")  # measured for 16-bit inputs only
    assert not tma_load(k=2044) and not tma_load(n=1404, out_dtype="float32")  # rows of whole 16-byte units only
    assert not tma_load(batch=8) and not tma_load(batch=8, shared_rhs=True)  # vmap's batches of problems
    assert not tma_load(facts=DeviceFacts.cpu())


def test_weight_gradient_runs_the_gluon_kernel_where_it_can():
    def gluon(m=32768, k=2048, n=1408, lhs_mk=True, dtype="bfloat16", out_dtype=None, facts=HOPPER_GLUON, **kw):
        plan = tgmm_plan(m, k, n, 64, 64, lhs_mk, dtype, out_dtype or dtype, facts, **kw)
        assert plan.is_gluon == (plan.name == "tgmm_gluon_kernel")
        return plan.is_gluon

    assert gluon() and gluon(dtype="float16") and gluon(m=700, k=128, n=1024) and gluon(k=264, n=200)
    assert tgmm_plan(32768, 2048, 1408, 64, 64, True, "bfloat16", "bfloat16", HOPPER_GLUON).grid == (132,)
    assert not gluon(facts=HOPPER)  # no launcher with global scratch (jax-triton)
    assert not gluon(facts=dataclasses.replace(HOPPER_GLUON, capability=(10, 0)))  # sm_90 only
    assert not gluon(lhs_mk=False)  # the public [k, m] layout
    assert not gluon(dtype="float32") and not gluon(out_dtype="float32")
    assert not gluon(batch=8)  # vmap's batch of problems
    assert not gluon(k=2044) and not gluon(n=1404)  # rows of whole 16-byte units only
    assert not gluon(m=0)
    assert gluon(m=64 * 1024) and not gluon(m=64 * 1024 + 1)  # long experts: the Triton kernel's main loop wins
    from triton_kernels.params import FwdParams

    assert not gluon(params=FwdParams(blocksize_n=128))  # explicit params tune the Triton kernel


def test_grid_is_persistent():
    for plan in PLANS:
        assert 1 <= plan.grid[0] <= 2 * HOPPER.num_sms
    assert any(plan.grid[0] > HOPPER.num_sms for plan in PLANS)  # small tiles: two programs per SM
