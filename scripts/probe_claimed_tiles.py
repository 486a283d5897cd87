"""The Gluon forward claiming its tiles against the same plan walking them statically, on a GPU.

    python scripts/probe_claimed_tiles.py [--seqs 1024 2048 4096] [--out PATH]

For each of the benchmark's shapes (bf16, batch x seq = 16k tokens, heads = 2048 / head_dim,
head_dim 128 and 64, causal and not) where the forward plan claims its tiles
(``schedule.claims_tiles``), the plan as it is and with ``DYNAMIC`` off (its counter then not
zeroed) are checked for the same bits and timed side by side (``time_beside_plan``, wall clock
over back-to-back calls). ``speedup`` > 1: claiming is faster.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _row(b, s, h, d, causal):
    import torch

    from benchmarks.common import time_beside_plan
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa
    from triton_kernels.flash_attention.plan import static_walk

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = fa.forward_plan(fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal),
                           device_facts(q.device))
    if not plan.constexpr_dict.get("DYNAMIC"):
        return None
    static = static_walk(plan)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    same = all(torch.equal(x, y) for x, y in zip(launch(plan, *arrays), launch(static, *arrays)))
    times = time_beside_plan({"plan": lambda: launch(static, *arrays), "claimed": lambda: launch(plan, *arrays)},
                             lambda _: torch.cuda.synchronize())
    (static_ms, _), (claimed_ms, speedup) = times["plan"], times["claimed"]
    return dict(shape=[b, s, h, d], causal=causal, same_bits=same, static_ms=static_ms, claimed_ms=claimed_ms,
                speedup=speedup, claimed_tflops=flops(b, h, s, d, causal, "fwd") / claimed_ms / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", nargs="*", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from benchmarks.common import variant_timed_shapes, write_run

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for b, s, _, h, d, causal in variant_timed_shapes(seqs=args.seqs):
        row = _row(b, s, h, d, causal)
        if row is not None:
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_run(args.out, rows)


if __name__ == "__main__":
    main()
