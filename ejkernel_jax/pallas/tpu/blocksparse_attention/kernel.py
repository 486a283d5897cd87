"""Pallas TPU kernels of blocksparse attention: forward, dQ and dK/dV.

Tensors are head-major here, ``q [B, H, Sq, D]``, ``k [B, Hkv, Skv, D]``, ``v [B, Hkv,
Skv, Dv]`` (``attention.py`` transposes from the project's ``[B, S, H, D]``).  Every
pass runs over a grid whose last axis walks a ``MaskInfo`` schedule (see ``info.py``):

* forward / dQ: grid ``(B, H, q blocks, kv steps)``; a step loads kv block
  ``data_next[row, i, step]``;
* dK/dV: grid ``(B, kv blocks, H, q steps)``, kv-major so one kv block's gradients
  accumulate over all q blocks and all q heads of its kv head (GQA/MQA) in VMEM.

Per step ``block_mask`` picks the code path: 0 = skip, 2 = full block (no mask work;
only segment ids, if any), 1 = partial block (mask block loaded through ``mask_next``,
or the mask function evaluated on token ids).

TPU layout notes (these shapes are what Mosaic accepts; the lowering test checks them):
per-row statistics (running max, sum, lse) are kept lane-replicated as ``[rows, 128]``
and widened with ``_lanes``; per-column vectors are fed as ``[8, n]`` sublane-replicated
tiles.  Block sizes must be multiples of (8, 128) for real TPU runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...._first_order import first_order
from ...._vma import out_struct
from .._dot import dot as _dot
from .info import FULL, PARTIAL

NUM_LANES = 128
NUM_SUBLANES = 8
_F32_MAX = float(np.finfo(np.float32).max)
# Masked logits.  Finite, so no inf - inf = NaN anywhere.
MASK_VALUE = -0.7 * _F32_MAX
# Initial running max, strictly above MASK_VALUE: while a row has seen only masked
# logits, exp(MASK_VALUE - _M_INIT) underflows to exactly 0, so fully masked rows sum
# to 0 (-> output 0, lse -inf) without a select on every block.
_M_INIT = -0.35 * _F32_MAX

# Batch and heads are independent; the q axis is kept sequential (megacore splits only
# the parallel axes) and the step axis carries the online-softmax / dQ accumulators.
_Q_MAJOR_SEMANTICS = ("parallel", "parallel", "arbitrary", "arbitrary")

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


class PassInfo(NamedTuple):
    """The arrays of one ``MaskInfo`` that a kernel pass consumes (jax/numpy arrays)."""

    data_next: Any
    block_mask: Any
    mask_next: Any  # None: computed in-kernel or no partial blocks
    partial_blocks: Any  # [n, a, b] or None
    q_sequence: Any  # [Sq] int32 or None


@dataclasses.dataclass(frozen=True)
class PassConfig:
    block_q: int
    block_kv: int
    mask_function: Callable | None  # hashable


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) parameters shared by the three kernels."""

    fwd: PassConfig
    dq: PassConfig
    dkv: PassConfig
    scale: float
    soft_cap: float | None
    interpret: Any


def _lanes(x, n: int):
    """Widen a lane-replicated ``[rows, 128]`` value to ``[rows, n]``."""
    reps = pl.cdiv(n, NUM_LANES)
    if reps > 1:
        x = jnp.tile(x, (1, reps))
    return x if x.shape[1] == n else x[:, :n]


def _div(x, n: int):
    """``x // n`` for non-negative traced ints.  ``lax.div`` truncates; ``//`` on jax
    ints floors via ``sign``, which Mosaic cannot lower without a TPU generation."""
    return x if n == 1 else lax.div(x, n)


def _soft_cap(s, cap):
    return s if cap is None else cap * jnp.tanh(s / cap)


def _soft_cap_grad(ds, s, cap):
    """Chain rule through ``cap * tanh(s / cap)``: multiply by ``1 - tanh^2``."""
    if cap is None:
        return ds
    t = jnp.tanh(s / cap)
    return ds * (1.0 - t * t)


class _Schedule:
    """Reads the scalar-prefetched schedule (data_next, block_mask[, mask_next])."""

    def __init__(self, info: PassInfo, heads: int):
        rows = info.block_mask.shape[0]
        if heads % rows:
            raise ValueError(f"MaskInfo has {rows} rows, which does not divide {heads} heads")
        self.rows = rows  # 1, head shards or heads: a row serves heads_per_row heads
        self.heads_per_row = heads // rows
        self.has_mask_next = info.mask_next is not None

    def arrays(self, info: PassInfo):
        return (info.data_next, info.block_mask) + ((info.mask_next,) if self.has_mask_next else ())

    @property
    def count(self) -> int:
        return 3 if self.has_mask_next else 2

    def _at(self, ref, h, i, j):
        row = 0 if self.rows == 1 else _div(h, self.heads_per_row)
        return ref[row, i, j].astype(jnp.int32)  # int8/int16 in scalar memory

    def data(self, refs, h, i, j):
        return self._at(refs[0], h, i, j)

    def kind(self, refs, h, i, j):
        return self._at(refs[1], h, i, j)

    def mask_index(self, refs, h, i, j):
        return self._at(refs[2], h, i, j)


def _head_group(num_q_heads: int, num_kv_heads: int) -> int:
    return num_q_heads // num_kv_heads


def _partial_dispatch(kind, has_partial: bool, step: Callable):
    """Run ``step(partial)`` for full and partial blocks; empty blocks do nothing."""

    @pl.when(kind == FULL)
    def _full():
        step(False)

    if has_partial:

        @pl.when(kind == PARTIAL)
        def _partial():
            step(True)


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
def _fwd_kernel(*refs, names, sched: _Schedule, cfg: Config, bkv: int, width: int, has_partial: bool):
    r = dict(zip(names, refs))
    s_refs = refs[: sched.count]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    kv_block = sched.data(s_refs, h, i, j)
    m_ref, l_ref, acc_ref = r["scratch0"], r["scratch1"], r["scratch2"]
    dv = acc_ref.shape[-1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, _M_INIT)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(partial: bool):
        q, k, v = r["q"][...], r["k"][...], r["v"][...]
        s = _dot(q, k, _NT) * cfg.scale
        z = _soft_cap(s, cfg.soft_cap)
        mask = _row_major_mask(r, kv_block, bkv, z.shape, partial, cfg.fwd.mask_function)
        if mask is not None:
            z = jnp.where(mask, z, MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_next = jnp.maximum(m_prev, z.max(axis=-1)[:, None])  # [bq, 128]
        p = jnp.exp(z - _lanes(m_next, bkv))
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_prev + p.sum(axis=-1)[:, None]
        m_ref[...] = m_next
        pv = _dot(p.astype(v.dtype), v, _NN)
        acc_ref[...] = _lanes(alpha, dv) * acc_ref[...] + pv

    _partial_dispatch(sched.kind(s_refs, h, i, j), has_partial, step)

    @pl.when(j == width - 1)
    def _finish():
        denom = l_ref[...]
        empty = denom == 0.0  # no key allowed for this row
        denom = jnp.where(empty, 1.0, denom)
        r["o"][...] = (acc_ref[...] * _lanes(1.0 / denom, dv)).astype(r["o"].dtype)
        r["lse"][...] = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(denom))


def _row_major_mask(r, kv_block, bkv, shape, partial, mask_fn):
    """Boolean [bq, bkv] mask of a step in the q-major passes, or None if nothing masks."""
    parts = []
    if partial:
        if mask_fn is not None:
            q_ids = _lanes(r["q_seq"][...], bkv)
            kv_ids = kv_block * bkv + lax.broadcasted_iota(jnp.int32, shape, 1)
            parts.append(mask_fn(q_ids, kv_ids))
        else:
            parts.append(r["mask"][...])
    if "q_seg" in r:
        parts.append(_lanes(r["q_seg"][...], bkv) == r["kv_seg"][:1, :])
    return functools.reduce(jnp.logical_and, parts) if parts else None


class _Inputs:
    """Named kernel inputs, in call order; kernels look their refs up by name."""

    def __init__(self, sched: _Schedule, info: PassInfo):
        self.sched, self.info = sched, info
        self.names, self.specs, self.arrays = [], [], []

    def add(self, name, block_shape, index_map, array):
        self.names.append(name)
        self.specs.append(pl.BlockSpec(block_shape, index_map))
        self.arrays.append(array)

    def call(
        self, kernel, *, grid, semantics, out_names, out_specs, out_shape, scratch, name, interpret, **static
    ):
        """``pallas_call`` with the schedule scalar-prefetched in front of the inputs."""
        names = ("_s",) * self.sched.count + tuple(self.names) + out_names
        names += tuple(f"scratch{n}" for n in range(len(scratch)))
        operands = (*self.sched.arrays(self.info), *self.arrays)
        # Typed for shard_map: varying over the mesh axes any operand varies over.
        out_shape = jax.tree.map(lambda s: out_struct(s.shape, s.dtype, *operands), out_shape)
        return pl.pallas_call(
            functools.partial(kernel, names=names, sched=self.sched, **static),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=self.sched.count,
                grid=grid,
                in_specs=self.specs,
                out_specs=out_specs,
                scratch_shapes=scratch,
            ),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=interpret,
            name=name,
        )(*operands)


def _q_major_inputs(sched, info, pc: PassConfig, q, k, v, q_seg, kv_seg) -> _Inputs:
    """Inputs shared by the forward and dQ passes, grid ``(b, h, i, step)``."""
    bq, bkv, D, Dv = pc.block_q, pc.block_kv, q.shape[-1], v.shape[-1]
    g = _head_group(q.shape[1], k.shape[1])
    kv_block = lambda b, h, i, j, *s: (b, _div(h, g), sched.data(s, h, i, j), 0)
    inputs = _Inputs(sched, info)
    inputs.add("q", (None, None, bq, D), lambda b, h, i, j, *s: (b, h, i, 0), q)
    inputs.add("k", (None, None, bkv, D), kv_block, k)
    inputs.add("v", (None, None, bkv, Dv), kv_block, v)
    if q_seg is not None:
        inputs.add("q_seg", (None, bq, NUM_LANES), lambda b, h, i, j, *s: (b, i, 0), _lane_rows(q_seg))
        inputs.add(
            "kv_seg",
            (None, NUM_SUBLANES, bkv),
            lambda b, h, i, j, *s: (b, 0, sched.data(s, h, i, j)),
            _sublane_cols(kv_seg),
        )
    if info.partial_blocks is not None:
        inputs.add(
            "mask",
            (None, bq, bkv),
            lambda b, h, i, j, *s: (sched.mask_index(s, h, i, j), 0, 0),
            info.partial_blocks,
        )
    if info.q_sequence is not None:
        inputs.add(
            "q_seq",
            (bq, NUM_LANES),
            lambda b, h, i, j, *s: (i, 0),
            _lane_rows(info.q_sequence[None])[0],
        )
    return inputs


def _has_partial(info: PassInfo, pc: PassConfig) -> bool:
    return info.partial_blocks is not None or pc.mask_function is not None


def forward(cfg: Config, q, k, v, q_seg, kv_seg, info: PassInfo):
    """Returns ``out [B, H, Sq, Dv]`` and ``lse [B, H, Sq]`` (float32, -inf on empty rows)."""
    B, H, Sq, _ = q.shape
    Dv = v.shape[-1]
    bq = cfg.fwd.block_q
    sched = _Schedule(info, H)
    nq, width = info.block_mask.shape[1:]
    assert nq == Sq // bq, (nq, Sq, bq)
    rows = lambda b, h, i, j, *s: (b, h, i, 0)
    out, lse = _q_major_inputs(sched, info, cfg.fwd, q, k, v, q_seg, kv_seg).call(
        _fwd_kernel,
        grid=(B, H, nq, width),
        semantics=_Q_MAJOR_SEMANTICS,
        out_names=("o", "lse"),
        out_specs=[
            pl.BlockSpec((None, None, bq, Dv), rows),
            pl.BlockSpec((None, None, bq, NUM_LANES), rows),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Sq, Dv), q.dtype),
            jax.ShapeDtypeStruct((B, H, Sq, NUM_LANES), jnp.float32),
        ],
        # running max, running sum (lane-replicated), output accumulator
        scratch=[pltpu.VMEM((bq, NUM_LANES), jnp.float32)] * 2 + [pltpu.VMEM((bq, Dv), jnp.float32)],
        name="blocksparse_attention_fwd",
        interpret=cfg.interpret,
        cfg=cfg,
        bkv=cfg.fwd.block_kv,
        width=width,
        has_partial=_has_partial(info, cfg.fwd),
    )
    return out, lse[..., 0]


def _lane_rows(x):
    """``[B, n]`` -> ``[B, n, 128]``: one value per row, replicated along lanes."""
    return jnp.broadcast_to(x.astype(jnp.int32)[..., None], (*x.shape, NUM_LANES))


def _sublane_cols(x):
    """``[B, n]`` -> ``[B, 8, n]``: one value per column, replicated along sublanes."""
    return jnp.broadcast_to(x.astype(jnp.int32)[:, None, :], (x.shape[0], NUM_SUBLANES, x.shape[1]))


# --------------------------------------------------------------------------------------
# dQ
# --------------------------------------------------------------------------------------
def _dq_kernel(*refs, names, sched: _Schedule, cfg: Config, bkv: int, width: int, has_partial: bool):
    r = dict(zip(names, refs))
    s_refs = refs[: sched.count]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    kv_block = sched.data(s_refs, h, i, j)
    acc_ref = r["scratch0"]

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(partial: bool):
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = _dot(q, k, _NT) * cfg.scale
        z = _soft_cap(s, cfg.soft_cap)
        mask = _row_major_mask(r, kv_block, bkv, z.shape, partial, cfg.dq.mask_function)
        if mask is not None:
            z = jnp.where(mask, z, MASK_VALUE)
        # lse is +inf on fully masked rows (see attention_bwd): p is then exactly 0.
        p = jnp.exp(z - r["lse"][0][:, None])
        dp = _dot(do, v, _NT)
        ds = _soft_cap_grad(p * (dp - r["di"][0][:, None]), s, cfg.soft_cap)
        acc_ref[...] += _dot(ds.astype(k.dtype), k, _NN)

    _partial_dispatch(sched.kind(s_refs, h, i, j), has_partial, step)

    @pl.when(j == width - 1)
    def _finish():
        r["dq"][...] = (acc_ref[...] * cfg.scale).astype(r["dq"].dtype)


def backward_dq(cfg: Config, q, k, v, q_seg, kv_seg, lse, di, do, info: PassInfo):
    B, H, Sq, D = q.shape
    bq = cfg.dq.block_q
    sched = _Schedule(info, H)
    nq, width = info.block_mask.shape[1:]
    rows = lambda b, h, i, j, *s: (b, h, i, 0)
    inputs = _q_major_inputs(sched, info, cfg.dq, q, k, v, q_seg, kv_seg)
    inputs.add("do", (None, None, bq, do.shape[-1]), rows, do)
    # Per-row scalars as [1, bq] lane vectors; the kernel turns them into columns.
    vec = lambda b, h, i, j, *s: (b, h, 0, i)
    inputs.add("lse", (None, None, 1, bq), vec, lse[:, :, None, :])
    inputs.add("di", (None, None, 1, bq), vec, di[:, :, None, :])
    return inputs.call(
        _dq_kernel,
        grid=(B, H, nq, width),
        semantics=_Q_MAJOR_SEMANTICS,
        out_names=("dq",),
        out_specs=pl.BlockSpec((None, None, bq, D), rows),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=[pltpu.VMEM((bq, D), jnp.float32)],
        name="blocksparse_attention_dq",
        interpret=cfg.interpret,
        cfg=cfg,
        bkv=cfg.dq.block_kv,
        width=width,
        has_partial=_has_partial(info, cfg.dq),
    )


# --------------------------------------------------------------------------------------
# dK / dV (kv-major, transposed score tiles [bkv, bq])
# --------------------------------------------------------------------------------------
def _dkv_kernel(
    *refs, names, sched: _Schedule, cfg: Config, bq: int, bkv: int, width: int, group: int, has_partial: bool
):
    r = dict(zip(names, refs))
    s_refs = refs[: sched.count]
    b, kv, h, t = (pl.program_id(a) for a in range(4))
    dk_acc, dv_acc = r["scratch0"], r["scratch1"]
    in_group = lax.rem(h, group) if group > 1 else 0

    # dK/dV of one kv head sum over its `group` q heads and all q steps.
    @pl.when((t == 0) & (in_group == 0))
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    def step(partial: bool):
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = _dot(k, q, _NT) * cfg.scale  # [bkv, bq]
        z = _soft_cap(s, cfg.soft_cap)
        parts = []
        if partial:
            if cfg.dkv.mask_function is not None:
                q_ids = jnp.broadcast_to(r["q_seq"][:1, :], z.shape)
                kv_ids = kv * bkv + lax.broadcasted_iota(jnp.int32, z.shape, 0)
                parts.append(cfg.dkv.mask_function(q_ids, kv_ids))
            else:
                parts.append(r["mask"][...])
        if "q_seg" in r:
            parts.append(r["q_seg"][:1, :] == _lanes(r["kv_seg"][...], bq))
        if parts:
            z = jnp.where(functools.reduce(jnp.logical_and, parts), z, MASK_VALUE)
        p = jnp.exp(z - r["lse"][:1, :])
        dv_acc[...] += _dot(p.astype(do.dtype), do, _NN)
        dp = _dot(v, do, _NT)
        ds = _soft_cap_grad(p * (dp - r["di"][:1, :]), s, cfg.soft_cap)
        dk_acc[...] += _dot(ds.astype(q.dtype), q, _NN)

    _partial_dispatch(sched.kind(s_refs, h, t, kv), has_partial, step)

    @pl.when((t == width - 1) & (in_group == group - 1))
    def _finish():
        r["dk"][...] = (dk_acc[...] * cfg.scale).astype(r["dk"].dtype)
        r["dv"][...] = dv_acc[...].astype(r["dv"].dtype)


def backward_dkv(cfg: Config, q, k, v, q_seg, kv_seg, lse, di, do, info: PassInfo):
    B, H, Sq, D = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = _head_group(H, Hkv)
    bq, bkv = cfg.dkv.block_q, cfg.dkv.block_kv
    sched = _Schedule(info, H)
    width, nkv = info.block_mask.shape[1:]
    assert nkv == Skv // bkv, (nkv, Skv, bkv)

    q_block = lambda s, kv, h, t: sched.data(s, h, t, kv)
    q_rows = lambda b, kv, h, t, *s: (b, h, q_block(s, kv, h, t), 0)
    kv_rows = lambda b, kv, h, t, *s: (b, _div(h, g), kv, 0)
    inputs = _Inputs(sched, info)
    inputs.add("q", (None, None, bq, D), q_rows, q)
    inputs.add("k", (None, None, bkv, D), kv_rows, k)
    inputs.add("v", (None, None, bkv, Dv), kv_rows, v)
    inputs.add("do", (None, None, bq, Dv), q_rows, do)
    # Per-q scalars broadcast over the kv (sublane) axis of the transposed tiles.
    vec = lambda b, kv, h, t, *s: (b, h, 0, q_block(s, kv, h, t))
    sublanes = (B, H, NUM_SUBLANES, Sq)
    inputs.add("lse", (None, None, NUM_SUBLANES, bq), vec, jnp.broadcast_to(lse[:, :, None, :], sublanes))
    inputs.add("di", (None, None, NUM_SUBLANES, bq), vec, jnp.broadcast_to(di[:, :, None, :], sublanes))
    if q_seg is not None:
        inputs.add(
            "q_seg",
            (None, NUM_SUBLANES, bq),
            lambda b, kv, h, t, *s: (b, 0, q_block(s, kv, h, t)),
            _sublane_cols(q_seg),
        )
        inputs.add("kv_seg", (None, bkv, NUM_LANES), lambda b, kv, h, t, *s: (b, kv, 0), _lane_rows(kv_seg))
    if info.partial_blocks is not None:
        inputs.add(
            "mask",
            (None, bkv, bq),
            lambda b, kv, h, t, *s: (sched.mask_index(s, h, t, kv), 0, 0),
            info.partial_blocks,
        )
    if info.q_sequence is not None:
        inputs.add(
            "q_seq",
            (NUM_SUBLANES, bq),
            lambda b, kv, h, t, *s: (0, q_block(s, kv, h, t)),
            _sublane_cols(info.q_sequence[None])[0],
        )
    return inputs.call(
        _dkv_kernel,
        grid=(B, nkv, H, width),
        # Heads and q steps accumulate into one dK/dV block.  The kv axis is kept
        # sequential too (as splash does): the prefetch chain runs across kv columns.
        semantics=("parallel", "arbitrary", "arbitrary", "arbitrary"),
        out_names=("dk", "dv"),
        out_specs=[pl.BlockSpec((None, None, bkv, D), kv_rows), pl.BlockSpec((None, None, bkv, Dv), kv_rows)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[pltpu.VMEM((bkv, D), jnp.float32), pltpu.VMEM((bkv, Dv), jnp.float32)],
        name="blocksparse_attention_dkv",
        interpret=cfg.interpret,
        cfg=cfg,
        bq=bq,
        bkv=bkv,
        width=width,
        group=g,
        has_partial=_has_partial(info, cfg.dkv),
    )


# --------------------------------------------------------------------------------------
# custom_vjp
# --------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: Config, q, k, v, q_seg, kv_seg, fwd_info, dq_info, dkv_info):
    """Head-major blocksparse attention; returns ``(out, lse)``."""
    return forward(cfg, q, k, v, q_seg, kv_seg, fwd_info)


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg, fwd_info, dq_info, dkv_info):
    # grad of grad differentiates this rule and the next: their Pallas backward calls have no
    # derivative (Pallas raised a bare NotImplementedError), so that raises naming the op.
    q, k, v = first_order("blocksparse_attention", (q, k, v))
    out, lse = forward(cfg, q, k, v, q_seg, kv_seg, fwd_info)
    # Fully masked rows carry lse = +inf into the backward pass: exp(z - lse) is then
    # exactly 0 and their gradients vanish without extra selects.
    res_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    return (out, lse), (q, k, v, q_seg, kv_seg, dq_info, dkv_info, out, res_lse)


def _attention_bwd(cfg, res, cotangents):
    (q, k, v, q_seg, kv_seg, dq_info, dkv_info, out, lse), (do, dlse) = first_order("blocksparse_attention",
                                                                                   (res, cotangents))
    # d(lse)/d(logits) = p, so an lse cotangent just shifts di (the row term of dS).
    di = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)
    do = do.astype(q.dtype)
    dq = backward_dq(cfg, q, k, v, q_seg, kv_seg, lse, di, do, dq_info)
    dk, dv = backward_dkv(cfg, q, k, v, q_seg, kv_seg, lse, di, do, dkv_info)
    return dq, dk, dv, None, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
