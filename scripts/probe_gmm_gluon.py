"""Probe: the Gluon gmm kernel's ring and tile choices against gmm_kernel and torch._grouped_mm,
kernel by kernel (forward and d_lhs), on a CUDA GPU.

    python scripts/probe_gmm_gluon.py [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.getcwd())

SHAPES = [(8, 65536, 4096, 2048), (16, 32768, 7168, 2048), (16, 16384, 4096, 4096), (64, 32768, 2048, 1408),
          (128, 65536, 7168, 2048)]
VARIANTS = [(256, 64, 4), (256, 64, 3), (256, 32, 8), (128, 64, 6), (128, 128, 3)]  # (BLOCK_N, BLOCK_K, STAGES)


def _variant(plan, bn, bk, stages):
    c = dict(plan.constexprs)
    c.update(BLOCK_N=bn, BLOCK_K=bk, STAGES=stages)
    return dataclasses.replace(plan, constexprs=tuple(c.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import numpy as np
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.grouped_matmul import group_sizes
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import grouped_matmul as gm

    facts = device_facts(torch.device("cuda"))
    rows = []
    for g, m, k, n in SHAPES:
        sizes = torch.from_numpy(group_sizes(m, g, "balanced", np.random.default_rng(0))).cuda()
        offset = torch.zeros(1, dtype=torch.int32, device="cuda")
        lhs, rhs, cot = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((m, k), (g, k, n), (m, n)))
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        rhs_cm = rhs.transpose(1, 2).contiguous().transpose(1, 2)
        kernels = {"fwd": ((m, k, n, False), (lhs, rhs, sizes, offset), lambda: torch._grouped_mm(lhs, rhs_cm, offs=offs)),
                   "dlhs": ((m, n, k, True), (cot, rhs, sizes, offset),
                            lambda: torch._grouped_mm(cot, rhs.transpose(1, 2), offs=offs))}
        for name, ((mm, kk, nn, t), inputs, baseline) in kernels.items():
            def row(label, ms):
                rows.append(dict(shape=[g, m, k, n], kernel=name, label=label, ms=ms, tflops=2 * m * k * n / ms / 1e9))
                print(json.dumps(rows[-1]), flush=True)

            row("torch._grouped_mm", bench_torch(baseline))
            triton_plan = gm.gmm_plan(mm, kk, nn, g, g, t, "bfloat16", "bfloat16", facts, gm.FwdParams(blocksize_m=128))
            row("gmm_kernel", bench_torch(lambda: launch(triton_plan, *inputs)))
            gluon = gm._gluon_gmm_plan(mm, kk, nn, g, g, t, "bfloat16", "bfloat16", facts)
            for bn, bk, stages in VARIANTS:
                plan = _variant(gluon, bn, bk, stages)
                try:
                    ms = bench_torch(lambda: launch(plan, *inputs))
                except Exception as e:  # a variant that does not fit
                    print(name, bn, bk, stages, type(e).__name__, str(e)[:200])
                    continue
                row(f"gluon {bn}x{bk} s{stages}", ms)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
