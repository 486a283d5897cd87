"""Where flash-attention time goes on a CUDA GPU, kernel by kernel: the forward, and the
backward's kernels in launch order (dq, which computes delta too, then dk/dv), each plan launched
directly (no op dispatch).

    python scripts/probe_flash_kernels.py [--head-dims 64 128] [--causal false true] [--out PATH]

bf16, batch 4, seq 4096, heads 2048 / head_dim. The effective TFLOP/s count the matmuls each
kernel runs: forward 2 (QK^T, PV), dk/dv 4 (QK^T, dO V^T, P^T dO, dS^T Q), dq 3 (QK^T,
dO V^T, dS K): dk/dv and dq recompute two products each rather than share them.
(Commit c57befd held experimental kernel variants this script compared; see
benchmarks/results/probe_flash_kernels-nvidia-h100-80gb-hbm3.json.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}


def _probe(head_dim: int, causal: bool) -> list[dict]:
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa

    b, s, h, d = 4, 4096, 2048 // head_dim, head_dim
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    fwd_plan = fa.forward_plan(spec, facts)
    out, lse = launch(fwd_plan, *arrays)
    plans = fa.backward_plans(spec, facts)
    dlse = torch.zeros(1, device="cuda", dtype=torch.float32)
    given = plans.run(launch, fa.backward_inputs(arrays, out, do, lse, dlse))
    per_matmul = flops(b, h, s, d, causal, "fwd") / 2
    rows = []
    steps = [("fwd", fwd_plan, arrays)] + [(name, plan, plan.inputs_from(given))
                                           for name, plan in (("dq", plans.dq), ("dkdv", plans.dkdv))]
    for name, plan, inputs in steps:  # dq computes delta too
        ms = bench_torch(lambda: launch(plan, *inputs))
        row = {"head_dim": d, "causal": causal, "kernel": name, "ms": ms,
               "effective_tflops": MATMULS[name] * per_matmul / ms / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [row for d in args.head_dims for c in args.causal for row in _probe(d, c == "true")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": "python scripts/probe_flash_kernels.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
