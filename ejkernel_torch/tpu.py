"""The Pallas TPU kernels of :mod:`ejkernel_jax.pallas.tpu`, callable from PyTorch.

``blocksparse_attention``, ``grouped_matmul``, ``transposed_grouped_matmul``,
``make_group_metadata`` and ``process_dynamic_mask(_dkv)`` take the same arguments as their jax
versions, with torch tensors where those take jax arrays, and return torch tensors. Each runs
the jax function through :func:`ejkernel_torch.interop.jax_to_torch`: inputs and outputs cross
zero-copy through DLPack, the call is one cached ``jax.jit`` (so results are bit-identical to
the jax function under ``jax.jit``), and gradients come from jax's VJP of the same kernels.
The mask classes, ``BlockSizes``, ``MaskInfo`` and ``process_mask(_dkv)`` are host-side (numpy)
objects and are the jax module's own.

Devices: cpu tensors run on jax's CPU and cuda tensors on jax's GPU, both in Pallas interpret
mode (``interpret=None`` resolves from the tensors' device, not from jax's default backend).
PyTorch/XLA tensors: on XLA:CPU/CUDA they cross through torch_xla's DLPack (interpret mode); on
a TPU, whose buffers DLPack cannot carry, the bridge runs the jax function inside torch_xla's own
graph (``call_jax``) and the kernels are compiled natively (``interpret=False``). Tensors of one
call must share a device.

Arguments: non-tensor arguments (masks, block sizes, tiling, dtypes, flags) are static: they
must be hashable and are part of the jit cache key (a numpy mask is wrapped in a ``NumpyMask``,
a dict of block sizes in ``BlockSizes``, a list in a tuple). Integer tensors (``group_sizes``,
segment ids, a ``group_offset`` tensor) are traced and get no gradient; a bool tensor mask is a
dynamic mask. Bad inputs raise ``TypeError`` / ``ValueError`` naming the argument before any
kernel runs; ``group_sizes`` / ``group_offset`` tensor values are checked too (one host sync).
Where they cannot be read (during CUDA graph capture), a ``group_offset`` tensor is clamped into
range before it is narrowed to int32, as the jax version clamps a traced one, and 64-bit segment
ids are renumbered on the device, as the jax version renumbers traced ones.

``torch.compile``: every op here is ``torch.compiler.disable``-d, a documented graph break; the
op runs eagerly with the right values and gradients (``fullgraph=True`` raises).
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import torch

from ejkernel_jax.pallas.tpu import blocksparse_attention as _bsa
from ejkernel_jax.pallas.tpu import grouped_matmul as _gmm
from ejkernel_jax.pallas.tpu._interpret import resolve_interpret
from ejkernel_jax.pallas.tpu.blocksparse_attention import attention as _bsa_attention
from ejkernel_jax.pallas.tpu.blocksparse_attention import info as _bsa_info
from ejkernel_torch.ops._common import autocast, clamp_to_int32, ordered_int64, values_readable

# Host-side objects: the jax module's own (numpy masks and schedules, no device arrays).
from ejkernel_jax.pallas.tpu.blocksparse_attention import (
    BlockSizes,
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MaskInfo,
    MultiHeadMask,
    NumpyMask,
    make_causal_mask,
    make_chunk_attention_mask,
    make_local_attention_mask,
    make_random_mask,
    process_mask,
    process_mask_dkv,
)

from ._interop._bridge import _compiler_disable, jax_to_torch
from ._interop._convert import TORCH_TO_JAX_DTYPE

__all__ = [
    "blocksparse_attention",
    "grouped_matmul",
    "transposed_grouped_matmul",
    "make_group_metadata",
    "BlockSizes",
    "MaskInfo",
    "process_mask",
    "process_mask_dkv",
    "process_dynamic_mask",
    "process_dynamic_mask_dkv",
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
    "cache_info",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Integer tensors (ids, offsets) of any integer dtype, as the jax versions take them.
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64,
               torch.uint8, torch.uint16, torch.uint32, torch.uint64)
_WIDE_INT_DTYPES = (torch.int64, torch.uint32, torch.uint64)  # values past int32 possible


# -- argument checks (torch side, before anything reaches jax) -----------------------------------


def _tensor(fn: str, name: str, x, dtypes: tuple, kind: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: argument {name!r} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{fn}: argument {name!r} must be {kind}, got {x.dtype}")
    return x


def _float(fn: str, name: str, x) -> torch.Tensor:
    # The kernels are written for TPU dtypes; float64 would also flip jax into x64 mode.
    return _tensor(fn, name, x, _FLOAT_DTYPES, "bfloat16, float16 or float32")


def _int32(fn: str, name: str, x) -> torch.Tensor:
    return _tensor(fn, name, x, (torch.int32,), "int32")


def _int_ids(fn: str, name: str, x) -> torch.Tensor | None:
    """Integer ids, checked; ids of a dtype wider than int32 are range-checked (one host sync),
    as the jax version checks concrete ones (uint16/32/64 were refused as "must be an integer
    tensor, got torch.uint32")."""
    if x is None:
        return None
    x = _tensor(fn, name, x, _INT_DTYPES, "an integer tensor")
    # values_readable(x): a torch.func-wrapped x has no storage to read (vmap crashed here in
    # .item()); unread, the bridge then refuses it by name.
    if x.dtype in _WIDE_INT_DTYPES and x.numel() and values_readable(x):
        ordered, shift = ordered_int64(x)  # uint64 from 2**63 up read as such, not as negatives
        lo, hi = (v + shift for v in torch.stack(torch.aminmax(ordered)).tolist())
        try:
            _bsa_attention.check_segment_id_range(name, lo, hi)
        except ValueError as e:
            raise ValueError(f"{fn}: {e}") from None
    return x


def _segment_ids(fn: str, q_segment_ids, kv_segment_ids) -> tuple:
    """Both ids (or None) as int32, like the jax version's. 64-bit ids whose values cannot be read
    (during CUDA graph capture) were narrowed as they were, so 0 and 2**32 were one segment: they
    are renumbered on the device instead, as jax renumbers traced ones (``dense_segment_ids``)."""
    ids = (_int_ids(fn, "q_segment_ids", q_segment_ids), _int_ids(fn, "kv_segment_ids", kv_segment_ids))
    given = [x for x in ids if x is not None]
    if any(x.element_size() == 8 and not values_readable(x) for x in given):
        _device(fn, q_segment_ids=ids[0], kv_segment_ids=ids[1])  # named, before torch.cat fails
        ranks = iter(_dense_ids(given))
        ids = tuple(None if x is None else next(ranks) for x in ids)
    return tuple(None if x is None else x.to(torch.int32) for x in ids)


def _dense_ids(ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ids`` renumbered jointly as int32 ranks (equal ids equal, distinct ones distinct), with
    device ops a CUDA graph can capture (sort, cumsum, gather: no host read, no data-dependent
    size). A uint64 id meets an int64 one as its bits, as in ``dense_segment_ids``."""
    keys = torch.cat([x.reshape(-1).to(torch.int64) for x in ids])
    sorted_keys, order = torch.sort(keys)
    new = torch.cat([torch.zeros_like(sorted_keys[:1], dtype=torch.bool), sorted_keys[1:] != sorted_keys[:-1]])
    ranks = torch.cumsum(new, 0)[torch.argsort(order)].to(torch.int32)  # back in the order of keys
    return [r.view(x.shape) for r, x in zip(ranks.split([x.numel() for x in ids]), ids)]


def _device(fn: str, **tensors) -> torch.device:
    """The one device of all given tensors (None entries skipped)."""
    named = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    first, device = named[0][0], named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"{fn}: argument {name!r} is on {t.device} but {first!r} is on {device}; "
                "all tensors of one call must share a device"
            )
    return device


def _scalar(fn: str, name: str, x) -> float | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{fn}: argument {name!r} must be a float or None, got {type(x).__name__}")
    return float(x)


def _xla_is_tpu(device: torch.device) -> bool:
    try:
        import torch_xla.core.xla_model as xm

        return xm.xla_device_hw(device) == "TPU"
    except Exception:  # no torch_xla, or a device string it does not know
        return False


def _interpret(interpret, device: torch.device):
    """``None``: Pallas interpret mode unless the data is on a TPU (decided by the tensors'
    device: cpu tensors run on jax's CPU even when jax's default backend is a TPU)."""
    if interpret is not None:
        return resolve_interpret(interpret)  # checked: "no" was truthy
    return not (device.type == "xla" and _xla_is_tpu(device))


def _jax_dtype(fn: str, name: str, dtype):
    """torch dtypes map to jax's; anything else is handed to jax as it is (jax checks it)."""
    if dtype is None:  # jnp.dtype(None) is float64: jax's check would name a dtype never passed
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_JAX_DTYPE:
            raise TypeError(f"{fn}: argument {name!r}: {dtype} has no jax equivalent")
        return TORCH_TO_JAX_DTYPE[dtype]
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{fn}: argument {name!r} must be a dtype, got {dtype!r}") from None


def _graph_break(fn):
    """dynamo cannot trace the DLPack exchange or jax: a documented graph break (see module doc)."""
    return _compiler_disable(fn, f"ejkernel_torch.tpu.{fn.__name__} runs a JAX/Pallas computation")


def _call(fn: str, bridge, *args, **kwargs):
    """``bridge(*args, **kwargs)``, with the jax version's own argument errors (raised while it is
    traced, before any kernel runs) prefixed with ``fn`` as the checks here are: "q heads (3) must
    be a multiple of kv heads (2)" or "tiling must be 3 positive ints" named no torch op. Only
    plain TypeError/ValueError: jax's subclasses (tracer errors) take other arguments.

    Also runs the jax version's own checks of static tuples on every call, before any trace:
    refused as jax refuses them ((1.0, 8) was accepted), so what reaches the bridge holds plain
    ints."""
    try:
        return bridge(*args, **kwargs)
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError) or str(e).startswith(f"{fn}:"):
            raise
        # The original frames are kept: where in the jax version the check (or a bug) was.
        raise type(e)(f"{fn}: {e}").with_traceback(e.__traceback__) from None


def _hashable(fn: str, name: str, value):
    if isinstance(value, list):
        value = tuple(value)
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{fn}: argument {name!r} must be hashable (it is static), got {value!r}") from None
    return value


# -- blocksparse attention ---------------------------------------------------------------------


def _attention_jax(q, k, v, dynamic_mask, q_segment_ids, kv_segment_ids, *, mask, causal, sliding_window,
                   chunk_size, softmax_scale, logits_soft_cap, block_sizes, interpret, return_lse):
    return _bsa.blocksparse_attention(
        q, k, v,
        mask=mask if dynamic_mask is None else dynamic_mask,
        causal=causal, sliding_window=sliding_window, chunk_size=chunk_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        block_sizes=block_sizes, interpret=interpret, return_lse=return_lse,
    )


# x64=False: inputs are 32-bit at most, and the kernels are traced as jax traces them by default.
_attention = jax_to_torch(
    _attention_jax,
    static_argnames=("mask", "causal", "sliding_window", "chunk_size", "softmax_scale", "logits_soft_cap",
                     "block_sizes", "interpret", "return_lse"),
    x64=False,
)


def _static_mask(fn: str, mask):
    """(static Mask or None, dynamic bool tensor or None)."""
    if mask is None or isinstance(mask, Mask):
        return mask, None
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"{fn}: argument 'mask' must be a bool tensor (dynamic mask), got {mask.dtype}")
        return None, mask
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_:  # checked here, as the jax version does: NumpyMask's error names its "array"
            raise TypeError(f"{fn}: argument 'mask' must be boolean, got dtype {mask.dtype}")
        # Static like a Mask: wrapped so it hashes by value (the jax version wraps it too).
        if mask.ndim == 2:
            return NumpyMask(mask), None
        if mask.ndim == 3:
            return MultiHeadMask([NumpyMask(m) for m in mask]), None
        raise ValueError(f"{fn}: argument 'mask' as a numpy array must be 2-D or 3-D, got shape {mask.shape}")
    raise TypeError(
        f"{fn}: argument 'mask' must be a Mask, a numpy bool array or a bool torch.Tensor, "
        f"got {type(mask).__name__}"
    )



@_graph_break
def blocksparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Any = None,
    causal: bool = False,
    sliding_window: int | tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    block_sizes: BlockSizes | dict | None = None,
    interpret: Any = None,
    return_lse: bool = False,
):
    """Block-sparse attention on ``[batch, seq, heads, head_dim]`` tensors, through the bridge.

    Same arguments and results as ``ejkernel_jax.pallas.tpu.blocksparse_attention`` (see there),
    with torch tensors: ``q``/``k``/``v`` bfloat16, float16 or float32 (one dtype); ``mask`` a
    ``Mask`` / ``MultiHeadMask`` or numpy bool array (static) or a bool tensor (dynamic);
    segment ids integer tensors ``[batch, seq]`` (used as int32). Returns ``out`` (and the
    float32 ``lse [batch, heads, q_len]`` with ``return_lse``); differentiable in q, k, v.
    """
    fn = "blocksparse_attention"
    q, k, v = autocast(*(_float(fn, n, t) for n, t in (("q", q), ("k", k), ("v", v))))
    q_seg, kv_seg = _segment_ids(fn, q_segment_ids, kv_segment_ids)
    static_mask, dynamic_mask = _static_mask(fn, mask)
    device = _device(fn, q=q, k=k, v=v, mask=dynamic_mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if isinstance(block_sizes, dict):  # a misspelt key is BlockSizes' TypeError, named with fn
        block_sizes = _call(fn, lambda sizes: BlockSizes(**sizes), block_sizes)
    return _call(
        fn, _attention, q, k, v, dynamic_mask, q_seg, kv_seg,
        mask=static_mask,
        causal=_gmm.check_flag(f"{fn}: argument 'causal'", causal),  # 1 == True for the bridge's cache
        sliding_window=None if sliding_window is None else _call(
            fn, _bsa_attention._window_sides, sliding_window),  # w -> (w, w), as jax reads it
        chunk_size=_hashable(fn, "chunk_size", chunk_size),
        softmax_scale=_scalar(fn, "softmax_scale", softmax_scale),
        logits_soft_cap=_scalar(fn, "logits_soft_cap", logits_soft_cap),
        block_sizes=_hashable(fn, "block_sizes", block_sizes),
        interpret=_hashable(fn, "interpret", _call(fn, _interpret, interpret, device)),
        return_lse=_gmm.check_flag(f"{fn}: argument 'return_lse'", return_lse),  # "no" was truthy
    )


def _mask_info_jax(mask, *, block_shape, is_dkv, downcast_smem_data, head_shards, q_seq_shards, shrink_grid):
    info, _ = _bsa.process_dynamic_mask(
        mask, block_shape, is_dkv=is_dkv, downcast_smem_data=downcast_smem_data,
        head_shards=head_shards, q_seq_shards=q_seq_shards, shrink_grid=shrink_grid,
    )
    return tuple(info[:5])  # arrays only; is_dynamic_mask is put back on the torch side


_mask_info = jax_to_torch(
    _mask_info_jax,
    static_argnames=("block_shape", "is_dkv", "downcast_smem_data", "head_shards", "q_seq_shards", "shrink_grid"),
    x64=False,
)


@_graph_break
def process_dynamic_mask(
    mask: torch.Tensor,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool = False,
    downcast_smem_data: bool = True,
    head_shards: int = 1,
    q_seq_shards: int = 1,
    shrink_grid: bool = True,
) -> tuple[MaskInfo, None]:
    """``MaskInfo`` (of torch tensors, on ``mask``'s device) of a bool mask tensor
    ``[heads, q_len, kv_len]``; see ``ejkernel_jax``'s ``process_dynamic_mask``."""
    fn = "process_dynamic_mask"
    mask = _tensor(fn, "mask", mask, (torch.bool,), "a bool tensor")
    arrays = _call(
        fn, _mask_info, mask,
        block_shape=_call(fn, _bsa_info._check_block_shape, block_shape),
        is_dkv=_gmm.check_flag(f"{fn}: argument 'is_dkv'", is_dkv),  # bool("no") is True
        downcast_smem_data=_gmm.check_flag(f"{fn}: argument 'downcast_smem_data'", downcast_smem_data),  # bool("no") is True
        head_shards=_hashable(fn, "head_shards", head_shards),
        q_seq_shards=_hashable(fn, "q_seq_shards", q_seq_shards),
        shrink_grid=_gmm.check_flag(f"{fn}: argument 'shrink_grid'", shrink_grid),  # bool("no") is True
    )
    return MaskInfo(*arrays, True), None


def process_dynamic_mask_dkv(mask: torch.Tensor, block_shape: tuple[int, int], **kwargs) -> tuple[MaskInfo, None]:
    """``process_dynamic_mask(..., is_dkv=True)``."""
    return process_dynamic_mask(mask, block_shape, is_dkv=True, **kwargs)


# -- grouped matmul ----------------------------------------------------------------------------


def _gmm_jax(lhs, rhs, group_sizes, group_offset, *, preferred_element_type, tiling, input_buffer_count,
             static_group_offset, transpose_rhs, interpret):
    return _gmm.grouped_matmul(
        lhs, rhs, group_sizes, preferred_element_type, tiling, input_buffer_count,
        static_group_offset if group_offset is None else group_offset, transpose_rhs, interpret,
    )


def _tgmm_jax(lhs, rhs, group_sizes, group_offset, *, preferred_element_type, tiling, input_buffer_count,
              static_group_offset, num_actual_groups, interpret):
    return _gmm.transposed_grouped_matmul(
        lhs, rhs, group_sizes, preferred_element_type, tiling, input_buffer_count,
        static_group_offset if group_offset is None else group_offset, num_actual_groups, interpret,
    )


_GMM_STATIC = ("preferred_element_type", "tiling", "input_buffer_count", "static_group_offset", "interpret")
_gmm_bridge = jax_to_torch(_gmm_jax, static_argnames=_GMM_STATIC + ("transpose_rhs",), x64=False)
_tgmm_bridge = jax_to_torch(_tgmm_jax, static_argnames=_GMM_STATIC + ("num_actual_groups",), x64=False)


def _group_args(fn: str, lhs, rhs, group_sizes, group_offset, m_axis: int, num_selected):
    """Checks shared by gmm and tgmm; returns (group_sizes, offset tensor | None, static offset, device).

    An int ``group_offset`` is static; a tensor one is traced. Both ranges are checked here,
    before anything is traced (the tensor's with ``group_sizes``' values, in one host sync).
    """
    lhs, rhs = autocast(_float(fn, "lhs", lhs), _float(fn, "rhs", rhs))
    group_sizes = _int32(fn, "group_sizes", group_sizes)
    offset_tensor = static_offset = None
    if isinstance(group_offset, torch.Tensor):
        offset_tensor = _tensor(fn, "group_offset", group_offset, _INT_DTYPES, "an integer tensor")
        if offset_tensor.shape not in ((), (1,)):
            raise ValueError(f"{fn}: argument 'group_offset' must be a scalar, got shape {tuple(offset_tensor.shape)}")
    elif group_offset is not None:
        if isinstance(group_offset, bool) or not isinstance(group_offset, numbers.Integral):
            raise TypeError(f"{fn}: argument 'group_offset' must be an int or an integer tensor, got {group_offset!r}")
        static_offset = int(group_offset)
    device = _device(fn, lhs=lhs, rhs=rhs, group_sizes=group_sizes, group_offset=offset_tensor)
    if group_sizes.ndim != 1:
        raise ValueError(f"{fn}: argument 'group_sizes' must be 1-D, got shape {tuple(group_sizes.shape)}")
    n_sel = num_selected if num_selected is not None else group_sizes.shape[0]
    if static_offset is not None:
        _check_offset_range(fn, static_offset, group_sizes.shape[0], n_sel)
    # values_readable(these tensors): not for torch.func-wrapped ones (no storage to read: "Cannot
    # access data pointer"); the bridge then refuses them by name.
    if values_readable(group_sizes, offset_tensor) and (group_sizes.numel() or offset_tensor is not None):
        # Also with no groups: an offset tensor must then be 0, as jax checks a concrete one.
        m = lhs.shape[m_axis] if lhs.ndim == 2 else None
        checks = [(group_sizes < 0).any().to(torch.int64), group_sizes.sum(dtype=torch.int64)]
        shift = 0
        if offset_tensor is not None:
            ordered, shift = ordered_int64(offset_tensor.reshape(()))  # uint64 past 2**63 not negative
            checks.append(ordered)
        got = torch.stack(checks).tolist()  # one host sync
        if got[0]:
            raise ValueError(f"{fn}: argument 'group_sizes' must be non-negative, got {group_sizes.tolist()}")
        if m is not None and got[1] > m:
            raise ValueError(f"{fn}: sum(group_sizes) = {got[1]} exceeds the {m} rows of the operand")
        if offset_tensor is not None:
            _check_offset_range(fn, got[2] + shift, group_sizes.shape[0], n_sel)
    if offset_tensor is not None:
        # Unread (values_readable() False), an int64 2**32 was cast to int32 0, a valid offset:
        # clamped first into the kernels' range, as the Triton fronts do (gm.group_offset_bounds).
        hi = group_sizes.shape[0] - n_sel if _is_count(n_sel) else group_sizes.shape[0]
        offset_tensor = clamp_to_int32(offset_tensor, 0, max(hi, 0))
    return lhs, rhs, group_sizes, offset_tensor, static_offset, device


def _is_count(num_selected) -> bool:
    # Not a bool: num_actual_groups=True, counted as 1 here, was refused by range, not by type.
    return isinstance(num_selected, numbers.Integral) and not isinstance(num_selected, (bool, np.bool_))


def _check_offset_range(fn: str, g0: int, num_groups: int, num_selected) -> None:
    # A num_selected that is not an int is left for jax to reject while tracing.
    if _is_count(num_selected) and not 0 <= g0 <= num_groups - num_selected:
        raise ValueError(
            f"{fn}: group_offset={g0} selects groups [{g0}, {g0 + num_selected}) but group_sizes has {num_groups}"
        )


@_graph_break
def grouped_matmul(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    preferred_element_type: Any = torch.float32,
    tiling: tuple[int, int, int] | Callable = (128, 128, 128),
    input_buffer_count: int = 2,
    group_offset: int | torch.Tensor | None = None,
    transpose_rhs: bool = False,
    interpret: Any = None,
) -> torch.Tensor:
    """Grouped matmul (gmm): ``out[rows_g] = lhs[rows_g] @ rhs[g - group_offset]``, through the bridge.

    Same arguments as ``ejkernel_jax.pallas.tpu.grouped_matmul.grouped_matmul`` with torch
    tensors: ``lhs [m, k]`` and ``rhs [num_selected, k, n]`` (``[.., n, k]`` with
    ``transpose_rhs``) of one dtype (bfloat16/float16/float32), ``group_sizes`` int32
    ``[num_groups]``; ``preferred_element_type`` a torch (or jax) dtype, default float32. There
    is no ``check_values``: the values are always checked here, in one host sync (module docstring).
    Differentiable in lhs and rhs.
    """
    fn = "grouped_matmul"
    rhs_groups = rhs.shape[0] if isinstance(rhs, torch.Tensor) and rhs.ndim == 3 else None
    lhs, rhs, group_sizes, offset, static_offset, device = _group_args(
        fn, lhs, rhs, group_sizes, group_offset, 0, rhs_groups
    )
    return _call(
        fn, _gmm_bridge, lhs, rhs, group_sizes, offset,
        preferred_element_type=_jax_dtype(fn, "preferred_element_type", preferred_element_type),
        tiling=_hashable(fn, "tiling", tiling),
        input_buffer_count=_hashable(fn, "input_buffer_count", input_buffer_count),
        static_group_offset=static_offset,
        transpose_rhs=_gmm.check_flag(f"{fn}: argument 'transpose_rhs'", transpose_rhs),
        interpret=_hashable(fn, "interpret", _call(fn, _interpret, interpret, device)),
    )


@_graph_break
def transposed_grouped_matmul(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    group_sizes: torch.Tensor,
    preferred_element_type: Any = torch.float32,
    tiling: tuple[int, int, int] | Callable = (128, 128, 128),
    input_buffer_count: int = 2,
    group_offset: int | torch.Tensor | None = None,
    num_actual_groups: int | None = None,
    interpret: Any = None,
) -> torch.Tensor:
    """Transposed grouped matmul (tgmm): ``out[i] = lhs[:, rows_g] @ rhs[rows_g]``, through the bridge.

    Same arguments as ``ejkernel_jax``'s ``transposed_grouped_matmul`` with torch tensors:
    ``lhs [k, m]``, ``rhs [m, n]``, ``group_sizes`` int32; returns
    ``[num_actual_groups, k, n]``; no ``check_values``, as in ``grouped_matmul``. Differentiable
    in lhs and rhs.
    """
    fn = "transposed_grouped_matmul"
    lhs, rhs, group_sizes, offset, static_offset, device = _group_args(
        fn, lhs, rhs, group_sizes, group_offset, 1, num_actual_groups
    )
    return _call(
        fn, _tgmm_bridge, lhs, rhs, group_sizes, offset,
        preferred_element_type=_jax_dtype(fn, "preferred_element_type", preferred_element_type),
        tiling=_hashable(fn, "tiling", tiling),
        input_buffer_count=_hashable(fn, "input_buffer_count", input_buffer_count),
        static_group_offset=static_offset,
        num_actual_groups=_hashable(fn, "num_actual_groups", num_actual_groups),
        interpret=_hashable(fn, "interpret", _call(fn, _interpret, interpret, device)),
    )


def _metadata_jax(group_sizes, start_group, *, m, tm, num_nonzero_groups, visit_empty_groups):
    return _gmm.make_group_metadata(
        group_sizes=group_sizes, m=m, tm=tm, start_group=start_group,
        num_nonzero_groups=num_nonzero_groups, visit_empty_groups=visit_empty_groups,
    )


_metadata = jax_to_torch(
    _metadata_jax, static_argnames=("m", "tm", "num_nonzero_groups", "visit_empty_groups"), x64=False
)


@_graph_break
def make_group_metadata(
    *,
    group_sizes: torch.Tensor,
    m: int,
    tm: int,
    start_group: torch.Tensor | int,
    num_nonzero_groups: int,
    visit_empty_groups: bool = True,
):
    """The grouped matmul's visit schedule as torch tensors:
    ``((group_offsets, group_ids, m_tile_ids), num_tiles)``; see ``ejkernel_jax``'s
    ``make_group_metadata``. ``start_group`` may be an int or an integer scalar tensor; its value
    is checked as jax checks a concrete one (a tensor's in one host sync)."""
    fn = "make_group_metadata"
    group_sizes = _int32(fn, "group_sizes", group_sizes)
    start_value = None  # known value of start_group: jax checks a concrete one, but here it is traced
    if isinstance(start_group, torch.Tensor):
        start_group = _tensor(fn, "start_group", start_group, _INT_DTYPES, "an integer tensor")
        if start_group.ndim != 0:  # as the jax version's message; checked inside the bridge, it showed jax's tracer
            raise TypeError(f"{fn}: argument 'start_group' must be an int or an integer scalar, "
                            f"got a tensor of shape {tuple(start_group.shape)}")
        _device(fn, group_sizes=group_sizes, start_group=start_group)
        if values_readable(start_group):  # read (one host sync)
            start_value = start_group.tolist()  # exact: int() raised on a uint64 past 2**63
    elif isinstance(start_group, bool) or not isinstance(start_group, numbers.Integral):
        raise TypeError(f"{fn}: argument 'start_group' must be an int or an integer tensor, got {start_group!r}")
    else:
        start_group = start_value = int(start_group)  # traced like jax.jit traces a Python int: no retrace per value
    # The jax version's checks, before tracing (a float m is a TypeError, m=-1 a ValueError, as there).
    m, tm, num_nonzero_groups = (_gmm._check_count(name, value, least, traced_ok=False) for name, value, least in
                                 (("m", m, 0), ("tm", tm, 1), ("num_nonzero_groups", num_nonzero_groups, 0)))
    if start_value is not None:
        _gmm._check_count("start_group", start_value, 0, traced_ok=False)
    _gmm._check_selection(start_value, num_nonzero_groups, group_sizes.shape[0])
    if isinstance(start_group, torch.Tensor):
        # Unread, an int64 2**32 was narrowed to int32 0 and selected groups from 0. A start below
        # -num_nonzero_groups or past num_groups selects no group, as those bounds do: clamped
        # into them first, the traced value selects what jax selects for it.
        start_group = clamp_to_int32(start_group, -num_nonzero_groups, group_sizes.shape[0])
    return _call(fn, _metadata, group_sizes, start_group, m=m, tm=tm, num_nonzero_groups=num_nonzero_groups,
                     visit_empty_groups=_gmm.check_flag(f"{fn}: argument 'visit_empty_groups'",
                                                        visit_empty_groups))  # bool("no") is True


# -- introspection -----------------------------------------------------------------------------

_BRIDGES = {
    "blocksparse_attention": _attention,
    "process_dynamic_mask": _mask_info,
    "grouped_matmul": _gmm_bridge,
    "transposed_grouped_matmul": _tgmm_bridge,
    "make_group_metadata": _metadata,
}


def cache_info() -> dict[str, dict[str, int]]:
    """Per op: calls, forward traces (jit compilations), backward traces, cache entries."""
    return {name: b.cache_info() for name, b in _BRIDGES.items()}
