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
    """Float64 gradients of sum(fn(*args) * cotangent) w.r.t. the first ``n_diff`` args. A tuple
    ``cotangent`` goes with a function of as many outputs."""
    ts = [_t(a) for a in args]
    for t in ts[:n_diff]:
        t.requires_grad_(True)
    outputs = fn(*ts, **kwargs)
    if isinstance(cotangent, tuple):
        torch.autograd.backward(list(outputs), [_t(c) for c in cotangent])
    else:
        outputs.backward(_t(cotangent))
    return [t.grad.numpy() for t in ts[:n_diff]]


def flash_vjp(fn: Callable, args: Sequence, out, dout, n_diff: int, varlen: bool = False) -> list[np.ndarray]:
    """Float64 gradients of flash attention as the kernels define them, ``fn`` its reference.

    The backward's delta = rowsum(out * dout) reads the ``out`` the forward returned (rounded to
    its dtype), as in FlashAttention-2/3, so its gradients of q, k and bias differ from the exact
    ones by the lse gradient of -(delta_kernel - delta_exact): d lse / d logits is the softmax,
    just as d delta / d logits is in dS = P (dP - delta). Where a bias is summed over batch and
    heads, or a row attends few keys, dP - delta cancels and that term alone can pass the fp16
    bound (8.8e-3 on dbias for a 1x37 MQA problem), so it is modelled here rather than measured.
    dv is the exact one. ``out``/``dout``: what the kernel returned and got, [.., heads, dim]."""
    want_out, _ = fn(*(_t(a) for a in args), return_lse=True)
    delta = (np.asarray(out, np.float64) - want_out.numpy()) * np.asarray(dout, np.float64)
    delta = delta.sum(-1)  # [b, s, h] dense, [tokens, h] varlen -> lse's [b, h, s] / [h, tokens]
    delta = delta.T if varlen else delta.transpose(0, 2, 1)
    return vjp(lambda *a: fn(*a, return_lse=True), args, (dout, -delta), n_diff)


def flash_dq_delta(q, k, v, o, do, lse, dlse, scale: float, causal: bool, cu=None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 (dq, delta) of the flash backward's formulas from given o, dO, lse and dlse (which
    need not be a forward's): delta = rowsum(o * dO) - dlse, dS = P (dP - delta) with P =
    exp(scale q k^T - lse), dq = scale dS k. Dense arrays [batch, seq, heads, dim] and lse
    [batch, heads, seq_q]; with ``cu`` (cumulative lengths, shared by q and k) varlen ones,
    [tokens, heads, dim] and [heads, tokens]. Causal is bottom-right aligned; k/v heads are shared
    by groups of q heads."""
    if cu is not None:
        dq, delta = np.zeros(np.shape(q)), np.zeros(np.shape(lse))
        for a, b in zip(cu[:-1], cu[1:]):
            part = flash_dq_delta(*(np.asarray(x)[None, a:b] for x in (q, k, v, o, do)),
                                  *(np.asarray(x)[None, :, a:b] for x in (lse, dlse)), scale, causal)
            dq[a:b], delta[:, a:b] = part[0][0], part[1][0]
        return dq, delta
    q, k, v, o, do = (_t(x).transpose(1, 2) for x in (q, k, v, o, do))  # [batch, heads, seq, dim]
    lse, dlse = _t(lse), _t(dlse)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    delta = (o * do).sum(-1) - dlse
    p = torch.exp(scale * q @ k.transpose(-1, -2) - lse[..., None])
    if causal:
        seq_q, seq_k = q.shape[2], k.shape[2]
        keep = torch.arange(seq_k)[None, :] <= torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        p = torch.where(keep, p, 0.0)
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    return (scale * ds @ k).transpose(1, 2).numpy(), delta.numpy()


softmax = reference.softmax
padded_softmax = reference.padded_softmax
padded_softmax_v = reference.padded_softmax_v
padded_attention = reference.padded_attention
grouped_matmul = reference.grouped_matmul
transposed_grouped_matmul = reference.transposed_grouped_matmul
flash_attention = reference.flash_attention
flash_attention_varlen = reference.flash_attention_varlen
flash_attention_keep = reference.flash_attention_keep
