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
from triton_kernels import HOPPER, HOPPER_GLUON, flash_attention as fa  # noqa: E402
from triton_kernels import padded_attention as pa, softmax as sm  # noqa: E402
from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan  # noqa: E402
from triton_kernels.plan import DeviceFacts  # noqa: E402

if not hasattr(library_triton, "triton_ops_to_kernels"):
    pytest.skip("this torch keys no cached graph on triton_op kernels", allow_module_level=True)

FACTS = (DeviceFacts.cpu(), HOPPER, HOPPER_GLUON)


def _flash_specs():
    shape = lambda seq, d: (2, seq, 4, d)  # noqa: E731
    yield fa.dense_spec(shape(1024, 128), shape(1024, 128), shape(1024, 128), ("bfloat16",) * 3, causal=True)
    yield fa.dense_spec(shape(1024, 64), shape(1024, 64), shape(1024, 64), ("bfloat16",) * 3)  # Triton dq
    yield fa.dense_spec(shape(37, 80), shape(37, 80), shape(37, 80), ("float32",) * 3, dropout_p=0.1)


def _plans_by_op():
    """Plans each registered op's body may build, across devices, paths and features."""
    specs = list(_flash_specs())
    yield "flash_attention_fwd", [fa.forward_plan(s, f) for s in specs for f in FACTS]
    yield "flash_attention_bwd", [p for s in specs for f in FACTS for w in (False, True) for p in
                                  fa.backward_plans(s, f, False, w)]
    yield "flash_attention_dropout_mask", [fa.dropout_mask_plan(2, 4, 37, 37, 0.1, f) for f in FACTS]
    yield "grouped_matmul", [gmm_plan(64, 32, 48, 3, 3, t, "bfloat16", "bfloat16", f) for t in (False, True)
                             for f in FACTS]
    yield "transposed_grouped_matmul", [tgmm_plan(256, 32, 48, 2, 2, True, "bfloat16", "bfloat16", HOPPER_GLUON)] + [
        tgmm_plan(64, 32, 48, 3, 3, mk, "bfloat16", "bfloat16", f) for mk in (False, True) for f in FACTS]
    yield "padded_attention_fwd", [pa.attention_fwd_plan((2, 32, 16), "float32", 0.25, f) for f in FACTS]
    yield "padded_attention_bwd", [p for f in FACTS for p in pa.attention_bwd_plans((2, 32, 16), "float32", 0.25, f)]
    yield "softmax_rows_fwd", [sm.softmax_fwd_plan(8, 32, "float32", f) for f in FACTS]
    yield "softmax_rows_bwd", [sm.softmax_bwd_plan(8, 32, "float32", f) for f in FACTS]
    yield "padded_softmax_fwd", [sm.padded_softmax_fwd_plan(2, 32, "float32", f) for f in FACTS]
    yield "padded_softmax_v_fwd", [pa.scores_v_fwd_plan((2, 32, 16), "float32", f) for f in FACTS]
    yield "padded_softmax_v_bwd", [p for f in FACTS for p in pa.scores_v_bwd_plans((2, 32, 16), "float32", f)]


PLANS = dict(_plans_by_op())


def test_every_registered_op_is_covered_here():
    registered = {name.split("::")[1] for name in library_triton.triton_ops_to_kernels if name.startswith("ejkernel::")}
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
