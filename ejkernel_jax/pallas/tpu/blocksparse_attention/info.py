"""MaskInfo: the block-level schedule that drives the blocksparse attention kernels.

The kernels tile attention into ``(block_q, block_kv)`` blocks.  ``process_mask`` looks
at every block of a mask once, on the host, and records:

* ``block_mask``: 0 = empty (skip: no load, no compute), 1 = partial (apply the mask
  block or the in-kernel mask function), 2 = full (no mask work at all);
* ``partial_mask_blocks``: the distinct partial blocks, each stored once no matter how
  many (head, q, kv) positions use it;
* ``data_next`` / ``mask_next``: for every grid step, which data block / partial mask
  block the step works on.  Steps that do no work (empty blocks, grid padding) point at
  the block of the next working step instead, so the TPU pipeline, which prefetches
  the next step's blocks, fetches something useful and then re-uses it (a repeated
  block index costs no DMA).

The forward and dQ passes iterate ``(head, q block, kv step)``: the schedule arrays are
``[rows, q_blocks, kv_steps]`` and ``data_next`` holds kv block indices.  The dKV pass
iterates kv-major, ``(kv block, head, q step)``: the arrays are ``[rows, q_steps,
kv_blocks]``, ``data_next`` holds q block indices counted from the start of each q
shard, and partial mask blocks are stored transposed (``[n, block_kv, block_q]``)
because that kernel works on transposed score tiles.

``rows`` is ``head_shards`` when every head shard uses a single mask (the schedule is
shared by the heads of a shard), else the number of heads.  With ``shrink_grid`` the
iterated axis is compacted to the non-empty blocks of each row/column (padded to the
longest with empty steps): a causal or local mask then launches only the blocks it
needs.  Sharding (``head_shards``, ``q_seq_shards``) keeps every shard's slice of the
schedule self-contained so the arrays can be split along heads / q with ``shard_map``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import masks as mask_lib

__all__ = [
    "MaskInfo",
    "process_mask",
    "process_mask_dkv",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
]

EMPTY, PARTIAL, FULL = 0, 1, 2


class MaskInfo(NamedTuple):
    """Sparse, block-level description of a multi-head mask (see the module docstring).

    Attributes:
      data_next: int ``[rows, q, kv]`` (dKV: ``[rows, q_steps, kv]``): block index of
        the data (kv for fwd/dQ, q for dKV) that each grid step loads.
      mask_next: int, same shape, index into ``partial_mask_blocks`` for each step;
        ``None`` when the mask is computed in-kernel or has no partial blocks.
      block_mask: int, same shape, 0 empty / 1 partial / 2 full.
      partial_mask_blocks: bool ``[n, block_q, block_kv]`` distinct partial blocks
        (dKV: ``[n, block_kv, block_q]``).  Dynamic masks keep one block per position,
        ``[heads, q_blocks, kv_blocks, ...]``, so they can be sharded like the rest.
      q_sequence: int32 ``[q_len]`` query token ids when the mask is computable in
        the kernel (then ``process_mask`` also returns the mask function), else None.
      is_dynamic_mask: True for ``process_dynamic_mask*`` results.
    """

    data_next: np.ndarray | jax.Array | None
    mask_next: np.ndarray | jax.Array | None
    block_mask: np.ndarray | jax.Array | None
    partial_mask_blocks: np.ndarray | jax.Array | None
    q_sequence: np.ndarray | None
    is_dynamic_mask: bool | None = None


class _Grid(NamedTuple):
    heads: int
    q_blocks: int
    kv_blocks: int
    q_blocks_per_shard: int
    heads_per_shard: int


def _check_grid(shape: tuple[int, ...], block_shape: Any, head_shards: int, q_seq_shards: int) -> _Grid:
    if len(shape) != 3:
        raise ValueError(f"mask must be 3-D [heads, q_len, kv_len], got shape {tuple(shape)}")
    bq, bkv = _check_block_shape(block_shape)
    head_shards = mask_lib.check_int("head_shards", head_shards)
    q_seq_shards = mask_lib.check_int("q_seq_shards", q_seq_shards)
    if bq <= 0 or bkv <= 0:
        raise ValueError(f"block_shape entries must be positive, got {block_shape}")
    heads, q_len, kv_len = shape
    if q_len % bq:
        raise ValueError(f"block_shape[0]={bq} must divide q_len={q_len}")
    if kv_len % bkv:
        raise ValueError(f"block_shape[1]={bkv} must divide kv_len={kv_len}")
    if head_shards <= 0 or heads % head_shards:
        raise ValueError(f"head_shards={head_shards} must divide the number of heads {heads}")
    q_blocks = q_len // bq
    if q_seq_shards <= 0 or q_blocks % q_seq_shards:
        raise ValueError(
            f"q_seq_shards={q_seq_shards} must divide the number of q blocks {q_blocks} (q_len / block_q)"
        )
    return _Grid(heads, q_blocks, kv_len // bkv, q_blocks // q_seq_shards, heads // head_shards)


def _check_block_shape(block_shape: Any) -> tuple[int, int]:
    try:
        bq, bkv = block_shape
    except (TypeError, ValueError):
        raise ValueError(f"block_shape must be a (block_q, block_kv) pair, got {block_shape!r}") from None
    return mask_lib.check_int("block_shape[0]", bq), mask_lib.check_int("block_shape[1]", bkv)


def _as_multi_head(mask: Any) -> mask_lib.MultiHeadMask:
    if isinstance(mask, mask_lib.MultiHeadMask):
        return mask
    if isinstance(mask, np.ndarray) and mask.ndim == 3:
        if mask.dtype != np.bool_:  # named here: NumpyMask's own error names its "array"
            raise TypeError(f"mask must be boolean, got dtype {mask.dtype}")
        return mask_lib.MultiHeadMask([mask_lib.NumpyMask(m) for m in mask])
    shape = getattr(mask, "shape", None)
    raise ValueError(
        f"mask must be a MultiHeadMask or a 3-D numpy bool array [heads, q_len, kv_len], "
        f"got {type(mask).__name__} with shape {shape}"
    )


def _smallest_int(array, max_value: int):
    """int8 / int16 / int32, the narrowest holding 0..max_value (TPU scalar memory is tiny)."""
    for dtype in (np.int8, np.int16):
        if max_value <= np.iinfo(dtype).max:
            return array.astype(dtype)
    return array.astype(np.int32)


def _next_work(flags, values, xp):
    """For every position of the flat iteration order: ``values`` at the next flagged
    position at or after it, wrapping around; 0 everywhere when nothing is flagged.

    ``xp`` is numpy (static masks) or jax.numpy (dynamic masks)."""
    n = flags.shape[0]
    pos = xp.where(flags, xp.arange(n), n)
    if xp is np:
        following = np.minimum.accumulate(pos[::-1])[::-1]
    else:
        following = jax.lax.cummin(pos, reverse=True)
    first = following[0]  # first flagged position overall (n if none)
    following = xp.where(following == n, first, following)
    return xp.where(first == n, 0, values[xp.minimum(following, n - 1)])


# --------------------------------------------------------------------------------------
# Static masks
# --------------------------------------------------------------------------------------
def _classify(mask: mask_lib.Mask, bq: int, bkv: int, g: _Grid, registry: dict | None, blocks: list):
    """Block kinds ``[q_blocks, kv_blocks]`` of one 2-D mask and, for partial blocks,
    their id in the shared registry of distinct partial blocks (-1 elsewhere; no ids
    when ``registry`` is None, i.e. the kernel computes the mask).

    Works one row of blocks at a time, so only ``block_q x kv_len`` booleans exist at
    once even for computable masks of huge sequences."""
    kind = np.zeros((g.q_blocks, g.kv_blocks), np.int32)
    pid = np.full((g.q_blocks, g.kv_blocks), -1, np.int32)
    for i in range(g.q_blocks):
        row = np.asarray(mask[i * bq : (i + 1) * bq, :], dtype=np.bool_)
        tiles = row.reshape(bq, g.kv_blocks, bkv).swapaxes(0, 1)  # [kv_blocks, bq, bkv]
        any_, all_ = tiles.any(axis=(1, 2)), tiles.all(axis=(1, 2))
        kind[i] = np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))
        if registry is None:
            continue
        for j in np.flatnonzero(kind[i] == PARTIAL):
            key = tiles[j].tobytes()
            if key not in registry:
                registry[key] = len(blocks)
                blocks.append(tiles[j].copy())
            pid[i, j] = registry[key]
    return kind, pid


def _schedule(kind: np.ndarray, pid: np.ndarray, width: int, shrink: bool):
    """Schedule of one (row, q shard), given as ``[outer, inner]`` blocks in iteration
    order (fwd/dQ: outer = q, inner = kv; dKV: outer = kv, inner = q).

    Returns ``block_mask, data_next, mask_next`` of shape ``[outer, width]``."""
    outer, inner = kind.shape
    if shrink:
        # Step w of an outer index visits its w-th non-empty block; -1 pads.
        cols = np.full((outer, width), -1, np.int64)
        for o in range(outer):
            nz = np.flatnonzero(kind[o])
            cols[o, : len(nz)] = nz
    else:
        cols = np.broadcast_to(np.arange(inner), (outer, inner))
    valid = cols >= 0
    safe = np.where(valid, cols, 0)
    rows = np.arange(outer)[:, None]
    block_mask = np.where(valid, kind[rows, safe], EMPTY).ravel()
    data_next = _next_work(block_mask != EMPTY, safe.ravel(), np)
    mask_next = _next_work(block_mask == PARTIAL, np.where(valid, pid[rows, safe], 0).ravel(), np)
    shape = (outer, width)
    return block_mask.reshape(shape), data_next.reshape(shape), mask_next.reshape(shape)


@functools.lru_cache(maxsize=16)  # entries hold the masks: keep it small
def _process_mask_cached(
    mask: mask_lib.MultiHeadMask,
    block_shape: tuple[int, int],
    is_dkv: bool,
    downcast_smem_data: bool,
    head_shards: int,
    q_seq_shards: int,
    shrink_grid: bool,
):
    g = _check_grid(mask.shape, block_shape, head_shards, q_seq_shards)
    bq, bkv = block_shape

    # Distinct head masks are processed once; partial blocks are shared across them.
    uid: dict[mask_lib.Mask, int] = {}
    head_uid = [uid.setdefault(m, len(uid)) for m in mask.masks]
    # A single computable mask is evaluated in the kernel: no mask blocks to collect.
    only = next(iter(uid)) if len(uid) == 1 else None
    computed = only is not None and only.mask_function is not None
    registry: dict[bytes, int] | None = None if computed else {}
    blocks: list[np.ndarray] = []
    per_mask = [_classify(m, bq, bkv, g, registry, blocks) for m in uid]

    # One schedule row per head shard when each shard has a single mask, else per head.
    shard_uids = [
        set(head_uid[s * g.heads_per_shard : (s + 1) * g.heads_per_shard]) for s in range(head_shards)
    ]
    if all(len(s) == 1 for s in shard_uids):
        row_uid = [next(iter(s)) for s in shard_uids]
    else:
        row_uid = head_uid
    kind = np.stack([per_mask[u][0] for u in row_uid])  # [rows, q_blocks, kv_blocks]
    pid = np.stack([per_mask[u][1] for u in row_uid])

    # dKV iterates kv-major: view every block grid as [kv, q].
    if is_dkv:
        kind, pid = kind.swapaxes(1, 2), pid.swapaxes(1, 2)

    def shard_views(a):  # [rows, outer, inner] of each (row, q shard)
        n = g.q_blocks_per_shard
        for r in range(a.shape[0]):
            for s in range(q_seq_shards):
                yield a[r, :, s * n : (s + 1) * n] if is_dkv else a[r, s * n : (s + 1) * n, :]

    inner = g.q_blocks_per_shard if is_dkv else g.kv_blocks
    if shrink_grid:
        width = max(1, max(int(np.count_nonzero(v, axis=1).max()) for v in shard_views(kind)))
    else:
        width = inner
    parts = [_schedule(k, p, width, shrink_grid) for k, p in zip(shard_views(kind), shard_views(pid))]

    def assemble(n):  # stitch (row, shard) pieces back into [rows, q, kv] order
        pieces = [part[n] for part in parts]
        if is_dkv:
            pieces = [p.T for p in pieces]  # [steps, kv]
        per_row = [
            np.concatenate(pieces[r * q_seq_shards : (r + 1) * q_seq_shards], axis=0)
            for r in range(len(row_uid))
        ]
        return np.stack(per_row)

    block_mask, data_next, mask_next = (assemble(n).astype(np.int32) for n in range(3))

    mask_function = q_sequence = partial = None
    if computed and (block_mask == PARTIAL).any():
        mask_function, q_sequence = only.mask_function, only.q_sequence
    elif blocks:
        partial = np.stack(blocks)
        if is_dkv:
            partial = partial.swapaxes(1, 2)
    if partial is None:
        mask_next = None  # nothing to index: computed in-kernel or no partial blocks

    if downcast_smem_data:
        block_mask = block_mask.astype(np.int8)
        data_next = _smallest_int(data_next, int(data_next.max(initial=0)))
        if mask_next is not None:
            mask_next = _smallest_int(mask_next, int(mask_next.max(initial=0)))
    info = MaskInfo(data_next, mask_next, block_mask, partial, q_sequence, False)
    for a in info[:5]:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False  # results are cached and shared
    return info, mask_function


def process_mask(
    mask: mask_lib.MultiHeadMask,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool = False,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, Callable | None]:
    """Turn a static multi-head mask into a ``MaskInfo`` (see the module docstring).

    Args:
      mask: ``MultiHeadMask`` (or a 3-D numpy bool array) of shape ``[heads, q_len, kv_len]``.
      block_shape: ``(block_q, block_kv)`` of the kernel pass this schedule drives.
      is_dkv: build the kv-major schedule of the dK/dV pass.
      downcast_smem_data: store the schedule in int8/int16 when the values fit.
      head_shards, q_seq_shards: how the kernel will be sharded (``shard_map``); they
        must divide the heads and the number of q blocks.
      shrink_grid: compact the iterated axis to the non-empty blocks.

    Returns:
      ``(mask_info, mask_function)``; ``mask_function`` is not None when one
      computable mask covers every head and has partial blocks: the kernel then
      evaluates it instead of loading ``partial_mask_blocks`` (which is None).
      Results are cached per (mask, block shape, options); the arrays are read-only.

    Raises:
      ValueError: wrong mask rank/type, block shape not dividing the sequence
        lengths, shard counts not dividing heads / q blocks.
    """
    mask = _as_multi_head(mask)
    return _process_mask_cached(
        mask,
        _check_block_shape(block_shape),
        mask_lib.check_flag("is_dkv", is_dkv),  # not bool(): "no" was the dK/dV schedule
        mask_lib.check_flag("downcast_smem_data", downcast_smem_data),
        mask_lib.check_int("head_shards", head_shards),
        mask_lib.check_int("q_seq_shards", q_seq_shards),
        mask_lib.check_flag("shrink_grid", shrink_grid),
    )


def process_mask_dkv(mask, block_shape, **kwargs) -> tuple[MaskInfo, Callable | None]:
    """``process_mask(..., is_dkv=True)``: the schedule of the dK/dV pass."""
    return process_mask(mask, block_shape, is_dkv=True, **kwargs)


# --------------------------------------------------------------------------------------
# Dynamic masks (jax arrays: contents unknown while tracing)
# --------------------------------------------------------------------------------------
def process_dynamic_mask(
    mask: jax.Array,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool = False,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, None]:
    """``MaskInfo`` of a bool ``jax.Array`` mask ``[heads, q_len, kv_len]``, traceable.

    The number of distinct partial blocks is unknown while tracing, so every block is
    kept: ``partial_mask_blocks`` is ``[heads, q_blocks, kv_blocks, block_q, block_kv]``
    (dKV: last two swapped), shardable along heads and q blocks like the schedule.
    ``mask_next`` indexes those blocks flattened per shard (relative to the shard).
    Empty blocks are still skipped; the grid is never shrunk (``shrink_grid`` is
    accepted for signature parity) and there is no per-shard deduplication.
    """
    is_dkv = mask_lib.check_flag("is_dkv", is_dkv)  # "no" was the dK/dV schedule
    mask_lib.check_flag("downcast_smem_data", downcast_smem_data), mask_lib.check_flag("shrink_grid", shrink_grid)
    del shrink_grid  # output shapes may not depend on the mask's contents
    if not isinstance(mask, (jax.Array, np.ndarray)):  # a Mask object goes to process_mask
        raise TypeError(f"mask must be a bool jax.Array [heads, q_len, kv_len], got {type(mask).__name__}"
                        + ("; for a mask object use process_mask" if isinstance(mask, mask_lib.Mask) else ""))
    shape = tuple(mask.shape)
    if len(shape) != 3:
        raise ValueError(f"mask must be 3-D [heads, q_len, kv_len], got shape {shape}")
    if jnp.dtype(mask.dtype) != jnp.bool_:
        raise TypeError(f"mask must be boolean, got dtype {mask.dtype}")
    # Python ints: the shard loops below range over them.
    head_shards = mask_lib.check_int("head_shards", head_shards)
    q_seq_shards = mask_lib.check_int("q_seq_shards", q_seq_shards)
    g = _check_grid(shape, block_shape, head_shards, q_seq_shards)
    bq, bkv = _check_block_shape(block_shape)
    H, nq, nkv = g.heads, g.q_blocks, g.kv_blocks

    tiles = jnp.asarray(mask).reshape(H, nq, bq, nkv, bkv).swapaxes(2, 3)  # [H, nq, nkv, bq, bkv]
    block_mask = jnp.where(
        tiles.all(axis=(3, 4)), FULL, jnp.where(tiles.any(axis=(3, 4)), PARTIAL, EMPTY)
    ).astype(jnp.int32)

    # Positions of each shard, in shard-local coordinates.
    hps, qps = g.heads_per_shard, g.q_blocks_per_shard
    local = jnp.arange(hps * qps * nkv, dtype=jnp.int32).reshape(hps, qps, nkv)
    q_local = jnp.broadcast_to(jnp.arange(qps, dtype=jnp.int32)[None, :, None], (hps, qps, nkv))
    kv_idx = jnp.broadcast_to(jnp.arange(nkv, dtype=jnp.int32)[None, None, :], (hps, qps, nkv))

    data_rows, mask_rows = [], []
    for hs in range(head_shards):
        data_cols, mask_cols = [], []
        for qs in range(q_seq_shards):
            bm = block_mask[hs * hps : (hs + 1) * hps, qs * qps : (qs + 1) * qps]
            if is_dkv:  # iteration order (kv, head, q)
                order = lambda a: a.transpose(2, 0, 1).ravel()
                unorder = lambda a: a.reshape(nkv, hps, qps).transpose(1, 2, 0)
                target = q_local
            else:  # iteration order (head, q, kv)
                order = lambda a: a.ravel()
                unorder = lambda a: a.reshape(hps, qps, nkv)
                target = kv_idx
            data_cols.append(unorder(_next_work(order(bm) != EMPTY, order(target), jnp)))
            mask_cols.append(unorder(_next_work(order(bm) == PARTIAL, order(local), jnp)))
        data_rows.append(jnp.concatenate(data_cols, axis=1))
        mask_rows.append(jnp.concatenate(mask_cols, axis=1))
    data_next = jnp.concatenate(data_rows, axis=0)
    mask_next = jnp.concatenate(mask_rows, axis=0)

    if is_dkv:
        tiles = tiles.swapaxes(3, 4)
    if downcast_smem_data:  # bounds known statically
        block_mask = block_mask.astype(jnp.int8)
        data_next = _smallest_int(data_next, (qps if is_dkv else nkv) - 1)
        mask_next = _smallest_int(mask_next, local.size - 1)
    return MaskInfo(data_next, mask_next, block_mask, tiles, None, True), None


def process_dynamic_mask_dkv(mask, block_shape, **kwargs) -> tuple[MaskInfo, None]:
    """``process_dynamic_mask(..., is_dkv=True)``."""
    return process_dynamic_mask(mask, block_shape, is_dkv=True, **kwargs)
