"""The batched grouped matmul with one rhs for every problem (what vmap with shared expert
weights launches), timed from the source tree the script is run from, against one plain call
on all the problems' tokens (the same FLOPs; the ideal).

    python scripts/probe_gmm_shared_batch.py [--label NAME] [--out PATH]

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


def _row(label: str, batch: int, m: int, k: int, n: int, g: int) -> dict:
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
    plan = gm.gmm_plan(m, k, n, g, g, False, "bfloat16", "bfloat16", facts, batch=batch, shared_rhs=True)
    out = launch(plan, lhs, rhs, sizes, offsets)[0]
    want = _expected(lhs, rhs, sizes, m).float()
    ms = bench_torch(lambda: launch(plan, lhs, rhs, sizes, offsets))
    plain = gm.gmm_plan(batch * m, k, n, g, g, False, "bfloat16", "bfloat16", facts)
    total, zero = sizes.sum(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device="cuda")
    plain_ms = bench_torch(lambda: launch(plain, lhs, rhs, total, zero))
    c = plan.constexpr_dict
    return dict(label=label, shape=[batch, m, k, n, g], tile=[c["BLOCK_M"], c["BLOCK_N"], plan.num_warps],
                ms=round(ms, 4), plain_ms=round(plain_ms, 4), ratio=round(ms / plain_ms, 3),
                rel_err=((out.float() - want).norm() / want.norm()).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from benchmarks.common import device_name, write_json

    rows = []
    for shape in SHAPES:
        rows.append(_row(args.label, *shape))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {"device": device_name(), "dtype": "bfloat16", "routing": "balanced", "rows": rows,
                              "command": "python scripts/probe_gmm_shared_batch.py " + " ".join(sys.argv[1:])})


if __name__ == "__main__":
    main()
