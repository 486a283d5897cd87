"""Packed-sequence helpers: cu_seqlens, position/sequence ids, chunk indices, segment-id masks.

``ejkernel_torch.xla_utils`` has the same functions with the same semantics; the tests check
both against one loop reference and against each other.

Conventions:
- ``cu_seqlens`` is 1-D int32 or int64, starts at 0 and is non-decreasing:
  ``[0, len0, len0+len1, ...]``. Empty sequences are allowed. Outputs indexed by token or chunk
  have ``cu_seqlens``'s dtype. Narrower or unsigned dtypes are refused (offsets would wrap).
- Without ``jax_enable_x64``, jax keeps integers in 32 bits: int64 numpy inputs become int32
  (so results are int32 where the torch front returns int64), and one whose values do not fit
  in int32 raises a ``ValueError`` instead of wrapping.
- Everything is vectorized and jit-able. Where the output length depends on values
  (``cu_seqlens[-1]`` tokens, or the number of chunks), pass it as a static int
  (``total_tokens=`` / ``total_chunks=``); without it the function works eagerly and raises a
  ``ValueError`` under ``jax.jit``. Slots past the end (a static size larger than needed, as
  when packing to a fixed budget) are padding and hold -1 in every output.
- Value checks (a first boundary other than 0, negative lengths, a too-small static size) run
  whenever values are concrete; under ``jit`` they cannot, and bad values give unspecified
  results.
- Segment ids: ids <= 0 are padding; tokens attend only to tokens with the same positive id.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from triton_kernels import checks

from .utils.arrays import _to_jax

__all__ = [
    "cdiv", "identity_dtype_convert", "mask_to_segment_ids", "prepare_chunk_indices",
    "prepare_chunk_offsets", "prepare_cu_seqlens_from_mask", "prepare_lens",
    "prepare_lens_from_mask", "prepare_position_ids", "prepare_sequence_ids",
    "prepare_token_indices", "segment_ids_to_mask",
]


def cdiv(a, b):
    """Ceiling division for ints and integer arrays."""
    return -(-a // b)


# -- validation --------------------------------------------------------------------------------


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _int_array(x, name: str, ndim: int | None = None, offsets: bool = False) -> jax.Array:
    """An integer array; ``offsets`` (lengths, boundaries) must be int32 or int64, since a
    narrower or unsigned dtype wraps around when they are added or subtracted."""
    if isinstance(x, (list, tuple)) and not x:  # not the float64 numpy gives []: the size checks name it
        x = np.zeros(0, np.int32)
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    if offsets and x.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    x = _to_jax(x, name)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    return x


def _mask_array(mask, name: str) -> jax.Array:
    # Compared with 0 before any jax conversion, which could wrap a nonzero int64 to 0.
    mask = mask if isinstance(mask, jax.Array) else np.asarray(mask)
    if mask.dtype != jnp.bool_:
        if not jnp.issubdtype(mask.dtype, jnp.integer):
            raise TypeError(f"{name} must be bool or integer (nonzero = valid), got {mask.dtype}")
        mask = mask != 0
    return jnp.asarray(mask)


def _dtype(dtype, name: str = "dtype") -> np.dtype:
    """``jnp.dtype`` naming the argument, as torch's front does; None is refused there too (numpy
    reads it as float64)."""
    if dtype is None:
        raise TypeError(f"{name} must be a dtype, got None")
    try:
        return jnp.dtype(dtype)
    except TypeError:  # "data type 'nonsense' not understood"
        raise TypeError(f"{name} must be a dtype, got {dtype!r}") from None


def _cu_seqlens(cu_seqlens) -> jax.Array:
    cu = _int_array(cu_seqlens, "cu_seqlens", ndim=1, offsets=True)
    if cu.shape[0] < 1:
        raise ValueError("cu_seqlens must hold at least one boundary, got an empty array")
    if not _traced(cu):
        values = np.asarray(cu)
        if values[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
        lens = np.diff(values)
        if (lens < 0).any():
            raise ValueError(f"cu_seqlens must be non-decreasing (lengths >= 0), got lengths {lens.tolist()}")
    return cu


def _chunk_size(chunk_size) -> int:
    if _traced(chunk_size):
        raise TypeError("chunk_size must be a static Python int, got a traced value")
    return checks.chunk_size(chunk_size)


def _static_size(size, bounds: jax.Array, arg: str, fn: str) -> int:
    """The output length: ``size`` if given (checked when possible), else ``bounds[-1]`` eagerly."""
    if size is None:
        if _traced(bounds):
            raise ValueError(
                f"{fn}: the output length depends on the values of cu_seqlens, which jax.jit does "
                f"not know; pass {arg}=<int> (a static Python int)"
            )
        return checks.layout_length(fn, arg, int(bounds[-1]), given=False)
    if _traced(size):
        raise TypeError(f"{fn}: {arg} must be a static Python int, got a traced value")
    size = checks.int_arg(f"{fn}: {arg}", size)
    if size < 0:
        raise ValueError(f"{fn}: {arg} must be >= 0, got {size}")
    if not _traced(bounds) and size < int(bounds[-1]):
        raise ValueError(f"{fn}: {arg}={size} is smaller than the {int(bounds[-1])} cu_seqlens needs")
    return checks.layout_length(fn, arg, size, given=True)


def _layout(bounds: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """For slots 0..size-1: the segment of ``bounds`` holding each slot and the offset in it."""
    slot = jnp.arange(size, dtype=bounds.dtype)
    # Last boundary <= slot; side="right" skips empty segments (repeated boundaries).
    owner = jnp.searchsorted(bounds, slot, side="right").astype(bounds.dtype) - 1
    valid = (slot >= bounds[0]) & (slot < bounds[-1])
    owner = jnp.where(valid, owner, -1)
    offset = jnp.where(valid, slot - bounds[jnp.maximum(owner, 0)], -1)
    return owner, offset


# -- cu_seqlens -----------------------------------------------------------------------------------


def prepare_lens(cu_seqlens) -> jax.Array:
    """Sequence lengths: ``prepare_lens([0, 5, 12, 18]) == [5, 7, 6]``."""
    cu = _cu_seqlens(cu_seqlens)
    return cu[1:] - cu[:-1]


def prepare_lens_from_mask(mask) -> jax.Array:
    """Valid tokens per row of a ``[batch, seq]`` mask (bool, or integer with nonzero = valid), int32."""
    mask = _mask_array(mask, "mask")
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [batch, seq], got shape {mask.shape}")
    return mask.sum(axis=-1, dtype=jnp.int32)


def prepare_cu_seqlens_from_mask(mask, out_dtype=jnp.int32) -> jax.Array:
    """``[0, cumsum(lens)]``: ``[[1,1,1,0],[1,1,0,0]] -> [0, 3, 5]``.

    ``out_dtype`` is int32 or int64 (a narrower one would overflow); int64 gives int32 unless
    ``jax_enable_x64`` is on.
    """
    lens = prepare_lens_from_mask(mask)
    out_dtype = _dtype(out_dtype, "out_dtype")
    if out_dtype not in (np.int32, np.int64):
        raise TypeError(f"out_dtype must be int32 or int64, got {out_dtype}")
    out_dtype = jax.dtypes.canonicalize_dtype(out_dtype)  # int64 -> int32 without x64, no warning
    return jnp.concatenate([jnp.zeros(1, out_dtype), jnp.cumsum(lens, dtype=out_dtype)])


# -- per token ----------------------------------------------------------------------------------------


def prepare_position_ids(cu_seqlens, total_tokens: int | None = None) -> jax.Array:
    """Position of each token in its sequence: ``[0, 3, 5, 9] -> [0,1,2, 0,1, 0,1,2,3]``."""
    cu = _cu_seqlens(cu_seqlens)
    return _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_position_ids"))[1]


def prepare_sequence_ids(cu_seqlens, total_tokens: int | None = None) -> jax.Array:
    """Sequence of each token: ``[0, 3, 5, 9] -> [0,0,0, 1,1, 2,2,2,2]``."""
    cu = _cu_seqlens(cu_seqlens)
    return _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_sequence_ids"))[0]


def prepare_token_indices(cu_seqlens, total_tokens: int | None = None) -> jax.Array:
    """``[total_tokens, 2]`` rows of ``(sequence id, position id)``."""
    cu = _cu_seqlens(cu_seqlens)
    owner, offset = _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_token_indices"))
    return jnp.stack([owner, offset], axis=1)


# -- per chunk --------------------------------------------------------------------------------------


def prepare_chunk_offsets(cu_seqlens, chunk_size: int) -> jax.Array:
    """``[0, cumsum(ceil(len / chunk_size))]``: where each sequence's chunks start."""
    cu = _cu_seqlens(cu_seqlens)
    # Every length fits cu's dtype, so a chunk_size past its range means one chunk each; cut to
    # it (jit raised OverflowError parsing 2**31 as an int32 argument).
    chunks = cdiv(cu[1:] - cu[:-1], min(_chunk_size(chunk_size), int(jnp.iinfo(cu.dtype).max)))
    return jnp.concatenate([jnp.zeros(1, cu.dtype), jnp.cumsum(chunks, dtype=cu.dtype)])


def prepare_chunk_indices(cu_seqlens, chunk_size: int, total_chunks: int | None = None) -> jax.Array:
    """``[total_chunks, 2]`` rows of ``(sequence id, chunk index within the sequence)``."""
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    owner, offset = _layout(offsets, _static_size(total_chunks, offsets, "total_chunks", "prepare_chunk_indices"))
    return jnp.stack([owner, offset], axis=1)


# -- gradients ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _identity_with_grad_cast(dtype: jnp.dtype):
    @jax.custom_vjp
    def identity(x):
        return x

    # g has the output's dtype, which is the input's: the gradient goes back in it, or adding
    # it to another path's gradient of the same input would mix dtypes.
    identity.defvjp(lambda x: (x, None), lambda _, g: (g.astype(dtype).astype(g.dtype),))
    return identity


def identity_dtype_convert(dtype):
    """A function that returns its input unchanged and rounds the incoming gradient through ``dtype``.

    The gradient w.r.t. the input keeps the input's dtype; its values are those of ``dtype``
    (as in the torch version).
    """
    return _identity_with_grad_cast(_dtype(dtype))


# -- segment ids <-> masks ------------------------------------------------------------------------------


def segment_ids_to_mask(segment_ids, dtype=jnp.bool_, return_separate_masks: bool = False):
    """Attention mask ``[..., Q, K]`` from segment ids ``[..., L]`` or a tuple ``(q_ids, kv_ids)``.

    Query i attends key j iff both ids are equal and positive (ids <= 0 are padding). With
    ``return_separate_masks`` returns ``(q_valid [..., Q], kv_valid [..., K], mask)``. A list is
    one array of ids, never a pair: pass the pair as a tuple.
    """
    if isinstance(segment_ids, tuple):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids as a tuple must be (q_segment_ids, kv_segment_ids), "
                             f"got {len(segment_ids)} items")
        q = _int_array(segment_ids[0], "q_segment_ids")
        kv = _int_array(segment_ids[1], "kv_segment_ids")
    else:
        q = kv = _int_array(segment_ids, "segment_ids")
    return_separate_masks = checks.flag("return_separate_masks", return_separate_masks)  # "no" was truthy
    dtype = _dtype(dtype)  # astype(None) gave float masks; torch refuses None
    if q.ndim < 1 or kv.ndim < 1:
        raise ValueError("segment_ids must have a sequence axis (ndim >= 1)")
    if q.shape[:-1] != kv.shape[:-1]:
        raise ValueError(f"q and kv segment ids need the same batch dims, got {q.shape} and {kv.shape}")
    q_valid, kv_valid = q > 0, kv > 0
    mask = (q[..., :, None] == kv[..., None, :]) & q_valid[..., :, None] & kv_valid[..., None, :]
    if return_separate_masks:
        return q_valid.astype(dtype), kv_valid.astype(dtype), mask.astype(dtype)
    return mask.astype(dtype)


def _pattern_ids(m: jax.Array) -> jax.Array:
    """Rows of ``m [..., Q, K]`` labelled 1, 2, ... by distinct pattern in order of first
    appearance; all-false rows get -1."""
    f = m.astype(jnp.float32)
    count = f.sum(-1)
    # 0/1 products summed in float32 are exact (K < 2**24) at any matmul precision.
    common = jnp.matmul(f, jnp.swapaxes(f, -1, -2), preferred_element_type=jnp.float32)
    same = (common == count[..., :, None]) & (common == count[..., None, :])
    first = jnp.argmax(same, axis=-1)  # earliest row with the same pattern
    valid = count > 0
    is_new = (first == jnp.arange(m.shape[-2])) & valid
    label = jnp.cumsum(is_new, axis=-1, dtype=jnp.int32)
    return jnp.where(valid, jnp.take_along_axis(label, first, axis=-1), -1)


def mask_to_segment_ids(mask, per_head: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(q_segment_ids, kv_segment_ids)`` (int32, -1 for padding) describing ``mask``.

    ``mask`` is ``[Q, K]``, ``[B, Q, K]`` or ``[B, H, Q, K]``; ids come back as ``[..., Q]`` and
    ``[..., K]``. A 4-D mask is merged over heads (a key is visible if any head sees it) unless
    ``per_head``, which gives ``[B, H, Q]`` and ``[B, H, K]``.

    Queries with the same row pattern share an id (1, 2, ... in order of first appearance, -1
    for rows that see nothing); each key takes the id of the queries that see it (-1 if none).
    For any mask that ``segment_ids_to_mask`` can produce this is its exact inverse, up to
    renumbering. Other masks (causal, banded) have no segment-id form; for them the result is
    not meant to reproduce the mask. Costs ``O(Q^2)`` memory per mask.
    """
    m = _mask_array(mask, "mask")
    per_head = checks.flag("per_head", per_head)  # "no" was truthy
    if m.ndim not in (2, 3, 4):
        raise ValueError(f"mask must be [Q, K], [B, Q, K] or [B, H, Q, K], got shape {m.shape}")
    if per_head and m.ndim != 4:
        raise ValueError(f"per_head=True needs a 4-D [B, H, Q, K] mask, got shape {m.shape}")
    if m.ndim == 4 and not per_head:
        m = m.any(axis=1)
    if m.shape[-2] == 0:  # no queries: nothing to label, and argmax needs a non-empty axis
        return jnp.zeros(m.shape[:-1], jnp.int32), jnp.full(m.shape[:-2] + m.shape[-1:], -1, jnp.int32)
    q_ids = _pattern_ids(m)
    kv_ids = jnp.where(m, q_ids[..., :, None], -1).max(axis=-2, initial=-1)
    return q_ids, kv_ids.astype(jnp.int32)
