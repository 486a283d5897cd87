"""Every plan shape the suite uses compiles ahead of time for Hopper (sm_90) and fits its
shared memory: compile errors surface in CI without a GPU."""
import pytest

from triton_kernels import HOPPER
from triton_kernels.aot import compile_plan, distinct_plans
from triton_kernels.padded_attention import (attention_bwd_plans, attention_fwd_plan, scores_v_bwd_plans,
                                              scores_v_fwd_plan)
from triton_kernels.softmax import padded_softmax_fwd_plan, softmax_bwd_plan, softmax_fwd_plan

DTYPES = ("float32", "float16", "bfloat16")


def _plans():
    for dtype in DTYPES:
        for n_cols in (1, 127, 1000, 32768, 100_000):
            yield softmax_fwd_plan(4096, n_cols, dtype, HOPPER)
            yield softmax_bwd_plan(4096, n_cols, dtype, HOPPER)
        yield padded_softmax_fwd_plan(2, 300, dtype, HOPPER)
        for head_dim in (3, 24, 64, 80, 128, 256):
            yield attention_fwd_plan((2, 1000, head_dim), dtype, 0.125, HOPPER)
            yield from attention_bwd_plans((2, 1000, head_dim), dtype, 0.125, HOPPER)
            yield scores_v_fwd_plan((2, 1000, head_dim), dtype, HOPPER)
            yield from scores_v_bwd_plans((2, 1000, head_dim), dtype, HOPPER)


PLANS = distinct_plans(_plans())


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.name}-{'-'.join(f'{k}{v}' for k, v in p.constexprs)}")
def test_compiles_for_hopper(plan):
    kernel = compile_plan(plan)
    assert kernel.metadata.num_warps == plan.num_warps
    assert kernel.metadata.shared <= HOPPER.shared_memory, (kernel.metadata.shared, HOPPER.shared_memory)
    assert "ptx" in kernel.asm and "cubin" in kernel.asm
