"""The batched grouped matmul with one rhs for every problem (what vmap with shared expert
weights launches), timed from the source tree the script is run from, against one plain call
on all the problems' tokens (the same FLOPs; the ideal).

    python scripts/probe_gmm_shared_batch.py [--label NAME] [--out PATH] [--shapes B,M,K,N,G ...]
                                             [--chunk N] [--problem-major]

Each plan is launched directly (no op dispatch), bf16, balanced routing; prints one JSON row per
shape with the relative error against a per-expert ``torch.matmul`` of each problem. Run it from
two source trees to compare kernels (``cd tree && python /path/to/probe_gmm_shared_batch.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the tree the script is run from, so that trees can be compared

SHAPES = [(8, 4096, 2048, 1408, 64), (4, 8192, 4096, 2048, 8), (16, 1024, 2048, 1408, 16), (2, 4096, 4096, 2048, 8)]


def _expected(lhs, rhs, sizes, m):
    import torch

    want = torch.empty(lhs.shape[0], rhs.shape[-1], device=lhs.device, dtype=lhs.dtype)
    for b, row in enumerate(sizes.tolist()):
        start = b * m
        for e, size in enumerate(row):
            want[start:start + size] = lhs[start:start + size] @ rhs[e]
            start += size
    return want


def _row(label: str, batch: int, m: int, k: int, n: int, g: int, problem_major: bool = False) -> dict:
    import numpy as np
    import torch

    from benchmarks.common import bench_torch
    from ejkernel_torch.launch import device_facts, launch
    from triton_kernels import grouped_matmul as gm

    facts = device_facts(torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(batch * m + g)
    lhs = torch.randn(batch * m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    base = np.full((batch, g), m // g, np.int32)
    base[:, : m % g] += 1
    sizes, offsets = torch.from_numpy(base).cuda(), torch.zeros(batch, dtype=torch.int32, device="cuda")
    by_group = gm.group_major
    if problem_major:  # the walk batches past 128 samples took before they were chunked
        gm.group_major = lambda batch, shared_rhs: False
    try:  # not gmm_plan's cached plan: this one reads --chunk and the walk
        plan = gm.gmm_plan.__wrapped__(m, k, n, g, g, False, "bfloat16", "bfloat16", facts, batch=batch,
                                       shared_rhs=True)
    finally:
        gm.group_major = by_group
    out = launch(plan, lhs, rhs, sizes, offsets)[0]
    want = _expected(lhs, rhs, sizes, m).float()
    ms = bench_torch(lambda: launch(plan, lhs, rhs, sizes, offsets))
    plain = gm.gmm_plan(batch * m, k, n, g, g, False, "bfloat16", "bfloat16", facts)
    total, zero = sizes.sum(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device="cuda")
    plain_ms = bench_torch(lambda: launch(plain, lhs, rhs, total, zero))
    c = plan.constexpr_dict
    walk = "group-major" if c["GROUP_MAJOR"] else "problem-major"
    return dict(label=label, shape=[batch, m, k, n, g], walk=walk, chunk=c["BATCH_P2"],
                tile=[c["BLOCK_M"], c["BLOCK_N"], plan.num_warps],
                ms=round(ms, 4), plain_ms=round(plain_ms, 4), ratio=round(ms / plain_ms, 3),
                rel_err=((out.float() - want).norm() / want.norm()).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,M,K,N,G",
                        help="samples, tokens a sample, k, n, experts (default: %s)"
                             % " ".join(",".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--chunk", type=int, default=None,
                        help="problems walked group-major at a time (default: gm.GROUP_MAJOR_CHUNK)")
    parser.add_argument("--problem-major", action="store_true",
                        help="also time each shape walked problem-major (as batches past 128 samples were)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from benchmarks.common import device_name, write_json

    rows = []
    if args.chunk:
        from triton_kernels import grouped_matmul as gm

        gm.GROUP_MAJOR_CHUNK = args.chunk
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    for shape in shapes:
        for problem_major in (False, True) if args.problem_major else (False,):
            rows.append(_row(args.label, *shape, problem_major=problem_major))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {"device": device_name(), "dtype": "bfloat16", "routing": "balanced", "rows": rows,
                              "command": "python scripts/probe_gmm_shared_batch.py " + " ".join(sys.argv[1:])})


if __name__ == "__main__":
    main()
