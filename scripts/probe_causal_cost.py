"""Where does the causal forward lose to cuDNN at short lengths? Same work, with and without a mask.

A causal call of seq s does about the work of a call without a mask of seq_q = s, seq_k = s / 2
(half the keys for every query): the same matmul FLOPs, but no masked blocks, every tile as long
as every other, and no tile pairs in the schedule. This times ours and cuDNN on both, in turn
(``benchmarks.common.interleaved``, wall clock over batches of ``calls_per_batch``), and the full square call
beside them. If ours matches cuDNN on the half-keys call but not on the causal one, the loss is
in what only causal calls do (masked diagonal blocks, tiles of unequal length, the paired
schedule); if it loses on both, it is the short per-tile loop itself.

    PYTHONPATH=. python scripts/probe_causal_cost.py [--head-dims 64 128] [--seqs 1024 2048 4096] [--out PATH]

Prints one JSON line per (head_dim, seq); "x vs cudnn" > 1: ours is faster.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (name, seq_k as a fraction of seq, causal)
CASES = (("causal", 1.0, True), ("half_keys", 0.5, False), ("full", 1.0, False))


def _timers(seq, head_dim) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ejkernel_torch
    from benchmarks.common import calls_per_batch, wall_batch

    batch, heads = 16384 // seq, 2048 // head_dim
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    timers = {}
    for name, frac, causal in CASES:
        q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, int(seq * frac), heads, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

        def ours(q=q, k=k, v=v, causal=causal):
            return ejkernel_torch.flash_attention(q, k, v, causal=causal)

        def cudnn(qt=qt, kt=kt, vt=vt, causal=causal):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        calls = calls_per_batch(statistics.median(wall_batch(ours, sync, 20)() for _ in range(3)))
        timers[f"{name}/ours"] = wall_batch(ours, sync, calls)
        timers[f"{name}/cudnn"] = wall_batch(cudnn, sync, calls)
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from benchmarks.common import interleaved, median_ratio, write_run

    rows = []
    for d in args.head_dims:
        for seq in args.seqs:
            samples = interleaved(_timers(seq, d))
            row = {"head_dim": d, "seq": seq, **{f"{n} ms": statistics.median(s) for n, s in samples.items()}}
            for name, _, _ in CASES:
                row[f"{name} vs cudnn"] = median_ratio(samples, f"{name}/cudnn", f"{name}/ours")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        write_run(args.out, rows)


if __name__ == "__main__":
    main()
