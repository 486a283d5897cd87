"""Plain jnp references for every op. They compute in float32 at least (float64 when the input
is float64 and x64 is enabled), so they serve as upcast references for the kernels."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _upcast(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def softmax(x, axis: int = -1):
    # Rows of only -inf give zeros (the kernels' convention), not NaN.
    x = _upcast(x)
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(s > 0, s, 1.0)


def causal_padding_mask(n_pad, seq_len: int):
    """[batch, seq, seq] bool: query i sees key j iff n_pad[b] <= j <= i."""
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    return (j <= i)[None] & (j[None] >= jnp.asarray(n_pad)[:, None, None])


def padded_softmax(scores, n_pad):
    mask = causal_padding_mask(n_pad, scores.shape[-1])
    return softmax(jnp.where(mask, _upcast(scores), -jnp.inf), -1)


def padded_softmax_v(scores, v, n_pad):
    return padded_softmax(scores, n_pad) @ _upcast(v)


def padded_attention(q, k, v, n_pad, *, softmax_scale=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q, k = _upcast(q), _upcast(k)
    return padded_softmax_v(q @ jnp.swapaxes(k, -1, -2) * scale, v, n_pad)


def _group_masks(group_sizes, m: int, group_offset, num: int):
    """[num, m] bool: row r belongs to group group_offset + i (traceable: sizes may be traced)."""
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    starts = ends - group_sizes
    g = group_offset + jnp.arange(num)
    rows = jnp.arange(m)[None, :]
    return (rows >= starts[g][:, None]) & (rows < ends[g][:, None])


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=0):
    """Rows of group ``group_offset + i`` times ``rhs[i]``; other rows are 0."""
    lhs, rhs = _upcast(lhs), _upcast(rhs)
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    masks = _group_masks(group_sizes, lhs.shape[0], group_offset, rhs.shape[0])
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    for i in range(rhs.shape[0]):
        out = out + jnp.where(masks[i][:, None], lhs @ rhs[i], 0)
    return out


def transposed_grouped_matmul(lhs, rhs, group_sizes, *, group_offset=0, num_actual_groups=None):
    """``out[i] = lhs[:, rows] @ rhs[rows]`` for the rows of group ``group_offset + i``."""
    lhs, rhs = _upcast(lhs), _upcast(rhs)
    num = group_sizes.shape[0] if num_actual_groups is None else num_actual_groups
    masks = _group_masks(group_sizes, rhs.shape[0], group_offset, num)
    return jnp.stack([jnp.where(masks[i][None, :], lhs, 0) @ rhs for i in range(num)]) if num \
        else jnp.zeros((0, lhs.shape[0], rhs.shape[1]), lhs.dtype)


# -- flash attention -------------------------------------------------------------------------------


def _window_sides(causal, sliding_window):
    if sliding_window is None:
        return (None, 0) if causal else None
    left, right = sliding_window if isinstance(sliding_window, (tuple, list)) else (sliding_window,) * 2
    return (left, 0 if causal else right)


def flash_attention_keep(seq_q, seq_k, *, causal=False, sliding_window=None, q_segment_ids=None,
                         kv_segment_ids=None):
    """[batch|1, 1, seq_q, seq_k] bool: which keys each query attends (bottom-right aligned)."""
    i = jnp.arange(seq_q)[:, None]
    j = jnp.arange(seq_k)[None, :]
    keep = jnp.ones((seq_q, seq_k), bool)
    window = _window_sides(causal, sliding_window)
    if window is not None:
        diag = i + seq_k - seq_q
        left, right = window
        if left is not None:
            keep &= j >= diag - left
        if right is not None:
            keep &= j <= diag + right
    keep = keep[None, None]
    if q_segment_ids is not None:
        qs = jnp.asarray(q_segment_ids)[:, None, :, None]
        ks = jnp.asarray(kv_segment_ids)[:, None, None, :]
        keep = keep & (qs == ks) & (qs > 0)
    return keep


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, sliding_window=None, logits_soft_cap=None,
                    bias=None, q_segment_ids=None, kv_segment_ids=None, dropout_p=0.0, dropout_mask=None,
                    return_lse=False):
    """softmax(mask(cap * tanh(q k^T * scale / cap) + bias)) [* keep / (1 - p)] v, [b, s, h, d] layout
    (mirror of ejkernel_torch.reference.flash_attention)."""
    heads_q, heads_kv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    k = jnp.repeat(k, heads_q // heads_kv, axis=2)
    v = jnp.repeat(v, heads_q // heads_kv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + _upcast(bias)
    keep = flash_attention_keep(q.shape[1], k.shape[1], causal=causal, sliding_window=sliding_window,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    s = jnp.where(keep, s, -jnp.inf)
    # initial: with no keys at all max has nothing to reduce (it raised); every row attends nothing.
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    attended = total > 0
    p = e / jnp.where(attended, total, 1.0)
    lse = jnp.where(attended, m + jnp.log(jnp.where(attended, total, 1.0)), -jnp.inf)[..., 0]
    if dropout_mask is not None:
        p = p * jnp.asarray(dropout_mask, p.dtype) / (1.0 - dropout_p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_mask=None,
                           return_lse=False, **options):
    """``flash_attention`` per packed sequence (mirror of ejkernel_torch.reference.flash_attention_varlen);
    the dropout mask is that of the padded ``[n_seq, heads_q, max_seqlen_q, max_seqlen_k]`` problem.
    Tokens past the last sequence give 0. A Python loop: ``cu_seqlens`` must be concrete."""
    cu_q, cu_k = [int(i) for i in np.asarray(cu_seqlens_q)], [int(i) for i in np.asarray(cu_seqlens_k)]
    dtype = jnp.promote_types(jnp.result_type(q), jnp.float32)
    out = jnp.zeros(q.shape[:2] + v.shape[2:], dtype)
    lse = jnp.zeros((q.shape[1], q.shape[0]), dtype)
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        mask = None if dropout_mask is None else jnp.asarray(dropout_mask)[b:b + 1, :, :q1 - q0, :k1 - k0]
        o, s = flash_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_mask=mask, return_lse=True,
                               **options)
        out, lse = out.at[q0:q1].set(o[0]), lse.at[:, q0:q1].set(s[0])
    return (out, lse) if return_lse else out
