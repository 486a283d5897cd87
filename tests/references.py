"""Float64 references for the shared suite, computed with ejkernel_torch.reference on CPU.

Inputs are the numpy values the kernel actually saw (after rounding to its dtype), so the
reference measures the kernel's error, not the rounding of its inputs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ejkernel_torch import reference


def _t(a) -> torch.Tensor:
    a = np.asarray(a)
    t = torch.from_numpy(np.array(a, copy=True, order="C"))
    return t.to(torch.float64) if np.issubdtype(a.dtype, np.floating) else t


def forward(fn: Callable, *args, **kwargs) -> np.ndarray:
    return fn(*(_t(a) for a in args), **kwargs).numpy()


def vjp(fn: Callable, args: Sequence, cotangent, n_diff: int, **kwargs) -> list[np.ndarray]:
    """Float64 gradients of sum(fn(*args) * cotangent) w.r.t. the first ``n_diff`` args."""
    ts = [_t(a) for a in args]
    for t in ts[:n_diff]:
        t.requires_grad_(True)
    fn(*ts, **kwargs).backward(_t(cotangent))
    return [t.grad.numpy() for t in ts[:n_diff]]


softmax = reference.softmax
padded_softmax = reference.padded_softmax
padded_softmax_v = reference.padded_softmax_v
padded_attention = reference.padded_attention
grouped_matmul = reference.grouped_matmul
transposed_grouped_matmul = reference.transposed_grouped_matmul
flash_attention = reference.flash_attention
flash_attention_varlen = reference.flash_attention_varlen
flash_attention_keep = reference.flash_attention_keep
