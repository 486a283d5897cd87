"""Small utilities of the torch front, mirroring ``ejkernel_jax.utils``.

Device identity (``device_fingerprint``, ``config_key``) is formatted by ``triton_kernels`` so
both fronts produce the same strings on the same device and share config-cache entries.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import time
from typing import Any, Iterator

import numpy as np
import torch

from triton_kernels import checks
from triton_kernels.config_cache import CacheKey, cpu_fingerprint, gpu_fingerprint, host_memory_usage
from triton_kernels.params import BwdParams, FwdParams, dtype_name, short_hash, stable_json

__all__ = [
    "BwdParams", "FwdParams", "abstractify", "assert_allclose", "chunk_array", "config_key",
    "device_fingerprint", "generate_attention_inputs", "get_device_platform", "get_memory_usage",
    "log_sum_exp", "safe_divide", "short_hash", "stable_json", "timer", "unchunk_array",
]

# -- devices ----------------------------------------------------------------------------------


def _device(device=None) -> torch.device:
    """A torch.device from ``None`` (current CUDA device, else CPU), a tensor, a string or an int."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, torch.Tensor):
        return device.device
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(f"device must be None, a tensor, a torch.device, an int or a string, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError:  # "Expected one of cpu, cuda, ... device type at start of device string"
        raise ValueError(f"device {device!r} names no torch device type (cpu, cuda, ..., optionally with "
                         "':<index>')") from None
    if device.type == "cuda" and not torch.cuda.is_available():  # an AssertionError in current_device()
        raise ValueError(f"device {str(device)!r} names no device torch can see: CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_fingerprint(device=None) -> str:
    """Stable identity of a device for config caches, e.g. ``cuda|NVIDIA H100 80GB HBM3|sm90|132sm``.

    Built from ``torch.cuda.get_device_properties`` (never nvidia-smi); equal to
    ``ejkernel_jax.utils.device_fingerprint`` on the same device.
    """
    return _fingerprint(_device(device))


@functools.lru_cache(maxsize=64)
def _fingerprint(dev: torch.device) -> str:  # ops ask on every call: computed once per device
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        vendor = "rocm" if torch.version.hip else "cuda"
        return gpu_fingerprint(vendor, p.name, (p.major, p.minor), p.multi_processor_count)
    if dev.type == "cpu":
        return cpu_fingerprint()
    return f"{dev.type}|unknown"


def get_device_platform(device=None) -> str:
    """``"gpu"``, ``"tpu"``, ``"cpu"`` or ``"unknown"`` (the jax front's vocabulary)."""
    return {"cuda": "gpu", "cpu": "cpu", "xla": "tpu"}.get(_device(device).type, "unknown")


def config_key(op: str, version: int | str, device=None, **shapes: Any) -> CacheKey:
    """Config-cache key for ``op`` on ``device``; tensors in ``shapes`` count by shape and dtype."""
    return CacheKey(device_fingerprint(device), op, version, dict(shapes))


def get_memory_usage(device=None) -> dict[str, int]:
    """``{"allocated", "reserved", "limit"}`` in bytes: CUDA allocator stats, or this process on CPU."""
    dev = _device(device)
    if dev.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(dev),
            "reserved": torch.cuda.memory_reserved(dev),
            "limit": torch.cuda.get_device_properties(dev).total_memory,
        }
    return host_memory_usage()


class Timing:
    seconds: float = float("nan")


@contextlib.contextmanager
def timer(name: str = "Operation", verbose: bool = True) -> Iterator[Timing]:
    """Wall time of the block (CUDA work included: synchronizes on entry and exit)."""
    timing = Timing()
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    try:
        yield timing
    finally:
        sync()
        timing.seconds = time.perf_counter() - start
        if verbose:
            print(f"{name} took {timing.seconds:.6f} s")


# -- conversions ------------------------------------------------------------------------------


def _dtype(dtype, name: str = "dtype") -> torch.dtype:
    """torch dtypes, and names/numpy dtypes shared with the jax front ("bfloat16", np.float16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    label = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))
    resolved = getattr(torch, label.removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise TypeError(f"{name} must be a dtype, got {dtype!r}")
    return resolved


def _numpy_dtype(dtype: np.dtype, name: str) -> torch.dtype:
    try:
        return _dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} has dtype {dtype}, which torch has no dtype for") from None


def _as_tensor(x, name: str) -> torch.Tensor:
    """A tensor from a tensor, a numpy array (the ones the jax front takes too) or a list."""
    if isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, (np.ndarray, np.generic)):
        return torch.as_tensor(x)
    a = np.asarray(x)
    dtype = _numpy_dtype(a.dtype, name)
    if any(s < 0 for s in a.strides):  # torch cannot view reversed numpy memory
        a = a.copy()
    if a.dtype.kind == "V":  # ml_dtypes (bfloat16, float8): numpy-unknown to torch, same bits
        return torch.from_numpy(a.view(f"u{a.itemsize}")).view(dtype)
    return torch.from_numpy(a)


# -- structures -------------------------------------------------------------------------------


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        out = copy.copy(tree)  # keeps the mapping's type and state (a defaultdict's factory)
        for k, v in tree.items():
            out[k] = _tree_map(fn, v)
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(_tree_map(fn, v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, v) for v in tree)
    return fn(tree)


def abstractify(tree: Any) -> Any:
    """Tensors (and numpy arrays) replaced by ``meta`` tensors of the same shape and dtype."""

    def leaf(x):
        if isinstance(x, np.ndarray):  # only shape and dtype are needed: no copy of the data
            return torch.empty(x.shape, dtype=_numpy_dtype(x.dtype, "an array"), device="meta")
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        return x

    return _tree_map(leaf, tree)


# -- arrays -------------------------------------------------------------------------------------


def chunk_array(x: torch.Tensor, chunk_size: int, axis: int = 0, pad_value: float = 0) -> torch.Tensor:
    """Split ``axis`` into ``[num_chunks, chunk_size]``, padding its end with ``pad_value``."""
    x = _as_tensor(x, "x")
    axis, num_chunks, chunk_size, pad = checks.chunking(tuple(x.shape), chunk_size, axis)
    pad_value = checks.pad_value(pad_value, dtype_name(x.dtype))
    if pad:
        # Float arrays fill through float64 and a cast: CUDA's fill refuses a value past the
        # dtype's range (2**40 in float16), which the CPU fill and jax take as inf.
        fill_dtype = torch.float64 if x.dtype.is_floating_point else x.dtype
        fill = x.new_full(x.shape[:axis] + (pad,) + x.shape[axis + 1:], pad_value, dtype=fill_dtype)
        x = torch.cat([x, fill.to(x.dtype)], dim=axis)
    return x.reshape(x.shape[:axis] + (num_chunks, chunk_size) + x.shape[axis + 1:])


def unchunk_array(x: torch.Tensor, original_length: int, axis: int = 0) -> torch.Tensor:
    """Inverse of ``chunk_array(..., axis=axis)``: merge the two axes it made, drop the padding.

    ``axis`` names the axis as ``chunk_array`` was given it (so ``-1`` round-trips too), and
    ``0 <= original_length <= num_chunks * chunk_size``.
    """
    x = _as_tensor(x, "x")
    axis, original_length = checks.unchunking(tuple(x.shape), original_length, axis)
    merged = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return merged.narrow(axis, 0, original_length)


def log_sum_exp(x: torch.Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> torch.Tensor:
    """``log(sum(exp(x)))`` without overflow; an all ``-inf`` slice gives ``-inf``, not NaN."""
    x = _as_tensor(x, "x")
    keepdims = checks.flag("keepdims", keepdims)  # "no" was truthy
    # Checked as jax checks them (torch raised IndexError for a bad axis, jax ValueError, and jax
    # read axis=True as 1).
    axes = checks.axes("axis", axis, x.ndim)
    dtype = x.dtype
    if not (dtype.is_floating_point or dtype.is_complex):  # integers and bools: a float result, as
        dtype = torch.get_default_dtype()  # torch.logsumexp's (cast back, [1, 2, 3] gave 3)
        x = x.to(dtype)
    if dtype in (torch.float16, torch.bfloat16):  # summed in float32: 70,000 fp16 ones sum to inf
        x = x.float()
    if not axes:  # torch reads dim=() as every axis; numpy and jax reduce none
        m, reduce = x, lambda y: y
    else:
        reduce = lambda y: torch.sum(y, dim=axes, keepdim=True)  # noqa: E731
        # amax of nothing fails; the empty sum is 0, its log -inf (as torch.logsumexp gives)
        empty = any(x.shape[a] == 0 for a in axes)
        m = reduce(torch.zeros_like(x)) if empty else torch.amax(x, dim=axes, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # -inf/inf max: shift by 0 instead
    out = (torch.log(reduce(torch.exp(x - m))) + m).to(dtype)
    return out if keepdims or not axes else out.squeeze(axes)


def safe_divide(numerator, denominator, min_denominator: float = 1e-10):
    """``numerator / denominator`` with denominators smaller than ``min_denominator`` in magnitude
    replaced by ``±min_denominator`` (sign kept; 0 counts as positive).

    Computed in the result's floating dtype (the one ``/`` gives). Where ``min_denominator`` is
    below that dtype's smallest normal number (1e-10 in float16), the floor is that number
    instead, so it never rounds to 0.
    """
    num, den = _operand(numerator, "numerator"), _operand(denominator, "denominator")
    dtype = torch.result_type(num, den)
    if dtype.is_complex:
        raise TypeError(f"safe_divide takes real numbers, got {dtype}")
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()  # what / gives for integers
    den = torch.as_tensor(den, dtype=dtype)
    floor = checks.min_denominator(min_denominator, torch.finfo(dtype).tiny, torch.finfo(dtype).max)
    floor = torch.tensor(floor, dtype=dtype, device=den.device)
    return num / torch.where(den.abs() < floor, torch.where(den < 0, -floor, floor), den)


def _operand(x, name: str):
    # Python numbers stay numbers: they promote weakly (1.0 / float16 is float16), as in jax.
    return x if isinstance(x, (bool, int, float)) else _as_tensor(x, name)


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.to(torch.float64) if x.is_floating_point() else x).numpy()
    return np.asarray(x)


def assert_allclose(actual, expected, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = True,
                    err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` on tensors (bfloat16 included), shapes checked first."""
    a, e = _to_numpy(actual), _to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {a.shape} vs {e.shape} {err_msg}")
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan, err_msg=err_msg)


def generate_attention_inputs(batch_size: int = 2, seq_len: int = 128, num_heads: int = 8, head_dim: int = 64,
                              dtype=torch.float32, seed: int = 0, *, kv_seq_len: int | None = None,
                              num_kv_heads: int | None = None, scale: float = 1.0,
                              device=None) -> dict[str, torch.Tensor]:
    """Random ``query``/``key``/``value`` in ``[batch, seq, heads, head_dim]``.

    Drawn with numpy from ``seed``, so the jax front's function gives the same values: a
    ready-made input for torch-vs-jax parity checks.
    """
    sizes = dict(batch_size=batch_size, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim,
                 kv_seq_len=kv_seq_len, num_kv_heads=num_kv_heads)
    shapes, seed, scale = checks.attention_inputs(sizes, seed, scale)
    rng = np.random.default_rng(seed)
    dev = _device(device)
    dtype = torch.get_default_dtype() if dtype is None else _dtype(dtype)  # None: as torch.randn's
    return {name: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).to(dev, dtype)
            for name, shape in shapes.items()}
