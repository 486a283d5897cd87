"""Sweep softmax forward tilings on a GPU (num_warps x rows per program) to pick the plan's
heuristic. Prints the best per (dtype, n_cols) as a fraction of copy bandwidth."""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import bench_torch, copy_bandwidth_gbs
from ejkernel_torch.launch import device_facts, launch
from triton_kernels.softmax import softmax_fwd_plan


WARPS = [int(w) for w in os.environ.get("TUNE_WARPS", "1,2,4,8,16,32").split(",")]
ROWS = [int(r) for r in os.environ.get("TUNE_ROWS", "1,2,4,8,16,32").split(",")]
PER_SM = [int(p) for p in os.environ.get("TUNE_PER_SM", "0").split(",")]  # 0: one program per block
DTYPES = os.environ.get("TUNE_DTYPES", "float32,bfloat16").split(",")
COLS = [int(c) for c in os.environ.get("TUNE_COLS", "128,512,1024,2048,4096,8192,16384,32768").split(",")]


def variants(plan):
    consts = plan.constexpr_dict
    for warps in WARPS:
        for rows in ROWS:
            if consts["BLOCK_N"] * rows > 65536 or consts["BLOCK_N"] * rows < 32 * warps:
                continue
            rows_plan = plan.with_constexprs(BLOCK_M=rows)
            blocks = -(-plan.scalar_dict["n_rows"] // rows)
            for per_sm in PER_SM:
                grid = min(blocks, 132 * per_sm) if per_sm else blocks
                yield dataclasses.replace(rows_plan, grid=(grid,), num_warps=warps), (warps, rows, per_sm)


def main():
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configured by environment variables (comma-separated lists):\n"
               "  TUNE_WARPS, TUNE_ROWS, TUNE_PER_SM (0: one program per block), TUNE_DTYPES, TUNE_COLS;\n"
               "  OUT: directory for tune_softmax.json (default .)").parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    copy = copy_bandwidth_gbs()
    results = []
    for dtype in DTYPES:
        for n_cols in COLS:
            x = torch.randn(4096, n_cols, device="cuda").to(getattr(torch, dtype))
            base = softmax_fwd_plan(4096, n_cols, dtype, device_facts(x.device))
            best = None
            for plan, knobs in variants(base):
                ms = bench_torch(lambda: launch(plan, x), rep_ms=20)
                gbs = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
                if best is None or gbs > best[0]:
                    best = (gbs, knobs)
            cur_ms = bench_torch(lambda: launch(base, x), rep_ms=20)
            cur = 2 * x.numel() * x.element_size() / (cur_ms * 1e-3) / 1e9
            results.append(dict(dtype=dtype, n_cols=n_cols, best_gbs=best[0], best_warps_rows=best[1],
                                current_gbs=cur, current=(base.num_warps, base.constexpr_dict["BLOCK_M"])))
            print(f"{dtype:9s} {n_cols:6d} best {best[0]:6.0f} GB/s ({best[0] / copy:.0%}) warps,rows={best[1]}  "
                  f"current {cur:6.0f} ({cur / copy:.0%}) {results[-1]['current']}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "tune_softmax.json"), "w") as f:
        json.dump({"copy_gbs": copy, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
