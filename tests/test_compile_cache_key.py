"""torch.compile's on-disk caches must not replay a graph compiled against other kernels.

torch keys a cached graph on the source of the Triton kernels it finds in each triton_op's body;
ours launch through plans, so it found none, and a graph cached by an older version of the
library ran that version's plan texts against today's kernels (CI: "plan for flash_bwd_dq_kernel
binds ..." after the dq kernel took new parameters). Each registered op now declares the kernels
its plans launch (``ejkernel_torch.ops._common.declare_kernels``). Torch-only by nature.
"""
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
library_triton = pytest.importorskip("torch._library.triton")

import ejkernel_torch  # noqa: E402,F401  (registers the ops)
from tests.plan_catalog import plans_by_op  # noqa: E402
from triton_kernels import HOPPER, HOPPER_GLUON  # noqa: E402
from triton_kernels.plan import DeviceFacts  # noqa: E402

if not hasattr(library_triton, "triton_ops_to_kernels"):
    pytest.skip("this torch keys no cached graph on triton_op kernels", allow_module_level=True)

# Each op's plans on every device kind: CPU, Hopper with Triton's kernels only, and with Gluon.
CATALOGS = [plans_by_op(facts) for facts in (DeviceFacts.cpu(), HOPPER, HOPPER_GLUON)]
PLANS = {op: [plan for catalog in CATALOGS for plan in catalog[op]] for op in CATALOGS[0]}


def test_every_registered_op_is_covered_here():
    registered = {name.split("::")[1] for name in library_triton.triton_ops_to_kernels
                  if name.startswith("ejkernel::")}
    assert registered == set(PLANS)


@pytest.mark.parametrize("op", sorted(PLANS))
def test_ops_declare_the_kernels_their_plans_launch(op):
    """Each op declares exactly the kernels of its plans here (the plans reach every Gluon kernel
    where this Triton has Gluon, so no declared kernel is left untested)."""
    declared = {id(k): k.fn.__name__ for k in library_triton.get_triton_kernels_for_op(f"ejkernel::{op}")}
    launched = {id(plan.kernel): plan.kernel.fn.__name__ for plan in PLANS[op]}
    assert launched == declared


@pytest.mark.parametrize("op", ["flash_attention_fwd", "flash_attention_bwd", "grouped_matmul"])
def test_the_compile_cache_key_holds_the_kernels_source(op):
    """What AOTAutograd's cache hashes for a graph calling ``op``: its kernels' source, so a graph
    cached before a kernel changed is not found after."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails

    graph = torch.fx.Graph()
    graph.output(graph.call_function(getattr(torch.ops.ejkernel, op).default, (graph.placeholder("x"),)))
    details = AOTAutogradCacheDetails.__new__(AOTAutogradCacheDetails)  # the method reads no state
    sources = details.get_triton_source_codes_from_gm(torch.fx.GraphModule({}, graph))
    for plan in PLANS[op]:
        assert any(f"def {plan.kernel.fn.__name__}(" in source for source in sources), plan.name
