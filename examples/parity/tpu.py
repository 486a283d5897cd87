"""Parity cases for the Pallas TPU kernels behind the DLPack bridge (``ejkernel_torch.tpu``).

The torch side is ``ejkernel_torch.tpu.X`` (the jax function through ``jax_to_torch``, one jitted
call); the jax side is ``ejkernel_jax.pallas.tpu...X`` under ``jax.jit``, so the two run the same
XLA computation and agree bit for bit. (Called eagerly, jax rounds dQ/dK's row term
``sum(out * dout)`` unfused and can differ from any jitted run by an ulp.) Off TPU both run in
Pallas interpret mode, so the shapes are small.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch

from ejkernel_torch import reference

from . import Case, register

# -- float64 reference -----------------------------------------------------------------------------


def _allowed(q_len, kv_len, *, mask, causal, sliding_window, chunk_size):
    """Dense bool [heads|1, q_len, kv_len] of the op's mask arguments (bottom-right aligned)."""
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            dense = mask.cpu().numpy()
        elif isinstance(mask, np.ndarray):
            dense = mask
        else:  # a Mask: dense window through its own slicing
            dense = mask[(slice(None),) * len(mask.shape)]
        dense = torch.from_numpy(np.array(dense, dtype=bool))
        return dense if dense.ndim == 3 else dense[None]
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)  # query i sits at key position i + offset
    j = torch.arange(kv_len)[None, :]
    keep = torch.ones(q_len, kv_len, dtype=torch.bool)
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        right = 0 if causal else right
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    elif causal and chunk_size is None:
        keep &= j <= i
    if chunk_size is not None:
        keep &= (i // chunk_size == j // chunk_size) & (j <= i)
    return keep[None]


def blocksparse_attention_reference(q, k, v, *, mask=None, causal=False, sliding_window=None, chunk_size=None,
                                    q_segment_ids=None, kv_segment_ids=None, softmax_scale=None,
                                    logits_soft_cap=None, return_lse=False, **_):
    """Dense masked attention in the inputs' dtype (float64 for a reference), ``[b, s, h, d]``.

    Splash conventions: a query attends keys with an *equal* segment id (every id is a segment);
    rows with no allowed key give output 0 and lse -inf. Block sizes / interpret are ignored.
    """
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    keep = _allowed(q.shape[1], k.shape[1], mask=mask, causal=causal, sliding_window=sliding_window,
                    chunk_size=chunk_size).to(q.device)
    keep = keep.expand(heads, -1, -1)[None]
    if q_segment_ids is not None or kv_segment_ids is not None:
        qs = q_segment_ids if q_segment_ids is not None else kv_segment_ids
        ks = kv_segment_ids if kv_segment_ids is not None else q_segment_ids
        keep = keep & (qs[:, None, :, None] == ks[:, None, None, :])
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if not return_lse:
        return out
    lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)


# -- resolving the op on each side -----------------------------------------------------------------

_JAX_OPS = {
    "blocksparse_attention": ("ejkernel_jax.pallas.tpu.blocksparse_attention", "blocksparse_attention"),
    "grouped_matmul": ("ejkernel_jax.pallas.tpu.grouped_matmul", "grouped_matmul"),
    "transposed_grouped_matmul": ("ejkernel_jax.pallas.tpu.grouped_matmul", "transposed_grouped_matmul"),
}


def _resolver(name: str, static: tuple[str, ...], positional_extra: tuple[str, ...] = ()):
    """``resolve(module)``: ``ejkernel_torch.tpu.<name>`` or the jax function under ``jax.jit``.

    ``positional_extra`` names keyword-only arguments that the case passes positionally
    (integer inputs such as segment ids are generated with the case's inputs)."""

    def resolve(module):
        if module.__name__ == "ejkernel_torch":
            op = getattr(importlib.import_module("ejkernel_torch.tpu"), name)
        else:
            import jax

            path, attr = _JAX_OPS[name]
            op = jax.jit(getattr(importlib.import_module(path), attr), static_argnames=static)
        if not positional_extra:
            return op
        n = len(positional_extra)
        return lambda *args, **kw: op(*args[:-n], **dict(zip(positional_extra, args[-n:])), **kw)

    return resolve


# -- cases -------------------------------------------------------------------------------------------

_ATTN_STATIC = ("mask", "causal", "sliding_window", "chunk_size", "softmax_scale", "logits_soft_cap",
                "block_sizes", "interpret", "return_lse")
_GMM_STATIC = ("preferred_element_type", "tiling", "input_buffer_count", "transpose_rhs", "interpret")
_TGMM_STATIC = ("preferred_element_type", "tiling", "input_buffer_count", "num_actual_groups", "interpret")


def _qkv(b, s, h, h_kv, d, segments=False):
    def make(rng):
        arrays = [rng.standard_normal((b, s, h, d)), rng.standard_normal((b, s, h_kv, d)),
                  rng.standard_normal((b, s, h_kv, d))]
        if segments:  # two documents per row, split at a random point
            cut = rng.integers(1, s, size=(b, 1))
            arrays.append((np.arange(s)[None, :] >= cut).astype(np.int32))
        return arrays

    return make


def _attention_reference(positional_extra=()):
    n = len(positional_extra)

    def ref(*args, **kw):
        if n:
            args, kw = args[:-n], {**kw, **dict(zip(positional_extra, args[-n:]))}
        return blocksparse_attention_reference(*args, **kw)

    return ref


def _matmul_reference(fn):
    # Tiling and output dtype do not change the math the reference computes.
    return lambda *args, tiling=None, preferred_element_type=None, **kw: fn(*args, **kw)


def _sizes(rng, m, groups):
    sizes = np.diff(np.concatenate([[0], np.sort(rng.integers(0, m - 3, size=groups - 1)), [m - 3]]))
    sizes[1] = 0  # an empty group
    return sizes.astype(np.int32)


def _gmm(m, k, n, groups):
    return lambda rng: [rng.standard_normal((m, k)), rng.standard_normal((groups, k, n)) / np.sqrt(k),
                        _sizes(rng, m, groups)]


def _tgmm(m, k, n, groups):
    return lambda rng: [rng.standard_normal((k, m)), rng.standard_normal((m, n)), _sizes(rng, m, groups)]


def _register():
    from ejkernel_jax.pallas.tpu.blocksparse_attention import BlockSizes, LocalMask

    blocks = BlockSizes(16, 16)
    seg = ("q_segment_ids",)
    local = LocalMask((32, 32), (8, 0))
    tiling = (16, 16, 16)
    for dtype in ("float32", "bfloat16"):
        # Output in the input dtype (jax's pullback wants a cotangent of the output's dtype).
        gmm_kwargs = {"tiling": tiling, "preferred_element_type": dtype}
        register(
            Case("tpu.blocksparse_attention", "32x2x32,causal", dtype, _qkv(1, 32, 2, 2, 32),
                 _attention_reference(), n_diff=3, kwargs={"causal": True, "block_sizes": blocks},
                 resolve=_resolver("blocksparse_attention", _ATTN_STATIC)),
            Case("tpu.blocksparse_attention", "32x4:2x32,l+seg", dtype, _qkv(1, 32, 4, 2, 32, segments=True),
                 _attention_reference(seg), n_diff=3, kwargs={"mask": local, "block_sizes": blocks},
                 resolve=_resolver("blocksparse_attention", _ATTN_STATIC, seg)),
            Case("tpu.grouped_matmul", "64x32x48,g4", dtype, _gmm(64, 32, 48, 4),
                 _matmul_reference(reference.grouped_matmul), n_diff=2, kwargs=gmm_kwargs,
                 resolve=_resolver("grouped_matmul", _GMM_STATIC)),
            Case("tpu.transposed_grouped_matmul", "32x64x48,g4", dtype, _tgmm(64, 32, 48, 4),
                 _matmul_reference(reference.transposed_grouped_matmul), n_diff=2, kwargs=gmm_kwargs,
                 resolve=_resolver("transposed_grouped_matmul", _TGMM_STATIC)),
        )


_register()
