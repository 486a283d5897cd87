"""Parity cases for the grouped matmul (MoE): gmm (plain, transposed rhs, one shard's experts) and tgmm."""
import numpy as np

from ejkernel_torch import reference

from . import Case, register


def _sizes(rng, m, groups):
    # Ragged sizes with empty groups, summing to a little less than m (rows past it give zeros).
    cuts = np.sort(rng.integers(0, m - 7, size=groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [m - 7]])).astype(np.int32)
    sizes[groups // 2] = 0
    return sizes


def _gmm(m, k, n, groups, held=None, transpose_rhs=False):
    held = held or groups
    rhs = (held, n, k) if transpose_rhs else (held, k, n)
    return lambda rng: [rng.standard_normal((m, k)), rng.standard_normal(rhs) / np.sqrt(k), _sizes(rng, m, groups)]


def _tgmm(m, k, n, groups):
    return lambda rng: [rng.standard_normal((k, m)), rng.standard_normal((m, n)), _sizes(rng, m, groups)]


for dtype in ("float32", "bfloat16"):
    register(
        Case("grouped_matmul", "1024x256x192,g8", dtype, _gmm(1024, 256, 192, 8), reference.grouped_matmul, n_diff=2),
        Case("grouped_matmul", "1024x256x192,g8,T", dtype, _gmm(1024, 256, 192, 8, transpose_rhs=True),
             reference.grouped_matmul, n_diff=2, kwargs={"transpose_rhs": True}),
        Case("grouped_matmul", "777x100x90,g16[4:8]", dtype, _gmm(777, 100, 90, 16, held=4),
             reference.grouped_matmul, n_diff=2, kwargs={"group_offset": 4}),
        Case("transposed_grouped_matmul", "256x1024x192,g8", dtype, _tgmm(1024, 256, 192, 8),
             reference.transposed_grouped_matmul, n_diff=2),
    )
