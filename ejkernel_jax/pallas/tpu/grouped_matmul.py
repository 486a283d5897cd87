"""Grouped matmul (v2) for TPU, written in Pallas: ``gmm``, ``tgmm`` and their custom VJP.

Semantics (shared with the Triton grouped matmul):

* The rows of ``lhs`` ``[m, k]`` are split into consecutive groups by ``group_sizes`` (int32
  ``[num_groups]``): group ``i`` owns rows ``[offsets[i], offsets[i + 1])`` where
  ``offsets = [0, cumsum(group_sizes)]``.
* ``grouped_matmul`` multiplies the rows of group ``i`` by ``rhs[i]``. Rows past
  ``sum(group_sizes)`` and rows of groups outside the selected range come out as zeros.
* ``transposed_grouped_matmul`` gives, per group, ``lhs[:, rows_i] @ rhs[rows_i, :]`` (``[k, n]``);
  an empty group gives a zero matrix. It is the weight gradient of ``grouped_matmul``.
* ``group_offset`` / ``num_actual_groups`` select the contiguous range of groups one shard holds
  (expert parallelism): ``rhs`` (or the output of tgmm) then only has that many groups, while
  ``group_sizes`` still lists all of them.

Schedule: ``make_group_metadata`` turns ``group_sizes`` into a list of *visits* (an m-tile and the
group it works for), computed on device. The kernel grid walks these visits, so no Python loop
runs over groups and the host never needs ``group_sizes``. A tile that straddles a group boundary
is visited once per group and each visit writes only its group's rows.

Shapes need not be multiples of the tile: a tile larger than a dimension is shrunk to that
dimension, and ragged edge tiles are masked inside the kernel (nothing is padded or copied).

Interpret mode: ``interpret=None`` (the default) means "auto": compiled with Mosaic on TPU, and
Pallas interpret mode on any other backend, so everything runs on CPU and GPU jax. An explicit
``interpret=True/False`` (or a ``pltpu.InterpretParams``) wins; pass ``interpret=False`` to lower
for TPU from a machine without one, e.g.
``jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))``.

Checking ``group_sizes``: dtype and shape are always checked. Negative sizes and
``sum(group_sizes) > m`` raise ``ValueError`` when the values are concrete (not traced), unless
``check_values=False`` (reading them is a device-to-host copy). Under ``jax.jit`` they cannot be
checked; the kernels then clamp them (a negative size acts as 0, groups are cut at row ``m``),
which keeps every memory access in bounds but makes the result meaningless. The same holds for a
traced (or unchecked) ``group_offset`` array out of range (it is clamped into range).

Inside ``jax.shard_map`` (``check_vma=True``, its default) the outputs are typed as varying over
the mesh axes the operands vary over, and gradients of operands replicated over an axis (expert
weights) are summed over it. One limit is jax's, in interpret mode only (off TPU): ``group_sizes``
or ``group_offset`` that *vary* over a mesh axis (per-shard routing, ``in_specs=P("x")``) fail
with "Primitive dynamic_slice requires varying manual axes to match" (jax 0.10.2). jax's Pallas
interpreter (``jax/_src/pallas/hlo_interpreter.py``, ``BlockMapping.compute_start_indices_interpret``)
evaluates the index maps, traced without mesh-axis types, on the varying scalar-prefetch values
and the invariant grid indices, and nothing casts between them. There, pass ``check_vma=False``
to ``shard_map`` or use the Triton path (``ejkernel_jax.grouped_matmul``, ``platform="cpu"``
or ``"gpu"``), which takes varying sizes; replicated ``group_sizes`` work either way.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._vma import out_struct, vary_together
from ._dot import dot as _dot
from ._interpret import resolve_interpret
from .blocksparse_attention.masks import check_flag
from .blocksparse_attention.masks import check_int as _check_int

__all__ = [
    "GroupMetadata",
    "TilingFn",
    "grouped_matmul",
    "make_group_metadata",
    "transposed_grouped_matmul",
]

Tiling = tuple[int, int, int]
TilingFn = Callable[[int, int, int], Optional[Tiling]]
GroupMetadata = tuple[jax.Array, jax.Array, jax.Array]  # (group_offsets, group_ids, m_tile_ids)

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# --------------------------------------------------------------------------------------------
# Group metadata
# --------------------------------------------------------------------------------------------
def make_group_metadata(
    *,
    group_sizes: jax.Array,
    m: int,
    tm: int,
    start_group: jax.Array | int,
    num_nonzero_groups: int,
    visit_empty_groups: bool = True,
) -> tuple[GroupMetadata, jax.Array]:
    """Lists the (m-tile, group) visits a grouped matmul makes, in order.

    Args:
      group_sizes: int32 ``[num_groups]``, rows per group (assumed non-negative, sum <= m).
      m: rows of the grouped operand.
      tm: rows per m-tile.
      start_group: first group to visit (may be traced).
      num_nonzero_groups: how many consecutive groups, from ``start_group``, to visit (may be
        traced); ``start_group + num_nonzero_groups <= num_groups``, checked when concrete.
      visit_empty_groups: give each empty group one visit (tgmm needs it to write the group's
        zero output); otherwise empty groups get none.

    Returns:
      ``((group_offsets, group_ids, m_tile_ids), num_tiles)``:

      * ``group_offsets``: int32 ``[num_groups + 1]``, ``[0, cumsum(group_sizes)]``; group ``i``
        owns rows ``[group_offsets[i], group_offsets[i + 1])``.
      * ``group_ids``, ``m_tile_ids``: int32 ``[max(cdiv(m, tm), 1) + num_groups - 1]`` (at
        least 1); visit ``v`` works on m-tile ``m_tile_ids[v]`` for group ``group_ids[v]``.
        Visits are sorted by group and by tile, so the visits to one tile (or of one group) are
        consecutive. With ``m = 0`` there is no tile: empty groups are visited on tile 0.
      * ``num_tiles``: int32 scalar, the number of valid visits. Entries past it are padding
        (copies of the last valid visit) and must not be used.
    """
    m, tm = _check_metadata_args(group_sizes, m, tm, start_group, num_nonzero_groups)
    visit_empty_groups = check_flag("make_group_metadata: argument 'visit_empty_groups'", visit_empty_groups)
    num_groups = group_sizes.shape[0]
    tiles_m = pl.cdiv(m, tm)
    # With m = 0 (no tiles) tile ids were clamped into [0, -1], giving -1, and the empty groups'
    # visits overflowed the arrays: counted as one tile, tile 0 stands in for the missing one.
    last_tile_id = max(tiles_m, 1) - 1
    # A group spans its own tiles; consecutive groups share at most one boundary tile, and an
    # empty group adds at most one visit, hence this bound.
    max_visits = max(last_tile_id + num_groups, 1)
    if num_groups == 0:
        # Nothing to visit. Below, gathers by group id from an empty group axis fail inside jax
        # ("sub got incompatible shapes"); the padding entries are tile 0 of group 0.
        padding = jnp.zeros((max_visits,), jnp.int32)
        return (jnp.zeros((1,), jnp.int32), padding, padding), jnp.zeros((), jnp.int32)

    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    starts = ends - group_sizes
    group_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])

    empty = group_sizes == 0
    # An empty group starting at row m (m a multiple of tm) is parked in the last tile.
    first_tile = jnp.minimum(starts // tm, last_tile_id)
    last_tile = (ends - 1) // tm
    visits = jnp.where(empty, int(visit_empty_groups), last_tile - first_tile + 1)
    group = jnp.arange(num_groups, dtype=jnp.int32)
    selected = (group >= start_group) & (group < start_group + num_nonzero_groups)
    visits = jnp.where(selected, visits, 0).astype(jnp.int32)
    num_tiles = visits.sum(dtype=jnp.int32)

    group_ids = jnp.repeat(group, visits, total_repeat_length=max_visits)
    # Visit v is the (v - first_visit[g])-th tile of its group g.
    first_visit = jnp.cumsum(visits, dtype=jnp.int32) - visits
    v = jnp.arange(max_visits, dtype=jnp.int32)
    m_tile_ids = first_tile[group_ids] + (v - first_visit[group_ids])

    # Padding repeats the last valid visit so that every entry is a valid index.
    last = jnp.maximum(num_tiles - 1, 0)
    group_ids = jnp.where(v < num_tiles, group_ids, group_ids[last])
    m_tile_ids = jnp.where(v < num_tiles, m_tile_ids, m_tile_ids[last])
    m_tile_ids = jnp.clip(m_tile_ids, 0, last_tile_id).astype(jnp.int32)
    return (group_offsets, group_ids, m_tile_ids), num_tiles


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------
def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_count(name: str, value, least: int, *, traced_ok: bool):
    """An int >= ``least`` (``traced_ok``: or an integer scalar array, checked when concrete)."""
    fn = "make_group_metadata"
    if traced_ok and not isinstance(value, (bool, np.bool_)) and hasattr(value, "dtype"):
        if not jnp.issubdtype(value.dtype, jnp.integer) or jnp.ndim(value) != 0:
            raise TypeError(f"{fn}: argument {name!r} must be an int or an integer scalar, got {value!r}")
        if not _is_concrete(value):
            return value
        value = int(value)
    count = _check_int(f"{fn}: argument {name!r}", value)
    if count < least:
        raise ValueError(f"{fn}: argument {name!r} must be a {'positive' if least else 'non-negative'} int, "
                         f"got {count}")
    return count


def _check_metadata_args(group_sizes, m, tm, start_group, num_nonzero_groups) -> tuple[int, int]:
    """make_group_metadata's arguments (tm=0 divided by zero, m=-1 or a float start_group ran);
    returns ``(m, tm)`` as ints. The values of ``group_sizes`` are the caller's to check."""
    if not hasattr(group_sizes, "dtype") or group_sizes.dtype != jnp.int32:
        got = getattr(group_sizes, "dtype", type(group_sizes).__name__)
        raise TypeError(f"make_group_metadata: argument 'group_sizes' must be an int32 array, got {got}")
    if group_sizes.ndim != 1:
        raise ValueError(
            f"make_group_metadata: argument 'group_sizes' must be 1-D, got shape {tuple(group_sizes.shape)}"
        )
    start = _check_count("start_group", start_group, 0, traced_ok=True)
    count = _check_count("num_nonzero_groups", num_nonzero_groups, 0, traced_ok=True)
    _check_selection(start, count, group_sizes.shape[0])
    return _check_count("m", m, 0, traced_ok=False), _check_count("tm", tm, 1, traced_ok=False)


def _check_selection(start_group, num_nonzero_groups, num_groups: int) -> None:
    """``start_group + num_nonzero_groups <= num_groups``, over the values known (ints; a traced
    one counts as 0). Groups past the end were accepted and silently never visited, where the
    grouped matmuls refuse such a ``group_offset``."""
    known = [(name, v) for name, v in (("start_group", start_group), ("num_nonzero_groups", num_nonzero_groups))
             if isinstance(v, int)]
    if sum(v for _, v in known) > num_groups:
        got = ", ".join(f"{name}={v}" for name, v in known)
        raise ValueError(f"make_group_metadata: start_group + num_nonzero_groups must be at most the {num_groups} "
                         f"groups of group_sizes, got {got}")


def _check_float(name: str, x) -> None:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def _check_same_dtype(lhs, rhs) -> None:
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")


def _check_group_sizes(group_sizes, m: int, check_values: bool) -> None:
    if not hasattr(group_sizes, "dtype"):
        raise TypeError(f"group_sizes must be an int32 array, got {type(group_sizes).__name__}")
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-D, got shape {tuple(group_sizes.shape)}")
    if check_values and _is_concrete(group_sizes):  # values are only known outside of tracing
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes must be non-negative, got {sizes.tolist()}")
        total = int(sizes.astype(np.int64).sum())
        if total > m:
            raise ValueError(f"sum(group_sizes) = {total} exceeds the {m} rows of the operand")


def _check_offset_range(g0: int, num_groups: int, num_selected: int) -> None:
    if not 0 <= g0 <= num_groups - num_selected:
        raise ValueError(
            f"group_offset={g0} selects groups [{g0}, {g0 + num_selected}) but group_sizes has {num_groups}"
        )


def _check_group_offset(group_offset, num_groups: int, num_selected: int, check_values: bool) -> jax.Array:
    if group_offset is None:
        return jnp.zeros((), jnp.int32)
    if isinstance(group_offset, (bool, np.bool_)):
        raise TypeError("group_offset must be an int or an integer scalar array")
    if isinstance(group_offset, (int, np.integer)):
        # Checked before it becomes an array: under jit, jnp.int32(g0) would be a tracer.
        _check_offset_range(int(group_offset), num_groups, num_selected)
        return jnp.int32(group_offset)
    if not hasattr(group_offset, "dtype") or not jnp.issubdtype(group_offset.dtype, jnp.integer):
        raise TypeError(f"group_offset must be an integer scalar, got {group_offset!r}")
    if group_offset.shape not in ((), (1,)):
        raise ValueError(f"group_offset must be a scalar, got shape {tuple(group_offset.shape)}")
    if check_values and _is_concrete(group_offset):
        # Read before narrowing to int32: an int64 / uint32 offset of 2**32 would wrap to 0.
        _check_offset_range(int(np.asarray(group_offset).reshape(())), num_groups, num_selected)
    # The kernels clamp a traced offset into range; clamped here first, in its own dtype, since
    # the int32 cast would wrap an int64 2**32 + 1 to 1, a valid offset selecting other groups.
    hi = min(num_groups - num_selected, np.iinfo(group_offset.dtype).max)
    clip = np.clip if isinstance(group_offset, np.ndarray) else jnp.clip
    return jnp.asarray(clip(group_offset, 0, hi)).reshape(()).astype(jnp.int32)


def _is_int(x) -> bool:
    # A bool is an int to isinstance: tiling=(True, 128, 128) silently meant tm=1.
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_tiling(tiling) -> Union[Tiling, TilingFn]:
    # A wrong type (a bool or float tile, None, a string) is a TypeError, a wrong count or a
    # tile < 1 a ValueError, as for the other arguments (all were ValueErrors).
    if callable(tiling):
        return tiling
    expected = "3 positive ints (tm, tk, tn) or a callable"
    if not isinstance(tiling, (tuple, list)) or not all(_is_int(t) for t in tiling):
        raise TypeError(f"tiling must be {expected}, got {tiling!r}")
    if len(tiling) != 3 or not all(t > 0 for t in tiling):
        raise ValueError(f"tiling must be {expected}, got {tiling!r}")
    return tuple(int(t) for t in tiling)


def _resolve_tiling(tiling, m: int, k: int, n: int) -> Tiling:
    """Looks a callable tiling up, then shrinks tiles larger than the problem.

    A tile equal to the full dimension is always a legal TPU block, so small or odd shapes
    need no padding.
    """
    if callable(tiling):
        found = tiling(m, k, n)
        if found is None:
            raise ValueError(f"tiling found no tile sizes for (m, k, n) = ({m}, {k}, {n})")
        if callable(found):  # _check_tiling passes callables through: unpacked below, it failed unnamed
            raise TypeError(f"tiling returned {found!r} for (m, k, n) = ({m}, {k}, {n}); "
                            "expected 3 positive ints (tm, tk, tn)")
        tiling = _check_tiling(found)
    tm, tk, tn = tiling
    return min(tm, m), min(tk, k), min(tn, n)


_OUT_DTYPES = ("float16", "bfloat16", "float32")


def _check_dtype_arg(dtype) -> jnp.dtype:
    if dtype is None:  # jnp.dtype(None) would silently be float64
        raise TypeError(f"preferred_element_type must be one of {', '.join(_OUT_DTYPES)}, got None")
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"preferred_element_type must be a dtype, got {dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"preferred_element_type must be a float dtype, got {dtype}")
    if dtype.name not in _OUT_DTYPES:  # the kernels store float16/bfloat16/float32 only
        raise TypeError(f"preferred_element_type must be one of {', '.join(_OUT_DTYPES)}, got {dtype}")
    return dtype


def _sanitize_sizes(group_sizes: jax.Array, m: int) -> jax.Array:
    """Identity on valid sizes; otherwise clamps them so every row index stays in [0, m]."""
    # A running sum saturating at m, never wrapping int32 (sizes near 2**31 would go negative):
    # each step adds at most the rows left. Associative, as the scan needs, for sizes >= 0.
    ends = lax.associative_scan(lambda a, b: a + jnp.minimum(b, m - a),
                                jnp.clip(group_sizes, 0, m).astype(jnp.int32))
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def _compute_dtype(a, b) -> jnp.dtype:
    # bf16 x bf16 feeds the MXU directly; anything else (f16 included) is multiplied in f32,
    # at Precision.HIGHEST (``_dot.dot``), so it is float32 math on TPU and GPU as on CPU.
    if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def _check_buffer_count(input_buffer_count) -> int:
    # A static int: 2.0 passed `in (1, 2)`, and a traced value failed inside it with jax's
    # TracerBoolConversionError, naming nothing.
    if not _is_int(input_buffer_count):
        raise TypeError(f"input_buffer_count must be an int (1 or 2), got {input_buffer_count!r}")
    # Mosaic's grid pipeline (jax 0.10) lowers only single or double buffering.
    if input_buffer_count not in (1, 2):
        raise ValueError(f"input_buffer_count must be 1 or 2, got {input_buffer_count!r}")
    return int(input_buffer_count)


def _block_spec(block_shape, index_map, buffer_count: int) -> pl.BlockSpec:
    if buffer_count == 2:  # Pallas' default double buffering
        return pl.BlockSpec(block_shape, index_map)
    return pl.BlockSpec(block_shape, index_map, pipeline_mode=pl.Buffered(buffer_count))


# --------------------------------------------------------------------------------------------
# gmm kernel: out[rows_g] = lhs[rows_g] @ rhs[g]
# --------------------------------------------------------------------------------------------
def _gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array,
    *,
    out_dtype: jnp.dtype,
    tiling,
    input_buffer_count: int,
    transpose_rhs: bool,
    interpret,
) -> jax.Array:
    m, k = lhs.shape
    num_active = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if min(m, k, n, num_active) == 0:  # nothing to multiply: all rows are zero
        return jnp.zeros((m, n), out_dtype)
    tm, tk, tn = _resolve_tiling(tiling, m, k, n)
    tiles_m, tiles_n, tiles_k = pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k, tk)
    k_rem = k % tk
    cdt = _compute_dtype(lhs, rhs)

    # Every row belongs to exactly one of: a leading zero group (rows before the selected
    # groups), the selected groups, a trailing zero group (rows after them). With that, every
    # output row is written by exactly one visit and nothing is left uninitialized.
    sizes = _sanitize_sizes(group_sizes, m)
    g0 = jnp.clip(group_offset, 0, sizes.shape[0] - num_active)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    lead, stop = offsets[g0], offsets[g0 + num_active]
    aug_sizes = jnp.concatenate(
        [lead[None], lax.dynamic_slice(sizes, (g0,), (num_active,)), (m - stop)[None]]
    )
    (aug_offsets, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=aug_sizes, m=m, tm=tm, start_group=0, num_nonzero_groups=num_active + 2,
        visit_empty_groups=False,
    )
    zero_tail = num_active + 1  # id of the trailing zero group

    def fetch_indices(v, kk, aug_offsets, group_ids, m_tile_ids):
        # Zero-group visits compute nothing. They ask for the same lhs/rhs blocks as the
        # neighbouring real step, so the pipeline skips the copy instead of streaming
        # inactive rows of lhs through VMEM.
        g = group_ids[v]
        is_lead, is_tail = g == 0, g == zero_tail
        # lax.div, not //: floor division of signed ints does not lower with Mosaic off-TPU.
        first_tile = jnp.minimum(lax.div(aug_offsets[1], jnp.int32(tm)), tiles_m - 1)
        last_tile = lax.div(jnp.maximum(aug_offsets[zero_tail] - 1, 0), jnp.int32(tm))
        tile = jnp.where(is_lead, first_tile, jnp.where(is_tail, last_tile, m_tile_ids[v]))
        k_block = jnp.where(is_lead, 0, jnp.where(is_tail, tiles_k - 1, kk))
        expert = jnp.clip(g - 1, 0, num_active - 1)
        return tile, k_block, expert

    def lhs_map(ni, v, kk, *meta):
        tile, k_block, _ = fetch_indices(v, kk, *meta)
        return tile, k_block

    def rhs_map(ni, v, kk, *meta):
        _, k_block, expert = fetch_indices(v, kk, *meta)
        return (expert, ni, k_block) if transpose_rhs else (expert, k_block, ni)

    def out_map(ni, v, kk, aug_offsets, group_ids, m_tile_ids):
        return m_tile_ids[v], ni

    def kernel(aug_offsets, group_ids, m_tile_ids, lhs_ref, rhs_ref, out_ref, acc_ref):
        v, kk = pl.program_id(1), pl.program_id(2)
        g = group_ids[v]
        real = (g > 0) & (g < zero_tail)

        @pl.when(kk == 0)
        def _init():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        def accumulate(mask_k: bool):
            x, w = lhs_ref[...], rhs_ref[...]
            if mask_k:  # the last k block reads past k: zero both sides (garbage may be NaN)
                # Masked in f32: older TPUs have no bf16 VPU. Only the last k step pays this.
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
                x = jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 1) < k_rem, x, 0.0)
                w_axis = 1 if transpose_rhs else 0
                w = jnp.where(lax.broadcasted_iota(jnp.int32, w.shape, w_axis) < k_rem, w, 0.0)
            dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
            acc_ref[...] += _dot(x.astype(cdt), w.astype(cdt), dims)

        if k_rem:
            pl.when(real & (kk < tiles_k - 1))(lambda: accumulate(False))
            pl.when(real & (kk == tiles_k - 1))(lambda: accumulate(True))
        else:
            pl.when(real)(lambda: accumulate(False))

        @pl.when(kk == tiles_k - 1)
        def _store():
            # Write only this group's rows; the tile's other rows belong to adjacent visits.
            rows = m_tile_ids[v] * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            mine = (rows >= aug_offsets[g]) & (rows < aug_offsets[g + 1])
            out_ref[...] = jnp.where(
                mine, acc_ref[...], out_ref[...].astype(jnp.float32)
            ).astype(out_ref.dtype)

    rhs_block = (pl.Squeezed(), tn, tk) if transpose_rhs else (pl.Squeezed(), tk, tn)
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        bytes_accessed=lhs.size * lhs.dtype.itemsize * tiles_n
        + rhs.size * rhs.dtype.itemsize * min(tiles_m, num_active)
        + m * n * jnp.dtype(out_dtype).itemsize,
        transcendentals=0,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((m, n), out_dtype, aug_offsets, group_ids, m_tile_ids, lhs, rhs),  # typed for shard_map
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(tiles_n, num_tiles, tiles_k),
            in_specs=[
                _block_spec((tm, tk), lhs_map, input_buffer_count),
                _block_spec(rhs_block, rhs_map, input_buffer_count),
            ],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="grouped_matmul",
    )
    return call(aug_offsets, group_ids, m_tile_ids, lhs, rhs)


# --------------------------------------------------------------------------------------------
# tgmm kernel: out[g] = lhs[:, rows_g] @ rhs[rows_g]
# --------------------------------------------------------------------------------------------
def _tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array,
    *,
    num_actual_groups: int,
    lhs_is_mk: bool,
    out_dtype: jnp.dtype,
    tiling,
    input_buffer_count: int,
    interpret,
) -> jax.Array:
    """``lhs`` is ``[k, m]``, or ``[m, k]`` when ``lhs_is_mk`` (the backward passes the forward
    operand as it is and the transpose happens per tile in VMEM, not as a copy in HBM)."""
    m, n = rhs.shape
    k = lhs.shape[1] if lhs_is_mk else lhs.shape[0]
    num_active = num_actual_groups
    if min(m, k, n, num_active) == 0:  # no rows (or an empty output): all zeros
        return jnp.zeros((num_active, k, n), out_dtype)
    tm, tk, tn = _resolve_tiling(tiling, m, k, n)
    tiles_n, tiles_k = pl.cdiv(n, tn), pl.cdiv(k, tk)
    cdt = _compute_dtype(lhs, rhs)

    sizes = _sanitize_sizes(group_sizes, m)
    g0 = jnp.clip(group_offset, 0, sizes.shape[0] - num_active)
    (offsets, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=sizes, m=m, tm=tm, start_group=g0, num_nonzero_groups=num_active,
        visit_empty_groups=True,  # an empty group still has its zero output to write
    )
    max_visits = group_ids.shape[0]

    def lhs_map(ni, kk, v, g0_ref, offsets, group_ids, m_tile_ids):
        return (m_tile_ids[v], kk) if lhs_is_mk else (kk, m_tile_ids[v])

    def rhs_map(ni, kk, v, g0_ref, offsets, group_ids, m_tile_ids):
        return m_tile_ids[v], ni

    def out_map(ni, kk, v, g0_ref, offsets, group_ids, m_tile_ids):
        return group_ids[v] - g0_ref[0], kk, ni

    def kernel(g0_ref, offsets, group_ids, m_tile_ids, lhs_ref, rhs_ref, out_ref, acc_ref):
        v, last_v = pl.program_id(2), pl.num_programs(2) - 1
        g = group_ids[v]
        starts_group = (v == 0) | (group_ids[jnp.maximum(v - 1, 0)] != g)
        ends_group = (v == last_v) | (group_ids[jnp.minimum(v + 1, max_visits - 1)] != g)
        start, end = offsets[g], offsets[g + 1]

        @pl.when(starts_group)
        def _init():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        row0 = m_tile_ids[v] * tm

        def accumulate(masked: bool):
            x, w = lhs_ref[...], rhs_ref[...]
            if masked:
                # Zero the rows (m) that are not this group's, on both sides: a boundary tile
                # holds other groups' rows, and the ragged last tile holds garbage (maybe NaN).
                # Masked in f32: older TPUs have no bf16 VPU.
                x_rows = row0 + lax.broadcasted_iota(jnp.int32, x.shape, 0 if lhs_is_mk else 1)
                x = jnp.where((x_rows >= start) & (x_rows < end), x.astype(jnp.float32), 0.0)
                w_rows = row0 + lax.broadcasted_iota(jnp.int32, w.shape, 0)
                w = jnp.where((w_rows >= start) & (w_rows < end), w.astype(jnp.float32), 0.0)
            if lhs_is_mk:
                x = x.astype(jnp.float32).T  # transposed in VMEM, as f32 (supported everywhere)
            acc_ref[...] += _dot(x.astype(cdt), w.astype(cdt), (((1,), (0,)), ((), ())))

        # Most tiles lie inside their group and need no masking.
        inside = (row0 >= start) & (row0 + tm <= end)
        pl.when(inside)(lambda: accumulate(False))
        pl.when(~inside & (end > start))(lambda: accumulate(True))

        @pl.when(ends_group)
        def _store():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    lhs_block = (tm, tk) if lhs_is_mk else (tk, tm)
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        bytes_accessed=lhs.size * lhs.dtype.itemsize * tiles_n
        + rhs.size * rhs.dtype.itemsize * tiles_k
        + num_active * k * n * jnp.dtype(out_dtype).itemsize,
        transcendentals=0,
    )
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct((num_active, k, n), out_dtype, g0, offsets, group_ids, m_tile_ids, lhs, rhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(tiles_n, tiles_k, num_tiles),
            in_specs=[
                _block_spec(lhs_block, lhs_map, input_buffer_count),
                _block_spec((tm, tn), rhs_map, input_buffer_count),
            ],
            out_specs=pl.BlockSpec((pl.Squeezed(), tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="transposed_grouped_matmul",
    )
    return call(g0[None], offsets, group_ids, m_tile_ids, lhs, rhs)


# --------------------------------------------------------------------------------------------
# Differentiable ops. The backward of each is made of the other two, so gradients of any order
# run on the kernels. Cotangents are cast to the input dtype so bf16 models keep a bf16 backward.
# --------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _gmm_op(lhs, rhs, group_sizes, group_offset, out_dtype, tiling, buffers, transpose_rhs, interp):
    return _gmm(lhs, rhs, group_sizes, group_offset, out_dtype=out_dtype, tiling=tiling,
                input_buffer_count=buffers, transpose_rhs=transpose_rhs, interpret=interp)


def _gmm_op_fwd(lhs, rhs, group_sizes, group_offset, out_dtype, tiling, buffers, transpose_rhs,
                interp):
    out = _gmm_op(lhs, rhs, group_sizes, group_offset, out_dtype, tiling, buffers, transpose_rhs,
                  interp)
    return out, (lhs, rhs, group_sizes, group_offset)


def _gmm_op_bwd(out_dtype, tiling, buffers, transpose_rhs, interp, res, grad):
    lhs, rhs, group_sizes, group_offset = res
    grad = grad.astype(lhs.dtype)
    # d_lhs[rows_g] = grad[rows_g] @ rhs[g]^T
    d_lhs = _gmm_op(grad, rhs, group_sizes, group_offset, lhs.dtype, tiling, buffers,
                    not transpose_rhs, interp)
    # d_rhs[g] = lhs[rows_g]^T @ grad[rows_g]  (or its transpose, computed as such directly)
    a, b = (grad, lhs) if transpose_rhs else (lhs, grad)
    d_rhs = _tgmm_op(a, b, group_sizes, group_offset, rhs.shape[0], True, rhs.dtype, tiling,
                     buffers, interp)
    return d_lhs, d_rhs, None, None


_gmm_op.defvjp(_gmm_op_fwd, _gmm_op_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _tgmm_op(lhs, rhs, group_sizes, group_offset, num_groups, lhs_is_mk, out_dtype, tiling,
             buffers, interp):
    return _tgmm(lhs, rhs, group_sizes, group_offset, num_actual_groups=num_groups,
                 lhs_is_mk=lhs_is_mk, out_dtype=out_dtype, tiling=tiling,
                 input_buffer_count=buffers, interpret=interp)


def _tgmm_op_fwd(lhs, rhs, group_sizes, group_offset, num_groups, lhs_is_mk, out_dtype, tiling,
                 buffers, interp):
    out = _tgmm_op(lhs, rhs, group_sizes, group_offset, num_groups, lhs_is_mk, out_dtype, tiling,
                   buffers, interp)
    return out, (lhs, rhs, group_sizes, group_offset)


def _tgmm_op_bwd(num_groups, lhs_is_mk, out_dtype, tiling, buffers, interp, res, grad):
    lhs, rhs, group_sizes, group_offset = res
    grad = grad.astype(lhs.dtype)  # [groups, k, n]
    # d_lhs[rows_g, :] (in [m, k] layout) = rhs[rows_g] @ grad[g]^T
    d_lhs_mk = _gmm_op(rhs, grad, group_sizes, group_offset, lhs.dtype, tiling, buffers, True,
                       interp)
    # d_rhs[rows_g] = lhs[:, rows_g]^T @ grad[g]
    lhs_mk = lhs if lhs_is_mk else lhs.T
    d_rhs = _gmm_op(lhs_mk, grad, group_sizes, group_offset, rhs.dtype, tiling, buffers, False,
                    interp)
    return (d_lhs_mk if lhs_is_mk else d_lhs_mk.T), d_rhs, None, None


_tgmm_op.defvjp(_tgmm_op_fwd, _tgmm_op_bwd)

_gmm_jit = jax.jit(_gmm_op, static_argnums=(4, 5, 6, 7, 8))
_tgmm_jit = jax.jit(_tgmm_op, static_argnums=(4, 5, 6, 7, 8, 9))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: jnp.dtype = jnp.float32,
    tiling: Union[Tiling, TilingFn] = (128, 128, 128),
    input_buffer_count: int = 2,
    group_offset: jax.Array | int | None = None,
    transpose_rhs: bool = False,
    interpret: Any = None,
    *,
    check_values: bool = True,
) -> jax.Array:
    """Grouped matmul (gmm): ``out[rows_g] = lhs[rows_g] @ rhs[g - group_offset]``.

    Args:
      lhs: ``[m, k]``, bfloat16 / float16 / float32.
      rhs: ``[num_selected, k, n]`` (``[num_selected, n, k]`` if ``transpose_rhs``), same dtype
        as ``lhs``; one matrix per selected group.
      group_sizes: int32 ``[num_groups]``, rows of ``lhs`` per group, ``num_groups >=
        num_selected``.
      preferred_element_type: output dtype; accumulation is always float32.
      tiling: ``(tm, tk, tn)``, or a function ``(m, k, n) -> (tm, tk, tn) | None``. On TPU the
        tiles must satisfy Mosaic's block rules (multiples of (8, 128), or the full dimension);
        tiles larger than the problem are shrunk to it.
      input_buffer_count: buffers per lhs/rhs block: 2 (double buffering, the default) or 1
        (no prefetch, half the VMEM). Deeper pipelines are not supported by Mosaic's grid
        pipeline in this jax version.
      group_offset: first selected group (int or int32 scalar, may be traced); groups
        ``[group_offset, group_offset + num_selected)`` are computed, other rows give zeros.
      transpose_rhs: ``rhs`` holds ``[n, k]`` matrices.
      interpret: ``None`` = auto (Pallas interpret mode off TPU); an explicit value wins.
      check_values: read concrete ``group_sizes`` (and a ``group_offset`` array) to check their
        values (a device-to-host copy); ``False`` for values known valid: unchecked values are
        clamped, as under ``jax.jit``.

    Returns:
      ``[m, n]`` in ``preferred_element_type``. Rows outside the selected groups (including rows
      past ``sum(group_sizes)``) are zeros. Differentiable w.r.t. ``lhs`` and ``rhs``.
    """
    transpose_rhs = check_flag("transpose_rhs", transpose_rhs)
    check_values = check_flag("check_values", check_values)
    _check_float("lhs", lhs)
    _check_float("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [m, k], got shape {tuple(lhs.shape)}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be 3-D [groups, k, n], got shape {tuple(rhs.shape)}")
    _check_same_dtype(lhs, rhs)
    m, k = lhs.shape
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rhs_k != k:
        layout = "[groups, n, k]" if transpose_rhs else "[groups, k, n]"
        raise ValueError(
            f"rhs {tuple(rhs.shape)} ({layout}) does not match lhs {tuple(lhs.shape)} in k"
        )
    _check_group_sizes(group_sizes, m, check_values)
    if rhs.shape[0] > group_sizes.shape[0]:
        raise ValueError(
            f"rhs has {rhs.shape[0]} groups but group_sizes only {group_sizes.shape[0]}"
        )
    group_offset = _check_group_offset(group_offset, group_sizes.shape[0], rhs.shape[0], check_values)
    out_dtype = _check_dtype_arg(preferred_element_type)
    tiling = _check_tiling(tiling)
    input_buffer_count = _check_buffer_count(input_buffer_count)
    # Typed as jax types a primitive's operands (shard_map: see _vma.vary_together).
    lhs, rhs, group_sizes, group_offset = vary_together((lhs, rhs, group_sizes, group_offset))
    return _gmm_jit(lhs, rhs, group_sizes, group_offset, out_dtype, tiling,
                    input_buffer_count, transpose_rhs, resolve_interpret(interpret))


def transposed_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    preferred_element_type: jnp.dtype = jnp.float32,
    tiling: Union[Tiling, TilingFn] = (128, 128, 128),
    input_buffer_count: int = 2,
    group_offset: jax.Array | int | None = None,
    num_actual_groups: int | None = None,
    interpret: Any = None,
    *,
    check_values: bool = True,
) -> jax.Array:
    """Transposed grouped matmul (tgmm): ``out[i] = lhs[:, rows_g] @ rhs[rows_g]``.

    ``g = group_offset + i``; this is the weight gradient of ``grouped_matmul``.

    Args:
      lhs: ``[k, m]``, bfloat16 / float16 / float32.
      rhs: ``[m, n]``, same dtype as ``lhs``.
      group_sizes: int32 ``[num_groups]``, rows (of ``rhs``; columns of ``lhs``) per group.
      preferred_element_type: output dtype; accumulation is always float32.
      tiling: ``(tm, tk, tn)`` or a function ``(m, k, n) -> (tm, tk, tn) | None``
        (see ``grouped_matmul``).
      input_buffer_count: buffers per lhs/rhs block, 1 or 2 (see ``grouped_matmul``).
      group_offset: first group to compute (int or int32 scalar, may be traced).
      num_actual_groups: how many groups to compute (static); default ``num_groups``.
      interpret: ``None`` = auto (Pallas interpret mode off TPU); an explicit value wins.
      check_values: as in ``grouped_matmul``.

    Returns:
      ``[num_actual_groups, k, n]``; empty groups give zeros. Differentiable w.r.t. ``lhs`` and
      ``rhs``.
    """
    check_values = check_flag("check_values", check_values)
    _check_float("lhs", lhs)
    _check_float("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D [k, m], got shape {tuple(lhs.shape)}")
    if rhs.ndim != 2:
        raise ValueError(f"rhs must be 2-D [m, n], got shape {tuple(rhs.shape)}")
    _check_same_dtype(lhs, rhs)
    if lhs.shape[1] != rhs.shape[0]:
        raise ValueError(
            f"lhs {tuple(lhs.shape)} ([k, m]) and rhs {tuple(rhs.shape)} ([m, n]) disagree on m"
        )
    m = rhs.shape[0]
    _check_group_sizes(group_sizes, m, check_values)
    num_groups = group_sizes.shape[0]
    if num_actual_groups is None:
        num_actual_groups = num_groups
    if not _is_int(num_actual_groups):  # True (once 1 group) was a ValueError; a wrong type is a TypeError
        raise TypeError(f"num_actual_groups must be an int or None, got {num_actual_groups!r}")
    if not 0 <= num_actual_groups <= num_groups:
        raise ValueError(
            f"num_actual_groups must be an int in [0, {num_groups}], got {num_actual_groups!r}"
        )
    group_offset = _check_group_offset(group_offset, num_groups, int(num_actual_groups), check_values)
    out_dtype = _check_dtype_arg(preferred_element_type)
    tiling = _check_tiling(tiling)
    input_buffer_count = _check_buffer_count(input_buffer_count)
    lhs, rhs, group_sizes, group_offset = vary_together((lhs, rhs, group_sizes, group_offset))
    return _tgmm_jit(lhs, rhs, group_sizes, group_offset, int(num_actual_groups), False, out_dtype,
                     tiling, input_buffer_count, resolve_interpret(interpret))
