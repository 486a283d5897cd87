"""Softmax throughput on a CUDA GPU: ours launched from torch and from jax, vs torch.softmax and
jax.nn.softmax, as GB/s (bytes read + written) and as a fraction of measured copy bandwidth.

    python benchmarks/softmax.py [--rows 4096] [--out benchmarks/results/softmax-<gpu>.json]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

from benchmarks.common import bench_jax, bench_torch, copy_bandwidth_gbs, device_name, write_json

COLS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def _per_call_overhead_us(calls: int = 2000) -> dict:
    """Host cost per call on a 4x128 input (GPU time is ~2 us): the public op, our launcher on a
    ready plan, a bare Triton launch of the same kernel, and torch.softmax."""
    import time

    import torch

    import ejkernel_torch
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels.softmax import softmax_fwd_plan

    x = torch.randn(4, 128, device="cuda")
    plan = softmax_fwd_plan(4, 128, "float32", device_facts(x.device))
    y = torch.empty_like(x)

    def bare():
        plan.kernel[plan.grid](x, 4, y, **plan.constexpr_dict, num_warps=plan.num_warps,
                               num_stages=plan.num_stages, enable_fp_fusion=plan.enable_fp_fusion)

    variants = {"ejkernel_torch.softmax": lambda: ejkernel_torch.softmax(x), "launch(plan)": lambda: launch(plan, x),
                "bare kernel[grid]": bare, "torch.softmax": lambda: torch.softmax(x, -1)}
    result = {}
    for name, fn in variants.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - start) * 1e6 / calls
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, nargs="*", default=COLS)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch

    import ejkernel_jax
    import ejkernel_torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device {device_name()}, copy bandwidth {copy_gbs:.0f} GB/s")
    ours_jax = jax.jit(ejkernel_jax.softmax)
    ref_jax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
    rows = []
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for n_cols in args.cols:
            data = rng.standard_normal((args.rows, n_cols), dtype=np.float32)
            xt = torch.from_numpy(data).cuda().to(getattr(torch, dtype))
            xj = jnp.asarray(data).astype(dtype)
            n_bytes = 2 * xt.numel() * xt.element_size()
            times = {
                "ours_torch": bench_torch(lambda: ejkernel_torch.softmax(xt)),
                "torch.softmax": bench_torch(lambda: torch.softmax(xt, dim=-1)),
                "ours_jax": bench_jax(ours_jax, xj),
                "jax.nn.softmax": bench_jax(ref_jax, xj),
            }
            row = {"dtype": dtype, "rows": args.rows, "cols": n_cols, "ms": times,
                   "gbs": {k: n_bytes / (v * 1e-3) / 1e9 for k, v in times.items()}}
            row["ratio_vs_torch_softmax"] = times["torch.softmax"] / times["ours_torch"]
            row["ratio_vs_jax_softmax"] = times["jax.nn.softmax"] / times["ours_jax"]
            row["fraction_of_copy_bw"] = row["gbs"]["ours_torch"] / copy_gbs
            rows.append(row)
            print(f"{dtype:9s} {n_cols:6d}  ours/torch {row['gbs']['ours_torch']:7.0f} GB/s "
                  f"({row['ratio_vs_torch_softmax']:.2f}x torch.softmax, {row['fraction_of_copy_bw']:.0%} of copy)  "
                  f"ours/jax {row['gbs']['ours_jax']:7.0f} GB/s ({row['ratio_vs_jax_softmax']:.2f}x jax.nn.softmax)",
                  flush=True)
    overhead = _per_call_overhead_us()
    print("per-call cost on a tiny input (us):", {k: round(v, 1) for k, v in overhead.items()})
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"softmax-{device_name()}.json")
    write_json(out, {"device": device_name(), "copy_bandwidth_gbs": copy_gbs,
                     "torch": torch.__version__, "jax": jax.__version__,
                     "method": "torch: triton.testing.do_bench median (events, L2 flushed); "
                               "jax: median of 9 batches of 50 pipelined calls (wall clock)",
                     "per_call_us_tiny_input": overhead, "results": rows})


if __name__ == "__main__":
    main()
