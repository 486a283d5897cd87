"""The torch side of ``triton_kernels.tuning``: device identity, launcher and clock for the resolver.

``resolve`` is called where an op builds its plan (explicit params, else the shared config
cache, else the heuristic); ``autotune`` by the public functions before their kernels run. It
tunes only in eager mode on plain tensors: never while ``torch.compile`` traces, nor inside a
``torch.func`` transform (vmap, grad), where the cache is only read, as jax reads it on tracers.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from ejkernel_torch.launch import device_facts, launch
from ejkernel_torch.ops._common import values_readable
from ejkernel_torch.utils import device_fingerprint
from triton_kernels import tuning
from triton_kernels.config_cache import check_autotune


_fingerprints: dict[torch.device, str] = {}


def _fingerprint(device: torch.device) -> str:
    """``device_fingerprint(device)``, a dict lookup after the first call (ops ask on every call)."""
    fp = _fingerprints.get(device)
    if fp is None:
        fp = device_fingerprint(device)
        if device.type != "cuda" or device.index is not None:  # bare "cuda" follows the current device
            _fingerprints[device] = fp
    return fp


def resolve(tunable: tuning.Tunable, problem: Hashable, device: torch.device, explicit=None):
    """The params to build ``tunable``'s plan with: ``explicit``, else the cached entry, else None."""
    if explicit is not None:  # nothing to look up
        return explicit
    return tuning.resolve(tunable, problem, device_facts(device), _fingerprint(device))


def _sync(device: torch.device):
    if device.type == "cuda":
        return lambda _outputs: torch.cuda.synchronize(device)
    return lambda _outputs: None


def autotune(tunable: tuning.Tunable, problem: Hashable, device: torch.device, arrays: Sequence[torch.Tensor],
             autotune: bool | None, explicit: Any = None) -> None:
    """With autotuning enabled and no ``explicit`` params: tune ``problem`` on a cache miss,
    timing the candidates on ``arrays`` (contiguous, as the plan's launch takes them)."""
    check_autotune(autotune)  # also when it is not read: explicit params, tracing
    if explicit is not None or not tuning.autotune_enabled(autotune) or not values_readable(*arrays):
        # tracing, capture, or torch.func-wrapped arrays (every candidate failed on vmap's: "no candidate ran")
        return
    facts = device_facts(device)
    with torch.no_grad():
        tuning.resolve(tunable, problem, facts, device_fingerprint(device), autotune=True, framework="torch",
                       measure=tuning.measure(tunable, problem, facts, arrays, launch, _sync(device)))
