"""Time the two grouped-matmul backward kernels on a CUDA GPU against torch._grouped_mm doing the
same products, with the heuristic config and candidate configs.

    python scripts/sweep_gmm_backward.py [--out PATH]

For out = gmm(lhs [m, k], rhs [g, k, n]) with cotangent dout [m, n] (bf16, balanced routing):
  d_lhs = gmm(dout, rhs, transpose_rhs=True)   vs  _grouped_mm(dout, rhs^T, offs)
  d_rhs = tgmm(lhs^T, dout) (lhs read as [m, k]) vs  _grouped_mm(lhs^T, dout, offs)
Prints and writes milliseconds per config and the ratio to _grouped_mm (> 1: ours faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = [(8, 65536, 4096, 2048), (16, 32768, 7168, 2048), (64, 32768, 2048, 1408), (128, 65536, 7168, 2048)]
# (blocksize_m, blocksize_n, blocksize_k, warps, stages); 0 stages: the most that fit.
D_LHS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3)]
# tgmm: blocksize_k x blocksize_n is the output tile, blocksize_m the rows summed per step.
D_RHS = [(64, 128, 128, 8, 0), (64, 256, 128, 8, 3), (64, 128, 256, 8, 3), (32, 256, 128, 8, 4),
         (64, 128, 128, 4, 0), (128, 128, 128, 8, 3), (64, 256, 256, 8, 2)]


def _label(cfg) -> str:
    return "{}x{}x{}-w{}-s{}".format(*cfg)


def _params(cfg):
    from triton_kernels.params import FwdParams

    bm, bn, bk, warps, stages = cfg
    return FwdParams(blocksize_m=bm, blocksize_n=bn, blocksize_k=bk, num_warps=warps, num_stages=stages or None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    from benchmarks.common import bench_torch, try_time
    from ejkernel_torch.ops.grouped_matmul import _encode, _gmm, _tgmm
    rows = []
    for g, m, k, n in SHAPES:
        gs = torch.full((g,), m // g, dtype=torch.int32, device="cuda")
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32, device="cuda")
        lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        dout = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        rhs_t_cm = rhs.transpose(1, 2)  # [g, n, k] view: column-major per expert, as _grouped_mm wants
        times, errors = {}, {}
        try_time(times, errors, "d_lhs/_grouped_mm", lambda: bench_torch(lambda: torch._grouped_mm(dout, rhs_t_cm, offs=offs)))
        try_time(times, errors, "d_rhs/_grouped_mm", lambda: bench_torch(lambda: torch._grouped_mm(lhs.t(), dout, offs=offs)))
        for cfg in [None] + D_LHS:
            enc = None if cfg is None else _encode(_params(cfg))
            try_time(times, errors, f"d_lhs/{_label(cfg) if cfg else 'heuristic'}",
                     lambda: bench_torch(lambda: _gmm(dout, rhs, gs, zero, True, torch.bfloat16, enc)))
        for cfg in [None] + D_RHS:
            enc = None if cfg is None else _encode(_params(cfg))
            try_time(times, errors, f"d_rhs/{_label(cfg) if cfg else 'heuristic'}",
                     lambda: bench_torch(lambda: _tgmm(lhs, dout, gs, zero, g, True, torch.bfloat16, enc)))
        ratios = {name: times[f"{name.split('/')[0]}/_grouped_mm"] / ms for name, ms in times.items()
                  if "_grouped_mm" not in name and f"{name.split('/')[0]}/_grouped_mm" in times}
        row = {"experts": g, "tokens": m, "k": k, "n": n, "ms": times, "vs_grouped_mm": ratios, "errors": errors}
        rows.append(row)
        print(json.dumps({"shape": [g, m, k, n], **{n_: round(r, 3) for n_, r in ratios.items()},
                          "grouped_mm_ms": {p: round(times.get(f"{p}/_grouped_mm", 0), 3) for p in ("d_lhs", "d_rhs")},
                          "errors": {e: v[:150] for e, v in errors.items()}}), flush=True)
        lhs = rhs = dout = rhs_t_cm = None  # free this shape's tensors (the view holds rhs) before the next
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
