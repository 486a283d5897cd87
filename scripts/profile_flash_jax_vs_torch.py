"""What the GPU runs for one flash-attention call launched from torch and from jax.

Both fronts launch the same compiled kernels, so any gap between their wall-clock times is either
other device work (a copy, a fill, a layout change one front adds) or host and clock effects.
This script tells them apart: it records each call's kernels with torch's profiler (CUPTI sees
the whole process, so XLA's launches too) and prints, per shape and front, every kernel's
device time per call, their sum, and the busy span from the first kernel's start to the last's
end over the calls (idle gaps between launches show up as span > sum).

While a profiler records, the torch front takes its registered-op path, not the plain-eager one
(``ejkernel_torch.launch.plain_eager``: the profiler's traces keep showing the ops), so its
unused inputs are fresh one-element tensors, six fill kernels a call, and its host cost is that
path's plus the profiler's: compare the flash kernel's own time, and read torch's span as an
upper bound.

    PYTHONPATH=. python scripts/profile_flash_jax_vs_torch.py [--seqs 1024 4096] [--head-dims 64 128]
        [--causal false true] [--phases fwd fwd+bwd] [--out FILE]

Prints one JSON line per shape, front and phase.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CALLS = 20


def _calls(seq, head_dim, causal, dtype, phase):
    """(front, callable, wait) for ours from torch and from jax, on the benchmark's shapes."""
    import jax
    import jax.numpy as jnp
    import torch

    import ejkernel_jax
    import ejkernel_torch
    from benchmarks.common import value_and_pullback
    from benchmarks.flash_attention import HIDDEN, TOKENS, _inputs

    batch, heads = max(1, TOKENS // seq), HIDDEN // head_dim
    arrays = _inputs(batch, seq, heads, head_dim)
    q, k, v, do = (torch.from_numpy(a).to("cuda", getattr(torch, dtype)) for a in arrays)
    qj, kj, vj, doj = (jnp.asarray(a).astype(dtype) for a in arrays)
    torch_fn = lambda a, b, c: ejkernel_torch.flash_attention(a, b, c, causal=causal)  # noqa: E731
    jax_fn = lambda a, b, c: ejkernel_jax.flash_attention(a, b, c, causal=causal)  # noqa: E731
    if phase == "fwd":
        jitted = jax.jit(jax_fn)
        yield "torch", lambda: torch_fn(q, k, v), lambda _: torch.cuda.synchronize()
        yield "jax", lambda: jitted(qj, kj, vj), jax.block_until_ready
    else:
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        step = jax.jit(lambda a, b, c, d: value_and_pullback(jax_fn, (a, b, c), d))
        yield "torch", lambda: torch.autograd.grad(torch_fn(qg, kg, vg), (qg, kg, vg), do), \
            lambda _: torch.cuda.synchronize()
        yield "jax", lambda: step(qj, kj, vj, doj), jax.block_until_ready


def profile(fn, wait) -> dict:
    """Kernels of ``CALLS`` back-to-back calls: device us per call by kernel name, their sum, and
    the busy span per call."""
    from benchmarks.common import profiled_kernels

    for _ in range(3):
        wait(fn())
    kernels = profiled_kernels(fn, CALLS, wait)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / CALLS
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / CALLS if kernels else 0
    return {"kernels_per_call": len(kernels) / CALLS, "device_us": sum(by_name.values()), "span_us": span,
            "by_kernel_us": {name[:80]: round(us, 2) for name, us in sorted(by_name.items(), key=lambda x: -x[1])}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dims", nargs="*", type=int, default=[64, 128])
    parser.add_argument("--seqs", nargs="*", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="*", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--phases", nargs="*", default=["fwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for d in args.head_dims:
        for seq in args.seqs:
            for causal in args.causal:
                for phase in args.phases:
                    fronts = {}
                    for front, fn, wait in _calls(seq, d, causal == "true", args.dtype, phase):
                        fronts[front] = profile(fn, wait)
                    row = {"head_dim": d, "seq": seq, "causal": causal == "true", "phase": phase,
                           "dtype": args.dtype, **fronts}
                    if fronts["torch"]["device_us"] and fronts["jax"]["device_us"]:
                        row["jax/torch device"] = fronts["jax"]["device_us"] / fronts["torch"]["device_us"]
                        row["jax/torch span"] = fronts["jax"]["span_us"] / fronts["torch"]["span_us"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows, calls_per_profile=CALLS)


if __name__ == "__main__":
    main()
