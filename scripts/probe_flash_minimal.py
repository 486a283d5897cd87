"""A yardstick for the flash-attention forward: a minimal kernel (dense, non-causal, no masks,
sequence a multiple of the tiles) against ours, and the same kernel with the next key block's
QK^T issued before this block's PV (``PIPE``), to see whether Triton then overlaps the softmax
with the tensor cores (FA3's intra-warpgroup pipelining, written at source level).

    python scripts/probe_flash_minimal.py [--out PATH]

bf16, batch 4, seq 4096, heads 2048 / head_dim, head_dim 64 and 128; several tiles. Prints one
JSON row per variant and tile (TFLOP/s, and the relative error against ours).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _softmax_step(qk, m_i, l_i, acc, scale):
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale)
    p = tl.exp2(qk * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_i, acc * alpha[:, None]


@triton.jit
def fwd(q_ptr, k_ptr, v_ptr, o_ptr, S, scale, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        PIPE: tl.constexpr):
    start_m = tl.program_id(0) * BM
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = start_m + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    row = H * D
    base = b * S * row + h * D
    q = tl.load(q_ptr + base + offs_m[:, None] * row + offs_d[None, :])
    k_ptrs = k_ptr + base + offs_n[:, None] * row + offs_d[None, :]
    v_ptrs = v_ptr + base + offs_n[:, None] * row + offs_d[None, :]
    acc = tl.zeros([BM, D], tl.float32)
    m_i = tl.zeros([BM], tl.float32) - 1e30  # finite: no row is ever fully masked here
    l_i = tl.zeros([BM], tl.float32)
    if PIPE:
        k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k))
        for start_n in range(0, S - BN, BN):
            p, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, scale)
            k = tl.load(k_ptrs + (start_n + BN) * row)
            qk = tl.dot(q, tl.trans(k))
            v = tl.load(v_ptrs + start_n * row)
            acc = tl.dot(p.to(v.dtype), v, acc)
        p, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, scale)
        v = tl.load(v_ptrs + (S - BN) * row)
        acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        for start_n in range(0, S, BN):
            k = tl.load(k_ptrs + start_n * row)
            qk = tl.dot(q, tl.trans(k))
            p, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, scale)
            v = tl.load(v_ptrs + start_n * row)
            acc = tl.dot(p.to(v.dtype), v, acc)
    out = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * row + offs_d[None, :], out.to(o_ptr.dtype.element_ty))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from benchmarks.common import bench_torch
    from ejkernel_torch import flash_attention
    rows = []
    for d in (64, 128):
        b, s, h = 4, 4096, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = flash_attention(q, k, v)
        flops = 4 * b * h * s * s * d
        ms = bench_torch(lambda: flash_attention(q, k, v))
        rows.append({"d": d, "variant": "ours", "ms": ms, "tflops": flops / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        scale = d ** -0.5 * 1.4426950408889634
        for pipe in (False, True):
            for bm, bn, w, st in ((128, 64, 4 if d == 64 else 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 3)):
                o = torch.full_like(q, float("nan"))
                try:
                    run = lambda: fwd[(s // bm, h, b)](q, k, v, o, s, scale, h, d, bm, bn, pipe, num_warps=w, num_stages=st)
                    run()
                    torch.cuda.synchronize()
                    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = bench_torch(run)
                    rows.append({"d": d, "variant": "pipe" if pipe else "base", "tile": [bm, bn, w, st], "ms": ms,
                                 "tflops": flops / ms / 1e9, "rel_err_vs_ours": err})
                except Exception as e:
                    rows.append({"d": d, "variant": "pipe" if pipe else "base", "tile": [bm, bn, w, st], "error": str(e)[:200]})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "command": "python scripts/probe_flash_minimal.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
