"""Variants of the Gluon flash-attention forward against the plans' kernel, on a Hopper GPU.

    python scripts/probe_gluon_forward_variants.py VARIANT.py [VARIANT.py ...] [--no-time] [--out PATH]
        [--head-dims 128] [--seqs 1024 2048] [--causal true]   # time a subset of the shapes

Each VARIANT.py is a copy of ``triton_kernels/flash_attention/gluon_forward.py`` with one change
(its ``flash_fwd_gluon_kernel`` must take the same arguments; its own ``forward_consumers``
picks the consumer warpgroups, and a ``variant_plan(plan)`` in it may change the launch, e.g.
its warps); the file's stem names it. The
plan's kernel ("plan") and each variant are first checked against the Triton forward on small odd
shapes (relative error of the output and lse, the worse of the two; NaN reported), then timed side
by side (wall clock over batches, in turn; ``speedup_vs_plan`` > 1: the variant is faster) on the
benchmark's shapes: bf16, batch x seq = 16k tokens, heads = 2048 / head_dim, head_dim 128
and 64, seq 1024-4096, causal and not. A variant that fails to compile or run is reported, not fatal.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (batch, seq_q, seq_k, heads, head_dim, causal). With seq_q < seq_k the causal diagonal is not on a
# key block's edge, so a tile's first rows may see no key of its last block.
CHECKS = [(1, 128, 128, 1, 128, False), (1, 128, 128, 1, 128, True), (1, 256, 256, 1, 128, True),
          (2, 1000, 1000, 3, 128, True), (2, 777, 777, 4, 64, False), (3, 1024, 1024, 5, 128, False),
          (2, 1000, 1000, 3, 64, False), (1, 4096, 4096, 2, 128, True), (2, 1000, 1000, 3, 64, True),
          (1, 2048, 2048, 2, 64, True), (1, 1152, 1152, 2, 64, True), (2, 1000, 1100, 3, 128, True),
          (2, 700, 1000, 3, 64, True), (1, 1, 777, 2, 128, True), (1, 300, 365, 2, 64, True)]


def forward_plan_of(module, spec, facts):
    """The Gluon forward plan of ``spec`` with ``module``'s kernel (None: the plan's own): the
    consumers its ``forward_consumers`` picks, launched as its ``variant_plan(plan)`` says where
    it has one (e.g. more warps)."""
    from triton_kernels.flash_attention.plan import gluon_forward_plan

    if module is None:
        return gluon_forward_plan(spec, facts)
    consumers = module.forward_consumers(spec.head_dim, spec.window is not None, spec.seq_q, spec.seq_k)
    plan = dataclasses.replace(gluon_forward_plan(spec, facts, consumers), kernel=module.flash_fwd_gluon_kernel)
    return getattr(module, "variant_plan", lambda p: p)(plan)


def _load_kernel(path: str):
    from benchmarks.common import load_kernel_copy

    return load_kernel_copy(path, "gluon_forward_variant")


def _row(shape, causal: bool, variants: dict, timed: bool) -> dict:
    import torch

    from benchmarks.common import time_beside_plan, error_text
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa
    from triton_kernels.flash_attention.plan import triton_forward_plan

    b, s, sk, h, d = shape
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    want = launch(triton_forward_plan(spec, facts), *arrays)
    row = {"shape": list(shape), "causal": causal}
    runs = {}
    for name, module in variants.items():
        try:
            plan = forward_plan_of(module, spec, facts)
            for w in want:  # NaN where the outputs will be allocated next, so unwritten elements show
                torch.full_like(w, float("nan"))
            got = launch(plan, *arrays)
            torch.cuda.synchronize()
            row[name] = {"rel_err_vs_triton": max(float((g.float() - w.float()).norm() / w.float().norm())
                                                  for g, w in zip(got, want)),
                         "nan": bool(got[0].isnan().any() or got[1].isnan().any())}
            runs[name] = lambda plan=plan: launch(plan, *arrays)
        except Exception as e:  # a broken variant is a result too
            row[name] = {"error": error_text(e)}
    if timed and "plan" in runs:
        for name, (ms, speedup) in time_beside_plan(runs, lambda _: torch.cuda.synchronize()).items():
            row[name].update(ms=ms, tflops=flops(b, h, s, d, causal, "fwd") / ms / 1e9, speedup_vs_plan=speedup)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from benchmarks.common import variant_probe_main

    variant_probe_main(__doc__, "gluon_forward.py", CHECKS, _load_kernel, _row)


if __name__ == "__main__":
    main()
