"""Packed-sequence helpers: cu_seqlens, position/sequence ids, chunk indices, segment-id masks.

The torch twin of ``ejkernel_jax.xla_utils``: same names, arguments and results (see that
module for the conventions). Outputs live on the input's device; int64 inputs give int64
results (jax without x64 gives int32). ``total_tokens=`` / ``total_chunks=`` avoid the host
sync that reading ``cu_seqlens[-1]`` costs, and keep shapes static under ``torch.compile``;
value checks are skipped where values cannot be read (compiling, ``torch.func`` transforms, fake
tensors, CUDA graph capture), as jax skips them for tracers.
"""
from __future__ import annotations

import torch

from triton_kernels import checks

from .ops._common import values_readable
from .utils import _as_tensor, _dtype

__all__ = [
    "cdiv", "identity_dtype_convert", "mask_to_segment_ids", "prepare_chunk_indices",
    "prepare_chunk_offsets", "prepare_cu_seqlens_from_mask", "prepare_lens",
    "prepare_lens_from_mask", "prepare_position_ids", "prepare_sequence_ids",
    "prepare_token_indices", "segment_ids_to_mask",
]


def cdiv(a, b):
    """Ceiling division for ints and integer tensors."""
    return -(-a // b)


# -- validation --------------------------------------------------------------------------------


def _is_int(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def _int_tensor(x, name: str, ndim: int | None = None, offsets: bool = False) -> torch.Tensor:
    """An integer tensor; ``offsets`` (lengths, boundaries) must be int32 or int64, since a
    narrower or unsigned dtype wraps around when they are added or subtracted (and torch
    indexes only with int64/int32)."""
    if isinstance(x, (list, tuple)) and not x:  # not the float32 torch gives []: the size checks name it
        x = torch.zeros(0, dtype=torch.int32)
    x = _as_tensor(x, name)
    if not _is_int(x):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
    if offsets and x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def _mask_tensor(mask, name: str) -> torch.Tensor:
    mask = _as_tensor(mask, name)
    if mask.dtype != torch.bool:
        if not _is_int(mask):
            raise TypeError(f"{name} must be bool or integer (nonzero = valid), got {mask.dtype}")
        mask = mask != 0
    return mask


def _cu_seqlens(cu_seqlens) -> torch.Tensor:
    cu = _int_tensor(cu_seqlens, "cu_seqlens", ndim=1, offsets=True)
    if cu.shape[0] < 1:
        raise ValueError("cu_seqlens must hold at least one boundary, got an empty array")
    # Not values_readable(cu): torch.func.vmap's batched tensors have no values to read (.item()
    # raised), as neither do compiled, fake or CUDA-graph-captured ones.
    if values_readable(cu):
        if int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
        lens = torch.diff(cu)
        if bool((lens < 0).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing (lengths >= 0), got lengths {lens.tolist()}")
    return cu


def _static_size(size, bounds: torch.Tensor, arg: str, fn: str) -> int:
    """The output length: ``size`` if given (checked when possible), else ``bounds[-1]``."""
    if size is None:
        # Unreadable values leave no length (torch.func.vmap failed inside .item()): name the
        # argument that gives it, as jax does for tracers. torch.compile reads it (a graph break).
        if not (values_readable(bounds) or torch.compiler.is_compiling()):
            raise ValueError(f"{fn}: the output length depends on the values of cu_seqlens, which cannot be read "
                             f"here (a torch.func transform, fake tensors or CUDA graph capture); pass {arg}=<int>")
        return checks.layout_length(fn, arg, int(bounds[-1]), given=False)
    if isinstance(size, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a Python int, got a tensor")
    size = checks.int_arg(f"{fn}: {arg}", size)
    if size < 0:
        raise ValueError(f"{fn}: {arg} must be >= 0, got {size}")
    if values_readable(bounds) and size < int(bounds[-1]):
        raise ValueError(f"{fn}: {arg}={size} is smaller than the {int(bounds[-1])} cu_seqlens needs")
    return checks.layout_length(fn, arg, size, given=True)


def _layout(bounds: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For slots 0..size-1: the segment of ``bounds`` holding each slot and the offset in it."""
    # Under torch.func.vmap searchsorted copied (and warned about) non-contiguous inputs: a mapped
    # bounds can be a strided or expanded view, and an unmapped slot was expanded over the batch
    # (stride 0). So bounds is copied (a few boundaries; .contiguous() looks only at the mapped
    # view, which is contiguous) and slot mapped as bounds is (adding zeros_like keeps the map).
    bounds = bounds.clone(memory_format=torch.contiguous_format)
    slot = torch.arange(size, dtype=bounds.dtype, device=bounds.device) + torch.zeros_like(bounds[:1])
    # Last boundary <= slot; right=True skips empty segments (repeated boundaries).
    owner = torch.searchsorted(bounds, slot, right=True).to(bounds.dtype) - 1
    valid = (slot >= bounds[0]) & (slot < bounds[-1])
    owner = torch.where(valid, owner, -1)
    offset = torch.where(valid, slot - bounds[owner.clamp(min=0)], -1)
    return owner, offset


# -- cu_seqlens -----------------------------------------------------------------------------------


def prepare_lens(cu_seqlens) -> torch.Tensor:
    """Sequence lengths: ``prepare_lens([0, 5, 12, 18]) == [5, 7, 6]``."""
    cu = _cu_seqlens(cu_seqlens)
    return cu[1:] - cu[:-1]


def prepare_lens_from_mask(mask) -> torch.Tensor:
    """Valid tokens per row of a ``[batch, seq]`` mask (bool, or integer with nonzero = valid), int32."""
    mask = _mask_tensor(mask, "mask")
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [batch, seq], got shape {tuple(mask.shape)}")
    return mask.sum(dim=-1, dtype=torch.int32)


def prepare_cu_seqlens_from_mask(mask, out_dtype=torch.int32) -> torch.Tensor:
    """``[0, cumsum(lens)]``: ``[[1,1,1,0],[1,1,0,0]] -> [0, 3, 5]``.

    ``out_dtype`` is int32 or int64 (a narrower one would overflow).
    """
    lens = prepare_lens_from_mask(mask)
    out_dtype = _dtype(out_dtype, "out_dtype")
    if out_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"out_dtype must be int32 or int64, got {out_dtype}")
    zero = torch.zeros(1, dtype=out_dtype, device=lens.device)
    return torch.cat([zero, torch.cumsum(lens, dim=0, dtype=out_dtype)])


# -- per token ----------------------------------------------------------------------------------------


def prepare_position_ids(cu_seqlens, total_tokens: int | None = None) -> torch.Tensor:
    """Position of each token in its sequence: ``[0, 3, 5, 9] -> [0,1,2, 0,1, 0,1,2,3]``."""
    cu = _cu_seqlens(cu_seqlens)
    return _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_position_ids"))[1]


def prepare_sequence_ids(cu_seqlens, total_tokens: int | None = None) -> torch.Tensor:
    """Sequence of each token: ``[0, 3, 5, 9] -> [0,0,0, 1,1, 2,2,2,2]``."""
    cu = _cu_seqlens(cu_seqlens)
    return _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_sequence_ids"))[0]


def prepare_token_indices(cu_seqlens, total_tokens: int | None = None) -> torch.Tensor:
    """``[total_tokens, 2]`` rows of ``(sequence id, position id)``."""
    cu = _cu_seqlens(cu_seqlens)
    owner, offset = _layout(cu, _static_size(total_tokens, cu, "total_tokens", "prepare_token_indices"))
    return torch.stack([owner, offset], dim=1)


# -- per chunk --------------------------------------------------------------------------------------


def prepare_chunk_offsets(cu_seqlens, chunk_size: int) -> torch.Tensor:
    """``[0, cumsum(ceil(len / chunk_size))]``: where each sequence's chunks start."""
    cu = _cu_seqlens(cu_seqlens)
    # Every length fits cu's dtype, so a chunk_size past its range means one chunk each; cut to
    # it, or the division casts chunk_size into that dtype and wraps (2**31 gave 0 chunks).
    size = min(checks.chunk_size(chunk_size), torch.iinfo(cu.dtype).max)
    chunks = cdiv(cu[1:] - cu[:-1], size)
    zero = torch.zeros(1, dtype=cu.dtype, device=cu.device)
    return torch.cat([zero, torch.cumsum(chunks, dim=0, dtype=cu.dtype)])


def prepare_chunk_indices(cu_seqlens, chunk_size: int, total_chunks: int | None = None) -> torch.Tensor:
    """``[total_chunks, 2]`` rows of ``(sequence id, chunk index within the sequence)``."""
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    owner, offset = _layout(offsets, _static_size(total_chunks, offsets, "total_chunks", "prepare_chunk_indices"))
    return torch.stack([owner, offset], dim=1)


# -- gradients ------------------------------------------------------------------------------------------


@torch.library.custom_op("ejkernel::round_through", mutates_args=())
def _round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back. An op of its own because inductor drops a
    ``.to(low).to(high)`` pair (``emulate_precision_casts`` is off by default): under
    torch.compile the gradient came back unrounded."""
    return x.to(dtype).to(x.dtype)


@_round_through.register_fake
def _(x, dtype):
    return torch.empty_like(x)


def _round_through_vmap(info, in_dims, x, dtype):
    return _round_through(x, dtype), in_dims[0]


def _round_through_backward(ctx, grad):
    return _round_through(grad, ctx.dtype), None  # as torch's own casts: the gradient cast both ways


def _round_through_setup(ctx, inputs, output):
    ctx.dtype = inputs[1]


_round_through.register_vmap(_round_through_vmap)
_round_through.register_autograd(_round_through_backward, setup_context=_round_through_setup)


class _IdentityGradCast(torch.autograd.Function):
    generate_vmap_rule = True  # with setup_context below: what torch.func transforms require

    @staticmethod
    def forward(x, dtype):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtype = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        # Back in grad's (= the input's) dtype, as the jax version does.
        return _round_through(grad, ctx.dtype), None


def identity_dtype_convert(dtype):
    """A function that returns its input unchanged and rounds the incoming gradient through ``dtype``.

    The gradient w.r.t. the input keeps the input's dtype; its values are those of ``dtype``
    (as in the jax version). The output is a view of the input made by an autograd function, which
    torch forbids to modify in place ("Output 0 of _IdentityGradCast is a view..."): clone it
    first. (Returning a copy would cost every call a pass over the tensor.)
    """
    dtype = _dtype(dtype)

    def identity(x: torch.Tensor) -> torch.Tensor:
        return _IdentityGradCast.apply(x, dtype)

    return identity


# -- segment ids <-> masks ------------------------------------------------------------------------------


def _segment_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids to compare, ids > 0)``. torch has no ``>`` for uint16/32/64 ("gt_cpu" not implemented
    for 'UInt32') nor ``==`` with another dtype, which jax takes: such ids are valid when nonzero
    and compared as int64 (uint64 past 2**63 wraps to negatives, equal to no valid signed id)."""
    if ids.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return ids.to(torch.int64), ids != 0
    return ids, ids > 0


def segment_ids_to_mask(segment_ids, dtype=torch.bool, return_separate_masks: bool = False):
    """Attention mask ``[..., Q, K]`` from segment ids ``[..., L]`` or a tuple ``(q_ids, kv_ids)``.

    Query i attends key j iff both ids are equal and positive (ids <= 0 are padding). With
    ``return_separate_masks`` returns ``(q_valid [..., Q], kv_valid [..., K], mask)``. A list is
    one array of ids, never a pair: pass the pair as a tuple.
    """
    if isinstance(segment_ids, tuple):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids as a tuple must be (q_segment_ids, kv_segment_ids), "
                             f"got {len(segment_ids)} items")
        q = _int_tensor(segment_ids[0], "q_segment_ids")
        kv = _int_tensor(segment_ids[1], "kv_segment_ids")
    else:
        q = kv = _int_tensor(segment_ids, "segment_ids")
    return_separate_masks = checks.flag("return_separate_masks", return_separate_masks)  # "no" was truthy
    if q.ndim < 1 or kv.ndim < 1:
        raise ValueError("segment_ids must have a sequence axis (ndim >= 1)")
    if q.shape[:-1] != kv.shape[:-1]:
        raise ValueError(f"q and kv segment ids need the same batch dims, got {tuple(q.shape)} and {tuple(kv.shape)}")
    dtype = _dtype(dtype)
    (q, q_valid), (kv, kv_valid) = _segment_ids(q), _segment_ids(kv)
    mask = (q[..., :, None] == kv[..., None, :]) & q_valid[..., :, None] & kv_valid[..., None, :]
    if return_separate_masks:
        return q_valid.to(dtype), kv_valid.to(dtype), mask.to(dtype)
    return mask.to(dtype)


def _pattern_ids(m: torch.Tensor) -> torch.Tensor:
    """Rows of ``m [..., Q, K]`` labelled 1, 2, ... by distinct pattern in order of first
    appearance; all-false rows get -1."""
    f = m.to(torch.float32)
    count = f.sum(-1)
    # 0/1 products summed in float32 are exact (K < 2**24), TF32 or not.
    common = f @ f.transpose(-1, -2)
    same = (common == count[..., :, None]) & (common == count[..., None, :])
    first = same.to(torch.uint8).argmax(dim=-1)  # earliest row with the same pattern
    valid = count > 0
    is_new = (first == torch.arange(m.shape[-2], device=m.device)) & valid
    label = torch.cumsum(is_new, dim=-1, dtype=torch.int32)
    return torch.where(valid, torch.gather(label, -1, first), -1)


def mask_to_segment_ids(mask, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
    m = _mask_tensor(mask, "mask")
    per_head = checks.flag("per_head", per_head)  # "no" was truthy
    if m.ndim not in (2, 3, 4):
        raise ValueError(f"mask must be [Q, K], [B, Q, K] or [B, H, Q, K], got shape {tuple(m.shape)}")
    if per_head and m.ndim != 4:
        raise ValueError(f"per_head=True needs a 4-D [B, H, Q, K] mask, got shape {tuple(m.shape)}")
    if m.ndim == 4 and not per_head:
        m = m.any(dim=1)
    kv_shape = m.shape[:-2] + m.shape[-1:]
    if m.shape[-2] == 0:  # no queries: nothing to label, and argmax needs a non-empty axis
        return m.new_zeros(m.shape[:-1], dtype=torch.int32), m.new_full(kv_shape, -1, dtype=torch.int32)
    q_ids = _pattern_ids(m)
    kv_ids = torch.where(m, q_ids[..., :, None], -1).amax(dim=-2)
    return q_ids, kv_ids.to(torch.int32)
