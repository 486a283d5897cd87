"""softmax, padded_softmax and padded_softmax_v on torch tensors, with autograd."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ejkernel_torch.launch import device_facts, dtype_name, launch_traceable
from ejkernel_torch.ops._common import (KernelFunction, KernelOp, first_order, n_pad_arg, name_of,
                                        same_device, saved_tensors, static_shape, tensor_arg)
from triton_kernels import checks
from triton_kernels.padded_attention import scores_v_bwd_plans, scores_v_fwd_plan
from triton_kernels import padded_attention as pa
from triton_kernels import softmax as sm
from triton_kernels.softmax import padded_softmax_fwd_plan, softmax_bwd_plan, softmax_fwd_plan


# -- kernels, as registered ops (KernelOp): inputs are checked and contiguous --------------------
# Each treats every row (batch row for the padded ones) on its own: under vmap the mapped axis
# folds into the rows, one launch for all samples.

def _rows_forward(x2d: Tensor) -> Tensor:
    plan = softmax_fwd_plan(*static_shape(x2d), dtype_name(x2d.dtype), device_facts(x2d.device))
    return launch_traceable(plan, x2d)[0]


def _rows_backward(y2d: Tensor, dy2d: Tensor) -> Tensor:
    plan = softmax_bwd_plan(*static_shape(y2d), dtype_name(y2d.dtype), device_facts(y2d.device))
    return launch_traceable(plan, y2d, dy2d)[0]


def _padded_probs(scores: Tensor, n_pad: Tensor) -> Tensor:
    batch, seq_len, _ = static_shape(scores)
    plan = padded_softmax_fwd_plan(batch, seq_len, dtype_name(scores.dtype), device_facts(scores.device))
    return launch_traceable(plan, scores, n_pad)[0]


def _scores_v_forward(scores: Tensor, v: Tensor, n_pad: Tensor) -> tuple[Tensor, Tensor]:
    plan = scores_v_fwd_plan(static_shape(v), dtype_name(v.dtype), device_facts(v.device))
    out, lse = launch_traceable(plan, scores, v, n_pad)
    return out, lse


def _scores_v_backward(scores: Tensor, v: Tensor, n_pad: Tensor, out: Tensor, lse: Tensor,
                       dout: Tensor) -> tuple[Tensor, Tensor]:
    delta_plan, ds_plan, dv_plan = scores_v_bwd_plans(static_shape(v), dtype_name(v.dtype), device_facts(v.device))
    (delta,) = launch_traceable(delta_plan, out, dout)
    (dscores,) = launch_traceable(ds_plan, scores, v, dout, lse, delta, n_pad)
    (dv,) = launch_traceable(dv_plan, scores, dout, lse, n_pad)
    return dscores, dv


# Folded past a launch's limit (a grid axis, int32 row counts), the samples go to several launches.
_rows_forward_op = KernelOp("softmax_rows_fwd", _rows_forward, kernels=(sm.softmax_fwd_kernel,), folds_under_vmap=True,
                            fold_limit=sm.rows_fold_limit)
_rows_backward_op = KernelOp("softmax_rows_bwd", _rows_backward, kernels=(sm.softmax_bwd_kernel,),
                             folds_under_vmap=True, fold_limit=sm.rows_fold_limit)
_padded_probs_op = KernelOp("padded_softmax_fwd", _padded_probs, kernels=(sm.padded_softmax_fwd_kernel,),
                            folds_under_vmap=True, fold_limit=sm.padded_fold_limit)
_scores_v_forward_op = KernelOp("padded_softmax_v_fwd", _scores_v_forward, kernels=(pa.scores_v_fwd_kernel,),
                                folds_under_vmap=True, fold_limit=pa.fold_limit)
_scores_v_backward_op = KernelOp("padded_softmax_v_bwd", _scores_v_backward, kernels=(
    pa.attention_bwd_delta_kernel, pa.scores_v_bwd_ds_kernel, pa.scores_v_bwd_dv_kernel), folds_under_vmap=True,
    fold_limit=pa.fold_limit)


def _softmax_rows_backward(y2d: Tensor, dy2d: Tensor) -> Tensor:
    return _rows_backward_op(y2d, dy2d.to(y2d.dtype).contiguous())


# Gradients (KernelFunction: forward, setup_context, backward)

def _save_probs(ctx, inputs, output):
    ctx.save_for_backward(output)


def _rows_grad(ctx, dy):
    (y,) = saved_tensors(ctx)
    return first_order("softmax", (_softmax_rows_backward(y, dy),), (y, dy))


def _padded_grad(ctx, dy):
    # Same rule as plain softmax: y is 0 outside each row's window, so the gradient is too.
    (y,) = saved_tensors(ctx)
    seq_len = y.shape[-1]
    if seq_len == 0:  # no rows to view as [-1, 0]
        return torch.zeros_like(y), None
    dscores = _softmax_rows_backward(y.view(-1, seq_len), dy.reshape(-1, seq_len)).view_as(y)
    return first_order("padded_softmax", (dscores, None), (y, dy))


def _scores_v_setup(ctx, inputs, output):
    # (out, lse): lse is an output only to be saved (setup_context sees inputs and outputs only)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(*inputs, *output)


def _scores_v_grad(ctx, dout, _dlse):
    scores, v, n_pad, out, lse = saved_tensors(ctx)
    dscores, dv = _scores_v_backward_op(scores, v, n_pad, out, lse, dout.to(v.dtype).contiguous())
    return first_order("padded_softmax_v", (dscores, dv, None), (scores, v, out, dout))


_softmax_rows = KernelFunction("SoftmaxRows", _rows_forward_op, _save_probs, _rows_grad)  # contiguous 2-D, last axis
_padded_softmax = KernelFunction("PaddedSoftmax", _padded_probs_op, _save_probs, _padded_grad)
_padded_softmax_v = KernelFunction("PaddedSoftmaxV", _scores_v_forward_op, _scores_v_setup, _scores_v_grad)


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Softmax along ``axis`` with float32 math; rows of only -inf give zeros, not NaN."""
    x = tensor_arg("x", x)
    axis = checks.softmax(tuple(x.shape), name_of(x), axis)
    sm.check_rows("x", math.prod(x.shape[:axis]) * math.prod(x.shape[axis + 1:]), f"rows (slices along axis {axis})")
    if axis == x.ndim - 1:  # the common case: no transposes
        shape = x.shape
        return _softmax_rows(x.contiguous().view(math.prod(shape[:-1]), shape[-1])).view(shape)
    moved = x.movedim(axis, -1)
    shape = moved.shape
    y = _softmax_rows(moved.contiguous().reshape(math.prod(shape[:-1]), shape[-1]))
    return y.reshape(shape).movedim(-1, axis)


def _padded_inputs(scores, n_pad):
    scores = tensor_arg("scores", scores)
    batch, seq_len = checks.padded_scores(tuple(scores.shape), name_of(scores))
    device = same_device(scores=scores)
    return scores.contiguous(), n_pad_arg(n_pad, batch, seq_len, device)


def padded_softmax(scores: torch.Tensor, n_pad: torch.Tensor) -> torch.Tensor:
    """Causal softmax of ``[batch, seq, seq]`` scores whose first ``n_pad[b]`` tokens are padding.

    Row ``i`` of batch ``b`` normalises over columns ``n_pad[b] <= j <= i``; padding rows are 0.
    """
    scores, n_pad = _padded_inputs(scores, n_pad)
    batch, seq_len = scores.shape[:2]
    sm.check_rows("scores", batch * seq_len, "rows (batch * seq)")
    return _padded_softmax(scores, n_pad)


def padded_softmax_v(scores: torch.Tensor, v: torch.Tensor, n_pad: torch.Tensor) -> torch.Tensor:
    """``padded_softmax(scores, n_pad) @ v`` in one kernel; v is ``[batch, seq, head_dim]``."""
    scores, v = tensor_arg("scores", scores), tensor_arg("v", v)
    batch, seq_len = checks.padded_scores(tuple(scores.shape), name_of(scores))
    checks.values_for_scores(tuple(v.shape), name_of(v), batch, seq_len, name_of(scores))
    pa.check_batch("scores", batch, seq_len)
    pa.check_sequence("scores", seq_len, seq_len)  # before _padded_inputs copies a strided scores
    pa.check_sequence("v", seq_len, v.shape[-1])
    scores, n_pad = _padded_inputs(scores, n_pad)
    same_device(scores=scores, v=v)
    return _padded_softmax_v(scores, v.contiguous(), n_pad)[0]
