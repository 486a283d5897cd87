"""Variants of the Gluon flash-attention backward kernels against the plans' kernels, on a Hopper GPU.

    python scripts/probe_gluon_backward_variants.py VARIANT.py [VARIANT.py ...] [--no-time] [--out PATH]
        [--head-dims 128] [--seqs 1024 2048] [--causal true]   # time a subset of the shapes

Each VARIANT.py is a copy of ``triton_kernels/flash_attention/gluon_backward.py`` with one change
(its ``flash_bwd_dq_gluon_kernel`` and ``flash_bwd_dkdv_gluon_kernel`` must take the same
arguments); the file's stem names it. Its relative imports are read as imports from
``triton_kernels.flash_attention``, so the copy can live anywhere.

For each shape, the plan's dq and dk/dv kernels ("plan") and each variant's run on the same
inputs (q, k, v, dO random, bf16; o and lse from the plan's forward, delta from its dq). The
checks on small odd shapes compare each variant's dq, delta, dk and dv with the plan's bit for bit
(outputs poisoned with NaN first, so unwritten elements show). The timings run the benchmark's
shapes (batch x seq = 16k tokens, heads = 2048 / head_dim, head_dim 128 and 64, seq 1024-4096,
causal and not) with the two kernels timed apart, side by side with the plan's (wall clock over
batches, in turn; ``speedup_vs_plan`` > 1: the variant is faster). The plans' own choice of
kernel does not matter here: the Gluon dq kernel is timed at every shape, also where the plan
takes the Triton one (head_dim 64 below seq_k 2048). A variant that fails is reported, not fatal.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (batch, seq_q, seq_k, heads, head_dim, causal): odd lengths, partial blocks, seq_q < seq_k.
CHECKS = [(1, 128, 128, 1, 128, False), (1, 128, 128, 1, 128, True), (2, 1000, 1000, 3, 128, True),
          (2, 777, 777, 4, 64, False), (3, 1024, 1024, 5, 128, False), (2, 1000, 1100, 3, 128, True),
          (2, 700, 1000, 3, 64, True), (1, 2048, 2048, 2, 64, True), (1, 300, 365, 2, 64, True)]
KERNELS = {"dq": "flash_bwd_dq_gluon_kernel", "dkdv": "flash_bwd_dkdv_gluon_kernel"}


def absolute_imports(source: str) -> str:
    """The kernel file's relative imports (``from .x import``) as imports from the package."""
    return source.replace("from .", "from triton_kernels.flash_attention.")


def load_kernel(path: str):
    """(name, module) of a variant file, loaded from a copy with absolute imports."""
    from benchmarks.common import load_kernel_copy

    return load_kernel_copy(path, "gluon_backward_variant", absolute_imports)


def variant_plans(spec, facts, module) -> dict:
    """The plan's Gluon dq and dk/dv plans, with ``module``'s kernels where it is not None."""
    from triton_kernels.flash_attention.plan import gluon_dkdv_plan, gluon_dq_plan

    plans = {"dq": gluon_dq_plan(spec, facts), "dkdv": gluon_dkdv_plan(spec, facts)}
    if module is None:
        return plans
    return {kind: dataclasses.replace(plan, kernel=getattr(module, KERNELS[kind])) for kind, plan in plans.items()}


def _inputs(shape, causal: bool):
    """The spec, the device facts and the backward kernels' arguments by name (delta from the plan's dq)."""
    import torch

    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa

    b, s, sk, h, d = shape
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    features = _features(q, k, v, None, None, None, None, None, None)
    out, lse = launch(fa.forward_plan(spec, facts), *features)
    arrays = fa.backward_inputs(features, out, dout, lse, torch.zeros(1, device="cuda"))
    dq_plan = fa.plan.gluon_dq_plan(spec, facts)
    _, arrays["delta_ptr"] = launch(dq_plan, *dq_plan.inputs_from(arrays))
    return spec, facts, arrays


def _poison(plan) -> None:
    """NaN in the memory the caching allocator hands ``plan``'s outputs next, so that elements a
    kernel leaves unwritten show."""
    import torch

    poisoned = [torch.full(o.shape, float("nan"), device="cuda", dtype=getattr(torch, o.dtype)) for o in plan.outputs]
    del poisoned


def _row(shape, causal: bool, variants: dict, timed: bool) -> dict:
    import torch

    from benchmarks.common import time_beside_plan, error_text
    from ejkernel_torch.launch import launch

    spec, facts, args = _inputs(shape, causal)
    row = {"shape": list(shape), "causal": causal}
    runs = {"dq": {}, "dkdv": {}}
    results = {}
    for name, module in variants.items():
        try:
            plans = variant_plans(spec, facts, module)
            got = []
            for plan in plans.values():
                _poison(plan)
                got += [t for t in launch(plan, *plan.inputs_from(args)) if t.numel() > 1]  # dq, delta; dk, dv
            torch.cuda.synchronize()
            results[name] = got
            row[name] = {"nan": any(bool(t.isnan().any()) for t in got)}
            for kind, plan in plans.items():
                runs[kind][name] = lambda plan=plan: launch(plan, *plan.inputs_from(args))
        except Exception as e:  # a broken variant is a result too
            row[name] = {"error": error_text(e)}
    for name, got in results.items():
        if name != "plan" and "plan" in results:
            row[name]["bitwise_equal_to_plan"] = all(torch.equal(a, b) for a, b in zip(got, results["plan"]))
    if timed:
        sync = lambda _: torch.cuda.synchronize()  # noqa: E731
        for kind, fns in runs.items():
            if "plan" not in fns:
                continue
            for name, (ms, speedup) in time_beside_plan(fns, sync).items():
                row[name][kind] = {"ms": ms, "speedup_vs_plan": speedup}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from benchmarks.common import variant_probe_main

    variant_probe_main(__doc__, "gluon_backward.py", CHECKS, load_kernel, _row)


if __name__ == "__main__":
    main()
