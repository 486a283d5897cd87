"""The backward's dq pass on a Hopper GPU: ``flash_bwd_dq_kernel`` (Triton) against the
warp-specialized ``flash_bwd_dq_gluon_kernel``, plans launched directly from torch.

    python scripts/probe_flash_gluon_dq.py [--seqs 1024 4096 16384] [--out PATH]

bf16, batch x seq = 16k tokens, heads = 2048 / head_dim (the benchmark's shapes). Each Gluon
variant (key block, stages) is checked against the Triton kernel's dq on the same inputs
(relative error) before it is timed. Effective TFLOP/s count the pass's three matmuls
(QK^T, dO V^T, dS K).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = ((64, 2), (64, 3), (64, 4), (128, 2))  # (BLOCK_N, STAGES) of the Gluon kernel; the plans use (64, 3)


def _variant(plan, block_n: int, stages: int):
    consts = dict(plan.constexprs)
    consts.update(BLOCK_N=block_n, STAGES=stages)
    return dataclasses.replace(plan, constexprs=tuple(consts.items()))


def _probe(head_dim: int, seq: int, causal: bool) -> list[dict]:
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa
    from triton_kernels.flash_attention.plan import gluon_dq_plan

    b, h, d = 16384 // seq, 2048 // head_dim, head_dim
    q, k, v, do = (torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    out, lse = launch(fa.forward_plan(spec, facts), *arrays)
    # The Triton dq plan: what backward_plans picks where the front cannot run Gluon.
    delta_plan, _, dq_plan = fa.backward_plans(spec, dataclasses.replace(facts, gluon=False))
    dlse = torch.zeros(1, device="cuda", dtype=torch.float32)
    (delta,) = launch(delta_plan, out, do, dlse, arrays[6], arrays[7])
    grads_in = arrays + [do, lse, delta]
    (want,) = launch(dq_plan, *grads_in)
    per_matmul = flops(b, h, seq, d, causal, "fwd") / 2
    rows = []
    candidates = [("triton", dq_plan)] + [(f"gluon n{n} s{s}", _variant(gluon_dq_plan(spec, facts), n, s))
                                          for n, s in VARIANTS]
    for name, plan in candidates:
        row = {"head_dim": d, "seq": seq, "causal": causal, "kernel": name}
        try:
            (got,) = launch(plan, *grads_in)
            torch.cuda.synchronize()
            row["rel_err_vs_triton"] = float((got.float() - want.float()).norm() / want.float().norm())
            row["ms"] = bench_torch(lambda: launch(plan, *grads_in))
            row["effective_tflops"] = 3 * per_matmul / row["ms"] / 1e9
        except Exception as e:  # a variant that does not compile or fit is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [row for d in args.head_dims for s in args.seqs for c in args.causal for row in _probe(d, s, c == "true")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": "python scripts/probe_flash_gluon_dq.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
