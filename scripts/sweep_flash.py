"""Time flash-attention tile configs on a CUDA GPU, each backward config in its own subprocess so
that a faulting config (a sticky CUDA error) is reported and the sweep goes on.

    python scripts/sweep_flash.py [--head-dims 64 128] [--causal false true] [--phases fwd bwd]
                                  [--fwd 128,64,8,3 ...] [--bwd 32,64,4,3 ...] [--out PATH]

bf16, batch 4, seq 4096, heads 2048 / head_dim, head_dim 64 and 128, causal and not. Prints and
writes milliseconds and TFLOP/s per config (forward, and forward+backward for backward configs).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FWD = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 4)]
BWD = [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2),
       (64, 128, 8, 2)]


def _time(case: dict) -> dict:
    import torch

    import ejkernel_torch
    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from triton_kernels.params import BwdParams, FwdParams

    d, causal = case["head_dim"], case["causal"]
    shape = (4, 4096, 2048 // d, d)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    results = {}
    for cfg in case["configs"]:
        bm, bn, w, s = cfg
        label = f"{bm}x{bn}-w{w}-s{s}"
        if case["phase"] == "fwd":
            params = dict(fwd_params=FwdParams(blocksize_m=bm, blocksize_n=bn, num_warps=w, num_stages=s))
            fn = lambda: ejkernel_torch.flash_attention(q, k, v, causal=causal, **params)  # noqa: E731
        else:
            params = dict(bwd_params=BwdParams(blocksize_m=bm, blocksize_n=bn, num_warps=w, num_stages=s))
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            fn = lambda: torch.autograd.grad(  # noqa: E731
                ejkernel_torch.flash_attention(qg, kg, vg, causal=causal, **params), (qg, kg, vg), do)
        ms = bench_torch(fn)
        phase = "fwd" if case["phase"] == "fwd" else "fwd+bwd"
        results[label] = {"ms": ms, "tflops": flops(*shape[:1], shape[2], shape[1], d, causal, phase) / ms / 1e9}
    return results


def _config(text: str) -> tuple[int, int, int, int]:
    values = tuple(int(x) for x in text.split(","))
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,BLOCK_N,warps,stages, got {text!r}")
    return values


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("{"):
        print("RESULT", json.dumps(_time(json.loads(sys.argv[1]))))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--head-dims", nargs="*", type=int, default=[128, 64])
    parser.add_argument("--causal", nargs="*", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--phases", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--fwd", nargs="*", type=_config, default=FWD, help="BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--bwd", nargs="*", type=_config, default=BWD, help="BLOCK_M,BLOCK_N,warps,stages")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cases = list(itertools.product(args.head_dims, [c == "true" for c in args.causal]))
    jobs = [dict(head_dim=d, causal=c, phase="fwd", configs=args.fwd) for d, c in cases if "fwd" in args.phases]
    jobs += [dict(head_dim=d, causal=c, phase="bwd", configs=[cfg])
             for (d, c), cfg in itertools.product(cases, args.bwd) if "bwd" in args.phases]
    table = []
    for job in jobs:
        r = subprocess.run([sys.executable, __file__, json.dumps(job)], capture_output=True, text=True, timeout=300)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode == 0 and line:
            for label, res in json.loads(line[0][7:]).items():
                table.append({**{k: job[k] for k in ("head_dim", "causal", "phase")}, "config": label, **res})
                print(json.dumps(table[-1]), flush=True)
        else:
            err = [x for x in (r.stdout + r.stderr).splitlines() if "Error" in x][-1:]
            label = "-".join(map(str, job["configs"][0])) if job["phase"] == "bwd" else "all"
            table.append({**{k: job[k] for k in ("head_dim", "causal", "phase")}, "config": label,
                          "error": f"rc={r.returncode} {err}"})
            print(json.dumps(table[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
