"""Array helpers for the jax front: abstract values, chunking, stable reductions, test inputs."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels import checks
from triton_kernels.params import dtype_name


def abstractify(tree: Any) -> Any:
    """Arrays (jax or numpy) replaced by ``jax.ShapeDtypeStruct`` of the same shape and dtype."""

    def leaf(x):
        if isinstance(x, (jax.Array, np.ndarray)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


def check_narrowing(name: str, x: np.ndarray) -> None:
    """Without x64, jax turns 64-bit numpy integers into 32-bit ones by wrapping them: an int64
    length of 2**32 + 1 would silently become 1. Values that do not fit are an error instead."""
    narrow = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype.kind not in "iu" or narrow == x.dtype or not x.size:
        return
    lo, hi, info = int(x.min()), int(x.max()), np.iinfo(narrow)
    if lo < info.min or hi > info.max:
        raise ValueError(f"{name} holds {x.dtype} values in [{lo}, {hi}], outside {narrow}'s range, which jax "
                         "(jax_enable_x64 off) would wrap; pass values that fit or enable x64")


def _to_jax(x, name: str) -> jax.Array:
    """``jnp.asarray`` of anything array-like, through ``check_narrowing``."""
    if isinstance(x, jax.Array):
        return x
    x = np.asarray(x)
    check_narrowing(name, x)
    return jnp.asarray(x)


def chunk_array(x: jax.Array, chunk_size: int, axis: int = 0, pad_value: float = 0) -> jax.Array:
    """Split ``axis`` into ``[num_chunks, chunk_size]``, padding its end with ``pad_value``."""
    x = _to_jax(x, "x")
    axis, num_chunks, chunk_size, padding = checks.chunking(x.shape, chunk_size, axis)
    pad_value = checks.pad_value(pad_value, dtype_name(x.dtype))
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padding)
    x = jnp.pad(x, pad, constant_values=pad_value)
    return x.reshape(x.shape[:axis] + (num_chunks, chunk_size) + x.shape[axis + 1:])


def unchunk_array(x: jax.Array, original_length: int, axis: int = 0) -> jax.Array:
    """Inverse of ``chunk_array(..., axis=axis)``: merge the two axes it made, drop the padding.

    ``axis`` names the axis as ``chunk_array`` was given it (so ``-1`` round-trips too), and
    ``0 <= original_length <= num_chunks * chunk_size``.
    """
    x = _to_jax(x, "x")
    axis, original_length = checks.unchunking(x.shape, original_length, axis)
    merged = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return jax.lax.slice_in_dim(merged, 0, original_length, axis=axis)


def log_sum_exp(x: jax.Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> jax.Array:
    """``log(sum(exp(x)))`` without overflow; an all ``-inf`` slice gives ``-inf``, not NaN."""
    keepdims = checks.flag("keepdims", keepdims)  # "no" was truthy
    axis = checks.axes("axis", axis, jnp.ndim(x))  # as torch checks it (True was axis 1)
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):  # integers and bools: a float result, as
        dtype = jnp.result_type(float)  # jax.nn.logsumexp's (cast back, [1, 2, 3] gave 3)
        x = jnp.asarray(x, dtype)
    if dtype in (jnp.float16, jnp.bfloat16):  # summed in float32: 70,000 fp16 ones sum to inf
        x = jnp.asarray(x, jnp.float32)
    if any(jnp.shape(x)[a] == 0 for a in axis):  # max of nothing fails; the empty sum is 0, its log -inf
        m = jnp.zeros_like(jnp.sum(x, axis=axis, keepdims=True))
    else:
        m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))  # -inf/inf max: shift by 0 instead
    out = (jnp.log(jnp.sum(jnp.exp(x - m), axis=axis, keepdims=True)) + m).astype(dtype)
    return out if keepdims else jnp.squeeze(out, axis=axis)


def safe_divide(numerator, denominator, min_denominator: float = 1e-10):
    """``numerator / denominator`` with denominators smaller than ``min_denominator`` in magnitude
    replaced by ``±min_denominator`` (sign kept; 0 counts as positive).

    Computed in the result's floating dtype (the one ``/`` gives). Where ``min_denominator`` is
    below that dtype's smallest normal number (1e-10 in float16), the floor is that number
    instead, so it never rounds to 0.
    """
    dtype = jnp.result_type(numerator, denominator)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"safe_divide takes real numbers, got {dtype}")
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.result_type(float)  # what / gives for integers
    den = jnp.asarray(denominator).astype(dtype)
    floor = jnp.asarray(checks.min_denominator(min_denominator, float(jnp.finfo(dtype).tiny),
                                                  float(jnp.finfo(dtype).max)), dtype)
    return numerator / jnp.where(jnp.abs(den) < floor, jnp.where(den < 0, -floor, floor), den)


def _to_numpy(x) -> np.ndarray:
    a = np.asarray(x)
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def assert_allclose(actual, expected, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = True,
                    err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` on jax arrays (bfloat16 included), shapes checked first."""
    a, e = _to_numpy(actual), _to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {e.shape} {err_msg}")
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan, err_msg=err_msg)


def generate_attention_inputs(batch_size: int = 2, seq_len: int = 128, num_heads: int = 8, head_dim: int = 64,
                              dtype=jnp.float32, seed: int = 0, *, kv_seq_len: int | None = None,
                              num_kv_heads: int | None = None, scale: float = 1.0) -> dict[str, jax.Array]:
    """Random ``query``/``key``/``value`` in ``[batch, seq, heads, head_dim]``.

    Drawn with numpy from ``seed``, so the torch front's function gives the same values: a
    ready-made input for torch-vs-jax parity checks.
    """
    sizes = dict(batch_size=batch_size, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim,
                 kv_seq_len=kv_seq_len, num_kv_heads=num_kv_heads)
    shapes, seed, scale = checks.attention_inputs(sizes, seed, scale)
    rng = np.random.default_rng(seed)
    dtype = _dtype(dtype)
    return {name: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype)
            for name, shape in shapes.items()}


def _dtype(dtype):
    """jnp.dtype of ``dtype``; None is jax's default float dtype, as in ``astype(None)`` (float64
    with x64 on), found without making an array on the default device."""
    try:
        return jnp.dtype(dtype) if dtype is not None else jax.dtypes.canonicalize_dtype(jnp.float64)
    except TypeError:
        raise TypeError(f"dtype must be a dtype, got {dtype!r}") from None
