"""Does the flash benchmark's order of methods move its ratios on a power-capped GPU?

``event_rounds`` times every method for 40 ms in turn, the order reversed every other round, each
sample after a warm-up (the benchmark's ``--warmup-ms``: 10 ms before session 58, 200 since). At
the power cap the SM clock a sample meets depends on what ran just before it. This probe reruns
``benchmarks.flash_attention.run_shape`` (torch only) with each of ``--warmups`` in the benchmark's
order, and with the first of them in reversed order; variants alternate, ``--repeats`` times. Per
run: ours over the best SDPA backend and ours' SM clock over its clock (``event_rounds`` spans,
``GpuLog``), both medians of the per-round ratios.

    python scripts/probe_bench_order.py [--shapes 16384:128:full 16384:64:causal] [--dtype float16]
        [--warmups 10 50] [--repeats 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import common  # noqa: E402
from benchmarks import flash_attention as bench  # noqa: E402
from benchmarks.common import flash_shape  # noqa: E402


def ordered_rounds(reverse: bool):
    """``event_rounds`` with the methods in the benchmark's order or reversed."""
    def rounds(calls, errors, **options):
        names = list(calls)[::-1] if reverse else list(calls)
        return common.event_rounds({n: calls[n] for n in names}, errors, **options)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", type=flash_shape,
                        default=[flash_shape(s) for s in ("16384:128:full", "16384:64:causal")])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--warmups", nargs="*", type=int, default=[10, 50],
                        help="ms; the first is the reversed variant's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    variants = {f"warmup {w} ms": (False, w) for w in args.warmups}
    variants[f"reversed, warmup {args.warmups[0]} ms"] = (True, args.warmups[0])
    results = []
    for seq, head_dim, causal in args.shapes:
        for repeat in range(args.repeats):
            for name, (reverse, warmup_ms) in variants.items():
                bench.event_rounds = ordered_rounds(reverse)
                row = bench.run_shape(seq, head_dim, causal, args.dtype, with_jax=False, warmup_ms=warmup_ms)
                entry = {"seq": seq, "head_dim": head_dim, "causal": causal, "dtype": args.dtype, "variant": name,
                         "repeat": repeat, **{k: v for k, v in row.items() if k.startswith("fwd")},
                         "rounds_ms": row["rounds_ms"], "rounds_clocks": row["rounds_clocks"]}
                results.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if not k.startswith("rounds")}), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"device": common.device_name(), "command": " ".join(sys.argv),
                                   "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
