"""Device identity, memory and timing for the jax front."""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Iterator

import jax

from triton_kernels.config_cache import CacheKey, cpu_fingerprint, gpu_fingerprint, host_memory_usage


def _device(device=None):
    """A jax Device from ``None`` (the default device), an array, a Device, or a string as the
    torch front takes it: a platform, optionally with an index (``"cpu"``, ``"gpu"``, ``"cuda:1"``)."""
    if device is None:
        return jax.devices()[0]
    if isinstance(device, jax.Array):
        return next(iter(device.devices()))
    if isinstance(device, str):
        return _named_device(device)
    if not isinstance(device, jax.Device):
        raise TypeError(f"device must be None, an array, a jax Device or a string, got {type(device).__name__}")
    return device


def _named_device(name: str):
    platform, _, index = name.partition(":")
    try:
        devices = jax.devices(platform)
        return devices[int(index) if index else 0]
    except (RuntimeError, ValueError, IndexError):
        raise ValueError(f"device {name!r} names no device jax can see (platforms: cpu, gpu, cuda, rocm, "
                         f"tpu, optionally with ':<index>')") from None


def _gpu_vendor(dev) -> str:
    version = str(getattr(dev.client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version or dev.platform == "rocm" else "cuda"


def device_fingerprint(device=None) -> str:
    """Stable identity of a device for config caches, e.g. ``cuda|NVIDIA H100 80GB HBM3|sm90|132sm``.

    Built from the device's own attributes (never nvidia-smi); equal to
    ``ejkernel_torch.utils.device_fingerprint`` on the same device.
    """
    return _fingerprint(_device(device))


@functools.lru_cache(maxsize=64)
def _fingerprint(dev) -> str:  # ops ask on every call: computed once per device
    if dev.platform == "cpu":
        return cpu_fingerprint()
    if dev.platform in ("gpu", "cuda", "rocm"):
        return gpu_fingerprint(_gpu_vendor(dev), dev.device_kind, dev.compute_capability, dev.core_count)
    return f"{dev.platform}|{dev.device_kind}"


def get_device_platform(device=None) -> str:
    """``"gpu"``, ``"tpu"``, ``"cpu"`` or ``"unknown"``."""
    platform = _device(device).platform.lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    return platform if platform in ("tpu", "cpu") else "unknown"


def config_key(op: str, version: int | str, device=None, **shapes: Any) -> CacheKey:
    """Config-cache key for ``op`` on ``device``; arrays in ``shapes`` count by shape and dtype."""
    return CacheKey(device_fingerprint(device), op, version, dict(shapes))


def get_memory_usage(device=None) -> dict[str, int]:
    """``{"allocated", "reserved", "limit"}`` in bytes: the device allocator's stats where it
    keeps them (GPU, TPU), else this process's host memory."""
    stats = _device(device).memory_stats()
    if not stats:
        return host_memory_usage()
    in_use = int(stats.get("bytes_in_use", 0))
    return {
        "allocated": in_use,
        "reserved": int(stats.get("bytes_reserved", stats.get("pool_bytes", in_use))),
        "limit": int(stats.get("bytes_limit", 0)),
    }


class Timing:
    seconds: float = float("nan")


@contextlib.contextmanager
def timer(name: str = "Operation", verbose: bool = True) -> Iterator[Timing]:
    """Wall time of the block. jax dispatches asynchronously: call ``jax.block_until_ready`` on
    the results inside the block, or the time covers only the dispatch."""
    timing = Timing()
    start = time.perf_counter()
    try:
        yield timing
    finally:
        timing.seconds = time.perf_counter() - start
        if verbose:
            print(f"{name} took {timing.seconds:.6f} s")
