"""Where a back-to-back flash forward's GPU time goes: the kernels, and the gaps between them.

A forward call of ours is two kernels on the stream (the tile counter's zero fill, where the plan
claims tiles, then the flash kernel), cuDNN's one or more. In a loop of back-to-back calls the
GPU time per call is the kernels' time plus the idle gaps between them: a kernel boundary costs
the GPU a few microseconds, and a host that issues calls slower than the GPU runs them leaves it
idle (and a kernel that starts on an idle GPU runs slower: ``probe_flash_builds.py --idle-us``).
This probe records ``--calls`` back-to-back forward calls of ours and of SDPA's cuDNN backend
with torch's profiler and reports per call: the span (first kernel's start to the last's end,
over the calls), the kernels' busy time, the idle rest, each kernel's mean duration, the idle
gap before each kernel name; and, without the profiler, the host time to issue a call.

With ``--jax`` it records the same for ours and cuDNN (``jax.nn.dot_product_attention``) launched
from jax, a jitted call each, and for ours as one jitted program of ``--calls`` chained calls
(``benchmarks.flash_attention.chained_program``): what the GPU does per call from each front, with
no wall-clock wait in the figures (the benchmark's jax-over-torch ratios carry a cost per batch).

Under a profiler our public function normally takes the registered op's path (its traces show
the ops), whose host cost is several times the plain eager path's; this probe times the plain
eager path, as it runs without a profiler (``plain_eager`` is told to ignore the profiler here).

    python scripts/probe_flash_gaps.py [--shapes 1024:64:causal 1024:128:causal] [--calls 50]
        [--repeats 5] [--jax] [--out FILE]

Shapes are the benchmark's (bf16, batch x seq = 16k tokens, heads = 2048 / head_dim).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.common import flash_shape, profiled_kernels  # noqa: E402


def plain_eager_under_the_profiler() -> None:
    """Let ``plain_eager`` answer as if no profiler were recording (the rest of its test kept)."""
    from ejkernel_torch import launch as launch_mod

    launch_mod._profiling = lambda: False


def timeline(fn, calls: int, per_call: int = 1, wait=lambda out: None) -> dict:
    """Kernels of ``calls`` back-to-back calls of ``fn`` (each making ``per_call`` attention
    calls), then ``wait(last output)``: span, busy and idle microseconds per attention call, mean
    duration and median idle gap before each kernel (by name)."""
    for _ in range(5):
        wait(fn())
    kernels = profiled_kernels(fn, calls, wait)
    calls *= per_call
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / calls
    busy = sum(e.time_range.elapsed_us() for e in kernels) / calls
    durations: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for before, e in zip([None, *kernels], kernels):
        name = e.name[:60]
        durations.setdefault(name, []).append(e.time_range.elapsed_us())
        if before is not None:
            gaps.setdefault(name, []).append(e.time_range.start - before.time_range.end)
    return {"kernels_per_call": len(kernels) / calls, "span_us": round(span, 2), "busy_us": round(busy, 2),
            "idle_us": round(span - busy, 2),
            "kernel_us": {n: round(statistics.mean(d), 2) for n, d in durations.items()},
            "median_gap_before_us": {n: round(statistics.median(g), 2) for n, g in gaps.items()}}


def host_us(fn, calls: int, per_call: int = 1) -> float:
    """Host microseconds to issue one attention call, ``calls`` calls of ``fn`` (each making
    ``per_call``) from an idle GPU, not waited for (median of 5); ``torch.cuda.synchronize`` waits
    for the whole device, jax's streams too."""
    import torch

    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / (calls * per_call))
    torch.cuda.synchronize()
    return round(statistics.median(samples), 2)


class Front(NamedTuple):
    """One way of calling: ``fn`` makes ``per_call`` attention calls; ``wait`` waits for its output."""
    fn: Callable
    per_call: int = 1
    wait: Callable = lambda out: None


def torch_fronts(q, k, v, causal) -> dict[str, Front]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ejkernel_torch

    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return {"ours": Front(lambda: ejkernel_torch.flash_attention(q, k, v, causal=causal)), "cudnn": Front(cudnn)}


def jax_fronts(arrays, causal, calls: int) -> dict[str, Front]:
    """Ours and cuDNN from jax, a jitted call each, and ours as one program of ``calls`` calls."""
    import jax
    import jax.numpy as jnp

    import ejkernel_jax
    from benchmarks.flash_attention import chained_program

    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in arrays)
    ours = lambda a, b, c: ejkernel_jax.flash_attention(a, b, c, causal=causal)  # noqa: E731
    cudnn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="cudnn"))
    jitted, program = jax.jit(ours), chained_program(ours, calls)
    wait = jax.block_until_ready
    return {"ours_jax": Front(lambda: jitted(q, k, v), wait=wait),
            "ours_jax_program": Front(lambda: program(q, k, v), calls, wait),
            "cudnn_jax": Front(lambda: cudnn(q, k, v), wait=wait)}


def row(seq: int, head_dim: int, causal: bool, calls: int, repeats: int, with_jax: bool) -> dict:
    import torch

    from benchmarks.flash_attention import HIDDEN, TOKENS, _inputs

    batch, heads = max(1, TOKENS // seq), HIDDEN // head_dim
    arrays = _inputs(batch, seq, heads, head_dim)[:3]
    q, k, v = (torch.from_numpy(a).to("cuda", torch.bfloat16) for a in arrays)
    fronts = torch_fronts(q, k, v, causal)
    if with_jax:
        fronts.update(jax_fronts(arrays, causal, calls))
    result = {"seq": seq, "head_dim": head_dim, "causal": causal, "batch": batch, "heads": heads}
    samples = {name: [] for name in fronts}
    for _ in range(repeats):  # in turn, so all meet the same clocks
        for name, front in fronts.items():
            samples[name].append(timeline(front.fn, max(1, calls // front.per_call), front.per_call, front.wait))
    for name, front in fronts.items():
        runs = samples[name]
        best = min(runs, key=lambda r: r["span_us"])
        result[name] = {"span_us_median": statistics.median(r["span_us"] for r in runs),
                        "busy_us_median": statistics.median(r["busy_us"] for r in runs),
                        "idle_us_median": statistics.median(r["idle_us"] for r in runs),
                        "run_with_the_shortest_span": best,
                        "host_us_per_call": host_us(front.fn, max(1, calls // front.per_call), front.per_call)}
    for a, b in [("ours", "cudnn"), ("ours_jax", "ours"), ("ours_jax_program", "ours"), ("cudnn_jax", "cudnn")]:
        if a in result and b in result:
            for what in ("span", "busy"):
                result[f"{a} {what} / {b} {what}"] = round(
                    result[a][f"{what}_us_median"] / result[b][f"{what}_us_median"], 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=flash_shape,
                        default=[flash_shape(s) for s in ("1024:64:causal", "1024:128:causal", "1024:64:full")],
                        help="seq:head_dim:causal|full")
    parser.add_argument("--calls", type=int, default=50, help="back-to-back calls a profiled loop")
    parser.add_argument("--repeats", type=int, default=5, help="profiled loops of each front, in turn")
    parser.add_argument("--jax", action="store_true", help="also ours and cuDNN launched from jax")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    plain_eager_under_the_profiler()
    rows = []
    for seq, head_dim, causal in args.shapes:
        rows.append(row(seq, head_dim, causal, args.calls, args.repeats, args.jax))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows, calls=args.calls, repeats=args.repeats)


if __name__ == "__main__":
    main()
