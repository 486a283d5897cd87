"""What one flash-attention call computes, as a hashable value, and the checks that build it.

Both fronts turn their arrays into shapes and dtype names, call ``dense_spec`` or ``varlen_spec``
before any kernel runs (so they reject the same inputs with the same messages), and hand the
resulting ``FlashSpec`` to the plan functions. Specs are cached, so a repeated call costs a dict
lookup.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import checks
from ..plan import FLOAT_DTYPES, MAX_GRID, hash_fields_once, state_without_hash

MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256  # padded to a power of two >= 16 inside the kernels
FLOAT32_MAX = checks.FLOAT32_MAX
MAX_GRID_YZ = MAX_GRID[1]  # CUDA's limit on grid axes 1 and 2 (heads, batch)


@dataclass(frozen=True)
class FlashSpec:
    """Everything static about a call. Varlen calls use ``batch`` = number of sequences and
    ``seq_q``/``seq_k`` = the max sequence lengths; tokens are packed (``total_q``/``total_k``)."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    softmax_scale: float
    window: tuple[int, int] | None = None  # (left, right) keys around the (bottom-right) diagonal
    softcap: float | None = None
    bias: tuple[int, int] | None = None  # (batch, heads) of the bias, each 1 or full
    bias_dtype: str | None = None
    segments: bool = False
    segment_dtype: str = "int32"  # what the kernels read ids as: int64 if either is int64
    dropout_p: float = 0.0
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0

    __hash__, __getstate__ = hash_fields_once, state_without_hash

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def q_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.total_q, self.heads_q, self.head_dim)
        return (self.batch, self.seq_q, self.heads_q, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.total_k, self.heads_kv, self.head_dim)
        return (self.batch, self.seq_k, self.heads_kv, self.head_dim)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.heads_q, self.total_q)
        return (self.batch, self.heads_q, self.seq_q)

    @property
    def bias_shape(self) -> tuple[int, ...] | None:
        return None if self.bias is None else (*self.bias, self.seq_q, self.seq_k)

    @property
    def dbias_full_shape(self) -> tuple[int, ...]:
        """The float32 gradient of the scores the backward writes before broadcast dims are summed."""
        return (self.batch, self.heads_q, self.seq_q, self.seq_k)


# --------------------------------------------------------------------------------------------
# option checks


def _window(causal, sliding_window) -> tuple[int | None, int | None] | None:
    """(left, right) with None for unbounded, or None when nothing is masked by position."""
    causal = checks.flag("causal", causal)
    if sliding_window is None:
        return (None, 0) if causal else None
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) != 2:
            raise ValueError(f"sliding_window must be an int or a (left, right) pair, got {sliding_window!r}")
        left, right = sliding_window
    else:
        left = right = sliding_window
    left, right = _window_side("left", left), _window_side("right", right)
    for side, w in (("left", left), ("right", right)):
        if w is not None and w < 0:
            raise ValueError(f"sliding_window must be >= 0, got {side}={w}")
    return (left, 0 if causal else right)


def _window_side(side: str, w) -> int | None:
    """One side as a Python int (numpy ints too) or None; bools and floats are refused."""
    if w is None:
        return None
    try:
        return checks.int_arg(f"sliding_window ({side})", w)
    except TypeError:
        raise TypeError(f"sliding_window ({side}) must be an int or None, got {checks.got(w)}") from None


def window_arg(sliding_window):
    """``sliding_window`` as the (hashable) value the cached spec functions take: lists become
    tuples. The sides' types are checked here, outside the cache: the cache is typed only at the
    top level, and (True, 2) == (1, 2)."""
    if isinstance(sliding_window, (tuple, list)):
        if len(sliding_window) == 2:
            for side, w in zip(("left", "right"), sliding_window):
                _window_side(side, w)
        return tuple(sliding_window)
    return sliding_window


def _clamped_window(window, seq_q: int, seq_k: int) -> tuple[int, int] | None:
    """Unbounded sides become a width that reaches every key (keeps int32 sums from overflowing)."""
    if window is None:
        return None
    reach = seq_q + seq_k
    return tuple(reach if w is None else min(w, reach) for w in window)


def _positive_float(name: str, value) -> float | None:
    if value is None:
        return None
    value = checks.float_arg(name, value, "a float or None")
    if not 0 < value <= FLOAT32_MAX:  # NaN and inf too (no math.isfinite: dynamo cannot trace it on a SymFloat)
        raise ValueError(f"{name} must be a finite number > 0 (and float32-representable), got {value}")
    return float(value)


# A soft cap this far above the softmax scale changes no logit: cap * tanh(x / cap) differs from
# x by x**3 / (3 cap**2), nothing for q.k products below 4e26. Computing it would put scale / cap
# among float32's subnormals, which flush-to-zero reads as 0 (XLA's CPU threads, where jax runs
# the interpreter; torch.set_flush_denormal): the logits collapsed to 0, a 0.72 relative error
# at a cap of 1e38. Such caps (the usual way to say "no cap") are no cap.
NO_CAP_ABOVE_SCALE_TIMES = 1e30


def _scale_and_cap(softmax_scale, logits_soft_cap, head_dim: int) -> dict:
    """FlashSpec's softmax_scale and softcap, checked."""
    scale = checks.softmax_scale(softmax_scale, head_dim)
    cap = _positive_float("logits_soft_cap", logits_soft_cap)
    if cap is not None and abs(scale) * NO_CAP_ABOVE_SCALE_TIMES <= cap:
        cap = None
    if cap is None:  # a cap bounds the logits by itself: |cap * tanh(.)| <= cap
        checks.uncapped_softmax_scale(scale, head_dim)
    return dict(softmax_scale=scale, softcap=cap)


def layer_options(head_dim: int, causal, sliding_window, logits_soft_cap, softmax_scale) -> None:
    """A ``MultiHeadAttention`` layer's attention options, checked when the layer is built (not
    at its first call) with the messages ``flash_attention`` gives."""
    _window(causal, window_arg(sliding_window))
    _positive_float("logits_soft_cap", logits_soft_cap)
    checks.softmax_scale(softmax_scale, head_dim)


def layer_head_dim(embed_dim: int, num_heads: int, head_dim: int | None, resolved: int) -> None:
    """A ``MultiHeadAttention`` layer's head size (``resolved``, from ``head_dim`` or ``embed_dim //
    num_heads``) within the kernels' range, checked when the layer is built: the kernels' own
    check came only at the first call and named neither size it came from."""
    if not MIN_HEAD_DIM <= resolved <= MAX_HEAD_DIM:
        source = f"head_dim={head_dim}" if head_dim is not None else f"embed_dim={embed_dim} / num_heads={num_heads}"
        raise ValueError(f"head_dim must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM} for flash_attention, "
                         f"got {resolved} ({source})")


def layer_dtype(dtype: str, source: str) -> None:
    """A ``MultiHeadAttention`` layer's compute dtype (``dtype``, named by ``source``: the
    argument it comes from) one flash_attention takes, checked before any weight is used: the
    kernels' check came only at the first call and named q."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"MultiHeadAttention would compute in {dtype} (from {source}); flash_attention takes "
                        "float16, bfloat16 or float32")


def dropout(dropout_p) -> float:
    dropout_p = checks.float_arg("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def seed_value(seed) -> int:
    """A Python or numpy int seed, or a numpy integer array of one, as the int32 the kernels read
    (taken modulo 2**32, as the fronts' int64 tensors are cast). numpy ints are what numpy's
    generators draw; bools are refused."""
    if isinstance(seed, np.ndarray):  # host values: read as an int in both fronts
        seed_array(seed.shape, seed.dtype.name)
        seed = seed.reshape(-1)[0]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"dropout_seed must be an int or an integer array, got {seed!r}")
    seed = int(seed) % 2**32
    return seed - 2**32 if seed >= 2**31 else seed


def dropout_mask_sizes(batch, heads, seq_q, seq_k) -> tuple[int, int, int, int]:
    """``flash_attention_dropout_mask``'s sizes as ints >= 0, checked before its (cached) plan:
    the plan cache would take a float or bool equal to a cached int."""
    sizes = {"batch": batch, "heads": heads, "seq_q": seq_q, "seq_k": seq_k}
    for name, value in sizes.items():
        if checks.int_arg(name, value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        # batch and heads are CUDA grid axes (as in the attention ops), refused alike on every device
        if name in ("batch", "heads") and value > MAX_GRID_YZ:
            raise ValueError(f"{name} must be <= {MAX_GRID_YZ} (a grid axis of one launch), got {value}")
    return tuple(int(v) for v in sizes.values())


def seed_array(shape: Sequence[int], dtype: str) -> None:
    # uint32: what jax.random.bits gives; the kernels read its bits as int32
    if dtype not in (*checks.INT_DTYPES, "uint32"):
        raise TypeError(f"dropout_seed must be an integer array ({', '.join(checks.INT_DTYPES)}, uint32), got {dtype}")
    if tuple(shape) not in ((), (1,)):
        raise ValueError(f"dropout_seed must be a scalar or have shape (1,), got {tuple(shape)}")


def _head_dim(d: int) -> None:
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}")


def _heads(heads_q: int, heads_kv: int) -> None:
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k/v ({heads_kv})")


def _qkv_dtypes(dtypes: Sequence[str]) -> str:
    for name, dtype in zip("qkv", dtypes):
        checks.float_input(name, dtype)
    checks.same_dtype(("q", "k", "v"), dtypes)
    return dtypes[0]


# --------------------------------------------------------------------------------------------
# specs


def _spec_cache(fn):
    """``fn`` behind an lru_cache, for calls whose arguments are all plain values (numbers,
    strings, None, tuples of them); others are called uncached: an array or a list (unhashable,
    the checks then name the argument), and a torch tensor, which hashes by identity, so a 0-d
    ``sliding_window`` changed in place hit the entry of its old value. typed: 1 == True == 1.0
    hash alike, and an untyped hit would skip the checks of a bad type."""
    cached = functools.lru_cache(maxsize=1024, typed=True)(fn)

    @functools.wraps(fn)
    def spec(*args, **kwargs):
        if _all_plain(args) and _all_plain(kwargs.values()):
            return cached(*args, **kwargs)
        return fn(*args, **kwargs)

    spec.cache_info, spec.cache_clear = cached.cache_info, cached.cache_clear
    return spec


# Exact types checked first: a front calls a spec on every call with about thirty such values
# (shapes, dtype names, options), and the generic test cost it 7 us of host time a call.
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _all_plain(values) -> bool:
    for value in values:
        if type(value) not in _SCALARS and not _plain(value):
            return False
    return True


def _plain(value) -> bool:
    if type(value) is tuple:
        return _all_plain(value)
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, (int, float, str, np.generic))


@_spec_cache
def dense_spec(q_shape: tuple, k_shape: tuple, v_shape: tuple, dtypes: tuple, *, causal=False,
               softmax_scale=None, sliding_window=None, logits_soft_cap=None,
               bias_shape: tuple | None = None, bias_dtype: str | None = None,
               q_segment_shape: tuple | None = None, q_segment_dtype: str | None = None,
               kv_segment_shape: tuple | None = None, kv_segment_dtype: str | None = None,
               dropout_p=0.0) -> FlashSpec:
    """Check a ``flash_attention`` call (q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]``)."""
    layout = "[batch, seq, heads, head_dim]"
    for name, shape in zip("qkv", (q_shape, k_shape, v_shape)):
        checks.ndim(name, shape, 4, layout)
    dtype = _qkv_dtypes(dtypes)
    batch, seq_q, heads_q, head_dim = q_shape
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have one shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    if k_shape[0] != batch or k_shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k_shape)} must match q {tuple(q_shape)} in batch and head_dim")
    seq_k, heads_kv = k_shape[1], k_shape[2]
    _head_dim(head_dim)
    _heads(heads_q, heads_kv)
    bias = None
    if bias_shape is not None:
        checks.float_input("bias", bias_dtype)
        checks.ndim("bias", bias_shape, 4, "[batch|1, heads|1, seq_q, seq_k]")
        bb, bh, bq, bk = bias_shape
        if bb not in (1, batch) or bh not in (1, heads_q) or (bq, bk) != (seq_q, seq_k):
            raise ValueError(f"bias must broadcast as [{batch}|1, {heads_q}|1, {seq_q}, {seq_k}], "
                             f"got {tuple(bias_shape)}")
        bias = (bb, bh)
    segment_dtype = _segments(q_segment_shape, q_segment_dtype, kv_segment_shape, kv_segment_dtype,
                              batch, seq_q, seq_k)
    return FlashSpec(
        batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        dtype=dtype, **_scale_and_cap(softmax_scale, logits_soft_cap, head_dim),
        window=_clamped_window(_window(causal, sliding_window), seq_q, seq_k),
        bias=bias, bias_dtype=bias_dtype if bias else None,
        segments=segment_dtype is not None, segment_dtype=segment_dtype or "int32", dropout_p=dropout(dropout_p),
    )


def _segments(q_shape, q_dtype, kv_shape, kv_dtype, batch, seq_q, seq_k) -> str | None:
    """The dtype both segment-id arrays reach the kernels in (None without segments): int64 when
    either is int64, so that ids are compared exactly; else int32, which holds every other
    accepted integer dtype's values."""
    if q_shape is None and kv_shape is None:
        return None
    if q_shape is None or kv_shape is None:
        raise ValueError("pass both q_segment_ids and kv_segment_ids (or neither)")
    for name, shape, dtype, seq in (("q_segment_ids", q_shape, q_dtype, seq_q),
                                    ("kv_segment_ids", kv_shape, kv_dtype, seq_k)):
        checks.int_input(name, dtype)
        if tuple(shape) != (batch, seq):
            raise ValueError(f"{name} must have shape ({batch}, {seq}) [batch, seq], got {tuple(shape)}")
    return "int64" if "int64" in (q_dtype, kv_dtype) else "int32"


@_spec_cache
def varlen_spec(q_shape: tuple, k_shape: tuple, v_shape: tuple, dtypes: tuple,
                cu_q_shape: tuple, cu_q_dtype: str, cu_k_shape: tuple, cu_k_dtype: str,
                max_seqlen_q, max_seqlen_k, *, causal=False, softmax_scale=None,
                sliding_window=None, logits_soft_cap=None, dropout_p=0.0) -> FlashSpec:
    """Check a ``flash_attention_varlen`` call (q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]``)."""
    layout = "[total_tokens, heads, head_dim]"
    for name, shape in zip("qkv", (q_shape, k_shape, v_shape)):
        checks.ndim(name, shape, 3, layout)
    dtype = _qkv_dtypes(dtypes)
    total_q, heads_q, head_dim = q_shape
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have one shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    total_k, heads_kv, kd = k_shape
    if kd != head_dim:
        raise ValueError(f"k/v {tuple(k_shape)} must match q {tuple(q_shape)} in head_dim")
    _head_dim(head_dim)
    _heads(heads_q, heads_kv)
    for name, shape, dt in (("cu_seqlens_q", cu_q_shape, cu_q_dtype), ("cu_seqlens_k", cu_k_shape, cu_k_dtype)):
        if dt != "int32":
            raise TypeError(f"{name} must be int32, got {dt}")
        if len(shape) != 1 or shape[0] < 2:
            raise ValueError(f"{name} must have shape [n_seq + 1] with n_seq >= 1, got {tuple(shape)}")
    if cu_q_shape != cu_k_shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one shape, got {cu_q_shape} and {cu_k_shape}")
    max_seqlen_q, max_seqlen_k = _max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k)
    return FlashSpec(
        batch=cu_q_shape[0] - 1, seq_q=max_seqlen_q, seq_k=max_seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, dtype=dtype, **_scale_and_cap(softmax_scale, logits_soft_cap, head_dim),
        # A sequence is no longer than its max_seqlen nor the packed tokens (the kernels clamp to
        # both): a huge max_seqlen made unbounded sides overflow the kernels' int32 window sums.
        window=_clamped_window(_window(causal, sliding_window), min(max_seqlen_q, total_q),
                               min(max_seqlen_k, total_k)),
        dropout_p=dropout(dropout_p), varlen=True, total_q=total_q, total_k=total_k,
    )


def _max_seqlen(name: str, value) -> int:
    """An int (numpy's too) in [0, 2**31): the kernels read sequence lengths as int32."""
    value = checks.int_arg(name, value)
    if not 0 <= value < 2**31:
        raise ValueError(f"{name} must be in [0, 2**31), got {value}")
    return value


def cu_seqlens_values(name: str, values: Sequence[int], total: int, max_seqlen: int) -> None:
    """Value checks for concrete cu_seqlens (skipped under tracing; kernels clamp instead)."""
    values = [int(v) for v in values]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] > total:
        raise ValueError(f"{name} ends at {values[-1]} but there are only {total} tokens")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{name} has a sequence of length {max(lengths)} > max_seqlen {max_seqlen}")
