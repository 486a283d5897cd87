"""softmax, padded_softmax and padded_softmax_v on jax arrays, with custom VJPs."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ejkernel_jax._vma import vary_together
from ejkernel_jax.launch import device_facts, launch
from ejkernel_jax.ops._common import array_arg, first_order, n_pad_arg, name_of, same_device
from ejkernel_jax.ops._folding import call_folding
from triton_kernels import checks
from triton_kernels.padded_attention import scores_v_bwd_plans, scores_v_fwd_plan
from triton_kernels import padded_attention as pa
from triton_kernels import softmax as sm
from triton_kernels.softmax import padded_softmax_fwd_plan, softmax_bwd_plan, softmax_fwd_plan


# -- kernels: each treats every row (batch row for the padded ones) on its own, so under vmap the
# mapped axis folds into the rows (call_folding), one launch for all samples (several past one
# launch's limit: a grid axis, int32 row counts).


def _rows_forward_kernel(x2d):
    return launch(softmax_fwd_plan(*x2d.shape, name_of(x2d), device_facts()), x2d)


def _rows_backward_kernel(y2d, dy2d):
    return launch(softmax_bwd_plan(*y2d.shape, name_of(y2d), device_facts()), y2d, dy2d)


def _padded_probs_kernel(scores, n_pad):
    batch, seq_len, _ = scores.shape
    return launch(padded_softmax_fwd_plan(batch, seq_len, name_of(scores), device_facts()), scores, n_pad)


def _scores_v_forward_kernel(scores, v, n_pad):
    return launch(scores_v_fwd_plan(tuple(v.shape), name_of(v), device_facts()), scores, v, n_pad)


def _scores_v_backward_kernels(scores, v, n_pad, out, lse, dout):
    delta_plan, ds_plan, dv_plan = scores_v_bwd_plans(tuple(v.shape), name_of(v), device_facts())
    (delta,) = launch(delta_plan, out, dout)
    (dscores,) = launch(ds_plan, scores, v, dout, lse, delta, n_pad)
    (dv,) = launch(dv_plan, scores, dout, lse, n_pad)
    return dscores, dv


def _rows_backward(y2d: jax.Array, dy2d: jax.Array) -> jax.Array:
    return call_folding(_rows_backward_kernel, (), y2d, dy2d.astype(y2d.dtype), limit=sm.rows_fold_limit)[0]


@jax.custom_vjp
def _softmax_rows(x2d):
    return call_folding(_rows_forward_kernel, (), x2d, limit=sm.rows_fold_limit)[0]


def _softmax_rows_fwd(x2d):
    y = _softmax_rows(x2d)
    return y, y


def _softmax_rows_bwd(y, dy):
    y, dy = first_order("softmax", (y, dy))
    return (_rows_backward(y, dy),)


_softmax_rows.defvjp(_softmax_rows_fwd, _softmax_rows_bwd)


def _padded_probs(scores, n_pad):
    return call_folding(_padded_probs_kernel, (), scores, n_pad, limit=sm.padded_fold_limit)[0]


@jax.custom_vjp
def _padded_softmax(scores, n_pad):
    return _padded_probs(scores, n_pad)


def _padded_softmax_fwd(scores, n_pad):
    scores, n_pad = first_order("padded_softmax", (scores, n_pad))  # grad of grad differentiates this rule
    y = _padded_probs(scores, n_pad)
    return y, y


def _padded_softmax_bwd(y, dy):
    y, dy = first_order("padded_softmax", (y, dy))
    # y is 0 outside each row's window, so the plain softmax rule gives 0 there too.
    seq_len = y.shape[-1]
    if seq_len == 0:  # no rows to reshape as [-1, 0]
        return jnp.zeros_like(y), None
    return _rows_backward(y.reshape(-1, seq_len), dy.reshape(-1, seq_len)).reshape(y.shape), None


_padded_softmax.defvjp(_padded_softmax_fwd, _padded_softmax_bwd)


def _scores_v_forward(scores, v, n_pad):
    return call_folding(_scores_v_forward_kernel, (), scores, v, n_pad, limit=pa.fold_limit)


@jax.custom_vjp
def _padded_softmax_v(scores, v, n_pad):
    return _scores_v_forward(scores, v, n_pad)[0]


def _padded_softmax_v_fwd(scores, v, n_pad):
    scores, v, n_pad = first_order("padded_softmax_v", (scores, v, n_pad))
    out, lse = _scores_v_forward(scores, v, n_pad)
    return out, (scores, v, n_pad, out, lse)


def _padded_softmax_v_bwd(residuals, dout):
    (scores, v, n_pad, out, lse), dout = first_order("padded_softmax_v", (residuals, dout))
    dscores, dv = call_folding(_scores_v_backward_kernels, (), scores, v, n_pad, out, lse, dout.astype(v.dtype),
                               limit=pa.fold_limit)
    return dscores, dv, None


_padded_softmax_v.defvjp(_padded_softmax_v_fwd, _padded_softmax_v_bwd)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax along ``axis`` with float32 math; rows of only -inf give zeros, not NaN."""
    x = array_arg("x", x)
    axis = checks.softmax(tuple(x.shape), name_of(x), axis)
    sm.check_rows("x", math.prod(x.shape[:axis]) * math.prod(x.shape[axis + 1:]), f"rows (slices along axis {axis})")
    moved = jnp.moveaxis(x, axis, -1)
    y = _softmax_rows(moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]))
    return jnp.moveaxis(y.reshape(moved.shape), -1, axis)


def _padded_inputs(scores, n_pad, v=None):
    scores = array_arg("scores", scores)
    same_device(scores=scores, v=v, n_pad=n_pad)
    batch, seq_len = checks.padded_scores(tuple(scores.shape), name_of(scores))
    return scores, n_pad_arg(n_pad, batch, seq_len)


def padded_softmax(scores: jax.Array, n_pad: jax.Array) -> jax.Array:
    """Causal softmax of ``[batch, seq, seq]`` scores whose first ``n_pad[b]`` tokens are padding.

    Row ``i`` of batch ``b`` normalises over columns ``n_pad[b] <= j <= i``; padding rows are 0.
    """
    scores, n_pad = _padded_inputs(scores, n_pad)
    sm.check_rows("scores", scores.shape[0] * scores.shape[1], "rows (batch * seq)")
    return _padded_softmax(*vary_together((scores, n_pad)))


def padded_softmax_v(scores: jax.Array, v: jax.Array, n_pad: jax.Array) -> jax.Array:
    """``padded_softmax(scores, n_pad) @ v`` in one kernel; v is ``[batch, seq, head_dim]``."""
    scores, n_pad = _padded_inputs(scores, n_pad, v)
    v = array_arg("v", v)
    checks.values_for_scores(tuple(v.shape), name_of(v), *scores.shape[:2], name_of(scores))
    pa.check_batch("scores", *scores.shape[:2])
    pa.check_sequence("scores", scores.shape[1], scores.shape[1])
    pa.check_sequence("v", scores.shape[1], v.shape[-1])
    return _padded_softmax_v(*vary_together((scores, v, n_pad)))
