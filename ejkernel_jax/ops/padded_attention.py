"""padded_attention on jax arrays: forward and backward are Triton kernels (custom VJP)."""
from __future__ import annotations

import functools

import jax

from ejkernel_jax._vma import vary_together
from ejkernel_jax.launch import device_facts, launch
from ejkernel_jax.ops import _tuning
from ejkernel_jax.ops._common import array_arg, first_order, n_pad_arg, name_of, same_device
from ejkernel_jax.ops._folding import call_folding
from triton_kernels import checks
from triton_kernels.tuning import PADDED_BWD, PADDED_FWD
from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan, check_batch, check_sequence, fold_limit
from triton_kernels.params import BwdParams, FwdParams, op_params


# Every kernel treats each batch row on its own: under vmap the mapped axis folds into the batch
# (call_folding), one launch for all samples (several past one launch's batch: fold_limit).


def _forward_kernel(softmax_scale, fwd_params, q, k, v, n_pad):
    problem = (tuple(q.shape), name_of(q), softmax_scale)
    plan = attention_fwd_plan(*problem, device_facts(), _tuning.resolve(PADDED_FWD, problem, fwd_params))
    return launch(plan, q, k, v, n_pad)


def _backward_kernels(softmax_scale, bwd_params, q, k, v, out, lse2, n_pad, dout):
    problem = (tuple(q.shape), name_of(q), softmax_scale)
    delta_plan, dkdv_plan, dq_plan = attention_bwd_plans(*problem, device_facts(),
                                                         _tuning.resolve(PADDED_BWD, problem, bwd_params))
    (delta,) = launch(delta_plan, out, dout)
    dk, dv = launch(dkdv_plan, q, k, v, dout, lse2, delta, n_pad)
    (dq,) = launch(dq_plan, q, k, v, dout, lse2, delta, n_pad)
    return dq, dk, dv


def _forward(q, k, v, n_pad, softmax_scale, fwd_params):
    return call_folding(_forward_kernel, (softmax_scale, fwd_params), q, k, v, n_pad, limit=fold_limit)


# Params are static (hashable FwdParams/BwdParams or None), like the scale.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _padded_attention(q, k, v, n_pad, softmax_scale, fwd_params, bwd_params):
    return _forward(q, k, v, n_pad, softmax_scale, fwd_params)[0]


def _padded_attention_fwd(q, k, v, n_pad, softmax_scale, fwd_params, bwd_params):
    q, k, v, n_pad = first_order("padded_attention", (q, k, v, n_pad))  # grad of grad differentiates this rule
    out, lse2 = _forward(q, k, v, n_pad, softmax_scale, fwd_params)
    return out, (q, k, v, out, lse2, n_pad)


def _padded_attention_bwd(softmax_scale, fwd_params, bwd_params, residuals, dout):
    (q, k, v, out, lse2, n_pad), dout = first_order("padded_attention", (residuals, dout))
    dq, dk, dv = call_folding(_backward_kernels, (softmax_scale, bwd_params), q, k, v, out, lse2, n_pad,
                              dout.astype(q.dtype), limit=fold_limit)
    return dq, dk, dv, None


_padded_attention.defvjp(_padded_attention_fwd, _padded_attention_bwd)


def padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, n_pad: jax.Array,
                     *, softmax_scale: float | None = None, fwd_params: FwdParams | dict | None = None,
                     bwd_params: BwdParams | dict | None = None, autotune: bool | None = None) -> jax.Array:
    """Single-head causal attention over left-padded sequences, ``[batch, seq, head_dim]``.

    Query ``i`` of batch ``b`` attends to keys ``n_pad[b] <= j <= i``; the ``n_pad[b]`` padding
    queries give zeros. ``softmax_scale`` defaults to ``head_dim ** -0.5``. Any sequence length,
    head_dim up to 256, float16/bfloat16/float32. ``fwd_params``/``bwd_params`` override the
    plans as in ``ejkernel_torch.padded_attention``; without them the plans use the config
    cache's entry, else their heuristic. ``autotune`` (default: ``EJKERNEL_AUTOTUNE``) times
    candidates (forward and backward) on a cache miss, on concrete arrays only: under ``jit``
    the cache is only read, when the function is traced. See ``triton_kernels.tuning``.
    """
    q, k, v = (array_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    same_device(q=q, k=k, v=v, n_pad=n_pad)
    batch, seq_len, head_dim = checks.single_head_qkv(
        [tuple(t.shape) for t in (q, k, v)], [name_of(t) for t in (q, k, v)]
    )
    scale = checks.softmax_scale(softmax_scale, head_dim)
    checks.uncapped_softmax_scale(scale, head_dim)
    check_batch("q", batch, seq_len)
    check_sequence("q", seq_len, head_dim)
    fwd, bwd = op_params(FwdParams, fwd_params, "fwd_params"), op_params(BwdParams, bwd_params, "bwd_params")
    if fwd is not None or bwd is not None:  # bad overrides fail here, before any kernel runs
        key = (tuple(q.shape), name_of(q), scale)
        attention_fwd_plan(*key, device_facts(), fwd)
        attention_bwd_plans(*key, device_facts(), bwd)
    n_pad, problem = n_pad_arg(n_pad, batch, seq_len), (tuple(q.shape), name_of(q), scale)
    _tuning.autotune(PADDED_FWD, problem, (q, k, v, n_pad), autotune, fwd)
    _tuning.autotune(PADDED_BWD, problem, (q, k, v, n_pad), autotune, bwd)  # a gradient may follow
    return _padded_attention(*vary_together((q, k, v, n_pad)), scale, fwd, bwd)
