"""Do TMA loads pay for the grouped matmul's forward and d_lhs? (``gmm_kernel``'s ``TMA_LOAD``)

    python scripts/probe_gmm_tma.py [--shapes 8,65536,4096,2048 ...] [--rounds 3] [--out PATH]

On Hopper, where the launcher provides global scratch, ``gmm_plan`` reads lhs and rhs through
tensor descriptors (``TMA_LOAD``, ``grouped_matmul._tma_load``) instead of pointer loads
(``cp.async``). Each shape times, side by side for ``--rounds`` rounds (do_bench, L2 flushed,
bf16, balanced routing; the order reversed every other round): the plan as made (``plan``), the
same plan with ``TMA_LOAD`` off (``pointer loads``) and ``torch._grouped_mm`` on the same product,
for the forward (``fwd``: lhs [m, k] x rhs [g, k, n]) and the input gradient (``dlhs``: cot
[m, n] x rhs[g]^T). ``speed_over_pointer_loads`` is the pointer-load plan's time over each
method's within a round (median over rounds; > 1: faster), and the outputs are compared bitwise.
torch-launched only.

Earlier forms: ``probe_gmm_tma-nvidia-h100-80gb-hbm3.json`` (a copy of the kernel with
descriptor loads and register stores, forward only, methods timed one after another) and
``probe_gmm_tma-copy-nvidia-h200.json`` (a copy with descriptor loads and TMA stores against the
plan of the time, side by side, its variants on the plan's tile: ``tma 128x256x64 w8 s3`` is the
plan's own tile and stages).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import triton

sys.path.insert(0, os.getcwd())

from bench_gmm_kernels import SHAPES  # noqa: E402  (this folder: the same shapes)
from benchmarks.common import gmm_shape, write_run  # noqa: E402


def _probe_kernel(name: str, plan, args, baseline, rounds: int, flops: int, shape: list) -> dict:
    import torch

    from benchmarks.common import bench_torch
    from ejkernel_torch.launch import launch

    pointer = plan.with_constexprs(TMA_LOAD=False)  # the pointer-load kernel, same tile, stages and store
    c = plan.constexpr_dict
    outs = {"plan": launch(plan, *args)[0], "pointer loads": launch(pointer, *args)[0]}
    row = {"shape": shape, "kernel": name, "tile": [c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], plan.num_warps,
                                                    plan.num_stages],
           "grid": list(plan.grid), "tma_load": c["TMA_LOAD"], "tma_store": c["TMA_STORE"],
           "same_bits": bool(torch.equal(outs["plan"], outs["pointer loads"])), "ms": {}}
    timers = {"plan": lambda: launch(plan, *args), "pointer loads": lambda: launch(pointer, *args),
              "torch._grouped_mm": baseline}
    for r in range(rounds):  # side by side, the order reversed every other round
        for label in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            row["ms"].setdefault(label, []).append(bench_torch(timers[label], rep_ms=100))
    base = row["ms"]["pointer loads"]
    row["speed_over_pointer_loads"] = {label: statistics.median(p / t for p, t in zip(base, ts))
                                       for label, ts in row["ms"].items()}
    row["tflops"] = {label: flops / statistics.median(ts) / 1e9 for label, ts in row["ms"].items()}
    print(json.dumps(row), flush=True)
    return row


def _probe_shape(g: int, m: int, k: int, n: int, rounds: int) -> list[dict]:
    import numpy as np
    import torch

    from benchmarks.grouped_matmul import group_sizes
    from ejkernel_torch.launch import device_facts
    from triton_kernels import grouped_matmul as gm

    facts = device_facts(torch.device("cuda"))
    sizes = torch.from_numpy(group_sizes(m, g, "balanced", np.random.default_rng(0))).cuda()
    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    gen = torch.Generator("cuda").manual_seed(m * 131 + g)
    lhs, rhs, cot = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for s in ((m, k), (g, k, n), (m, n)))
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    rhs_cm = rhs.transpose(1, 2).contiguous().transpose(1, 2)  # the layout _grouped_mm wants
    dt, flops = "bfloat16", 2 * m * k * n
    return [
        _probe_kernel("fwd", gm.gmm_plan(m, k, n, g, g, False, dt, dt, facts), (lhs, rhs, sizes, offset),
                      lambda: torch._grouped_mm(lhs, rhs_cm, offs=offs), rounds, flops, [g, m, k, n]),
        _probe_kernel("dlhs", gm.gmm_plan(m, n, k, g, g, True, dt, dt, facts), (cot, rhs, sizes, offset),
                      lambda: torch._grouped_mm(cot, rhs.transpose(1, 2), offs=offs), rounds, flops, [g, m, k, n]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=gmm_shape, default=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [row for s in args.shapes for row in _probe_shape(*s, args.rounds)]
    if args.out:
        write_run(args.out, rows, triton=triton.__version__)


if __name__ == "__main__":
    main()
