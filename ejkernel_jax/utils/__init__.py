"""Small utilities of the jax front (``ejkernel_torch.utils`` mirrors them).

Device identity (``device_fingerprint``, ``config_key``) is formatted by ``triton_kernels`` so
both fronts produce the same strings on the same device and share config-cache entries.
"""
from triton_kernels.params import BwdParams, FwdParams, short_hash, stable_json

from .arrays import (
    abstractify,
    assert_allclose,
    chunk_array,
    generate_attention_inputs,
    log_sum_exp,
    safe_divide,
    unchunk_array,
)
from .device import config_key, device_fingerprint, get_device_platform, get_memory_usage, timer

__all__ = [
    "BwdParams", "FwdParams", "abstractify", "assert_allclose", "chunk_array", "config_key",
    "device_fingerprint", "generate_attention_inputs", "get_device_platform", "get_memory_usage",
    "log_sum_exp", "safe_divide", "short_hash", "stable_json", "timer", "unchunk_array",
]
