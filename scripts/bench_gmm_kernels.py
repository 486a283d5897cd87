"""Kernel by kernel: the three grouped-matmul kernels of one bf16 training step, each plan
launched directly (no op dispatch), against torch._grouped_mm doing the same products.

    python scripts/bench_gmm_kernels.py [--shapes 64,32768,2048,1408 ...] [--routing skewed]
        [--label NAME] [--gmm-params JSON] [--tgmm-params JSON] [--out PATH]

Kernels: ``fwd`` (gmm, lhs [m, k] x rhs [g, k, n]), ``dlhs`` (gmm of the cotangent with rhs
transposed) and ``drhs`` (tgmm in the [m, k] layout). Each runs with the plan's default config,
then with every config of ``--gmm-params`` (forward) / ``--tgmm-params`` (drhs), a JSON list of
FwdParams dicts. The benchmark's inputs and routing (balanced unless ``--routing skewed``).
Prints one JSON row per kernel and config, with a digest of the default config's output bits,
so that two source trees (run the script from each) can be compared for speed and for
identical results.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the tree the script is run from, so that trees can be compared

from benchmarks.common import gmm_shape, write_run  # noqa: E402

SHAPES = [(8, 65536, 4096, 2048), (16, 32768, 7168, 2048), (16, 16384, 4096, 4096), (64, 32768, 2048, 1408),
          (128, 65536, 7168, 2048)]


def _digest(t) -> str:
    """Hash of a tensor's bits (16-bit elements)."""
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]


def _bench_shape(label: str, g: int, m: int, k: int, n: int, gmm_alts: list, tgmm_alts: list,
                 routing: str = "balanced") -> list[dict]:
    import numpy as np
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.grouped_matmul import group_sizes
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import grouped_matmul as gm
    from triton_kernels.params import FwdParams

    facts = device_facts(torch.device("cuda"))
    sizes = torch.from_numpy(group_sizes(m, g, routing, np.random.default_rng(0))).cuda()
    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    gen = torch.Generator("cuda").manual_seed(m * 131 + g)  # the same inputs in every tree, for the digests
    lhs, rhs, cot = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for s in ((m, k), (g, k, n), (m, n)))
    dt = "bfloat16"
    kernels = {
        "fwd": (lambda p: gm.gmm_plan(m, k, n, g, g, False, dt, dt, facts, p), (lhs, rhs, sizes, offset), gmm_alts),
        "dlhs": (lambda p: gm.gmm_plan(m, n, k, g, g, True, dt, dt, facts, p), (cot, rhs, sizes, offset), []),
        "drhs": (lambda p: gm.tgmm_plan(m, k, n, g, g, True, dt, dt, facts, p), (lhs, cot, sizes, offset), tgmm_alts),
    }
    rows = []
    for name, (make, args, alts) in kernels.items():
        for params in [None] + alts:
            row = {"label": label, "shape": [g, m, k, n], "routing": routing, "kernel": name, "params": params}
            try:
                plan = make(FwdParams.coerce(params) if params else None)
            except ValueError as e:  # e.g. does not fit shared memory
                row["error"] = str(e)
            else:
                out = launch(plan, *args)[0]
                c = plan.constexpr_dict
                ms = bench_torch(lambda: launch(plan, *args))
                tile = [c.get("BLOCK_M"), c["BLOCK_N"], c.get("BLOCK_K"), plan.num_warps, plan.num_stages]
                row.update(kernel_name=plan.name, tile=tile,
                           ms=ms, tflops=2 * m * k * n / ms / 1e9, digest=_digest(out) if params is None else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    rhs_cm = rhs.transpose(1, 2).contiguous().transpose(1, 2)  # the layout _grouped_mm wants
    baselines = {"fwd": lambda: torch._grouped_mm(lhs, rhs_cm, offs=offs),
                 "dlhs": lambda: torch._grouped_mm(cot, rhs.transpose(1, 2), offs=offs),
                 "drhs": lambda: torch._grouped_mm(lhs.t(), cot, offs=offs)}
    for name, fn in baselines.items():
        ms = bench_torch(fn)
        rows.append({"label": "torch._grouped_mm", "shape": [g, m, k, n], "routing": routing, "kernel": name, "ms": ms,
                     "tflops": 2 * m * k * n / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=gmm_shape, default=SHAPES)
    parser.add_argument("--routing", default="balanced", choices=["balanced", "skewed"])
    parser.add_argument("--label", default="current")
    parser.add_argument("--gmm-params", type=json.loads, default=[])
    parser.add_argument("--tgmm-params", type=json.loads, default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [row for s in args.shapes
            for row in _bench_shape(args.label, *s, args.gmm_params, args.tgmm_params, args.routing)]
    if args.out:
        write_run(args.out, rows, triton=triton.__version__)


if __name__ == "__main__":
    main()
