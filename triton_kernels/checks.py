"""Argument checks shared by both fronts: shapes and dtype names in, clear errors out.

Each front turns its arrays into (shape, dtype name) and calls these before any kernel runs, so
the two fronts reject the same inputs with the same messages.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import numpy as np

from .plan import FLOAT_DTYPES

INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
FLOAT32_MAX = 3.4028234663852886e38
FLOAT16_MAX = 65504.0
INT32_MAX = 2**31 - 1
_LOG2E = 1.4426950408889634  # kernels fold it into the scale for exp2


def float_input(name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float16, bfloat16 or float32 array, got {dtype}")


def int_input(name: str, dtype: str) -> None:
    if dtype not in INT_DTYPES:
        # Name the accepted dtypes: "an integer array, got uint32" read as a contradiction.
        raise TypeError(f"{name} must be an integer array ({', '.join(INT_DTYPES)}), got {dtype}")


def ndim(name: str, shape: Sequence[int], expected: int, layout: str) -> None:
    if len(shape) != expected:
        raise ValueError(f"{name} must be {expected}-D {layout}, got shape {tuple(shape)}")


def same_dtype(names: Sequence[str], dtypes: Sequence[str]) -> None:
    if len(set(dtypes)) > 1:
        pairs = ", ".join(f"{n}={d}" for n, d in zip(names, dtypes))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {pairs}")


def axis(name: str, axis_value, rank: int) -> int:
    """``axis_value`` in ``[-rank, rank)`` made non-negative; out of range is an error, not a wrap."""
    axis_value = int_arg(name, axis_value)
    if not -rank <= axis_value < rank:
        raise ValueError(f"{name}={axis_value} is out of range for an array of rank {rank}")
    return axis_value % rank


def axes(name: str, value, rank: int) -> tuple[int, ...]:
    """A reduction's axes: ``None`` (every axis), one axis, or a tuple/list of distinct axes, each
    as ``axis`` takes it; returned as a tuple of non-negative ints."""
    if value is None:
        return tuple(range(rank))
    if not isinstance(value, (tuple, list)):
        return (axis(name, value, rank),)
    out = tuple(axis(name, a, rank) for a in value)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must name distinct axes, got {value!r}")
    return out


def softmax(x_shape: Sequence[int], x_dtype: str, axis_value) -> int:
    float_input("x", x_dtype)
    if len(x_shape) == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    return axis("axis", axis_value, len(x_shape))


def n_pad(n_pad_shape: Sequence[int], n_pad_dtype: str, batch: int) -> None:
    int_input("n_pad", n_pad_dtype)
    if tuple(n_pad_shape) != (batch,):
        raise ValueError(f"n_pad must have shape ({batch},) (one count per batch row), got {tuple(n_pad_shape)}")


def n_pad_values(lowest: int, highest: int, seq_len: int) -> None:
    if lowest < 0 or highest > seq_len:
        raise ValueError(f"n_pad values must lie in [0, {seq_len}] (the sequence length), got [{lowest}, {highest}]")


def padded_scores(scores_shape: Sequence[int], scores_dtype: str) -> tuple[int, int]:
    float_input("scores", scores_dtype)
    ndim("scores", scores_shape, 3, "[batch, seq, seq]")
    batch, s1, s2 = scores_shape
    if s1 != s2:
        raise ValueError(f"scores must be square in its last two axes [batch, seq, seq], got {tuple(scores_shape)}")
    return batch, s1


def values_for_scores(v_shape: Sequence[int], v_dtype: str, batch: int, seq_len: int, scores_dtype: str) -> None:
    float_input("v", v_dtype)
    ndim("v", v_shape, 3, "[batch, seq, head_dim]")
    if tuple(v_shape[:2]) != (batch, seq_len):
        raise ValueError(f"v must have shape [{batch}, {seq_len}, head_dim] to match scores, got {tuple(v_shape)}")
    head_dim(v_shape[2])
    same_dtype(("scores", "v"), (scores_dtype, v_dtype))


def head_dim(d: int) -> None:
    if not 1 <= d <= 256:
        raise ValueError(f"head_dim must be between 1 and 256, got {d}")


def single_head_qkv(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> tuple[int, int, int]:
    names = ("q", "k", "v")
    for name, shape, dtype in zip(names, shapes, dtypes):
        float_input(name, dtype)
        ndim(name, shape, 3, "[batch, seq, head_dim]")
    for name, shape in zip(names[1:], shapes[1:]):
        if tuple(shape) != tuple(shapes[0]):
            raise ValueError(f"{name} must have the shape of q {tuple(shapes[0])}, got {tuple(shape)}")
    same_dtype(names, dtypes)
    batch, seq_len, d = shapes[0]
    head_dim(d)
    return batch, seq_len, d


def softmax_scale(value, d: int) -> float:
    if value is None:
        return d ** -0.5
    scale = float_arg("softmax_scale", value, "a float or None")
    # The kernels multiply by scale * log2(e) in float32: beyond its range that is inf, and NaN out.
    if not abs(scale) * _LOG2E <= FLOAT32_MAX:
        raise ValueError(f"softmax_scale must be finite with |softmax_scale| <= {FLOAT32_MAX / _LOG2E:.4g} "
                         f"(float32), got {value}")
    return scale


def uncapped_softmax_scale(scale: float, d: int) -> None:
    """``softmax_scale`` where nothing caps the logits: the kernels' float32 logits
    q.k * scale * log2(e) must not overflow, or the online softmax takes inf - inf and the output
    is NaN, silently (1e38 did so for any |q.k| > 2.4). q.k itself can overflow in float32, so no
    bound holds for every input; this one keeps the logits finite for every q and k in float16's
    range (|q.k| <= d * 65504**2). Past it softmax is a hard max for all practical inputs."""
    limit = FLOAT32_MAX / (_LOG2E * d * FLOAT16_MAX**2)
    if not abs(scale) <= limit:
        raise ValueError(f"|softmax_scale| must be <= {limit:.4g} for head_dim {d}, got {scale}: beyond it the "
                         "kernels' float32 logits q.k * softmax_scale overflow (NaN output) for inputs within "
                         "float16's range")


def _traced(value) -> bool:
    """A jax tracer (a traced jit argument), known without importing jax."""
    return any(cls.__name__ == "Tracer" for cls in type(value).__mro__)


def got(value) -> str:
    """``value`` as an error message shows it. A traced one also says why it was refused: the
    option is static (a plain repr only showed "JitTracer(~float32[])")."""
    if _traced(value):
        return f"a traced value {value!r} (the option is static: pass a Python value, not a jit argument)"
    return repr(value)


def int_arg(name: str, value) -> int:
    """A Python int (or integer scalar) as an int; bools are refused, not read as 0/1 (bool
    scalar tensors and arrays of either framework too), and floats are refused, not truncated."""
    if type(value) is int:  # the usual case
        return value
    if isinstance(value, (bool, np.bool_)) or str(getattr(value, "dtype", "")).endswith("bool"):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {got(value) if _traced(value) else type(value).__name__}") from None


def float_arg(name: str, value, expected: str = "a float") -> float:
    """A real number (Python's or numpy's: np.float32 or np.int64 as well as float or int) as
    a Python float; bools and strings are refused, not read as 0/1. An int beyond float64
    becomes inf, for the caller's range check to refuse."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {expected}, got {got(value)}")
    try:
        return float(value)
    except OverflowError:  # a Python int beyond float64
        return math.inf


def min_denominator(value, tiny: float, largest: float) -> float:
    """``safe_divide``'s floor: a positive real, at least the dtype's smallest normal ``tiny``. It
    must also be at most the dtype's ``largest``: an inf floor (1e6 in float16, or inf) replaced
    every finite denominator and gave 0 everywhere."""
    value = float_arg("min_denominator", value, "a real number")
    if not value > 0:
        raise ValueError(f"min_denominator must be positive, got {value}")
    if not value <= largest:
        raise ValueError(f"min_denominator must be at most {largest:g} (the result dtype's largest number), got {value}")
    return max(value, tiny)


def flag(name: str, value) -> bool:
    """A bool (numpy's too) as a bool; anything else is refused, not read by truthiness: a
    string such as "false" would be True, and a traced jax value fails inside bool()."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {got(value)}")
    return bool(value)


def chunk_size(value) -> int:
    value = int_arg("chunk_size", value)
    if value < 1:
        raise ValueError(f"chunk_size must be positive, got {value}")
    return value


def chunking(shape: Sequence[int], size, axis_value) -> tuple[int, int, int, int]:
    """``chunk_array``'s arguments for an array of ``shape``: (axis, num_chunks, chunk_size,
    padding)."""
    size = chunk_size(size)
    if len(shape) < 1:
        raise ValueError("x must have at least one axis to chunk, got a scalar")
    axis_value = axis("axis", axis_value, len(shape))
    num_chunks = -(-shape[axis_value] // size)
    return axis_value, num_chunks, size, num_chunks * size - shape[axis_value]


def pad_value(value, dtype: str):
    """``chunk_array``'s ``pad_value`` for an array of dtype name ``dtype``: a real number (a bool
    only for a bool array, which takes only bools, 0 and 1), or a 0-d real tensor/jax array (a
    traced jax scalar too), returned as given. A numpy scalar or 0-d numpy array is checked and
    returned as the Python number it holds: it skipped the checks (uint8 np.int64(300) padded 44
    in jax) and torch's new_full takes no numpy array. For an integer array, an integer the
    dtype holds: jax padded with 0 for NaN where torch raised, and the two failed differently
    past the range. A string failed deep inside torch's new_full or jax's pad."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.shape == ()):
        value = value.item()
    shape = getattr(value, "shape", None)
    if shape is not None:  # an array or tensor of either framework
        kind = str(getattr(value, "dtype", "")).removeprefix("torch.")
        if tuple(shape) != () or not (kind == "bool" or kind.startswith(("int", "uint", "float", "bfloat"))):
            raise TypeError(f"pad_value must be a real number or a 0-d real array, got {kind} of shape "
                            f"{tuple(shape)}")
        return value
    if isinstance(value, (bool, np.bool_)):
        if dtype != "bool":
            raise TypeError(f"pad_value must be a number for {dtype} arrays, got {value!r}")
        return value
    if not isinstance(value, numbers.Real):
        raise TypeError(f"pad_value must be a real number, got {value!r}")
    if dtype == "bool" and value not in (0, 1):  # 2 or 0.5 became True silently
        raise ValueError(f"pad_value must be a bool, 0 or 1 for bool arrays, got {value!r}")
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        whole = isinstance(value, numbers.Integral) or float(value).is_integer()
        if not (whole and info.min <= int(value) <= info.max):
            raise ValueError(f"pad_value must be an integer in [{info.min}, {info.max}] for {dtype} "
                             f"arrays, got {value!r}")
    elif dtype != "bool" and isinstance(value, numbers.Integral):
        return _float_pad_value(value, dtype)
    return value


def _float_pad_value(value: int, dtype: str) -> float:
    """An integer ``pad_value`` for a float (or complex) array, as the float it stands for: jax's
    pad parsed a Python int past int32 as an int32 argument (OverflowError) where torch padded
    with its float value, and torch's new_full failed past int64."""
    try:
        return float(value)
    except OverflowError:  # past float64: no float array holds it
        raise ValueError(f"pad_value must fit in a float64 for {dtype} arrays, got an integer of "
                         f"{value.bit_length()} bits") from None


def unchunking(shape: Sequence[int], original_length, axis_value) -> tuple[int, int]:
    """``unchunk_array``'s arguments for an array of ``shape``: (axis, original_length);
    ``axis`` as ``chunk_array`` was given it (the rank before chunking)."""
    if len(shape) < 2:
        raise ValueError(f"x must have the two axes chunk_array made, got shape {tuple(shape)}")
    axis_value = axis("axis", axis_value, len(shape) - 1)
    chunked = shape[axis_value] * shape[axis_value + 1]
    original_length = int_arg("original_length", original_length)
    if not 0 <= original_length <= chunked:
        raise ValueError(f"original_length must lie in [0, {chunked}] (the chunked length), got {original_length}")
    return axis_value, original_length


def attention_inputs(sizes: dict, seed, scale) -> tuple[dict[str, tuple[int, ...]], int, float]:
    """``generate_attention_inputs``' arguments (both fronts): ``sizes`` maps each size argument
    (``kv_seq_len`` and ``num_kv_heads`` may be None) to its value. Returns the query/key/value
    shapes, the seed and the scale; bools are refused (scale=True was 1.0, a string was parsed)."""
    size = {name: None if value is None else int_arg(name, value) for name, value in sizes.items()}
    for name, value in size.items():
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    seed = int_arg("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    scale = float_arg("scale", scale)
    if not abs(scale) <= FLOAT32_MAX:  # the inputs are drawn in float32: inf or NaN otherwise
        raise ValueError(f"scale must be finite in float32, got {scale}")
    kv_len = size["seq_len"] if size["kv_seq_len"] is None else size["kv_seq_len"]
    kv_heads = size["num_heads"] if size["num_kv_heads"] is None else size["num_kv_heads"]
    kv_shape = (size["batch_size"], kv_len, kv_heads, size["head_dim"])
    query = (size["batch_size"], size["seq_len"], size["num_heads"], size["head_dim"])
    return {"query": query, "key": kv_shape, "value": kv_shape}, seed, scale


def layout_length(fn: str, arg: str, size: int, given: bool) -> int:
    """The output length of the packed-sequence helpers: ``arg`` (``total_tokens`` /
    ``total_chunks``) if ``given``, else the last cu_seqlens boundary. Their ids are token
    indices in the int32 range the varlen kernels read (jax keeps them as int32): a longer
    output ran out of memory (2**40) or wrapped, so it is refused up front."""
    if size > INT32_MAX:
        source = arg if given else f"the last cu_seqlens boundary (the default {arg})"
        raise ValueError(f"{fn}: {source} must be at most {INT32_MAX} (int32 token indices), got {size}")
    return size


def _positive_int(name: str, value) -> int:
    value = int_arg(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def attention_layer(embed_dim, num_heads, num_kv_heads, head_dim, dropout) -> tuple[int, int]:
    """A ``MultiHeadAttention`` layer's sizes (both fronts): returns ``(kv_heads, head_dim)``.
    Without ``head_dim``, ``embed_dim`` must split evenly over the heads (as in torch.nn), not be
    floored to a narrower layer."""
    _positive_int("embed_dim", embed_dim)
    _positive_int("num_heads", num_heads)
    kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads})")
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                             "or pass head_dim")
        head_dim = embed_dim // num_heads
    _positive_int("head_dim", head_dim)
    valid = not isinstance(dropout, (bool, np.bool_)) and isinstance(dropout, (int, float, np.integer, np.floating))
    if not (valid and 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return kv_heads, head_dim


def attention_layer_input(shape: Sequence[int], embed_dim: int) -> None:
    if len(shape) != 3 or shape[-1] != embed_dim:
        raise ValueError(f"x must be [batch, seq, embed_dim={embed_dim}], got shape {tuple(shape)}")


def attention_layer_segment_ids(shape: Sequence[int], dtype: str, x_shape: Sequence[int]) -> None:
    """The layer's ``segment_ids`` (after ``attention_layer_input``): named as the layer's argument,
    where flash_attention, which gets them twice, named them q_segment_ids."""
    int_input("segment_ids", dtype)
    if tuple(shape) != tuple(x_shape[:2]):
        raise ValueError(f"segment_ids must have shape {tuple(x_shape[:2])} [batch, seq] (as x), got {tuple(shape)}")
