"""Every flash-attention plan shape compiles ahead of time for Hopper (sm_90) and fits its shared
memory: GPU compile errors (which the interpreter cannot see) surface in CI without a GPU.

Each feature is a constexpr branch, so "all features on" and "all off" compile every branch; the
default set covers them per dtype at head_dim 64/128/256, the slow set more head_dims."""
import pytest

from triton_kernels import HOPPER
from triton_kernels import flash_attention as fa
from triton_kernels.aot import compile_key, compile_plan

DTYPES = ("float32", "float16", "bfloat16")


def _dense(dtype, head_dim, features, seq=1000, segment_dtype="int32", softcap=30.0):
    q, kv = (2, seq, 8, head_dim), (2, seq, 2, head_dim)
    if not features:
        return fa.dense_spec(q, kv, kv, (dtype,) * 3)
    return fa.dense_spec(q, kv, kv, (dtype,) * 3, causal=True, sliding_window=128, logits_soft_cap=softcap,
                         bias_shape=(1, 8, seq, seq), bias_dtype=dtype, q_segment_shape=(2, seq),
                         q_segment_dtype=segment_dtype, kv_segment_shape=(2, seq), kv_segment_dtype=segment_dtype,
                         dropout_p=0.1)


def _varlen(dtype, head_dim):
    shape = (4000, 8, head_dim), (4000, 8, head_dim)
    return fa.varlen_spec(shape[0], shape[1], shape[1], (dtype,) * 3, (5,), "int32", (5,), "int32", 1000, 1000,
                          causal=True)


def _plans(spec, write_ds=False, use_dlse=False):
    yield fa.forward_plan(spec, HOPPER)
    yield from fa.backward_plans(spec, HOPPER, write_ds, use_dlse)


def _default_specs():
    for dtype in DTYPES:
        for head_dim in (64, 128, 256):
            yield _dense(dtype, head_dim, True), dict(write_ds=True, use_dlse=True)
    yield _dense("bfloat16", 128, False), {}
    yield _dense("bfloat16", 128, True, segment_dtype="int64"), dict(write_ds=True, use_dlse=True)
    yield _dense("float16", 64, True, seq=1), dict(write_ds=True, use_dlse=True)  # runtime ints equal to 1
    yield _dense("bfloat16", 64, True, softcap=1e4), dict(write_ds=True, use_dlse=True)  # tanh's precise form
    yield _varlen("bfloat16", 80), {}
    yield fa.dropout_mask_plan(2, 8, 1000, 1000, 0.1, HOPPER), None


def _slow_specs():
    for dtype in DTYPES:
        for head_dim in (16, 80, 192):
            yield _dense(dtype, head_dim, True), dict(write_ds=True, use_dlse=True)
        yield _dense(dtype, 256, False), {}
        yield _varlen(dtype, 256), {}


def _unique(specs, skip=()):
    seen = {}
    for spec, options in specs:
        for plan in ([spec] if options is None else _plans(spec, **options)):
            key = compile_key(plan)
            if key not in skip:
                seen.setdefault(key, plan)
    return seen


DEFAULT = _unique(_default_specs())
SLOW = _unique(_slow_specs(), skip=DEFAULT)


def _id(plan):
    c = plan.aot_constexprs()
    feats = "-".join(k.removeprefix("USE_").lower() for k, v in c.items() if k.startswith("USE_") and v)
    varlen = "varlen-" if c.get("IS_VARLEN") else ""
    ones = "-ones" if c.get("seq_q") == 1 else ""
    ids64 = "-ids64" if "int64" in plan.input_dtypes else ""
    return f"{plan.name}-{plan.input_dtypes[0]}-d{c.get('HEAD_DIM')}-{varlen}{feats}{ones}{ids64}"


def _check(plan):
    kernel = compile_plan(plan)
    assert kernel.metadata.num_warps == plan.num_warps
    assert kernel.metadata.shared <= HOPPER.shared_memory, (kernel.metadata.shared, HOPPER.shared_memory)
    assert "cubin" in kernel.asm


@pytest.mark.parametrize("plan", list(DEFAULT.values()), ids=_id)
def test_compiles_for_hopper(plan):
    _check(plan)


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(SLOW.values()), ids=_id)
def test_compiles_for_hopper_all_head_dims(plan):
    _check(plan)


def _sweep_plans():
    from benchmarks.flash_attention import SWEEP_BWD, SWEEP_FWD

    shape = (4, 4096, 16, 128)  # head_dim 128: the largest tiles; 64 fits when these do
    spec = fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=True)
    for params in SWEEP_FWD:
        yield fa.forward_plan(spec, HOPPER, params)
    for params in SWEEP_BWD:
        yield from fa.backward_plans(spec, HOPPER, params=params)  # the Triton dq and dk/dv


@pytest.mark.slow
@pytest.mark.parametrize("plan", list({compile_key(p): p for p in _sweep_plans()}.values()),
                         ids=lambda p: f"{p.name}-{p.input_dtypes[0]}-d{dict(p.constexprs)['HEAD_DIM']}-"
                                       f"{dict(p.constexprs)['BLOCK_M']}x{dict(p.constexprs)['BLOCK_N']}-"
                                       f"w{p.num_warps}-s{p.num_stages}")
def test_benchmark_sweep_configs_compile(plan):
    """What benchmarks/flash_attention.py --sweep launches compiles for sm_90 and fits."""
    _check(plan)


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float16", 64)])
def test_forward_normalises_its_rows_by_one_reciprocal_each(dtype, head_dim):
    # The epilogue divides once for each row a thread holds, then multiplies: dividing each of
    # the thread's output elements put one div.full an element in the PTX (64 here).
    import re

    plan = fa.forward_plan(_dense(dtype, head_dim, False), HOPPER)
    assert plan.name == "flash_fwd_kernel"
    divisions = re.findall(r"\bdiv\.[\w.]*f32", compile_plan(plan).asm["ptx"])
    c = plan.constexpr_dict
    elements_a_thread = c["BLOCK_M"] * c["BLOCK_D"] // (32 * plan.num_warps)
    assert 0 < len(divisions) <= elements_a_thread // 8, (len(divisions), elements_a_thread)
