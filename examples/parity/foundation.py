"""Parity cases for the foundation ops: softmax and the padded-attention family."""
import numpy as np

from ejkernel_torch import reference

from . import Case, register


def _normal(*shape, scale=1.0):
    return lambda rng: [rng.standard_normal(shape) * scale]


def _padded(batch, seq, head_dim=None, qkv=False):
    def make(rng):
        n_pad = rng.integers(0, seq + 1, size=batch).astype(np.int32)
        n_pad[0] = 0
        if qkv:
            return [rng.standard_normal((batch, seq, head_dim)) for _ in range(3)] + [n_pad]
        scores = rng.standard_normal((batch, seq, seq)) * 2
        return [scores, rng.standard_normal((batch, seq, head_dim)), n_pad] if head_dim else [scores, n_pad]

    return make


for dtype in ("float32", "bfloat16"):
    register(
        Case("softmax", "4096x1000", dtype, _normal(4096, 1000, scale=3.0), reference.softmax, n_diff=1),
        Case("softmax", "8x100000", dtype, _normal(8, 100_000, scale=3.0), reference.softmax, n_diff=1),
        Case("padded_softmax", "4x300x300", dtype, _padded(4, 300), reference.padded_softmax, n_diff=1),
        Case("padded_softmax_v", "4x300x300,d64", dtype, _padded(4, 300, 64), reference.padded_softmax_v, n_diff=2),
        Case("padded_attention", "4x1000,d64", dtype, _padded(4, 1000, 64, qkv=True), reference.padded_attention,
             n_diff=3),
    )
