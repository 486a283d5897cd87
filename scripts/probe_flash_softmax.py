"""Do the softmax tricks of FlashAttention-4 pay in a Triton forward on Hopper?

At head_dim 128 the forward spends about a third of its matmul time on exp2, which runs on the
SM's 16-per-clock special-function units. Two tricks reduce the non-matmul work per key block:

* ``LAZY``: rescale the accumulator only when some row's running max grew by more than 8 (base
  2, a factor 256); otherwise keep the stale max. p is then at most 256, harmless in fp32 and
  bf16, and the final division by the normaliser is unchanged.
* ``SPLIT``: compute 1/SPLIT of the tile's exp2 with a cubic polynomial on the FMA units
  (round x to an integer j with the 1.5 * 2**23 trick, 2**f for the rest f in [-0.5, 0.5], then
  add j to the exponent bits); the rest on the special-function units. The cubic's relative
  error is below 7.5e-5, far under bf16's rounding.

The kernel is the dense one of ``probe_flash_minimal.py`` (non-causal, no masks, sequence a
multiple of the tiles); ours (``ejkernel_torch.flash_attention``) is timed beside it.

    python scripts/probe_flash_softmax.py [--out PATH]

bf16, batch 4, seq 4096, heads 2048 / head_dim. Prints one JSON row per variant and tile
(TFLOP/s, and the relative error against ours).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it holds round(x) in the low mantissa bits
# Minimax (relative error) cubic for 2**f on [-0.5, 0.5], fitted for this probe.
C0 = tl.constexpr(0.9999281167984009)
C1 = tl.constexpr(0.6932609677314758)
C2 = tl.constexpr(0.24261054396629333)
C3 = tl.constexpr(0.05517132207751274)


@triton.jit
def _exp2_fma(x):
    """2**x on the FMA/ALU pipes, for x >= -126 (unmasked logits minus a max are)."""
    x = tl.maximum(x, -126.0)
    t = x + ROUND_MAGIC
    f = x - (t - ROUND_MAGIC)
    p = C0 + f * (C1 + f * (C2 + f * C3))
    # bits(t) = bits(1.5 * 2**23) + j; shifted by 23 the constant part leaves the word.
    j_exp = t.to(tl.int32, bitcast=True) << 23
    return (p.to(tl.int32, bitcast=True) + j_exp).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_split(x, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """exp2 of a [BM, BN] tile, 1/SPLIT of its columns (every SPLIT-th pair member) by polynomial."""
    if SPLIT == 2:
        a, b = tl.split(tl.reshape(x, (BM, BN // 2, 2)))
        return tl.reshape(tl.join(tl.exp2(a), _exp2_fma(b)), (BM, BN))
    elif SPLIT == 4:
        a, b = tl.split(tl.reshape(x, (BM, BN // 4, 2, 2)))
        a0, a1 = tl.split(a)
        return tl.reshape(tl.join(tl.join(tl.exp2(a0), _exp2_fma(a1)), tl.exp2(b)), (BM, BN))
    else:
        return tl.exp2(x)


@triton.jit
def fwd(q_ptr, k_ptr, v_ptr, o_ptr, S, scale, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        LAZY: tl.constexpr, SPLIT: tl.constexpr):
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
    for start_n in range(0, S, BN):
        k = tl.load(k_ptrs + start_n * row)
        qk = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale)
        if LAZY:
            grow = tl.max(m_new - m_i, axis=0) > 8.0
            alpha = tl.where(grow, tl.exp2(m_i - m_new), 1.0)
            m_i = tl.where(grow, m_new, m_i)
        else:
            alpha = tl.exp2(m_i - m_new)
            m_i = m_new
        p = _exp2_split(qk * scale - m_i[:, None], BM, BN, SPLIT)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if LAZY:
            if grow:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * row)
        acc = tl.dot(p.to(v.dtype), v, acc)
    out = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * row + offs_d[None, :], out.to(o_ptr.dtype.element_ty))


VARIANTS = {"base": (False, 1), "lazy": (True, 1), "split2": (False, 2), "split4": (False, 4),
            "lazy+split4": (True, 4)}


def _tiles(d, wanted):
    if wanted:
        return [tuple(int(x) for x in t.split(",")) for t in wanted]
    return ((128, 64, 4 if d == 64 else 8, 3), (128, 128, 8, 2))


def _row(d, name, tile, ms, flops, err):
    return {"d": d, "variant": name, "tile": list(tile), "ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_ours": err}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiles", nargs="+", default=None, metavar="BM,BN,WARPS,STAGES",
                        help="tiles to run each variant with (default: the two of ours at this head_dim)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from benchmarks.common import bench_torch
    from ejkernel_torch import flash_attention
    rows = []
    for d in args.head_dims:
        b, s, h = 4, 4096, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = flash_attention(q, k, v)
        flops = 4 * b * h * s * s * d
        ms = bench_torch(lambda: flash_attention(q, k, v))
        rows.append({"d": d, "variant": "ours", "ms": ms, "tflops": flops / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        scale = d ** -0.5 * 1.4426950408889634
        for name in args.variants:
            lazy, split = VARIANTS[name]
            for bm, bn, w, st in _tiles(d, args.tiles):
                o = torch.full_like(q, float("nan"))
                try:
                    def run():
                        fwd[(s // bm, h, b)](q, k, v, o, s, scale, h, d, bm, bn, lazy, split, num_warps=w, num_stages=st)
                    run()
                    torch.cuda.synchronize()
                    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    rows.append(_row(d, name, (bm, bn, w, st), bench_torch(run), flops, err))
                except Exception as e:  # a variant that does not compile is a result too
                    rows.append({"d": d, "variant": name, "tile": [bm, bn, w, st], "error": str(e)[:300]})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "command": "python scripts/probe_flash_softmax.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
