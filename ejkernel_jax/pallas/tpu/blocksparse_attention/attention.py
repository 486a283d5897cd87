"""Public entry point: ``blocksparse_attention`` on ``[batch, seq, heads, head_dim]``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...._vma import vary_together
from .._interpret import resolve_interpret
from . import info as info_lib
from . import kernel as kernel_lib
from . import masks as mask_lib

__all__ = ["BlockSizes", "blocksparse_attention"]

_BLOCK_LADDER = (512, 256, 128, 64, 32, 16, 8)
# Mosaic tiling on TPU: a block equals its whole sequence or is a multiple of this.  A
# block is a lane (last) dimension of some tile where 128 is needed, else a sublane one.
_TPU_MULTIPLE = {
    "block_q": 8,
    "block_kv": 128,
    "block_q_dq": 128,
    "block_kv_dq": 128,
    "block_q_dkv": 128,
    "block_kv_dkv": 8,
}
# Longest sequence a TPU default covers with one whole block when no multiple of 128
# divides it (twice the largest ladder block): such a tile grows with the square of the
# length, so past this the user chooses.
_TPU_MAX_WHOLE_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes per pass.  ``None`` picks a default: the forward sizes fall back to
    the largest of 512, 256, ..., 8 dividing the sequence (else the whole sequence);
    the dQ and dK/dV sizes fall back to the forward ones.

    On a real TPU (Mosaic tiling) each size must equal its whole sequence or be a
    multiple of 128, except ``block_q`` and ``block_kv_dkv``: multiples of 8.  There the
    defaults obey that rule: each size is the largest of 512, 256, 128 dividing the
    sequence, else the whole sequence if it is at most 1024 long, else (``block_q``,
    ``block_kv_dkv``) the largest of 64, ..., 8 dividing it; a dQ / dK/dV size takes
    the forward one only when that is valid for it.  A length with no valid default
    raises a ValueError: pass ``block_sizes``.
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                # Stored as a Python int, so BlockSizes(np.int64(8)) equals and hashes like BlockSizes(8).
                value = mask_lib.check_int(f"block_sizes.{field.name}", value)
                object.__setattr__(self, field.name, value)

    def resolve(self, q_len: int, kv_len: int, *, tpu: bool) -> BlockSizes:
        lengths = {"q": q_len, "kv": kv_len}
        length_of = lambda name: lengths[name.split("_")[1]]
        chosen: dict[str, int] = {}
        for name, fallback in _FALLBACK.items():  # forward sizes first: the others inherit
            value = getattr(self, name)
            if value is None:
                value = _default(name, length_of(name), chosen.get(fallback), tpu)
            chosen[name] = value
        for name, value in chosen.items():
            _check_block(name, value, length_of(name), tpu)
        return BlockSizes(**chosen)


# Field -> the forward field it defaults to (None: a forward field itself).
_FALLBACK = {
    "block_q": None,
    "block_kv": None,
    "block_q_dq": "block_q",
    "block_kv_dq": "block_kv",
    "block_q_dkv": "block_q",
    "block_kv_dkv": "block_kv",
}


def _tpu_valid(block: int, length: int, multiple: int) -> bool:
    return block == length or (0 < block and length % block == 0 and block % multiple == 0)


def _check_block(name: str, block: int, length: int, tpu: bool) -> None:
    if block <= 0:
        raise ValueError(f"block_sizes.{name} must be a positive int, got {block!r}")
    if length % block:
        raise ValueError(f"block_sizes.{name}={block} must divide the sequence length {length}")
    multiple = _TPU_MULTIPLE[name]
    if tpu and not _tpu_valid(block, length, multiple):
        raise ValueError(
            f"block_sizes.{name}={block} must be a multiple of {multiple} on TPU (or equal {length})"
        )


def _default(name: str, length: int, inherited: int | None, tpu: bool) -> int:
    """Default of one field: the forward size it inherits when valid, else a ladder size."""
    if not tpu:
        return _default_block(length) if inherited is None else inherited
    multiple = _TPU_MULTIPLE[name]
    if inherited is not None and _tpu_valid(inherited, length, multiple):
        return inherited
    # Lane-wide blocks first, then one whole-sequence block (fewer, fuller grid steps
    # than blocks of 8..64), then the narrower ladder sizes the field allows.
    wide = [b for b in _BLOCK_LADDER if b % 128 == 0]
    whole = [length] if length <= _TPU_MAX_WHOLE_BLOCK else []
    narrow = [b for b in _BLOCK_LADDER if b % 128 and b % multiple == 0]
    block = next((b for b in wide + whole + narrow if length % b == 0), None)
    if block is None:
        raise ValueError(
            f"no default block_sizes.{name} for sequence length {length} on TPU: defaults exist for "
            f"lengths that are multiples of {multiple} or at most {_TPU_MAX_WHOLE_BLOCK}; "
            f"pass block_sizes (a multiple of {multiple} dividing {length}, or {length} itself)"
        )
    return block


def _default_block(length: int) -> int:
    return next((b for b in _BLOCK_LADDER if length % b == 0), length)


def _finite_real(name: str, value) -> float | None:
    """None, or a finite real number (numpy's too) as a Python float; bools and strings refused."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float or None, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _window_sides(sliding_window) -> tuple[int | None, int | None]:
    """``w`` -> ``(w, w)``; a ``(left, right)`` pair of ints or None is checked as it is."""
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) != 2:
            raise ValueError(f"sliding_window must be an int or a (left, right) pair, got {sliding_window!r}")
        sides = tuple(None if w is None else mask_lib.check_int("sliding_window", w) for w in sliding_window)
    else:
        # Anything else must be one int (a string would unpack into a "pair").
        try:
            w = mask_lib.check_int("sliding_window", sliding_window)
        except TypeError:
            raise TypeError(
                f"sliding_window must be an int or a (left, right) pair, "
                f"got {type(sliding_window).__name__} {sliding_window!r}"
            ) from None
        sides = (w, w)
    if any(w is not None and w < 0 for w in sides):
        raise ValueError(f"sliding_window must be >= 0, got {sliding_window!r}")
    return sides


def _convenience_mask(q_len, kv_len, causal, sliding_window, chunk_size) -> mask_lib.Mask:
    """The mask for causal / sliding_window / chunk_size, bottom-right aligned."""
    shape = (q_len, kv_len)
    offset = kv_len - q_len  # the last query sits on the last key
    parts = []
    if sliding_window is not None:
        left, right = _window_sides(sliding_window)
        parts.append(mask_lib.LocalMask(shape, (left, 0 if causal else right), offset))
    elif causal and chunk_size is None:
        parts.append(mask_lib.CausalMask(shape, offset))
    if chunk_size is not None:
        parts.append(mask_lib.ChunkedCausalMask(shape, chunk_size, offset=offset))
    if not parts:
        return mask_lib.FullMask(shape)
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _resolve_mask(mask, causal, sliding_window, chunk_size, heads, q_len, kv_len):
    """-> ("static", MultiHeadMask) or ("dynamic", bool jax.Array [1 | heads, Sq, Skv])."""
    if mask is None:
        return "static", mask_lib.MultiHeadMask(
            [_convenience_mask(q_len, kv_len, causal, sliding_window, chunk_size)]
        )
    if causal or sliding_window is not None or chunk_size is not None:
        raise ValueError("pass either mask or causal/sliding_window/chunk_size, not both")
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_:  # named here: NumpyMask's own error names its "array"
            raise TypeError(f"mask must be boolean, got dtype {mask.dtype}")
        if mask.ndim == 2:
            mask = mask_lib.NumpyMask(mask)
        elif mask.ndim == 3:
            mask = mask_lib.MultiHeadMask([mask_lib.NumpyMask(m) for m in mask])
        else:  # was a TypeError saying a numpy bool array is not one (the torch front's ValueError)
            raise ValueError(f"mask as a numpy array must be 2-D or 3-D, got shape {mask.shape}")
    if isinstance(mask, mask_lib.Mask):
        if not isinstance(mask, mask_lib.MultiHeadMask):
            if len(mask.shape) != 2:
                raise ValueError(f"mask must be 2-D or a MultiHeadMask, got shape {mask.shape}")
            mask = mask_lib.MultiHeadMask([mask])
        kind = "static"
    elif isinstance(mask, jax.Array):
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean, got dtype {mask.dtype}")
        if mask.ndim == 2:
            mask = mask[None]
        kind = "dynamic"
    else:
        raise TypeError(
            f"mask must be a Mask, a numpy bool array or a bool jax.Array, got {type(mask).__name__}"
        )
    if len(mask.shape) != 3 or mask.shape[0] not in (1, heads) or tuple(mask.shape[1:]) != (q_len, kv_len):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must be (q_len, kv_len)=({q_len}, {kv_len}), "
            f"optionally with a leading head axis of 1 or {heads}"
        )
    return kind, mask


def _pass_info(mask_kind, mask, block_shape, is_dkv) -> tuple[kernel_lib.PassInfo, Any]:
    if mask_kind == "static":
        mi, fn = info_lib.process_mask(mask, block_shape, is_dkv=is_dkv)
        partial = mi.partial_mask_blocks
    else:
        mi, fn = info_lib.process_dynamic_mask(mask, block_shape, is_dkv=is_dkv)
        partial = mi.partial_mask_blocks.reshape(-1, *mi.partial_mask_blocks.shape[-2:])
    return kernel_lib.PassInfo(mi.data_next, mi.block_mask, mi.mask_next, partial, mi.q_sequence), fn


def _segment_ids(q_segment_ids, kv_segment_ids, batch, q_len, kv_len):
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None
    if q_segment_ids is None or kv_segment_ids is None:
        if q_len != kv_len:
            raise ValueError("q_segment_ids and kv_segment_ids must both be given when q_len != kv_len")
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    for name, ids, length in (
        ("q_segment_ids", q_segment_ids, q_len),
        ("kv_segment_ids", kv_segment_ids, kv_len),
    ):
        if not isinstance(ids, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax or numpy integer array, got {type(ids).__name__}")
        if tuple(ids.shape) != (batch, length):
            raise ValueError(
                f"{name} must have shape (batch, seq)=({batch}, {length}), got {tuple(ids.shape)}"
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be integer, got dtype {ids.dtype}")
        if np.iinfo(ids.dtype).max > _INT32.max and ids.size and not isinstance(ids, jax.core.Tracer):
            values = np.asarray(ids)
            check_segment_id_range(name, int(values.min()), int(values.max()))
    if any(isinstance(ids, jax.core.Tracer) and jnp.dtype(ids.dtype).itemsize == 8
           for ids in (q_segment_ids, kv_segment_ids)):
        return dense_segment_ids(q_segment_ids, kv_segment_ids)
    return jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)


def dense_segment_ids(q_segment_ids, kv_segment_ids):
    """Both id arrays renumbered jointly as int32 ranks: equal ids stay equal, distinct ones
    distinct, all the kernels compare. For 64-bit ids whose values cannot be read (traced): the
    int32 cast wrapped them, so 0 and 2**32 were one segment under ``jit``. (A uint64 id meets an
    int64 one as its bits: uint64 ids from 2**63 up equal the negative int64 of the same bits.)"""
    keys = jnp.concatenate([jnp.ravel(q_segment_ids).astype(jnp.int64), jnp.ravel(kv_segment_ids).astype(jnp.int64)])
    _, ranks = jnp.unique(keys, return_inverse=True, size=keys.size)
    ranks = ranks.reshape(-1).astype(jnp.int32)  # fewer than 2**31 distinct ids: exact
    return (ranks[:q_segment_ids.size].reshape(q_segment_ids.shape),
            ranks[q_segment_ids.size:].reshape(kv_segment_ids.shape))


_INT32 = np.iinfo(np.int32)
_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_segment_id_range(name: str, lo: int, hi: int) -> None:
    """The kernels compare int32 ids: wider ones would wrap (0 and 2**32 would be one segment).
    Checked where the values are known; 64-bit ids traced under ``jit`` are renumbered instead
    (``dense_segment_ids``), and uint32 ones narrowed as they are (one to one)."""
    if lo < _INT32.min or hi > _INT32.max:
        raise ValueError(f"{name} holds values in [{lo}, {hi}], outside the int32 range the kernels compare")


def _check_shapes(q, k, v) -> tuple[int, int, int, int, int]:
    """``(batch, q_len, heads, head_dim, kv_len)`` of valid q, k, v."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}"
        )
    # Every size must be >= 1: a zero would otherwise divide by zero (scale, head
    # groups) or build empty grids deep inside the kernels.
    for name, x in (("q", q), ("k", k), ("v", v)):
        for axis, size in zip(("batch", "seq", "heads", "head_dim"), x.shape):
            if size < 1:
                raise ValueError(f"{name} must have {axis} >= 1, got shape {x.shape}")
    B, Sq, H, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k shape {k.shape} does not match q shape {q.shape} (batch and head_dim must agree)"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v shape {v.shape} must match k shape {k.shape} except in head_dim")
    if H % k.shape[2]:
        raise ValueError(f"q heads ({H}) must be a multiple of kv heads ({k.shape[2]})")
    return B, Sq, H, D, k.shape[1]


def blocksparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: Any = None,
    causal: bool = False,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | dict | None = None,
    interpret: Any = None,
    return_lse: bool = False,
):
    """Block-sparse attention (Pallas TPU kernels; Pallas interpret mode elsewhere).

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k: ``[batch, kv_len, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (MHA,
        GQA, MQA: query head ``h`` reads kv head ``h // (heads // kv_heads)``).
      v: ``[batch, kv_len, kv_heads, v_head_dim]``.
      mask: a 2-D ``Mask`` shared by all heads, a ``MultiHeadMask`` (1 or ``heads``
        masks), a numpy bool array ``[q_len, kv_len]`` / ``[heads, q_len, kv_len]``,
        or a bool ``jax.Array`` of those shapes (dynamic mask: traced, every block
        kept).  Static masks are analysed once per block shape and cached.
      causal, sliding_window, chunk_size: build the mask when ``mask`` is None.
        Aligned bottom-right when ``q_len != kv_len`` (the last query sees the last
        key), like ``flash_attention``.  ``sliding_window`` is ``w`` (left ``w`` and,
        unless causal, right ``w``) or ``(left, right)``.  ``chunk_size`` means causal
        attention inside chunks (Llama-4); combined with a window by intersection.
      q_segment_ids, kv_segment_ids: ``[batch, seq]`` ints; a query attends only to
        keys with an **equal** id (the splash convention: every id, 0 and negatives
        included, is an ordinary segment; there are no padding ids).  If only one is
        given and ``q_len == kv_len`` it is used for both.
      softmax_scale: default ``head_dim ** -0.5``.
      logits_soft_cap: ``cap * tanh(logits / cap)`` applied to the scaled logits.
      block_sizes: ``BlockSizes`` (or a dict of its fields) per pass.
      interpret: Pallas interpret mode; default: on unless the backend is TPU.
      return_lse: also return the float32 log-sum-exp ``[batch, heads, q_len]``.

    Returns:
      ``out [batch, q_len, heads, v_head_dim]`` in ``q.dtype`` (and ``lse``).  Rows
      with no allowed key give 0 output, lse ``-inf`` and zero gradients.
    """
    B, Sq, H, D, Skv = _check_shapes(q, k, v)
    # A wrong kind of dtype is a TypeError, as in the torch front; mismatched floats a ValueError.
    # The kernels are written for TPU dtypes: float64 (x64 mode) ran at float32 precision and
    # float8 rounded the output, where the torch front refuses both.
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # Checked, not read loosely: causal="no" or return_lse=1 were truthy, softmax_scale="1"
    # went through float(), and a NaN/inf scale gave an all-NaN output.
    causal, return_lse = mask_lib.check_flag("causal", causal), mask_lib.check_flag("return_lse", return_lse)
    softmax_scale = _finite_real("softmax_scale", softmax_scale)
    logits_soft_cap = _finite_real("logits_soft_cap", logits_soft_cap)
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")

    interpret = resolve_interpret(interpret)
    if isinstance(block_sizes, dict):
        block_sizes = BlockSizes(**block_sizes)
    if not isinstance(block_sizes, (BlockSizes, type(None))):
        raise TypeError(f"block_sizes must be a BlockSizes, a dict or None, got {type(block_sizes).__name__}")
    bs = (block_sizes or BlockSizes()).resolve(Sq, Skv, tpu=interpret is False)

    mask_kind, mask = _resolve_mask(mask, causal, sliding_window, chunk_size, H, Sq, Skv)
    fwd_info, fwd_fn = _pass_info(mask_kind, mask, (bs.block_q, bs.block_kv), False)
    dq_info, dq_fn = _pass_info(mask_kind, mask, (bs.block_q_dq, bs.block_kv_dq), False)
    dkv_info, dkv_fn = _pass_info(mask_kind, mask, (bs.block_q_dkv, bs.block_kv_dkv), True)
    q_seg, kv_seg = _segment_ids(q_segment_ids, kv_segment_ids, B, Sq, Skv)

    cfg = kernel_lib.Config(
        fwd=kernel_lib.PassConfig(bs.block_q, bs.block_kv, fwd_fn),
        dq=kernel_lib.PassConfig(bs.block_q_dq, bs.block_kv_dq, dq_fn),
        dkv=kernel_lib.PassConfig(bs.block_q_dkv, bs.block_kv_dkv, dkv_fn),
        scale=float(D**-0.5 if softmax_scale is None else softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        interpret=interpret,
    )
    to_heads = lambda x: jnp.swapaxes(x, 1, 2)  # [B, S, H, D] <-> [B, H, S, D]
    # Typed as jax types a primitive's operands (shard_map: see ejkernel_jax._vma.vary_together).
    q, k, v, q_seg, kv_seg = vary_together((to_heads(q), to_heads(k), to_heads(v), q_seg, kv_seg))
    out, lse = kernel_lib.attention(cfg, q, k, v, q_seg, kv_seg, fwd_info, dq_info, dkv_info)
    out = to_heads(out)
    return (out, lse) if return_lse else out
