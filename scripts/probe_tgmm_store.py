"""How much of the weight-gradient kernel's time is its output store? (tgmm, the training layout)

    python scripts/probe_tgmm_store.py [--shapes 64,32768,2048,1408 ...] [--out PATH]

The grouped weight gradient writes one [k, n] tile per expert: 369 MB of bf16 at 64 experts x
2048 x 1408, where a dense weight gradient writes 5.8 MB; each 128x256 output tile sums only
eight 64-row steps before its store. This probe times ``tgmm_kernel``'s schedule (``[m, k]``
lhs, one problem) three ways, side by side (do_bench, L2 flushed, bf16, balanced routing):

* ``registers``: the plan with ``TMA_STORE`` off (``tl.store`` from registers), as made for a
  front whose launcher provides no global scratch;
* ``tma``: the plan as made for this GPU with default params given (which keep the Triton
  kernel), storing through a tensor descriptor on Hopper (a TMA store from shared memory, left
  in flight while the next tile's loads run);
* ``gluon``: the plan the op runs on an sm_90 GPU with Gluon, ``tgmm_gluon_kernel`` (a loader
  warp runs ahead across tiles; TMA loads and stores), where ``uses_gluon_tgmm`` picks it;
* ``no-store``: the same walk and products with the store behind a branch never taken (a floor,
  not a result).

The plans' outputs are compared bitwise with the register store's. (The JSONs of the first runs, from an earlier form
of this probe whose own kernel also stored both ways, name the modes ``store`` and
``tma-store``; ``plan`` there is the plan of the time.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import gmm_shape, write_run  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from triton_kernels.grouped_matmul import _first_selected, _group_end, _tgmm_acc  # noqa: E402


@triton.jit
def no_store_tgmm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, group_offset_ptr, m, out_ptr,
                         K: tl.constexpr, N: tl.constexpr, NUM_GROUPS: tl.constexpr, NUM_SELECTED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    # tgmm_kernel's walk for one problem with lhs [m, K] (LHS_MK); the store is compiled, not run
    g0, start = _first_selected(group_sizes_ptr, group_offset_ptr, m, NUM_GROUPS, NUM_SELECTED)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tl.cdiv(K, BLOCK_K) * tiles_n
    current = tl.zeros([], tl.int32)
    end = _group_end(start, group_sizes_ptr, g0, m, NUM_GROUPS)
    for tile in range(tl.program_id(0), NUM_SELECTED * per_group, tl.num_programs(0)):
        index = tile // per_group
        while current < index:
            current += 1
            start = end
            end = _group_end(start, group_sizes_ptr, g0 + current, m, NUM_GROUPS)
        local = tile - index * per_group
        pk, pn = local // tiles_n, local % tiles_n
        acc = _tgmm_acc(lhs_ptr, rhs_ptr, m, start, end - start, pk, pn, K, N, True, BLOCK_M, BLOCK_N, BLOCK_K,
                        DOT_PRECISION)
        if pk < 0:  # never
            offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
            offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + tl.cast(index, tl.int64) * (K * N) + offs_k[:, None] * N + offs_n[None, :]
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


def _probe_shape(g: int, m: int, k: int, n: int) -> dict:
    import numpy as np
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.grouped_matmul import group_sizes
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import grouped_matmul as gm
    from triton_kernels.params import FwdParams

    facts = device_facts(torch.device("cuda"))
    sizes = torch.from_numpy(group_sizes(m, g, "balanced", np.random.default_rng(0))).cuda()
    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    gen = torch.Generator("cuda").manual_seed(m * 131 + g)
    lhs, cot = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) for s in ((m, k), (m, n)))
    plans = {"registers": gm.tgmm_plan(m, k, n, g, g, True, "bfloat16", "bfloat16",
                                       dataclasses.replace(facts, gluon=False)),
             "tma": gm.tgmm_plan(m, k, n, g, g, True, "bfloat16", "bfloat16", facts, FwdParams())}
    if gm.uses_gluon_tgmm(m, k, n, g, True, "bfloat16", "bfloat16", facts):
        plans["gluon"] = gm.tgmm_plan(m, k, n, g, g, True, "bfloat16", "bfloat16", facts)
    plan = plans["registers"]
    c = plan.constexpr_dict
    outs = {name: launch(p, lhs, cot, sizes, offset)[0] for name, p in plans.items()}
    out = torch.empty_like(outs["registers"])
    row = {"shape": [g, m, k, n], "tile": [c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], plan.num_warps, plan.num_stages],
           "tma_store": plans["tma"].constexpr_dict["TMA_STORE"],
           "same_bits": {name: bool(torch.equal(outs["registers"], o)) for name, o in outs.items() if name != "registers"},
           "max_abs_diff": {name: float((outs["registers"].float() - o.float()).abs().max()) for name, o in outs.items()},
           "ms": {}}
    timers = {name: (lambda p=p: launch(p, lhs, cot, sizes, offset)) for name, p in plans.items()}
    timers["no-store"] = lambda: no_store_tgmm_kernel[plan.grid](
        lhs, cot, sizes, offset, m, out, K=k, N=n, NUM_GROUPS=g, NUM_SELECTED=g, BLOCK_M=c["BLOCK_M"],
        BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], DOT_PRECISION=c["DOT_PRECISION"], num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    for _ in range(2):  # two rounds, side by side
        for name, fn in timers.items():
            row["ms"].setdefault(name, []).append(bench_torch(fn))
    flops = 2 * m * k * n
    row["tflops"] = {name: [flops / (t * 1e-3) / 1e12 for t in ts] for name, ts in row["ms"].items()}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=gmm_shape,
                        default=[(64, 32768, 2048, 1408), (128, 16384, 2048, 1408), (8, 65536, 4096, 2048)])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [_probe_shape(*s) for s in args.shapes]
    if args.out:
        write_run(args.out, rows, triton=triton.__version__)


if __name__ == "__main__":
    main()
