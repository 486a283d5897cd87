"""Small helpers the jax ops share: argument normalisation before any kernel runs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_jax._first_order import first_order  # noqa: F401 (the ops import it from here)
from ejkernel_jax.utils.arrays import check_narrowing
from triton_kernels import checks


def array_arg(name: str, x) -> jax.Array:
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax.Array, got {type(x).__name__}")
    if isinstance(x, np.ndarray):
        check_narrowing(name, x)
    return jnp.asarray(x)


def name_of(x) -> str:
    # Typed PRNG keys (jax.random.key) have an extended dtype that jnp.dtype cannot read ("Cannot
    # interpret 'key<fry>' as a data type"): its own name lets the checks refuse it by argument.
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x.dtype.name
    return jnp.dtype(x.dtype).name


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def same_device(**arrays) -> None:
    """Concrete arrays committed to different devices (``jax.device_put(x, device)``) are refused
    by name: jax's own error named only the callback's "args[1]". Uncommitted arrays follow the
    committed ones; others (ints, numpy, tracers: jit checks its arguments) are not looked at."""
    first = None
    for name, x in arrays.items():
        if not isinstance(x, jax.Array) or not is_concrete(x) or not x.committed:
            continue
        if first is None:
            first = name, x.devices()
        elif x.devices() != first[1]:
            raise ValueError(f"{name} is on {_where(x.devices())} but {first[0]} is on {_where(first[1])}; "
                             "move them to one device (jax.device_put)")


def _where(devices) -> str:
    names = [str(d) for d in sorted(devices, key=lambda d: d.id)]
    return names[0] if len(names) == 1 else "[" + ", ".join(names) + "]"


def n_pad_arg(n_pad, batch: int, seq_len: int) -> jax.Array:
    """Validate ``n_pad`` and return it as int32.

    Values are checked when they are concrete; under ``jax.jit`` they are not known, and the
    kernels clamp them to ``[0, seq_len]``.
    """
    n_pad = array_arg("n_pad", n_pad)
    checks.n_pad(tuple(n_pad.shape), name_of(n_pad), batch)
    if not is_concrete(n_pad):
        # Unchecked: clip before the int32 cast, which would wrap int64 values (2**32 + 2 -> 2).
        # Bounds in n_pad's dtype (a uint8 n_pad cannot hold seq 300, nor need clipping to it).
        info = jnp.iinfo(n_pad.dtype)
        n_pad = jnp.clip(n_pad, max(0, info.min), min(seq_len, info.max))
    elif batch:
        # numpy, not n_pad.min(): inside a jit trace even a concrete array's min is a tracer.
        values = np.asarray(n_pad)
        checks.n_pad_values(int(values.min()), int(values.max()), seq_len)
    return n_pad.astype(jnp.int32)
