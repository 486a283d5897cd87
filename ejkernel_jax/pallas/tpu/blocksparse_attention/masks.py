"""Attention masks as small symbolic objects.

A mask answers one question: may query ``i`` attend to key ``j``?  Masks here are
values, not arrays: they are hashable (so mask processing can be cached per mask)
and sliceable, ``mask[q_slice, kv_slice]`` returning the dense boolean block for that
window.  Only ``NumpyMask`` holds a dense array; the others compute any window on
demand, so processing a 64k x 64k causal mask never allocates 64k x 64k booleans.

"Computable" masks (``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``, ``FullMask``
and ``&`` / ``|`` of computable masks) also carry a ``mask_function(q_ids, kv_ids)``
that the kernel evaluates on the fly from token indices instead of loading mask
blocks from memory.  A mask function receives two int32 arrays of equal shape and
must use only operators (``+ - // >= == & |``), so that the same function runs on
numpy arrays (mask processing) and on jax arrays inside the kernel.

Conventions: ``True`` means "may attend"; shapes are ``(q_len, kv_len)``; ``offset``
shifts the query position, i.e. query ``i`` is treated as sitting at key position
``i + offset``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

_INT32_MAX = 2**31 - 1

__all__ = [
    "Mask",
    "LogicalOr",
    "LogicalAnd",
    "FullMask",
    "CausalMask",
    "LocalMask",
    "ChunkedCausalMask",
    "NumpyMask",
    "MultiHeadMask",
    "make_causal_mask",
    "make_local_attention_mask",
    "make_chunk_attention_mask",
    "make_random_mask",
]


# --------------------------------------------------------------------------------------
# Dense helpers (numpy arrays; handy as references and for NumpyMask)
# --------------------------------------------------------------------------------------
def _grid(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    q_len, kv_len = _check_shape(shape)
    return np.arange(q_len, dtype=np.int32)[:, None], np.arange(kv_len, dtype=np.int32)[None, :]


def make_causal_mask(shape: tuple[int, int], offset: int = 0) -> np.ndarray:
    """Dense causal mask: query ``i`` sees keys ``j <= i + offset``."""
    offset = _check_offset(offset, _check_shape(shape))
    q, kv = _grid(shape)
    return q + offset >= kv


def make_local_attention_mask(
    shape: tuple[int, int],
    window_size: tuple[int | None, int | None],
    *,
    offset: int = 0,
) -> np.ndarray:
    """Dense sliding-window mask: ``i + offset - left <= j <= i + offset + right``.

    ``None`` on a side means no limit on that side.
    """
    shape = _check_shape(shape)
    offset = _check_offset(offset, shape)
    left, right = _reaching_sides(_check_window(window_size), shape, offset)
    q, kv = _grid(shape)
    out = np.ones((q.shape[0], kv.shape[1]), dtype=np.bool_)
    if left is not None:
        out &= q + offset - left <= kv
    if right is not None:
        out &= q + offset + right >= kv
    return out


def make_chunk_attention_mask(shape: tuple[int, int], chunk_size: int, *, offset: int = 0) -> np.ndarray:
    """Dense chunked-causal mask: causal inside chunks of ``chunk_size`` tokens, nothing across."""
    shape = _check_shape(shape)
    offset = _check_offset(offset, shape)
    chunk_size = _reaching_chunk(_check_chunk(chunk_size), shape, offset)
    q, kv = _grid(shape)
    pos = q + offset
    if chunk_size > _INT32_MAX:  # one chunk holds every position: causal (2**31 is no int32)
        return pos >= kv
    return (pos // chunk_size == kv // chunk_size) & (pos >= kv)


def make_random_mask(shape: tuple[int, int], sparsity: float, seed: int) -> np.ndarray:
    """Dense random mask; each entry is False with probability ``sparsity``."""
    # Not read as numbers: sparsity=True was 1 (an empty mask), seed=True seed 1.
    if isinstance(sparsity, (bool, np.bool_)) or not isinstance(sparsity, (int, float, np.integer, np.floating)):
        raise TypeError(f"sparsity must be a float, got {sparsity!r}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    seed = check_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    q_len, kv_len = _check_shape(shape)
    rng = np.random.default_rng(seed)  # local generator: no global numpy state touched
    return rng.random((q_len, kv_len)) >= sparsity


# --------------------------------------------------------------------------------------
# Argument checks and index handling: masks accept ints and unit-step slices, like a
# 2-D numpy array
# --------------------------------------------------------------------------------------
def check_int(name: str, value: Any) -> int:
    """``value`` as a Python int; TypeError naming ``name`` for anything that is not an
    integer (``int()`` would silently truncate 2.5 or parse "4"; bools are flags)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_flag(name: str, value: Any) -> bool:
    """A bool (numpy's too), not read by truthiness: "false" would transpose (grouped matmul),
    "no" would be causal (attention)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        entries = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a (q_len, kv_len) tuple, got {shape!r}") from None
    shape = tuple(check_int("shape entries", s) for s in entries)
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"shape must be a (q_len, kv_len) tuple of positive ints, got {shape}")
    if max(shape) > _INT32_MAX:  # token ids are int32
        raise ValueError(f"shape entries must be at most {_INT32_MAX} (int32 token ids), got {shape}")
    return shape


def _check_offset(offset: Any, shape: tuple[int, int]) -> int:
    """An offset that keeps every query position ``i + offset`` an int32: the mask functions
    run on int32 token ids (numpy raised an OverflowError naming no argument, or wrapped)."""
    offset = check_int("offset", offset)
    lowest, highest = -_INT32_MAX - 1, _INT32_MAX - (shape[0] - 1)
    if not lowest <= offset <= highest:
        raise ValueError(
            f"offset must lie in [{lowest}, {highest}] (query positions i + offset are int32 "
            f"for q_len={shape[0]}), got {offset}"
        )
    return offset


def _check_window(window_size: Any) -> tuple[int | None, int | None]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}") from None
    sides = tuple(None if s is None else check_int("window_size entries", s) for s in (left, right))
    if any(s is not None and s < 0 for s in sides):
        raise ValueError(f"window_size entries must be >= 0 or None, got {window_size}")
    return sides


def _check_chunk(chunk_size: Any) -> int:
    chunk_size = check_int("chunk_size", chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return chunk_size


# A window side or chunk reaching past every position is unbounded, as flash attention's
# sliding_window is: the mask is the same, and a huge value (2**40) stays out of the int32
# sums of token ids (it raised numpy's OverflowError naming no argument).
def _reaching_sides(sides, shape: tuple[int, int], offset: int) -> tuple[int | None, int | None]:
    """``(left, right)`` with a side that covers every key for every query made ``None``."""
    (left, right), (q_len, kv_len) = sides, shape
    if left is not None and left >= offset + q_len - 1:  # the last query reaches key 0
        left = None
    if right is not None and right >= kv_len - 1 - offset:  # the first query reaches the last key
        right = None
    if right is not None and right > _INT32_MAX:  # only with an offset near -2**31
        raise ValueError(f"window_size entries must be at most {_INT32_MAX} unless they reach every key, "
                         f"got {sides}")
    return left, right


def _reaching_chunk(chunk_size: int, shape: tuple[int, int], offset: int) -> int:
    """``chunk_size`` capped at one chunk holding every position (negative positions are
    masked by the causal term, whatever their chunk). The cap is 2**31 when the last query
    sits at position 2**31 - 1: callers treat a chunk past int32 as causal attention."""
    return min(chunk_size, max(offset + shape[0], shape[1]))


def _axis_range(index: Any, size: int) -> tuple[int, int, bool]:
    """(start, stop, drop_axis) for one axis index; only unit steps are supported."""
    if isinstance(index, slice):
        start, stop, step = index.indices(size)
        if step != 1:
            raise IndexError(f"masks only support unit-step slices, got step {index.step}")
        return start, max(start, stop), False
    try:
        if isinstance(index, bool):  # True was row 1 (numpy adds an axis); np.True_ was refused already
            raise TypeError
        i = operator.index(index)  # numpy integers too; never truncates a float
    except TypeError:
        raise IndexError(f"masks are indexed by ints and slices, got {index!r}") from None
    if not -size <= i < size:
        raise IndexError(f"index {i} out of range for axis of size {size}")
    i %= size
    return i, i + 1, True


def _split_index(idx: Any, ndim: int) -> tuple[Any, ...]:
    """Normalise ``mask[idx]`` to a tuple of ``ndim`` per-axis indices."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(i is Ellipsis for i in idx):
        pos = next(n for n, i in enumerate(idx) if i is Ellipsis)
        fill = (slice(None),) * (ndim - len(idx) + 1)
        idx = idx[:pos] + fill + idx[pos + 1 :]
    if len(idx) > ndim:
        raise IndexError(f"too many indices for a {ndim}-D mask: {idx}")
    return idx + (slice(None),) * (ndim - len(idx))


# --------------------------------------------------------------------------------------
# Mask functions: small hashable callables (they are static arguments of jitted kernels)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _AllowAll:
    def __call__(self, q_ids, kv_ids):
        return kv_ids >= 0  # key ids are never negative: all True, with the right shape/type


@dataclasses.dataclass(frozen=True)
class _Causal:
    offset: int

    def __call__(self, q_ids, kv_ids):
        return (q_ids + self.offset if self.offset else q_ids) >= kv_ids


@dataclasses.dataclass(frozen=True)
class _Local:
    left: int | None
    right: int | None
    offset: int

    def __call__(self, q_ids, kv_ids):
        pos = q_ids + self.offset if self.offset else q_ids
        out = kv_ids >= 0
        if self.left is not None:
            out = out & (pos - self.left <= kv_ids)
        if self.right is not None:
            out = out & (pos + self.right >= kv_ids)
        return out


def _chunk_of(ids, chunk_size: int):
    # In the kernel use lax.div: jax's floor-dividing `//` needs `sign`, which the TPU
    # lowering rejects.  lax.div truncates instead of flooring; the two differ only on
    # negative ids, which the causal term masks out anyway.
    if isinstance(ids, np.ndarray):
        return ids // chunk_size
    from jax import lax

    return lax.div(ids, np.int32(chunk_size))


@dataclasses.dataclass(frozen=True)
class _ChunkedCausal:
    chunk_size: int
    offset: int = 0

    def __call__(self, q_ids, kv_ids):
        pos = q_ids + self.offset if self.offset else q_ids
        same_chunk = _chunk_of(pos, self.chunk_size) == _chunk_of(kv_ids, self.chunk_size)
        return same_chunk & (pos >= kv_ids)


@dataclasses.dataclass(frozen=True)
class _And:
    left: Callable
    right: Callable

    def __call__(self, q_ids, kv_ids):
        return self.left(q_ids, kv_ids) & self.right(q_ids, kv_ids)


@dataclasses.dataclass(frozen=True)
class _Or:
    left: Callable
    right: Callable

    def __call__(self, q_ids, kv_ids):
        return self.left(q_ids, kv_ids) | self.right(q_ids, kv_ids)


# --------------------------------------------------------------------------------------
# Mask classes
# --------------------------------------------------------------------------------------
class Mask:
    """Base class of all masks.

    Subclasses define ``shape``, ``_block(q0, q1, k0, k1)`` (dense bool window) and
    equality/hash.  Computable masks also set ``mask_function`` and ``q_sequence``
    (the query token ids, ``arange(q_len)``); for the others both are ``None``.
    """

    mask_function: Callable | None = None
    q_sequence: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _block(self, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, idx) -> np.ndarray:
        if len(self.shape) != 2:
            raise NotImplementedError
        qi, ki = _split_index(idx, 2)
        q0, q1, q_drop = _axis_range(qi, self.shape[0])
        k0, k1, k_drop = _axis_range(ki, self.shape[1])
        out = np.asarray(self._block(q0, q1, k0, k1), dtype=np.bool_)
        if q_drop or k_drop:
            out = out[(0 if q_drop else slice(None), 0 if k_drop else slice(None))]
        return out

    def __bool__(self) -> bool:
        raise TypeError("a Mask has no truth value; combine masks with `&` / `|`, not `and` / `or`")

    def __or__(self, other: Mask) -> Mask:
        return LogicalOr(self, other)

    def __and__(self, other: Mask) -> Mask:
        return LogicalAnd(self, other)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def _key(self) -> tuple:
        raise NotImplementedError


class _Computable(Mask):
    """A 2-D mask defined by a mask function of (query id, key id)."""

    def __init__(self, shape: tuple[int, int], mask_function: Callable, shard_count: int = 1):
        self._shape = _check_shape(shape)
        shard_count = check_int("shard_count", shard_count)
        if shard_count <= 0 or self._shape[0] % shard_count:
            # Each q shard evaluates the function on its own slice of q_sequence.
            raise ValueError(f"shard_count={shard_count} must be positive and divide q_len={self._shape[0]}")
        self.shard_count = shard_count
        self.mask_function = mask_function
        self.q_sequence = np.arange(self._shape[0], dtype=np.int32)
        self.q_sequence.flags.writeable = False

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def _block(self, q0, q1, k0, k1):
        q_ids, kv_ids = np.broadcast_arrays(
            self.q_sequence[q0:q1, None], np.arange(k0, k1, dtype=np.int32)[None, :]
        )
        return self.mask_function(q_ids, kv_ids)

    def _key(self):
        # The function captures every parameter; shard_count only validates.
        return (self._shape, self.mask_function)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self._shape}, fn={self.mask_function})"


class FullMask(_Computable):
    """Every query attends to every key."""

    def __init__(self, shape: tuple[int, int], shard_count: int = 1):
        super().__init__(shape, _AllowAll(), shard_count)

    def _block(self, q0, q1, k0, k1):
        return np.ones((q1 - q0, k1 - k0), dtype=np.bool_)


class CausalMask(_Computable):
    """Query ``i`` attends to keys ``j <= i + offset``.

    ``offset = kv_len - q_len`` aligns the diagonal to the bottom-right corner (the
    flash-attention convention for ``q_len != kv_len``).  A negative offset leaves the
    first ``-offset`` rows empty; the kernel gives such rows a zero output.
    """

    def __init__(self, shape: tuple[int, int], offset: int = 0, shard_count: int = 1):
        self.offset = _check_offset(offset, _check_shape(shape))
        super().__init__(shape, _Causal(self.offset), shard_count)


class LocalMask(_Computable):
    """Sliding window: query ``i`` attends to ``i + offset - left <= j <= i + offset + right``.

    ``window_size = (left, right)``; ``None`` on a side means unlimited on that side,
    so ``(w, 0)`` is causal sliding-window attention.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        window_size: tuple[int | None, int | None],
        offset: int = 0,
        shard_count: int = 1,
    ):
        shape = _check_shape(shape)
        self.window_size = _check_window(window_size)
        self.offset = _check_offset(offset, shape)
        sides = _reaching_sides(self.window_size, shape, self.offset)
        super().__init__(shape, _Local(*sides, self.offset), shard_count)


class ChunkedCausalMask(_Computable):
    """Causal attention inside consecutive chunks of ``chunk_size`` key positions
    (Llama-4 style); query ``i`` sits at key position ``i + offset``."""

    def __init__(self, shape: tuple[int, int], chunk_size: int, shard_count: int = 1, *, offset: int = 0):
        shape = _check_shape(shape)
        self.chunk_size = _check_chunk(chunk_size)
        self.offset = _check_offset(offset, shape)
        chunk = _reaching_chunk(self.chunk_size, shape, self.offset)
        # A chunk holding every position is causal attention; one of 2**31 (the last query at
        # position 2**31 - 1) is no int32 chunk id divisor: numpy raised an OverflowError.
        fn = _Causal(self.offset) if chunk > _INT32_MAX else _ChunkedCausal(chunk, self.offset)
        super().__init__(shape, fn, shard_count)


class _Binary(Mask):
    _fn_type: type
    _np_op: Callable

    def __init__(self, left: Mask, right: Mask):
        if not isinstance(left, Mask) or not isinstance(right, Mask):  # e.g. mask & ndarray: wrap it in NumpyMask
            raise TypeError(
                f"both operands must be Masks, got {type(left).__name__} and {type(right).__name__}"
            )
        if left.shape != right.shape:
            raise ValueError(f"mask shapes differ: {left.shape} vs {right.shape}")
        if len(left.shape) != 2:
            raise ValueError("only 2-D masks combine with & and |; combine per head before MultiHeadMask")
        self.left, self.right = left, right
        # Two computable masks make a computable mask: the kernel can still skip
        # loading mask blocks.
        if left.mask_function is not None and right.mask_function is not None:
            self.mask_function = self._fn_type(left.mask_function, right.mask_function)
            self.q_sequence = left.q_sequence

    @property
    def shape(self) -> tuple[int, int]:
        return self.left.shape

    def _block(self, q0, q1, k0, k1):
        return type(self)._np_op(self.left._block(q0, q1, k0, k1), self.right._block(q0, q1, k0, k1))

    def _key(self):
        return (self.left, self.right)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.left!r}, {self.right!r})"


class LogicalOr(_Binary):
    """Union of two masks (``a | b``)."""

    _fn_type = _Or
    _np_op = np.logical_or


class LogicalAnd(_Binary):
    """Intersection of two masks (``a & b``)."""

    _fn_type = _And
    _np_op = np.logical_and


class NumpyMask(Mask):
    """A mask backed by a dense 2-D boolean numpy array (copied, read-only)."""

    def __init__(self, array: np.ndarray):
        array = np.asarray(array)
        if array.ndim != 2:
            raise ValueError(f"array must be 2-D (q_len, kv_len), got shape {array.shape}")
        if array.dtype != np.bool_:
            raise TypeError(f"array must be boolean, got dtype {array.dtype}")
        _check_shape(array.shape)  # a zero-length axis, as the computed masks refuse
        self.array = np.array(array, copy=True)
        self.array.flags.writeable = False
        # Hashing a large array is not free: do it once.
        self._hash = hash((self.array.shape, np.packbits(self.array).tobytes()))

    @property
    def shape(self) -> tuple[int, int]:
        return self.array.shape

    def _block(self, q0, q1, k0, k1):
        return self.array[q0:q1, k0:k1]

    def __eq__(self, other):
        if type(other) is not NumpyMask:
            return NotImplemented
        return self._hash == other._hash and np.array_equal(self.array, other.array)

    def __hash__(self):
        return self._hash

    def __repr__(self) -> str:
        return f"NumpyMask(shape={self.shape}, density={self.array.mean():.3f})"


class MultiHeadMask(Mask):
    """One 2-D mask per head; shape ``(heads, q_len, kv_len)``.

    Indexing takes three indices: ``mask[head, q_slice, kv_slice]``.
    """

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks:
            raise ValueError("masks must hold at least one mask")
        for m in masks:
            if not isinstance(m, Mask):
                raise TypeError(f"masks must be Mask objects, got {type(m).__name__}")
            if isinstance(m, MultiHeadMask):
                raise ValueError("masks must be 2-D; MultiHeadMask cannot be nested")
            if m.shape != masks[0].shape:
                raise ValueError(f"all masks must share one shape, got {m.shape} and {masks[0].shape}")
        self.masks = masks

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.masks),) + tuple(self.masks[0].shape)

    def __getitem__(self, idx) -> np.ndarray:
        hi, qi, ki = _split_index(idx, 3)
        if isinstance(hi, slice):
            heads = [m[qi, ki] for m in self.masks[hi]]
            if not heads:  # an empty head range, as numpy slices it: no heads of the other axes' shape
                return np.zeros((0, *self.masks[0][qi, ki].shape), np.bool_)
            return np.stack(heads)
        h0, _, _ = _axis_range(hi, len(self.masks))
        return self.masks[h0][qi, ki]

    def _key(self):
        return self.masks

    def __repr__(self) -> str:
        return f"MultiHeadMask({list(self.masks)!r})"
