"""padded_attention on torch tensors: forward and backward are Triton kernels."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ejkernel_torch.launch import device_facts, dtype_name, launch_traceable
from ejkernel_torch.ops import _tuning
from ejkernel_torch.ops._common import (KernelFunction, KernelOp, autocast, first_order, n_pad_arg,
                                        name_of, same_device, saved_tensors, static_shape, tensor_arg)
from triton_kernels import checks
from triton_kernels import padded_attention as pa
from triton_kernels.tuning import PADDED_BWD, PADDED_FWD
from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan, check_batch, check_sequence, fold_limit
from triton_kernels.params import BwdParams, FwdParams, decode_params, encode_params, op_params


def _forward(q: Tensor, k: Tensor, v: Tensor, n_pad: Tensor, softmax_scale: float,
             fwd_params: Optional[list[int]], bwd_params: Optional[list[int]]) -> tuple[Tensor, Tensor]:
    # bwd_params is for the gradient (_setup), which sees the op's arguments only.
    problem = (static_shape(q), dtype_name(q.dtype), softmax_scale)
    params = _tuning.resolve(PADDED_FWD, problem, q.device, decode_params(FwdParams, fwd_params))
    out, lse2 = launch_traceable(attention_fwd_plan(*problem, device_facts(q.device), params), q, k, v, n_pad)
    return out, lse2


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse2: Tensor, n_pad: Tensor, dout: Tensor,
              softmax_scale: float, bwd_params: Optional[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    problem = (static_shape(q), dtype_name(q.dtype), softmax_scale)
    params = _tuning.resolve(PADDED_BWD, problem, q.device, decode_params(BwdParams, bwd_params))
    delta_plan, dkdv_plan, dq_plan = attention_bwd_plans(*problem, device_facts(q.device), params)
    (delta,) = launch_traceable(delta_plan, out, dout)
    dk, dv = launch_traceable(dkdv_plan, q, k, v, dout, lse2, delta, n_pad)
    (dq,) = launch_traceable(dq_plan, q, k, v, dout, lse2, delta, n_pad)
    return dq, dk, dv


# Folded under vmap past one launch's batch (fold_limit), the samples go to several launches.
_forward_op = KernelOp("padded_attention_fwd", _forward, kernels=(pa.attention_fwd_kernel,), folds_under_vmap=True,
                       fold_limit=fold_limit)
_backward_op = KernelOp("padded_attention_bwd", _backward, kernels=(pa.attention_bwd_delta_kernel,
                        pa.attention_bwd_dkdv_kernel, pa.attention_bwd_dq_kernel), folds_under_vmap=True,
                        fold_limit=fold_limit)


def _setup(ctx, inputs, output):
    # (out, lse2): lse2 is an output only to be saved (setup_context sees inputs and outputs only)
    q, k, v, n_pad, softmax_scale, _, bwd_params = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, *output, n_pad)
    ctx.softmax_scale = softmax_scale
    ctx.bwd_params = bwd_params


def _grad(ctx, dout, _dlse2):
    q, k, v, out, lse2, n_pad = saved_tensors(ctx)
    dq, dk, dv = _backward_op(q, k, v, out, lse2, n_pad, dout.to(q.dtype).contiguous(), ctx.softmax_scale,
                              ctx.bwd_params)
    return first_order("padded_attention", (dq, dk, dv, None, None, None, None), (q, k, v, out, dout))


# Arguments: q, k, v, n_pad, softmax_scale, fwd_params, bwd_params (encode_params lists)
_padded_attention = KernelFunction("PaddedAttention", _forward_op, _setup, _grad)


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
    q, k, v = autocast(*(tensor_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v))))
    batch, seq_len, head_dim = checks.single_head_qkv(
        [tuple(t.shape) for t in (q, k, v)], [name_of(t) for t in (q, k, v)]
    )
    scale = checks.softmax_scale(softmax_scale, head_dim)
    checks.uncapped_softmax_scale(scale, head_dim)
    check_batch("q", batch, seq_len)
    check_sequence("q", seq_len, head_dim)
    device = same_device(q=q, k=k, v=v)
    fwd, bwd = op_params(FwdParams, fwd_params, "fwd_params"), op_params(BwdParams, bwd_params, "bwd_params")
    # Bad overrides fail here, before any kernel runs (torch.compile cannot trace the plan code).
    if (fwd is not None or bwd is not None) and not torch.compiler.is_compiling():
        facts, key = device_facts(device), (tuple(q.shape), dtype_name(q.dtype), scale)
        attention_fwd_plan(*key, facts, fwd)
        attention_bwd_plans(*key, facts, bwd)
    n_pad = n_pad_arg(n_pad, batch, seq_len, device)
    args = (q.contiguous(), k.contiguous(), v.contiguous(), n_pad)
    problem = (tuple(q.shape), dtype_name(q.dtype), scale)  # what the plans are built from
    _tuning.autotune(PADDED_FWD, problem, device, args, autotune, fwd)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _tuning.autotune(PADDED_BWD, problem, device, args, autotune, bwd)
    return _padded_attention(*args, scale, encode_params(fwd), encode_params(bwd))[0]
