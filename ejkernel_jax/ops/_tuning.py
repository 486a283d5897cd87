"""The jax side of ``triton_kernels.tuning``: device identity, launcher and clock for the resolver.

``resolve`` is called where an op builds its plan (explicit params, else the shared config
cache, else the heuristic); under ``jax.jit`` that happens when the function is traced.
``autotune`` is called by the public functions and tunes only when every array is concrete and
nothing is staged out: under ``jit`` (closed-over arrays too), ``grad`` or ``vmap`` tracing it
does nothing, and the ops just read the cache.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp

from ejkernel_jax.launch import device_facts, launch
from ejkernel_jax.ops._common import is_concrete
from ejkernel_jax.utils import device_fingerprint
from triton_kernels import tuning
from triton_kernels.config_cache import check_autotune


def resolve(tunable: tuning.Tunable, problem: Hashable, explicit=None):
    """The params to build ``tunable``'s plan with: ``explicit``, else the cached entry, else None."""
    return tuning.resolve(tunable, problem, device_facts(), device_fingerprint(), explicit)


def _staging() -> bool:
    """Whether jax stages the ops out now (``jit``, ``scan``, ``checkpoint``, ``make_jaxpr``)
    rather than running them. Arrays a jitted function closes over are concrete, but launches on
    them are only recorded: the candidates' "timings" measured tracing, and the winner was stored."""
    return not is_concrete(jnp.zeros((), jnp.int32))


def autotune(tunable: tuning.Tunable, problem: Hashable, arrays: Sequence[Any], autotune: bool | None,
             explicit: Any = None) -> None:
    """With autotuning enabled, no ``explicit`` params and concrete ``arrays``: tune ``problem``
    on a cache miss, timing the candidates on ``arrays`` (as the plan's launch takes them)."""
    check_autotune(autotune)  # also when it is not read: explicit params, tracing
    if (explicit is not None or not tuning.autotune_enabled(autotune) or not all(map(is_concrete, arrays))
            or _staging()):
        return
    facts = device_facts()
    tuning.resolve(tunable, problem, facts, device_fingerprint(), autotune=True, framework="jax",
                   measure=tuning.measure(tunable, problem, facts, arrays, launch, jax.block_until_ready))
