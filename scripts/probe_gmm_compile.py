"""Does torch.compile cost the grouped matmul anything? Eager forward, eager forward + backward,
and the same step compiled (inductor, fullgraph), on balanced MoE shapes.

torch.compile launches the kernels through ``wrap_triton``, which copies every input its TTIR
analysis takes as written before each launch (tests/test_compile_mutations.py). When the gmm
kernel looked like it wrote lhs and rhs, the compiled step took 1.06-1.78x the eager one's time
on an H200. Run it once per version of the kernels to compare them (PYTHONPATH picks
``triton_kernels``):

    PYTHONPATH=. python scripts/probe_gmm_compile.py [--label after] [--no-compile]

Prints one JSON line: median ms per shape (``triton.testing.do_bench``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = ((8, 65536, 4096, 2048), (64, 32768, 2048, 1408), (128, 16384, 4096, 2048))  # experts, tokens, k, n


def _times(g: int, m: int, k: int, n: int, compile_too: bool) -> dict:
    import torch
    import triton

    import ejkernel_torch as ejk

    sizes = torch.full((g,), m // g, dtype=torch.int32, device="cuda")
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rhs = (torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5).requires_grad_()
    dout = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def gmm(a, b):
        return ejk.grouped_matmul(a, b, sizes, check_values=False)

    def step(fn):
        torch.autograd.grad(fn(lhs, rhs), (lhs, rhs), dout)

    row = {}
    with torch.no_grad():
        row["fwd"] = triton.testing.do_bench(lambda: gmm(lhs, rhs), warmup=25, rep=200)
    row["fwd_bwd"] = triton.testing.do_bench(lambda: step(gmm), warmup=25, rep=200)
    if compile_too:
        compiled = torch.compile(gmm, fullgraph=True)
        step(compiled)  # compile outside the timing
        row["compiled_fwd_bwd"] = triton.testing.do_bench(lambda: step(compiled), warmup=25, rep=200)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="", help="a name for this run in the output")
    parser.add_argument("--no-compile", action="store_true", help="eager timings only")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("probe_gmm_compile.py needs a CUDA GPU")
    import triton_kernels

    torch.manual_seed(0)
    result = {"label": args.label, "kernels": os.path.dirname(triton_kernels.__file__)}
    for g, m, k, n in SHAPES:
        result[f"g{g} m{m} k{k} n{n}"] = _times(g, m, k, n, not args.no_compile)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
