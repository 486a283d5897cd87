"""Time the flash backward's delta kernel (rowsum(O * dO), what the Gluon dq reads) over its tiles.

Delta reads O and dO once: at 16k tokens x 2048 channels that is 134 MB, so its floor is the
copy bandwidth. Each variant is the plan's with another rows-a-program tile (``BLOCK_M``, the
grid follows) and warp count; its output must equal the plan's bit for bit (same sums: one row
is one program's, whatever the tile). Also times torch's own ``(o.float() * do.float()).sum(-1)``
and reports each as the achieved GB/s.

    python scripts/probe_flash_delta.py [--shapes 1024:128 16384:64] [--dtype bfloat16] [--out FILE]

A shape is seq:head_dim, batch x seq = 16k tokens, heads = 2048 / head_dim.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TILES = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]


def parse_shape(text: str) -> tuple[int, int]:
    try:
        seq, head_dim = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seq:head_dim, got {text!r}") from None
    return seq, head_dim


def variant(plan, block_m: int, warps: int):
    """``plan`` with ``block_m`` rows a program (its grid's first axis follows) and ``warps``."""
    extent = plan.grid[0] * plan.constexpr_dict["BLOCK_M"]  # rows the plan's grid covers, rounded up
    grid = (-(-extent // block_m), *plan.grid[1:])
    return dataclasses.replace(plan.with_constexprs(BLOCK_M=block_m), grid=grid, num_warps=warps)


def probe(seq: int, head_dim: int, dtype_name: str) -> list[dict]:
    import torch

    from benchmarks.common import bench_torch
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import flash_attention as fa

    batch, heads = max(1, 16384 // seq), 2048 // head_dim
    dtype = getattr(torch, dtype_name)
    o, do = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    spec = fa.dense_spec(o.shape, o.shape, o.shape, (dtype_name,) * 3)
    plan = fa.plan.delta_plan(spec, device_facts(o.device))
    dummy = torch.zeros(1, device="cuda", dtype=torch.int32)
    args = (o, do, torch.zeros(1, device="cuda"), dummy, dummy)
    want = launch(plan, *args)[0]
    gigabytes = 2 * o.numel() * o.element_size() / 1e9
    rows = []

    def row(name, fn, equal=None):
        ms = bench_torch(fn)
        rows.append({"seq": seq, "head_dim": head_dim, "dtype": dtype_name, "variant": name, "ms": ms,
                     "gb_per_s": gigabytes / ms * 1e3, "bitwise_equal_to_plan": equal})
        print(json.dumps(rows[-1]), flush=True)

    row(f"plan BLOCK_M={plan.constexpr_dict['BLOCK_M']} warps={plan.num_warps}", lambda: launch(plan, *args), True)
    for block_m, warps in TILES:
        candidate = variant(plan, block_m, warps)
        got = launch(candidate, *args)[0]
        row(f"BLOCK_M={block_m} warps={warps}", lambda: launch(candidate, *args), bool(torch.equal(got, want)))
    row("torch (o.float() * do.float()).sum(-1)", lambda: (o.float() * do.float()).sum(-1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(1024, 128), (16384, 64)])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [r for seq, head_dim in args.shapes for r in probe(seq, head_dim, args.dtype)]
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows)


if __name__ == "__main__":
    main()
