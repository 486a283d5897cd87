"""Where flash-attention time goes on a CUDA GPU, kernel by kernel, and what forward variants
(tensor-descriptor K/V loads, warp specialization) would buy.

    python scripts/probe_flash_kernels.py [--head-dims 64 128] [--causal false true]
                                          [--variants base tma tma+ws] [--out PATH]

bf16, batch 4, seq 4096, heads 2048 / head_dim. Each plan is launched directly (no op
dispatch); every variant's output is compared with the base plan's (max abs difference).
The backward rows time the delta, dk/dv and dq kernels of ``backward_plans`` one at a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = {"base": {}, "tma": {"USE_TMA": True}, "tma+ws": {"USE_TMA": True, "WARP_SPECIALIZE": True},
            "ws": {"WARP_SPECIALIZE": True}}


def _with(plan, **constexprs):
    return dataclasses.replace(plan, constexprs=tuple((n, constexprs.get(n, v)) for n, v in plan.constexprs))


def _install_allocator() -> None:
    # Device-side tensor descriptors need per-program global scratch from the launcher.
    import torch
    import triton

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _probe(head_dim: int, causal: bool, variants: list[str], atomic_tiles) -> list[dict]:
    import torch

    from benchmarks.common import bench_torch
    from benchmarks.flash_attention import flops
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa

    b, s, h, d = 4, 4096, 2048 // head_dim, head_dim
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    facts = device_facts(q.device)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    base = fa.forward_plan(spec, facts)
    ref, lse = launch(base, *arrays)
    rows = []
    for name in variants:
        plan = _with(base, **VARIANTS[name])
        row = {"head_dim": d, "causal": causal, "kernel": f"fwd/{name}"}
        try:
            out, _ = launch(plan, *arrays)
            torch.cuda.synchronize()
            row["max_abs_diff_vs_base"] = (out.float() - ref.float()).abs().max().item()
            row["ms"] = bench_torch(lambda: launch(plan, *arrays))
            row["tflops"] = flops(b, h, s, d, causal, "fwd") / row["ms"] / 1e9
        except Exception as e:  # report and go on: a variant may not compile on this Triton
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
    delta_plan, dkdv_plan, dq_plan = fa.backward_plans(spec, facts)
    dlse = torch.zeros(1, device="cuda", dtype=torch.float32)
    (delta,) = launch(delta_plan, ref, do, dlse, arrays[6], arrays[7])
    grads_in = arrays + [do, lse, delta]
    for name, fn in (("delta", lambda: launch(delta_plan, ref, do, dlse, arrays[6], arrays[7])),
                     ("dkdv", lambda: launch(dkdv_plan, *grads_in)),
                     ("dq", lambda: launch(dq_plan, *grads_in))):
        row = {"head_dim": d, "causal": causal, "kernel": f"bwd/{name}", "ms": bench_torch(fn)}
        rows.append(row)
        print(row, flush=True)
    for tiles in atomic_tiles:
        rows += _probe_atomic_dq(spec, facts, grads_in, d, causal, tiles)
    return rows


def _probe_atomic_dq(spec, facts, grads_in, d, causal, tiles) -> list[dict]:
    """dk/dv with dq added atomically from the same programs, then cast: vs dk/dv + dq kernels."""
    import torch

    from benchmarks.common import bench_torch
    from ejkernel_torch.launch import launch
    from triton_kernels import flash_attention as fa
    from triton_kernels.params import BwdParams

    bm, bn, w, s = tiles
    params = BwdParams(blocksize_m=bm, blocksize_n=bn, num_warps=w, num_stages=s)
    _, dkdv_plan, dq_plan = fa.backward_plans(spec, facts)
    try:
        _, dkdv_atomic, cast_plan = fa.backward_plans(spec, facts, params=params, atomic_dq=True)
    except ValueError as e:
        print(e)
        return []
    dk, dv, _, _ = launch(dkdv_plan, *grads_in)
    (dq,) = launch(dq_plan, *grads_in)
    dk2, dv2, _, acc = launch(dkdv_atomic, *grads_in)
    (dq2,) = launch(cast_plan, acc)
    torch.cuda.synchronize()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    row = {"head_dim": d, "causal": causal, "kernel": "bwd/dkdv+atomic_dq+cast", "tiles": f"{bm}x{bn}-w{w}-s{s}",
           "dq_rel_diff_vs_dq_kernel": rel(dq2, dq), "dk_equal": bool(torch.equal(dk, dk2)),
           "ms": bench_torch(lambda: launch(cast_plan, launch(dkdv_atomic, *grads_in)[3]))}
    print(row, flush=True)
    return [row]


def _tiles(text: str) -> tuple[int, int, int, int]:
    values = tuple(int(x) for x in text.split(","))
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,BLOCK_N,warps,stages, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--variants", nargs="+", default=["base", "tma", "tma+ws"], choices=sorted(VARIANTS))
    parser.add_argument("--atomic-tiles", nargs="*", type=_tiles, default=[(32, 64, 4, 3)],
                        help="BLOCK_M,BLOCK_N,warps,stages of the atomic-dq dk/dv kernel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    _install_allocator()
    rows = []
    for d in args.head_dims:
        for c in args.causal:
            rows += _probe(d, c == "true", args.variants, args.atomic_tiles)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "command": "python scripts/probe_flash_kernels.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
