"""padded_attention on torch tensors: forward and backward are Triton kernels."""
from __future__ import annotations

import torch

from ejkernel_torch.launch import device_facts, dtype_name, launch
from ejkernel_torch.ops import _tuning
from ejkernel_torch.ops._common import apply, n_pad_arg, name_of, same_device, tensor_arg
from triton_kernels import checks
from triton_kernels.tuning import PADDED_BWD, PADDED_FWD
from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan
from triton_kernels.params import BwdParams, FwdParams, op_params


class _PaddedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, n_pad, softmax_scale, fwd_params=None, bwd_params=None):
        problem = (tuple(q.shape), dtype_name(q.dtype), softmax_scale)
        plan = attention_fwd_plan(*problem, device_facts(q.device), _tuning.resolve(PADDED_FWD, problem, q.device,
                                                                                    fwd_params))
        out, lse2 = launch(plan, q, k, v, n_pad)
        ctx.save_for_backward(q, k, v, out, lse2, n_pad)
        ctx.softmax_scale = softmax_scale
        ctx.bwd_params = bwd_params
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, n_pad = ctx.saved_tensors
        problem = (tuple(q.shape), dtype_name(q.dtype), ctx.softmax_scale)
        delta_plan, dkdv_plan, dq_plan = attention_bwd_plans(
            *problem, device_facts(q.device), _tuning.resolve(PADDED_BWD, problem, q.device, ctx.bwd_params)
        )
        dout = dout.to(q.dtype).contiguous()
        (delta,) = launch(delta_plan, out, dout)
        dk, dv = launch(dkdv_plan, q, k, v, dout, lse2, delta, n_pad)
        (dq,) = launch(dq_plan, q, k, v, dout, lse2, delta, n_pad)
        return dq, dk, dv, None, None, None, None


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_pad: torch.Tensor,
                     *, softmax_scale: float | None = None, fwd_params: FwdParams | dict | None = None,
                     bwd_params: BwdParams | dict | None = None, autotune: bool | None = None) -> torch.Tensor:
    """Single-head causal attention over left-padded sequences, ``[batch, seq, head_dim]``.

    Query ``i`` of batch ``b`` attends to keys ``n_pad[b] <= j <= i``; the ``n_pad[b]`` padding
    queries give zeros. ``softmax_scale`` defaults to ``head_dim ** -0.5``. Any sequence length,
    head_dim up to 256, float16/bfloat16/float32. ``fwd_params``/``bwd_params`` (FwdParams /
    BwdParams or dicts: ``blocksize_m``/``q_blocksize``, ``blocksize_n``/``kv_blocksize``,
    ``num_warps``, ``num_stages``) override the forward / backward plans; checked up front.
    Without them the plans use the config cache's entry, else their heuristic; ``autotune``
    (default: ``EJKERNEL_AUTOTUNE``) times candidates on a cache miss and stores the fastest
    (the backward's too when an input requires grad). See ``triton_kernels.tuning``.
    """
    q, k, v = (tensor_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    batch, seq_len, head_dim = checks.single_head_qkv(
        [tuple(t.shape) for t in (q, k, v)], [name_of(t) for t in (q, k, v)]
    )
    scale = checks.softmax_scale(softmax_scale, head_dim)
    device = same_device(q=q, k=k, v=v)
    fwd, bwd = op_params(FwdParams, fwd_params, "fwd_params"), op_params(BwdParams, bwd_params, "bwd_params")
    if fwd is not None or bwd is not None:  # bad overrides fail here, before any kernel runs
        facts, key = device_facts(device), (tuple(q.shape), dtype_name(q.dtype), scale)
        attention_fwd_plan(*key, facts, fwd)
        attention_bwd_plans(*key, facts, bwd)
    n_pad = n_pad_arg(n_pad, batch, seq_len, device)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), n_pad)
    problem = (tuple(q.shape), dtype_name(q.dtype), scale)  # what the plans are built from
    _tuning.autotune(PADDED_FWD, problem, device, args, autotune, fwd)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _tuning.autotune(PADDED_BWD, problem, device, args, autotune, bwd)
    return apply(_PaddedAttention, *args, scale, fwd, bwd)
