"""torch.compile launches the kernels through ``wrap_triton``, which reads each kernel's TTIR to
find the inputs it writes. An input it takes as written is copied before every launch (and a
leaf that requires grad fails: "a leaf Variable that requires grad is being used in an in-place
operation"). The grouped matmul's persistent loop made it take lhs and rhs as written. Every
plan must write its outputs only; small integer metadata (group sizes, n_pad, cu_seqlens), whose
indices reach the stores through helper calls, may be reported too: copying it costs nothing."""
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from triton_kernels import HOPPER, flash_attention as fa  # noqa: E402
from triton_kernels import padded_attention as pa, softmax as sm  # noqa: E402
from triton_kernels.flash_attention.plan import triton_forward_plan  # noqa: E402
from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan  # noqa: E402

METADATA = {"group_sizes_ptr", "group_offset_ptr", "n_pad_ptr", "cu_q_ptr", "cu_k_ptr"}


def _plans():
    yield "gmm", gmm_plan(64, 32, 48, 3, 3, False, "bfloat16", "bfloat16", HOPPER)
    yield "gmm transpose_rhs", gmm_plan(64, 32, 48, 3, 3, True, "bfloat16", "bfloat16", HOPPER)
    yield "tgmm", tgmm_plan(64, 32, 48, 3, 3, False, "bfloat16", "bfloat16", HOPPER)
    yield "tgmm lhs_mk", tgmm_plan(64, 32, 48, 3, 3, True, "bfloat16", "bfloat16", HOPPER)
    # torch.func.vmap's batches of problems (the pointers each problem's operands start at)
    yield "gmm batch", gmm_plan(64, 32, 48, 3, 3, False, "bfloat16", "bfloat16", HOPPER, batch=4)
    yield "gmm batch shared rhs", gmm_plan(64, 32, 48, 3, 3, True, "bfloat16", "bfloat16", HOPPER, batch=4,
                                           shared_rhs=True)
    yield "tgmm batch", tgmm_plan(64, 32, 48, 3, 3, False, "bfloat16", "bfloat16", HOPPER, batch=4)
    yield "tgmm lhs_mk batch", tgmm_plan(64, 32, 48, 3, 3, True, "bfloat16", "bfloat16", HOPPER, batch=4)
    yield "softmax", sm.softmax_fwd_plan(8, 32, "float32", HOPPER)
    yield "softmax bwd", sm.softmax_bwd_plan(8, 32, "float32", HOPPER)
    yield "padded_softmax", sm.padded_softmax_fwd_plan(2, 32, "float32", HOPPER)
    yield "padded_attention", pa.attention_fwd_plan((2, 32, 16), "float32", 0.25, HOPPER)
    for i, plan in enumerate(pa.attention_bwd_plans((2, 32, 16), "float32", 0.25, HOPPER)):
        yield f"padded_attention bwd {i}", plan
    yield "padded_softmax_v", pa.scores_v_fwd_plan((2, 32, 16), "float32", HOPPER)
    for i, plan in enumerate(pa.scores_v_bwd_plans((2, 32, 16), "float32", HOPPER)):
        yield f"padded_softmax_v bwd {i}", plan
    spec = fa.dense_spec((2, 256, 4, 64), (2, 256, 2, 64), (2, 256, 2, 64), ("bfloat16",) * 3, causal=True)
    yield "flash_attention", triton_forward_plan(spec, HOPPER)
    for i, plan in enumerate(fa.backward_plans(spec, HOPPER)):
        yield f"flash_attention bwd {i}", plan


PLANS = dict(_plans())


class _Hopper:
    """The driver torch's analysis asks for a target, on a machine without a GPU."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def hopper_target():
    from triton.runtime import driver
    saved = driver._active
    driver.set_active(_Hopper())
    try:
        yield
    finally:
        driver._active = saved


def _written_inputs(plan) -> set[str]:
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(wrap, "identify_accessed_tensors"):
        pytest.skip("this torch has no identify_accessed_tensors (its analysis is checked with torch 2.13)")
    inputs = [torch.zeros(1, dtype=getattr(torch, d)) for d in plan.input_dtypes]
    outputs = [torch.zeros(1) for _ in plan.outputs]
    arg_names = [n for n in plan.kernel.arg_names if n not in plan.constexpr_dict]
    kwargs = {**dict(zip(arg_names, plan.runtime_args(inputs, outputs))), **plan.constexpr_dict}
    accesses = wrap.identify_accessed_tensors(plan.kernel, kwargs, {})
    return {dep.name for dep in accesses.read_writes.writes} & set(plan.inputs)


@pytest.mark.parametrize("name", PLANS)
def test_compile_sees_only_outputs_written(hopper_target, name):
    plan = PLANS[name]
    assert _written_inputs(plan) <= METADATA, plan.inputs
