"""Plain torch references for every op, float64-capable (they compute in the input dtype).

Tests call them on float64 copies of the inputs; they are also handy for users who want to see
what an op means in a few lines.
"""
from __future__ import annotations

import torch


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    # Rows of only -inf give zeros (the kernels' convention), not NaN.
    m = x.amax(dim=axis, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    e = torch.exp(x - m)
    s = e.sum(dim=axis, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def causal_padding_mask(n_pad: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[batch, seq, seq] bool: query i sees key j iff n_pad[b] <= j <= i."""
    i = torch.arange(seq_len, device=n_pad.device)[:, None]
    j = torch.arange(seq_len, device=n_pad.device)[None, :]
    return (j <= i)[None] & (j[None] >= n_pad.long()[:, None, None])


def padded_softmax(scores: torch.Tensor, n_pad: torch.Tensor) -> torch.Tensor:
    mask = causal_padding_mask(n_pad, scores.shape[-1])
    return softmax(scores.masked_fill(~mask, float("-inf")), -1)


def padded_softmax_v(scores: torch.Tensor, v: torch.Tensor, n_pad: torch.Tensor) -> torch.Tensor:
    return padded_softmax(scores, n_pad) @ v


def padded_attention(q, k, v, n_pad, *, softmax_scale=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return padded_softmax_v(q @ k.transpose(-1, -2) * scale, v, n_pad)


def _group_bounds(group_sizes: torch.Tensor) -> list[int]:
    return [0] + torch.cumsum(group_sizes.long(), 0).tolist()


def grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs=False, group_offset=0):
    """A loop of matmuls: rows of group ``group_offset + i`` times ``rhs[i]``; other rows are 0."""
    bounds = _group_bounds(group_sizes)
    rhs = rhs.transpose(1, 2) if transpose_rhs else rhs
    out = lhs.new_zeros((lhs.shape[0], rhs.shape[2]))
    for i in range(rhs.shape[0]):
        start, end = bounds[group_offset + i], bounds[group_offset + i + 1]
        out[start:end] = lhs[start:end] @ rhs[i]
    return out


def transposed_grouped_matmul(lhs, rhs, group_sizes, *, group_offset=0, num_actual_groups=None):
    """``out[i] = lhs[:, rows] @ rhs[rows]`` for the rows of group ``group_offset + i``."""
    bounds = _group_bounds(group_sizes)
    num = len(group_sizes) if num_actual_groups is None else num_actual_groups
    out = [lhs[:, bounds[group_offset + i]:bounds[group_offset + i + 1]]
           @ rhs[bounds[group_offset + i]:bounds[group_offset + i + 1]] for i in range(num)]
    return torch.stack(out) if out else lhs.new_zeros((0, lhs.shape[0], rhs.shape[1]))


# -- flash attention -------------------------------------------------------------------------------


def _window_sides(causal, sliding_window):
    """(left, right) with None for unbounded, or None: the ops' reading of causal/sliding_window."""
    if sliding_window is None:
        return (None, 0) if causal else None
    left, right = sliding_window if isinstance(sliding_window, (tuple, list)) else (sliding_window,) * 2
    return (left, 0 if causal else right)


def flash_attention_keep(seq_q, seq_k, *, causal=False, sliding_window=None, q_segment_ids=None,
                         kv_segment_ids=None, device=None) -> torch.Tensor:
    """[batch|1, 1, seq_q, seq_k] bool: which keys each query attends (bottom-right aligned)."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    window = _window_sides(causal, sliding_window)
    if window is not None:
        diag = i + seq_k - seq_q
        left, right = window
        if left is not None:
            keep &= j >= diag - left
        if right is not None:
            keep &= j <= diag + right
    keep = keep[None, None]
    if q_segment_ids is not None:
        qs, ks = q_segment_ids[:, None, :, None], kv_segment_ids[:, None, None, :]
        keep = keep & (qs == ks) & (qs > 0)
    return keep


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, sliding_window=None, logits_soft_cap=None,
                    bias=None, q_segment_ids=None, kv_segment_ids=None, dropout_p=0.0, dropout_mask=None,
                    return_lse=False):
    """softmax(mask(cap * tanh(q k^T * scale / cap) + bias)) [* keep / (1 - p)] v, [b, s, h, d] layout.

    Dropout needs the keep-mask ``[batch, heads_q, seq_q, seq_k]`` (``flash_attention_dropout_mask``
    gives the kernels' one). Rows that attend nothing give 0 and lse -inf.
    """
    heads_q, heads_kv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(heads_q // heads_kv, dim=2)
    v = v.repeat_interleave(heads_q // heads_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias
    keep = flash_attention_keep(q.shape[1], k.shape[1], causal=causal, sliding_window=sliding_window,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, device=q.device)
    s = s.masked_fill(~keep, float("-inf"))
    # No keys at all: amax has nothing to reduce, and every row attends nothing.
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros((*s.shape[:-1], 1))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    attended = total > 0
    p = e / torch.where(attended, total, torch.ones_like(total))
    lse = torch.where(attended, m + torch.log(torch.where(attended, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf"))).squeeze(-1)
    if dropout_mask is not None:
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_mask=None,
                           return_lse=False, **options):
    """``flash_attention`` per packed sequence; the dropout mask is that of the padded
    ``[n_seq, heads_q, max_seqlen_q, max_seqlen_k]`` problem. Tokens past the last sequence give 0."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_zeros(q.shape[:2] + v.shape[2:])
    lse = q.new_zeros(q.shape[1], q.shape[0])
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        mask = None if dropout_mask is None else dropout_mask[b:b + 1, :, :q1 - q0, :k1 - k0]
        o, s = flash_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_mask=mask, return_lse=True,
                               **options)
        out[q0:q1], lse[:, q0:q1] = o[0], s[0]
    return (out, lse) if return_lse else out
