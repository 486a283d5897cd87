"""Plain jnp references for every op. They compute in float32 at least (float64 when the input
is float64 and x64 is enabled), so they serve as upcast references for the kernels."""
from __future__ import annotations

import jax.numpy as jnp


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
