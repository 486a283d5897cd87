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
