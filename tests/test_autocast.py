"""Torch-only (jax has no autocast): under ``torch.autocast`` the attention ops and grouped
matmuls take their float operands in the autocast dtype, as SDPA and matmul do. So an fp32
expert weight meets bf16 activations, and fp32 q/k/v run in bf16, instead of a dtype error or
an fp32 kernel. Each autocast call must equal the same call on explicitly cast operands, bit
for bit, gradients (back to the fp32 leaves) included."""
import numpy as np
import pytest
import torch

import ejkernel_torch as ejk
from tests.frameworks import get

DEVICE = get("torch").device
LOW = torch.bfloat16


def _rand(*shape, seed=0, dtype=torch.float32):
    gen = np.random.default_rng(seed)
    return torch.tensor(gen.standard_normal(shape), dtype=torch.float32).to(DEVICE, dtype).requires_grad_()


def _grads(out, leaves, seed=9):
    cotangent = _rand(*out.shape, seed=seed, dtype=out.dtype).detach()
    return torch.autograd.grad(out, leaves, cotangent)


def _same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert not torch.isnan(a).any()
    assert torch.equal(a, b)


def _check(fn, leaves, cast_leaves, out_dtype=LOW):
    """``fn`` under autocast on fp32 ``leaves`` equals ``fn`` on ``cast_leaves`` without it."""
    with torch.autocast(DEVICE, dtype=LOW):
        out = fn(*leaves)
    expected = fn(*cast_leaves(leaves))
    assert out.dtype == out_dtype
    _same(out, expected)
    for leaf, got, want in zip(leaves, _grads(out, leaves), _grads(expected, leaves)):
        assert got.dtype == leaf.dtype  # back in the leaves' dtype, through autocast's cast
        _same(got, want)


def _to_low(*tensors):
    return [t.to(LOW) for t in tensors]


def test_flash_attention_runs_in_the_autocast_dtype():
    q, k, v = _rand(2, 9, 4, 16, seed=1), _rand(2, 11, 2, 16, seed=2), _rand(2, 11, 2, 16, seed=3)
    _check(lambda *t: ejk.flash_attention(*t, causal=True), [q, k, v], lambda ts: _to_low(*ts))


def test_flash_attention_takes_mixed_dtypes_under_autocast():
    # q from an autocast linear (bf16), k/v kept in fp32 (e.g. after fp32 rotary embeddings).
    q, k, v = _rand(1, 7, 2, 16, seed=1, dtype=LOW), _rand(1, 7, 2, 16, seed=2), _rand(1, 7, 2, 16, seed=3)
    with pytest.raises(TypeError):
        ejk.flash_attention(q, k, v)  # outside autocast a mismatch stays an error
    _check(lambda *t: ejk.flash_attention(*t), [q, k, v], lambda ts: _to_low(*ts))


def test_flash_attention_varlen_runs_in_the_autocast_dtype():
    q, k, v = (_rand(9, 2, 16, seed=s) for s in (1, 2, 3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    _check(lambda *t: ejk.flash_attention_varlen(*t, cu, cu, 5, 5, causal=True), [q, k, v],
           lambda ts: _to_low(*ts))


def test_float64_is_not_cast():
    q = _rand(1, 5, 1, 16, dtype=torch.float64).detach()
    with torch.autocast(DEVICE, dtype=LOW), pytest.raises(TypeError, match="float64"):
        ejk.flash_attention(q, q, q)  # as torch's own autocast: float64 stays, and is refused


def test_padded_attention_runs_in_the_autocast_dtype():
    q, k, v = (_rand(2, 9, 16, seed=s) for s in (1, 2, 3))
    n_pad = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    _check(lambda *t: ejk.padded_attention(*t, n_pad), [q, k, v], lambda ts: _to_low(*ts))


def _group_sizes():
    return torch.tensor([5, 0, 8], dtype=torch.int32, device=DEVICE)


def test_grouped_matmul_takes_fp32_weights_under_autocast():
    tokens, weights = _rand(13, 24, seed=1, dtype=LOW), _rand(3, 24, 10, seed=2)
    _check(lambda x, w: ejk.grouped_matmul(x, w, _group_sizes()), [tokens, weights], lambda ts: _to_low(*ts))


def test_grouped_matmul_keeps_an_explicit_output_dtype_under_autocast():
    tokens, weights = _rand(13, 24, seed=1), _rand(3, 24, 10, seed=2)
    fn = lambda x, w: ejk.grouped_matmul(x, w, _group_sizes(), preferred_element_type=torch.float32)  # noqa: E731
    _check(fn, [tokens, weights], lambda ts: _to_low(*ts), out_dtype=torch.float32)


def test_transposed_grouped_matmul_runs_in_the_autocast_dtype():
    lhs, rhs = _rand(24, 13, seed=1), _rand(13, 10, seed=2)
    _check(lambda a, b: ejk.transposed_grouped_matmul(a, b, _group_sizes()), [lhs, rhs], lambda ts: _to_low(*ts))


def test_autocast_under_torch_compile():
    q, k, v = _rand(1, 9, 2, 16, seed=1), _rand(1, 9, 1, 16, seed=2), _rand(1, 9, 1, 16, seed=3)
    fn = torch.compile(lambda *t: ejk.flash_attention(*t, causal=True), fullgraph=True)
    _check(fn, [q, k, v], lambda ts: _to_low(*ts))


def test_devices_without_autocast_still_get_the_device_error():
    # torch.is_autocast_enabled("meta") raises; the casting must not ask about such a device.
    q = _rand(1, 5, 1, 16).detach()
    with torch.autocast(DEVICE, dtype=LOW), pytest.raises(ValueError, match="meta"):
        ejk.flash_attention(q, q.to("meta"), q)
