"""The Gluon flash-attention forward with two consumer warpgroups (128-row query tiles) against
three (192-row tiles), on a Hopper GPU, beside cuDNN.

    python scripts/probe_gluon_forward_consumers.py [--head-dim 64] [--seqs 1024 2048 ...] [--out PATH]

Both plans are first run on odd shapes (GQA, seq_q != seq_k, partial tiles, causal and not) and
compared with a float32 SDPA reference (relative error; NaN reported). Then, on the benchmark's
shapes (bf16, batch x seq = 16k tokens, heads = 2048 / head_dim, causal and not), each plan is
timed twice in turn (``triton.testing.do_bench`` medians) beside torch's cuDNN SDPA;
``*_tflops`` and ``*_vs_cudnn`` use the better of the two times. ``gluon_forward.forward_consumers``
picks between the two for the library.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (batch, seq_q, seq_k, heads_q, heads_kv, causal)
CHECKS = [(2, 1000, 1000, 4, 2, False), (2, 1000, 1000, 4, 4, True), (1, 333, 4000, 2, 1, True),
          (3, 4000, 4000, 2, 2, False), (1, 200, 4096, 4, 4, False), (2, 777, 777, 3, 3, True)]
SEQS = (1024, 2048, 4096, 8192, 16384)
REPEATS = 2


def _plans(spec, facts) -> dict:
    from triton_kernels.flash_attention.plan import gluon_forward_plan

    return {f"c{n}": gluon_forward_plan(spec, facts, consumers=n) for n in (2, 3)}


def _inputs(b, sq, sk, h, hk, d, causal):
    """(q, k, v), the nine feature arrays the plans take, and the call's spec."""
    import torch

    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa

    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    return (q, k, v), _features(q, k, v, None, None, None, None, None, None), spec


def _check(shape, head_dim, facts) -> list[dict]:
    import torch

    from ejkernel_torch.launch import launch

    b, sq, sk, h, hk, causal = shape
    (q, k, v), arrays, spec = _inputs(b, sq, sk, h, hk, head_dim, causal)
    mask = torch.ones(sq, sk, device="cuda", dtype=torch.bool).tril(sk - sq) if causal else None  # bottom-right
    kf, vf = (x.float().repeat_interleave(h // hk, 2).transpose(1, 2) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(1, 2), kf, vf,
                                                            attn_mask=mask).transpose(1, 2)
    rows = []
    for name, plan in _plans(spec, facts).items():
        out, lse = launch(plan, *arrays)
        rows.append({"check": list(shape), "kernel": name,
                     "rel_err_vs_fp32": float((out.float() - want).norm() / want.norm()),
                     "nan": bool(out.isnan().any() or lse.isnan().any())})
    return rows


def _time(seq, head_dim, causal, facts) -> dict:
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import launch

    b, h = 16384 // seq, 2048 // head_dim
    (q, k, v), arrays, spec = _inputs(b, seq, seq, h, h, head_dim, causal)
    row = {"seq": seq, "head_dim": head_dim, "causal": causal}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        row["cudnn_ms"] = bench_torch(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                                            is_causal=causal))
    plans = _plans(spec, facts)
    for rep in range(REPEATS):
        for name, plan in plans.items():
            row[f"{name}_ms_{rep}"] = bench_torch(lambda: launch(plan, *arrays))
    for name in plans:
        ms = min(row[f"{name}_ms_{rep}"] for rep in range(REPEATS))
        row[f"{name}_tflops"] = flops(b, h, seq, head_dim, causal, "fwd") / ms / 1e9
        row[f"{name}_vs_cudnn"] = row["cudnn_ms"] / ms
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dim", type=int, default=64, choices=[64])  # three do not fit at 128
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from ejkernel_torch.launch import device_facts

    facts = device_facts(torch.device("cuda"))
    rows = [row for shape in CHECKS for row in _check(shape, args.head_dim, facts)]
    rows += [_time(seq, args.head_dim, causal, facts) for causal in (False, True) for seq in args.seqs]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows)


if __name__ == "__main__":
    main()
