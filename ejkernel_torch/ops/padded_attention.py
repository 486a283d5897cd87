"""padded_attention on torch tensors: forward and backward are Triton kernels."""
from __future__ import annotations

import torch

from ejkernel_torch.launch import device_facts, dtype_name, launch
from ejkernel_torch.ops._common import apply, n_pad_arg, name_of, same_device, tensor_arg
from triton_kernels import checks
from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan


class _PaddedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n_pad, softmax_scale):
        facts = device_facts(q.device)
        plan = attention_fwd_plan(tuple(q.shape), dtype_name(q.dtype), softmax_scale, facts)
        out, lse2 = launch(plan, q, k, v, n_pad)
        ctx.save_for_backward(q, k, v, out, lse2, n_pad)
        ctx.softmax_scale = softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, n_pad = ctx.saved_tensors
        facts = device_facts(q.device)
        delta_plan, dkdv_plan, dq_plan = attention_bwd_plans(
            tuple(q.shape), dtype_name(q.dtype), ctx.softmax_scale, facts
        )
        dout = dout.to(q.dtype).contiguous()
        (delta,) = launch(delta_plan, out, dout)
        dk, dv = launch(dkdv_plan, q, k, v, dout, lse2, delta, n_pad)
        (dq,) = launch(dq_plan, q, k, v, dout, lse2, delta, n_pad)
        return dq, dk, dv, None, None


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_pad: torch.Tensor,
                     *, softmax_scale: float | None = None) -> torch.Tensor:
    """Single-head causal attention over left-padded sequences, ``[batch, seq, head_dim]``.

    Query ``i`` of batch ``b`` attends to keys ``n_pad[b] <= j <= i``; the ``n_pad[b]`` padding
    queries give zeros. ``softmax_scale`` defaults to ``head_dim ** -0.5``. Any sequence length,
    head_dim up to 256, float16/bfloat16/float32.
    """
    q, k, v = (tensor_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    batch, seq_len, head_dim = checks.single_head_qkv(
        [tuple(t.shape) for t in (q, k, v)], [name_of(t) for t in (q, k, v)]
    )
    scale = checks.softmax_scale(softmax_scale, head_dim)
    device = same_device(q=q, k=k, v=v)
    n_pad = n_pad_arg(n_pad, batch, seq_len, device)
    return apply(_PaddedAttention, q.contiguous(), k.contiguous(), v.contiguous(), n_pad, scale)
