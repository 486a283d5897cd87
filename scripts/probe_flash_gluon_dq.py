"""Flash attention's passes on a Hopper GPU: the Triton kernels (``flash_fwd_kernel``,
``flash_bwd_dq_kernel``, ``flash_bwd_dkdv_kernel``) against their warp-specialized Gluon versions,
plans launched directly from torch.

    python scripts/probe_flash_gluon_dq.py [--passes fwd dq dkdv] [--seqs 1024 4096 16384] [--out PATH]

bf16, batch x seq = 16k tokens, heads = 2048 / head_dim (the benchmark's shapes; ``--group g``
shares each kv head among g query heads). Each Gluon variant (streamed block, stages) is checked
against the Triton kernel's outputs on the same inputs (relative error, the worst output) before
it is timed. Effective TFLOP/s count the pass's matmuls: the forward two (QK^T, PV), dq three
(QK^T, dO V^T, dS K), dk/dv four (K Q^T, V dO^T, P^T dO, dS^T Q).

Committed JSON from before a kernel went persistent times its version with a program per tile,
since replaced: the forward's "gluon" rows, the dq file without "persistent" in its name, and the
dk/dv files' "gluon m64" rows ("gluon persistent" rows time the current kernels).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (streamed block, STAGES) of each Gluon kernel; the plans use dq (64, 3), dk/dv (64, DKDV_STAGES).
VARIANTS = {"dq": ("BLOCK_N", ((64, 2), (64, 3), (64, 4), (128, 2))),
            "dkdv": ("BLOCK_M", ((64, 2), (64, 3)))}
MATMULS = {"fwd": 2, "dq": 3, "dkdv": 4}


def _variant(plan, block_name: str, block: int, stages: int):
    return plan.with_constexprs(**{block_name: block, "STAGES": stages})


def _rel_err(got, want) -> float:
    return max(float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip(got, want))


def _probe(kind: str, head_dim: int, seq: int, causal: bool, group: int) -> list[dict]:
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa
    from triton_kernels.flash_attention.plan import gluon_dkdv_plan, gluon_dq_plan

    b, h, d = 16384 // seq, 2048 // head_dim, head_dim
    q, do = (torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, seq, h // group, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    out, lse = launch(fa.forward_plan(spec, facts), *arrays)
    # The Triton plans: what backward_plans picks where the front cannot run Gluon. Both dq kernels
    # take the same inputs and compute delta, which the dk/dv kernels read.
    triton_plans = fa.backward_plans(spec, dataclasses.replace(facts, gluon=False))
    dlse = torch.zeros(1, device="cuda", dtype=torch.float32)
    given = triton_plans.run(launch, fa.backward_inputs(arrays, out, do, lse, dlse))  # delta among them
    if kind == "fwd":
        from triton_kernels.flash_attention.plan import gluon_forward_plan, triton_forward_plan

        triton_plan = triton_forward_plan(spec, facts)
        inputs = arrays
        candidates = [("triton", triton_plan)] + [
            (f"gluon persistent s{s}", _variant(gluon_forward_plan(spec, facts), "BLOCK_N", 128, s)) for s in (2, 3)]
    else:
        triton_plan, gluon_plan = ((triton_plans.dq, gluon_dq_plan) if kind == "dq"
                                   else (triton_plans.dkdv, gluon_dkdv_plan))
        inputs = triton_plan.inputs_from(given)
        block_name, variants = VARIANTS[kind]
        candidates = [("triton", triton_plan)] + [
            (f"gluon {block_name[-1].lower()}{n} s{s}", _variant(gluon_plan(spec, facts), block_name, n, s))
            for n, s in variants]
    want = launch(triton_plan, *inputs)[:2]  # out and lse, dq and delta, or dk and dv
    per_matmul = flops(b, h, seq, d, causal, "fwd") / 2  # one of the pass's matmuls (MATMULS)
    rows = []
    for name, plan in candidates:
        row = {"pass": kind, "head_dim": d, "seq": seq, "group": group, "causal": causal, "kernel": name}
        try:
            got = launch(plan, *inputs)[:2]
            torch.cuda.synchronize()
            row["rel_err_vs_triton"] = _rel_err(got, want)
            row["ms"] = bench_torch(lambda: launch(plan, *inputs))
            row["effective_tflops"] = MATMULS[kind] * per_matmul / row["ms"] / 1e9
        except Exception as e:  # a variant that does not compile or fit is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", nargs="+", default=["dq"], choices=["fwd", "dq", "dkdv"])
    parser.add_argument("--group", type=int, default=1, help="query heads per kv head")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [row for kind in args.passes for d in args.head_dims for s in args.seqs for c in args.causal
            for row in _probe(kind, d, s, c == "true", args.group)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": "python scripts/probe_flash_gluon_dq.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
