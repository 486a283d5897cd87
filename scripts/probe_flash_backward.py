"""Time the torch flash-attention backward alone (and forward + backward), for A/B runs of two trees.

The backward of the public op, ``torch.autograd.grad`` of a forward recorded once, timed by CUDA
events with L2 flushed between calls (``bench_torch``) and back to back by the wall clock
(``bench_torch_wall``); the same for a whole forward + backward step. Each row lists the
backward's kernels in launch order. Run the same command in two checkouts to compare them (the
script uses only the public op, so a copy runs in an older tree).

    python scripts/probe_flash_backward.py [--cases 1024:64:causal 1024:128:causal:dropout]
        [--dtype bfloat16] [--out FILE]

A case is seq:head_dim:mask[:feature] with mask ``causal`` or ``full`` and feature ``dropout``
(p 0.1), ``window`` (sliding_window 256, both sides unless causal) or ``softcap`` (30); batch x
seq = 16k tokens, heads = 2048 / head_dim.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DEFAULT_CASES = ["1024:64:causal", "1024:64:full", "1024:128:causal:dropout", "2048:96:causal",
                 "4096:128:full:window", "2048:128:causal:softcap"]
FEATURES = {"": {}, "dropout": dict(dropout_p=0.1, dropout_seed=1234), "window": dict(sliding_window=256),
            "softcap": dict(logits_soft_cap=30.0)}


def parse_case(text: str) -> tuple[int, int, bool, str]:
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[2] not in ("causal", "full") or (parts[3:] or [""])[0] not in FEATURES:
        raise argparse.ArgumentTypeError(f"expected seq:head_dim:causal|full[:{'|'.join(FEATURES)[1:]}], got {text!r}")
    return int(parts[0]), int(parts[1]), parts[2] == "causal", (parts[3:] or [""])[0]


def _kernels(q, k, v, causal: bool, options: dict) -> list[str]:
    """The backward's kernels in launch order, as this tree plans them."""
    from ejkernel_torch.launch import device_facts
    from triton_kernels import flash_attention as fa

    window = options.get("sliding_window")
    spec = fa.dense_spec(q.shape, k.shape, v.shape, (str(q.dtype).split(".")[-1],) * 3, causal=causal,
                         sliding_window=window, logits_soft_cap=options.get("logits_soft_cap"),
                         dropout_p=options.get("dropout_p", 0.0))
    return [plan.name for plan in fa.backward_plans(spec, device_facts(q.device))]


def probe(case: tuple[int, int, bool, str], dtype_name: str) -> dict:
    import torch

    import ejkernel_torch
    from benchmarks.common import bench_torch, bench_torch_wall

    seq, head_dim, causal, feature = case
    batch, heads = max(1, 16384 // seq), 2048 // head_dim
    dtype = getattr(torch, dtype_name)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    options = dict(FEATURES[feature], causal=causal)
    out = ejkernel_torch.flash_attention(q, k, v, **options)

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def step():
        return torch.autograd.grad(ejkernel_torch.flash_attention(q, k, v, **options), (q, k, v), dout)

    row = {"case": ":".join(str(x) for x in (seq, head_dim, "causal" if causal else "full", feature)).rstrip(":"),
           "batch": batch, "heads": heads, "dtype": dtype_name}
    try:
        row["kernels"] = _kernels(q, k, v, causal, FEATURES[feature])
    except Exception as e:  # an older tree's plans: the timings still compare
        row["kernels"] = f"{type(e).__name__}: {e}"
    row["bwd_ms_events"] = bench_torch(backward)
    row["bwd_ms_wall"] = bench_torch_wall(backward)
    row["step_ms_events"] = bench_torch(step)
    row["step_ms_wall"] = bench_torch_wall(step)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=parse_case, nargs="+", default=[parse_case(c) for c in DEFAULT_CASES])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for case in args.cases:
        rows.append(probe(case, args.dtype))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows)


if __name__ == "__main__":
    main()
