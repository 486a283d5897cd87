"""Does loading through TMA tensor descriptors pay for the grouped matmul's forward on Hopper?

    python scripts/probe_gmm_tma.py [--shapes 8,65536,4096,2048 ...] [--out PATH]

Our gmm kernel loads its tiles with pointer loads (``cp.async``), because jax-triton 0.3.1
passes no global scratch, which device-side descriptors need. jaxlib 0.11's ``TritonKernel``
takes a ``global_scratch_size``, so a launcher of our own could. This probe measures what that
would buy before building it: the same persistent schedule and tiles as ``gmm_kernel``, with
lhs and rhs read through ``tl.make_tensor_descriptor`` (rows of the next group inside a boundary
tile are read but never stored), optionally with Triton's warp specialization of the k loop,
against our kernel and ``torch._grouped_mm`` in the same run. torch-launched only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())

from bench_gmm_kernels import SHAPES  # noqa: E402  (this folder: the same shapes)
from benchmarks.common import gmm_shape, write_run  # noqa: E402
from triton_kernels.grouped_matmul import _first_selected, _group_end, _swizzle  # noqa: E402


@triton.jit
def _tile(a_desc, b_desc, out_ptr, start, rows, rhs_index, pm, pn, N: tl.constexpr, K: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS: tl.constexpr):
    first_row = start + pm * BLOCK_M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS):
        a = a_desc.load([first_row, k0])
        b = b_desc.load([rhs_index, k0, pn * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < rows - pm * BLOCK_M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + first_row.to(tl.int64) * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_tile(out_ptr, start, rows, pm, pn, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    first_row = start + pm * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < rows - pm * BLOCK_M)[:, None] & (offs_n < N)[None, :]
    ptrs = out_ptr + first_row.to(tl.int64) * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_N], out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _segment(a_desc, b_desc, out_ptr, tile, done, start, end, rhs_index, N: tl.constexpr, K: tl.constexpr,
             IS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr, WS: tl.constexpr):
    tiles_m = tl.cdiv(end - start, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    count = tiles_m * tiles_n
    while tile < done + count:
        pm, pn = _swizzle(tile - done, tiles_m, tiles_n, GROUP_M)
        if IS_ZERO:
            _zero_tile(out_ptr, start, end - start, pm, pn, N, BLOCK_M, BLOCK_N)
        else:
            _tile(a_desc, b_desc, out_ptr, start, end - start, rhs_index, pm, pn, N, K, BLOCK_M, BLOCK_N, BLOCK_K, WS)
        tile += tl.num_programs(0)
    return tile, done + count


@triton.jit
def gmm_tma_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m, out_ptr,
                   K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(lhs_ptr, shape=[m, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    # 3-D, so that a k tile past K reads zeros instead of the next expert's rows.
    b_desc = tl.make_tensor_descriptor(rhs_ptr, shape=[NUM_SELECTED, K, N], strides=[K * N, N, 1],
                                       block_shape=[1, BLOCK_K, BLOCK_N])
    g0, first_row = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
    tile = tl.program_id(0)
    done = tl.zeros([], tl.int32)
    row = first_row
    for i in range(0, NUM_SELECTED):
        end = _group_end(row, group_sizes_ptr, g0 + i, m, NUM_GROUPS)
        tile, done = _segment(a_desc, b_desc, out_ptr, tile, done, row, end, i, N, K, False,
                              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WS)
        row = end
    zero = tl.zeros([], tl.int32)
    tile, done = _segment(a_desc, b_desc, out_ptr, tile, done, zero, first_row, zero, N, K, True,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WS)
    _segment(a_desc, b_desc, out_ptr, tile, done, row, m, zero, N, K, True, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WS)


def _bench_shape(g: int, m: int, k: int, n: int, variants: list[dict]) -> list[dict]:
    import numpy as np
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.grouped_matmul import group_sizes
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import grouped_matmul as gm

    facts = device_facts(torch.device("cuda"))
    sizes = torch.from_numpy(group_sizes(m, g, "balanced", np.random.default_rng(0))).cuda()
    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * k * n
    rows = []

    def record(label, ms, **extra):
        rows.append({"shape": [g, m, k, n], "label": label, "ms": ms, "tflops": flops / ms / 1e9, **extra})
        print(json.dumps(rows[-1]), flush=True)

    plan = gm.gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", facts)
    c = plan.constexpr_dict
    ours = launch(plan, lhs, rhs, sizes, offset)[0]
    record("ours (pointer loads)", bench_torch(lambda: launch(plan, lhs, rhs, sizes, offset)),
           tile=[c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], plan.num_warps, plan.num_stages])
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    rhs_cm = rhs.transpose(1, 2).contiguous().transpose(1, 2)
    record("torch._grouped_mm", bench_torch(lambda: torch._grouped_mm(lhs, rhs_cm, offs=offs)))

    for v in variants:
        bm, bn, bk = v.get("bm", c["BLOCK_M"]), v.get("bn", c["BLOCK_N"]), v.get("bk", c["BLOCK_K"])
        warps, stages, ws = v.get("warps", plan.num_warps), v.get("stages", plan.num_stages), v.get("ws", False)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        programs = facts.num_sms

        def run():
            gmm_tma_kernel[(programs,)](lhs, rhs, sizes, offset, m, out, K=k, N=n, NUM_GROUPS=g, NUM_SELECTED=g,
                                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, WS=ws,
                                        num_warps=warps, num_stages=stages)
        label = f"tma {bm}x{bn}x{bk} w{warps} s{stages}" + (" ws" if ws else "")
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a probe records what fails to compile or run
            rows.append({"shape": [g, m, k, n], "label": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        same = bool(torch.equal(out, ours))
        record(label, bench_torch(run), bitwise_equal_to_ours=same)
    return rows


VARIANTS = [dict(), dict(stages=4), dict(ws=True), dict(bm=128, bn=128, warps=4, stages=4),
            dict(bm=128, bn=128, warps=8, stages=4, ws=True), dict(bm=128, bn=256, bk=64, warps=8, stages=4, ws=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=gmm_shape, default=SHAPES)
    parser.add_argument("--variants", type=json.loads, default=VARIANTS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = [row for s in args.shapes for row in _bench_shape(*s, args.variants)]
    if args.out:
        write_run(args.out, rows, triton=triton.__version__)


if __name__ == "__main__":
    main()
