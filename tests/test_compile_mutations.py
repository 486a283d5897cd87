"""torch.compile launches the kernels through ``wrap_triton``, which reads each kernel's TTIR to
find the inputs it writes. An input it takes as written is copied before every launch (and a
leaf that requires grad fails: "a leaf Variable that requires grad is being used in an in-place
operation"). The grouped matmul's persistent loop made it take lhs and rhs as written. Every
plan must write its outputs only; small integer metadata (group sizes, n_pad, cu_seqlens), whose
indices reach the stores through helper calls, may be reported too: copying it costs nothing."""
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from tests.plan_catalog import plans_by_op  # noqa: E402
from triton_kernels import HOPPER  # noqa: E402

METADATA = {"group_sizes_ptr", "group_offset_ptr", "n_pad_ptr", "cu_q_ptr", "cu_k_ptr"}

# The @triton.jit plans (Gluon ones run in the opaque op under torch.compile, never wrap_triton).
PLANS = {f"{op} {i}": plan for op, plans in plans_by_op(HOPPER).items() for i, plan in enumerate(plans)}


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
