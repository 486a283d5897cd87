"""flash_attention and flash_attention_varlen on jax arrays: the shared Triton kernels with a
custom VJP. Works under jit, grad and vmap; options are static Python values."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ejkernel_jax._vma import vary_together
from ejkernel_jax.launch import any_traced, device_facts, launch
from ejkernel_jax.ops import _tuning
from ejkernel_jax.ops._common import array_arg, first_order, is_concrete, name_of, same_device
from ejkernel_jax.ops._folding import fold, in_chunks, unfold
from triton_kernels import checks, flash_attention as fa
from triton_kernels.flash_attention.spec import dropout as check_dropout, dropout_mask_sizes
from triton_kernels.params import BwdParams, FwdParams, op_params
from triton_kernels.tuning import FLASH_BWD, FLASH_FWD, autotune_enabled

# aux arrays (never differentiated): q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed


def _features(q, k, v, bias, aux) -> list[jax.Array]:
    """The kernels' nine feature inputs, with one-element stand-ins for unused ones."""
    dummy_float = jnp.zeros((1,), q.dtype)
    dummy_int = jnp.zeros((1,), jnp.int32)
    return [q, k, v, dummy_float if bias is None else bias] + [dummy_int if a is None else a for a in aux]


def _forward_kernel(spec, params, q, k, v, bias, aux):
    plan = fa.forward_plan(spec, device_facts(), _tuning.resolve(FLASH_FWD, spec, params[0]))
    return tuple(launch(plan, *_features(q, k, v, bias, aux)))


def _backward_kernels(spec, params, bias_grad, use_dlse, q, k, v, bias, aux, out, lse, dout, dlse):
    """(dq, dk, dv, ds): ds is the float32 gradient of the full scores, a [1] stand-in unless
    bias_grad; ``dlse`` is None unless use_dlse."""
    plans = fa.backward_plans(spec, device_facts(), bias_grad, use_dlse, _tuning.resolve(FLASH_BWD, spec, params[1]))
    dlse_arg = dlse if use_dlse else jnp.zeros((1,), jnp.float32)
    return plans.gradients(launch, _features(q, k, v, bias, aux), out, dout, lse, dlse_arg)


# -- vmap: the mapped axis folded into the batch --------------------------------------------------
# The launches' own vmap rule runs one launch per sample, in sequence (lax.map). The kernels treat
# every (batch row, head) on its own, so a dense call maps instead by folding the mapped axis into
# the batch: one launch for all samples. Not with dropout (the mask is drawn by batch-row index, so
# a folded sample would draw another row's mask) nor varlen (cu_seqlens index packed tokens).


def _foldable(spec) -> bool:
    return not spec.varlen and spec.dropout_p == 0.0


def _fold_call(spec, n, in_batched, arrays):
    """The spec of the folded call and its arrays (q, k, v, bias, q_seg, kv_seg, then more
    ``[batch, ...]`` arrays; None stays None). A bias the same for every batch row and sample
    (``[1, ...]``, unmapped) stays so; the kernels broadcast it."""
    bias, bias_spec = arrays[3], spec.bias
    shared_bias = bias is not None and not in_batched[3] and bias.shape[0] == 1
    folded = [x if x is None or (i == 3 and shared_bias) else fold(x, b, n, spec.batch)
              for i, (x, b) in enumerate(zip(arrays, in_batched))]
    if bias is not None and not shared_bias:
        bias_spec = (n * spec.batch, spec.bias[1])
    return dataclasses.replace(spec, batch=n * spec.batch, bias=bias_spec), folded


@functools.lru_cache(maxsize=256)
def _folding(kernels, spec, static: tuple, shared_outputs: tuple = ()):
    """``kernels(spec, *static, q, k, v, bias, aux, *rest)`` (the forward or backward kernels of a
    dense call) on ``(q, k, v, bias, q_seg, kv_seg, *rest)``, with a vmap rule that folds.
    ``shared_outputs``: indices of outputs that are the same for every sample (placeholders)."""

    @jax.custom_batching.custom_vmap
    def run(q, k, v, bias, q_seg, kv_seg, *rest):
        return tuple(kernels(spec, *static, q, k, v, bias, (q_seg, kv_seg, None, None, None), *rest))

    @run.def_vmap
    def _rule(n, in_batched, *arrays):
        # The folded batch is a grid axis: past its limit the samples go to several launches.
        def launch(size, chunk):
            folded_spec, folded = _fold_call(spec, size, in_batched, chunk)
            return _folding(kernels, folded_spec, static, shared_outputs)(*folded)  # an outer vmap folds again

        outputs = in_chunks(fa.fold_chunks(n, spec.batch), n, arrays, in_batched, launch, shared_outputs)
        batched = tuple(i not in shared_outputs for i in range(len(outputs)))
        return tuple(unfold(o, n, spec.batch) if b else o for o, b in zip(outputs, batched)), batched

    return run


def _forward(spec, params, q, k, v, bias, aux):
    if _foldable(spec) and any_traced(q, k, v, bias, *aux):
        return _folding(_forward_kernel, spec, (params,))(q, k, v, bias, aux[0], aux[1])
    return _forward_kernel(spec, params, q, k, v, bias, aux)


def _backward(spec, params, bias_grad, use_dlse, q, k, v, bias, aux, out, lse, dout, dlse):
    if _foldable(spec) and any_traced(q, k, v, bias, *aux, out, lse, dout, dlse):
        shared = () if bias_grad else (3,)  # ds: else a [1] stand-in, the same for every sample
        return _folding(_backward_kernels, spec, (params, bias_grad, use_dlse), shared)(
            q, k, v, bias, aux[0], aux[1], out, lse, dout, dlse)
    return _backward_kernels(spec, params, bias_grad, use_dlse, q, k, v, bias, aux, out, lse, dout, dlse)


# params: (FwdParams | None, BwdParams | None), static like the spec.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(spec, params, q, k, v, bias, aux):
    return _forward(spec, params, q, k, v, bias, aux)


def _flash_fwd(spec, params, q, k, v, bias, aux):
    # symbolic_zeros: arguments arrive as CustomVJPPrimal, which says whether bias is differentiated.
    bias_grad = bias is not None and bias.perturbed
    q, k, v = q.value, k.value, v.value
    bias = None if bias is None else bias.value
    aux = tuple(None if a is None else a.value for a in aux)
    q, k, v, bias, aux = first_order("flash_attention", (q, k, v, bias, aux))  # grad of grad differentiates this rule
    out, lse = _forward(spec, params, q, k, v, bias, aux)
    return (out, lse), (q, k, v, bias, aux, out, lse, bias_grad)


def _flash_bwd(spec, params, residuals, cotangents):
    (q, k, v, bias, aux, out, lse, bias_grad), (dout, dlse) = first_order("flash_attention", (residuals, cotangents))
    dout = jnp.zeros_like(out) if isinstance(dout, SymbolicZero) else dout.astype(q.dtype)
    use_dlse = not isinstance(dlse, SymbolicZero)
    dlse = dlse.astype(jnp.float32) if use_dlse else None
    dq, dk, dv, ds = _backward(spec, params, bias_grad, use_dlse, q, k, v, bias, aux, out, lse, dout, dlse)
    dbias = _sum_to(ds, bias.shape).astype(bias.dtype) if bias_grad else None
    return dq, dk, dv, dbias, (None,) * len(aux)


def _sum_to(ds, shape):
    dims = tuple(d for d in (0, 1) if shape[d] == 1 and ds.shape[d] != 1)
    return ds.sum(axis=dims, keepdims=True) if dims else ds


_flash.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)

# --------------------------------------------------------------------------------------------
# public functions


def _optional(name, x):
    return None if x is None else array_arg(name, x)


def _segment_ids(spec, x):
    return None if x is None else x.astype(spec.segment_dtype)


def _seed(dropout_seed, dropout_p: float):
    if dropout_p == 0.0:
        if dropout_seed is not None:  # unused, but a bad one is still an error
            _seed_array(dropout_seed)
        return None
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed in jax (an int or an integer array)")
    return _seed_array(dropout_seed)


def _seed_array(dropout_seed) -> jax.Array:
    if not isinstance(dropout_seed, jax.Array):  # ints and numpy arrays, or refused as torch does
        return jnp.full((1,), fa.seed_value(dropout_seed), jnp.int32)
    seed = array_arg("dropout_seed", dropout_seed)
    fa.seed_array(tuple(seed.shape), name_of(seed))
    if seed.dtype == jnp.uint32:  # same bits as torch's int32 view of the seed
        seed = jax.lax.bitcast_convert_type(seed, jnp.int32)
    return seed.reshape(1).astype(jnp.int32)


def _shape_dtype(x):
    return (None, None) if x is None else (tuple(x.shape), name_of(x))


def _params(spec, fwd_params, bwd_params):
    """(FwdParams | None, BwdParams | None), checked against the plans before any kernel runs."""
    params = op_params(FwdParams, fwd_params, "fwd_params"), op_params(BwdParams, bwd_params, "bwd_params")
    if params != (None, None):
        fa.forward_plan(spec, device_facts(), params[0])
        fa.backward_plans(spec, device_facts(), False, False, params[1])
    return params


def _autotune(spec, params, q, k, v, bias, aux, autotune) -> None:
    """On a cache miss with autotuning enabled and concrete arrays (never under jit), tune the
    forward and the backward (whether a gradient follows is not known here)."""
    if not autotune_enabled(autotune):
        return
    features = _features(q, k, v, bias, aux)
    _tuning.autotune(FLASH_FWD, spec, features, autotune, params[0])
    _tuning.autotune(FLASH_BWD, spec, features, autotune, params[1])


def flash_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    sliding_window=None, logits_soft_cap: float | None = None, bias=None,
                    q_segment_ids=None, kv_segment_ids=None, dropout_p: float = 0.0, dropout_seed=None,
                    return_lse: bool = False, fwd_params: FwdParams | dict | None = None,
                    bwd_params: BwdParams | dict | None = None, autotune: bool | None = None):
    """Attention softmax(q k^T * scale [soft cap] + bias, masked) v with flash-attention kernels.

    Same arguments, defaults and semantics as ``ejkernel_torch.flash_attention``: q
    ``[batch, seq_q, heads_q, head_dim]``, k/v ``[batch, seq_k, heads_kv, head_dim]``; causal is
    bottom-right aligned; ``softmax_scale`` None means ``head_dim ** -0.5``; ``sliding_window`` int
    or (left, right); ``logits_soft_cap``; additive
    ``bias`` ``[batch|1, heads_q|1, seq_q, seq_k]`` (differentiable); segment ids ``[batch, seq]``
    (ids <= 0 are padding, masked but still read: keep its q/k/v finite; int64 ids, which need
    jax_enable_x64, are compared as int64); dropout from
    ``dropout_seed`` (required when ``dropout_p`` > 0: an int or an integer array, uint32 read as
    its bits, traced values welcome); ``return_lse`` adds the float32 log-sum-exp
    ``[batch, heads_q, seq_q]``. Rows that attend nothing give 0, lse -inf and zero gradients.
    ``fwd_params``/``bwd_params`` override the kernels' tiles, warps and stages; without them the
    plans use the config cache's entry for these shapes and device, else their heuristic.
    ``autotune`` (default: ``EJKERNEL_AUTOTUNE``) times candidates (forward and backward) on a
    cache miss, on concrete arrays only: under ``jit``/``grad``/``vmap`` tracing the cache is
    only read, when the function is traced. See ``triton_kernels.tuning``.
    """
    q, k, v = (array_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    bias = _optional("bias", bias)
    q_seg = _optional("q_segment_ids", q_segment_ids)
    kv_seg = _optional("kv_segment_ids", kv_segment_ids)
    same_device(q=q, k=k, v=v, bias=bias, q_segment_ids=q_seg, kv_segment_ids=kv_seg, dropout_seed=dropout_seed)
    (bias_shape, bias_dtype), (qs_shape, qs_dtype), (ks_shape, ks_dtype) = map(_shape_dtype, (bias, q_seg, kv_seg))
    spec = fa.dense_spec(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), (name_of(q), name_of(k), name_of(v)), causal=causal,
        softmax_scale=softmax_scale, sliding_window=fa.window_arg(sliding_window), logits_soft_cap=logits_soft_cap,
        bias_shape=bias_shape, bias_dtype=bias_dtype, q_segment_shape=qs_shape, q_segment_dtype=qs_dtype,
        kv_segment_shape=ks_shape, kv_segment_dtype=ks_dtype, dropout_p=dropout_p)
    return_lse = checks.flag("return_lse", return_lse)  # "no" is truthy
    params = _params(spec, fwd_params, bwd_params)
    aux = (_segment_ids(spec, q_seg), _segment_ids(spec, kv_seg), None, None, _seed(dropout_seed, spec.dropout_p))
    _autotune(spec, params, q, k, v, bias, aux, autotune)
    out, lse = _flash(spec, params, *vary_together((q, k, v, bias, aux)))
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, softmax_scale: float | None = None, sliding_window=None,
                           logits_soft_cap: float | None = None, bias=None, q_segment_ids=None,
                           kv_segment_ids=None, dropout_p: float = 0.0, dropout_seed=None,
                           return_lse: bool = False, fwd_params: FwdParams | dict | None = None,
                           bwd_params: BwdParams | dict | None = None, autotune: bool | None = None):
    """``flash_attention`` over packed sequences, as ``ejkernel_torch.flash_attention_varlen``:
    q ``[total_q, heads_q, head_dim]``, k/v ``[total_k, heads_kv, head_dim]``, int32 cu_seqlens
    ``[n_seq + 1]`` (values checked when concrete; under jit the kernels clamp them), static
    ``max_seqlen_*``. lse is ``[heads_q, total_q]``. No bias or segment ids. ``fwd_params``,
    ``bwd_params`` and ``autotune`` as in ``flash_attention``.
    """
    q, k, v = (array_arg(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    if bias is not None or q_segment_ids is not None or kv_segment_ids is not None:
        raise ValueError("flash_attention_varlen takes no bias or segment ids (sequences are given by cu_seqlens)")
    cu_q, cu_k = array_arg("cu_seqlens_q", cu_seqlens_q), array_arg("cu_seqlens_k", cu_seqlens_k)
    same_device(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_seed=dropout_seed)
    spec = fa.varlen_spec(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), (name_of(q), name_of(k), name_of(v)),
        tuple(cu_q.shape), name_of(cu_q), tuple(cu_k.shape), name_of(cu_k), max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, sliding_window=fa.window_arg(sliding_window),
        logits_soft_cap=logits_soft_cap, dropout_p=dropout_p)
    for name, cu, total, max_len in (("cu_seqlens_q", cu_q, spec.total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_k, spec.total_k, max_seqlen_k)):
        if is_concrete(cu):
            fa.cu_seqlens_values(name, jax.device_get(cu).tolist(), total, max_len)
    return_lse = checks.flag("return_lse", return_lse)  # "no" is truthy
    params = _params(spec, fwd_params, bwd_params)
    aux = (None, None, cu_q, cu_k, _seed(dropout_seed, spec.dropout_p))
    _autotune(spec, params, q, k, v, None, aux, autotune)
    out, lse = _flash(spec, params, *vary_together((q, k, v, None, aux)))
    return (out, lse) if return_lse else out


def flash_attention_dropout_mask(dropout_seed, batch: int, heads: int, seq_q: int, seq_k: int,
                                 dropout_p: float) -> jax.Array:
    """The bool keep-mask ``[batch, heads, seq_q, seq_k]`` flash attention draws for this seed;
    bit-for-bit ``ejkernel_torch.flash_attention_dropout_mask``."""
    plan = fa.dropout_mask_plan(*dropout_mask_sizes(batch, heads, seq_q, seq_k), check_dropout(dropout_p),
                                device_facts())
    return launch(plan, _seed_array(dropout_seed))[0].astype(bool)
