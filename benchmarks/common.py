"""Timing helpers shared by the benchmarks (GPU: device events for torch, pipelined wall clock
for jax, whose work runs on its own stream)."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time


def bench_torch(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds per call, CUDA events around each call, L2 flushed between calls."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_jax(fn, *args, calls: int = 50, repeats: int = 9) -> float:
    """Median milliseconds per call over ``repeats`` batches of ``calls`` back-to-back calls
    (``fn`` may return a pytree: every leaf is waited for)."""
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(samples)


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name().replace(" ", "-").lower()
    except ImportError:
        pass
    return "cpu-" + platform.machine()


def copy_bandwidth_gbs(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), torch on CUDA."""
    import torch

    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_torch(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
