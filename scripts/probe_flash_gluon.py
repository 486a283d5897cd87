"""Probe: can a warp-specialized Hopper forward, written in Gluon, reach cuDNN?

Stock ``@triton.jit`` leaves our forward at 0.77-0.94x SDPA's cuDNN backend on an H100; the
kernels that match cuDNN (FlashAttention-3) split the work by warps. This probe writes that
schedule in Gluon (Triton's lower-level dialect, shipped with triton) for the dense,
non-causal forward and times it beside cuDNN and our Triton forward in the same run:

- a 1-warp loader partition issues TMA copies of Q once and of each K and V block into a ring of
  shared-memory stages, signalling mbarriers;
- two consumer warpgroups (the default partition and one worker) each own 64 query rows of a
  128-row tile, read the same K/V stages, and free a stage by arriving on its "empty" barrier;
- inside a consumer, QK^T of block j is issued asynchronously together with PV of block j-1, so
  the softmax of block j runs while the tensor cores do PV (FA3's intra-warpgroup overlap);
- registers move from the loader to the consumers (``worker_num_regs``).

Dense and non-causal only (key columns past seq_k masked on the last block, rows past seq_q
not stored); base-2 softmax as in our kernels. It is a probe, not a kernel of the library:
it runs from torch only (jax-triton launches neither Gluon kernels nor TMA descriptors).

    python scripts/probe_flash_gluon.py [--out PATH]            # needs a Hopper GPU
    python scripts/probe_flash_gluon.py --compile-only           # sm_90 compile, no GPU needed

Prints one JSON row per shape: TFLOP/s of each, the ratio to cuDNN, and the relative error of
ours and of the probe against a float32 reference.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

# Triton 3.6 (the GPU machine) names the TMA load async_copy_global_to_shared; newer versions async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

ROWS_PER_CONSUMER = 64  # one warpgroup's wgmma covers 64 rows; a CTA's tile is two of them


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
            q_row, kv_row, kv_col, q_col, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    half: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + half, q_col], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        stage = j % STAGES
        # mbarriers start with phase 1 complete, so the first pass through the ring does not wait.
        phase = ((j // STAGES) & 1) ^ 1
        row = kv_row + j * BLOCK_N
        mbarrier.wait(k_empty.index(stage), phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, kv_col], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _tma_load(v_desc, [row, kv_col], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, col0, seq_k, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
             MASK: gl.constexpr):
    if MASK:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] < seq_k, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _consumer(o_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              qk_scale, m0, seq_q, seq_k, n_blocks, o_row0, o_col, o_stride, lse_row0,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    q = q_smem.index(WG)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    last_masked = seq_k % BLOCK_N != 0

    # Block 0: S only; PV of block 0 is issued with S of block 1.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_blocks == 1 and last_masked:
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, 0, seq_k, s_layout, BLOCK_N, True)
    else:
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, 0, seq_k, s_layout, BLOCK_N, False)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # Rescale while QK^T runs; alpha belongs to block j-1, whose PV is issued next.
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # Wait for S only (one group, PV, may stay in flight), then the softmax overlaps PV.
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        if j == n_blocks - 1 and last_masked:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j * BLOCK_N, seq_k, s_layout, BLOCK_N, True)
        else:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j * BLOCK_N, seq_k, s_layout, BLOCK_N, False)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(prev), count=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_blocks - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(dtype)
    rows = m0 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (o_row0 + rows.to(gl.int64))[:, None] * o_stride + o_col + cols[None, :]
    gl.store(ptrs, out, mask=(rows < seq_q)[:, None])
    lse_rows = m0 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + lse_row0 + lse_rows, lse, mask=lse_rows < seq_q)


@gluon.jit
def flash_fwd_ws(q_desc, k_desc, v_desc, o_ptr, lse_ptr, qk_scale, seq_q, seq_k, heads, kv_group, o_stride,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    half: gl.constexpr = q_desc.block_type.shape[0]
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // heads
    h = bh % heads
    m0 = pid_m * (2 * half)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [2, half, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a stage
        mbarrier.init(v_empty.index(i), count=2)

    n_blocks = gl.cdiv(seq_k, BLOCK_N)
    q_row = b * seq_q + m0
    kv_row = b * seq_k
    q_col = h * HEAD_DIM
    kv_col = (h // kv_group) * HEAD_DIM
    o_row0 = b * seq_q
    lse_row0 = bh * seq_q
    gl.warp_specialize([
        (_consumer, (o_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, qk_scale,
                     m0, seq_q, seq_k, n_blocks, o_row0, q_col, o_stride, lse_row0, 0, HEAD_DIM, BLOCK_N, STAGES)),
        (_consumer, (o_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, qk_scale,
                     m0, seq_q, seq_k, n_blocks, o_row0, q_col, o_stride, lse_row0, 1, HEAD_DIM, BLOCK_N, STAGES)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                   q_row, kv_row, kv_col, q_col, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [232, 24])


def _descriptors(q, k, v, block_n):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    gdtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, d], gdtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdtype)
    q2, k2, v2 = q.view(b * sq, h * d), k.view(b * sk, hk * d), v.view(b * sk, hk * d)
    return (TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [ROWS_PER_CONSUMER, d], q_layout),
            TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], kv_layout),
            TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, d], kv_layout))


def launch_args(q, k, v, out, lse, block_n=128, stages=2):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qk_scale = d ** -0.5 / math.log(2)
    grid = (triton.cdiv(sq, 2 * ROWS_PER_CONSUMER), b * h)
    args = (*_descriptors(q, k, v, block_n), out, lse, qk_scale, sq, sk, h, h // hk, out.stride(1))
    return grid, args, dict(HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, num_warps=4, maxnreg=168)


def gluon_flash_fwd(q, k, v, block_n=128, stages=2):
    for t in (q, k, v):
        if not t.is_contiguous():
            raise ValueError("q, k and v must be contiguous [batch, seq, heads, head_dim]")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
    grid, args, kw = launch_args(q, k, v, out, lse, block_n, stages)
    flash_fwd_ws[grid](*args, **kw)
    return out, lse


def compile_only(head_dims=(64, 128)):
    """Compile for sm_90 on any machine: the runtime's own argument binding, with a Hopper target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(flash_fwd_ws.signature, flash_fwd_ws.params, backend)
    for d in head_dims:
        q, k, v = (torch.empty(2, 256, 2048 // d, d, dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(2, q.shape[2], 256, dtype=torch.float32)
        _, args, kw = launch_args(q, k, v, out, lse)
        bound, spec, opts = binder(*args, **kw)
        options, signature, constexprs, attrs = flash_fwd_ws._pack_args(backend, kw, bound, spec, opts)
        src = GluonASTSource(flash_fwd_ws, signature, constexprs, attrs)
        kernel = triton.compile(src, target=target, options=options.__dict__)
        print(json.dumps({"head_dim": d, "compiled": True, "shared": kernel.metadata.shared,
                          "num_warps": kernel.metadata.num_warps}), flush=True)


def _rel_err(out, ref):
    diff = (out.float() - ref).norm() / ref.norm()
    return float("nan") if not torch.isfinite(out.float()).all() else diff.item()


def _check(q, k, v):
    """The probe against a float32 reference, on poisoned outputs."""
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), enable_gqa=True).transpose(1, 2)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    grid, args, kw = launch_args(q, k, v, out, lse)
    flash_fwd_ws[grid](*args, **kw)
    torch.cuda.synchronize()
    return _rel_err(out, ref), ref


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.common import bench_torch
    from ejkernel_torch import flash_attention

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    # Correctness first, at odd sizes: tails of both sequences, GQA.
    for b, sq, sk, h, hk, d in ((2, 1000, 777, 4, 2, 128), (1, 129, 300, 2, 1, 64), (3, 64, 1, 2, 2, 128)):
        err, _ = _check(rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d))
        rows.append({"check": [b, sq, sk, h, hk, d], "rel_err": err})
        print(json.dumps(rows[-1]), flush=True)

    for d in (64, 128):
        for s in (4096, 16384):
            b, h = 16384 // s, 2048 // d
            q, k, v = rand(b, s, h, d), rand(b, s, h, d), rand(b, s, h, d)
            flops = 4 * b * h * s * s * d
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms_cudnn = bench_torch(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
            ms_ours = bench_torch(lambda: flash_attention(q, k, v))
            err_probe, ref = _check(q, k, v)
            err_ours = _rel_err(flash_attention(q, k, v), ref)
            row = {"d": d, "seq": s, "batch": b, "heads": h, "rel_err_probe": err_probe, "rel_err_ours": err_ours,
                   "tflops_cudnn": flops / ms_cudnn / 1e9, "tflops_ours": flops / ms_ours / 1e9}
            for block_n, stages in ((128, 2), (128, 3), (64, 3)):
                try:
                    ms = bench_torch(lambda: gluon_flash_fwd(q, k, v, block_n, stages))
                    row[f"tflops_probe_n{block_n}_s{stages}"] = flops / ms / 1e9
                except Exception as e:  # a config that does not fit: report, keep going
                    row[f"error_probe_n{block_n}_s{stages}"] = str(e)[:200]
            best = max(v for key, v in row.items() if key.startswith("tflops_probe"))
            row["best_probe_vs_cudnn"] = best / row["tflops_cudnn"]
            row["ours_vs_cudnn"] = row["tflops_ours"] / row["tflops_cudnn"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "command": "python scripts/probe_flash_gluon.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
