"""Kernel-by-kernel CUDA time of one grouped-matmul training step (forward + both gradients)
from torch, ours against torch._grouped_mm, to see where a fwd+bwd gap comes from.

    python scripts/profile_gmm_step.py [--shapes 8,65536,4096,2048 128,65536,7168,2048] [--out PATH]

bf16, balanced routing, the benchmark's inputs (benchmarks/grouped_matmul.py). Per method: the
step's median time (triton.testing.do_bench), and the profiler's per-kernel CUDA time averaged
over the profiled steps; their sum against the step time shows idle gaps between kernels, and
the host time to issue a step shows whether the launches keep up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import gmm_shape, write_run  # noqa: E402

STEPS = 10


def _kernel_times(step) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    # do_bench clears the L2 cache before every call: so do the profiled steps (the flush
    # kernel is left out of the sums).
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0 and "FillFunctor<signed char>" not in event.key:
            key = event.key[:90]  # templated names can share a prefix: add them up
            times[key] = times.get(key, 0.0) + us / STEPS / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _host_ms(step) -> float:
    """Median host time to issue one step (no sync inside): above the step time, the GPU waits."""
    import statistics
    import time

    import torch

    samples = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _profile_shape(g: int, m: int, k: int, n: int) -> dict:
    import numpy as np
    import torch

    import ejkernel_torch
    from benchmarks.common import bench_torch
    from benchmarks.grouped_matmul import group_sizes

    rng = np.random.default_rng(0)
    sizes = torch.from_numpy(group_sizes(m, g, "balanced", rng)).cuda()
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rhs_cm = rhs.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    cot = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    methods = {
        "ours_unchecked": lambda: torch.autograd.grad(
            ejkernel_torch.grouped_matmul(lhs, rhs, sizes, check_values=False), (lhs, rhs), cot),
        "torch._grouped_mm": lambda: torch.autograd.grad(torch._grouped_mm(lhs, rhs_cm, offs=offs), (lhs, rhs_cm), cot),
    }
    result = {"shape": {"experts": g, "tokens": m, "k": k, "n": n}}
    for name, step in methods.items():
        kernels = _kernel_times(step)
        result[name] = {"step_ms": bench_torch(step), "kernel_ms_sum": sum(kernels.values()),
                        "host_ms": _host_ms(step), "kernels_ms": kernels}
        print(name, json.dumps(result[name]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=gmm_shape, default=[(8, 65536, 4096, 2048), (128, 65536, 7168, 2048)])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [_profile_shape(*s) for s in args.shapes]
    if args.out:
        write_run(args.out, rows)


if __name__ == "__main__":
    main()
