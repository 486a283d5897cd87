"""The one matmul every Pallas TPU kernel here uses: explicit precision, float32 accumulation.

``lax.dot_general`` with ``precision=None`` means "whatever the backend does by default", and
for float32 operands that is not float32 math everywhere:

* interpret mode on an NVIDIA GPU (the kernel body runs as ordinary XLA:GPU ops): TF32 on
  Ampere and newer, about 1e-3 relative error, while XLA:CPU computes true float32;
* Mosaic (TPU): ``precision=None``/``DEFAULT`` emits no ``precision`` attribute on
  ``tpu.matmul`` and leaves the contraction precision to Mosaic (not guaranteed float32);
  ``HIGHEST`` emits ``#tpu.contract_precision<fp32>``;
* a user's ``jax_default_matmul_precision`` would silently change either.

So every dot states its precision: ``HIGHEST`` when an operand is float32 (float32 in, float32
math on every backend), ``DEFAULT`` for bfloat16 / float16 operands (their native MXU /
tensor-core path: exact products, float32 accumulation). Mosaic's lowering accepts only
``DEFAULT`` and ``HIGHEST`` (``HIGH`` raises NotImplementedError) and the same precision for
both operands; ``contract_precision<fp32>`` is meant for float32 operands, so HIGHEST is never
put on a bf16 / f16 dot.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["dot", "dot_precision"]

_FULL = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def dot_precision(*dtypes) -> lax.Precision:
    """``HIGHEST`` if any operand dtype is float32 (or float64), else ``DEFAULT``."""
    return lax.Precision.HIGHEST if any(jnp.dtype(d) in _FULL for d in dtypes) else lax.Precision.DEFAULT


def dot(a, b, dimension_numbers):
    """``lax.dot_general(a, b, dims)`` with explicit precision and a float32 result."""
    return lax.dot_general(
        a,
        b,
        dimension_numbers,
        precision=dot_precision(a.dtype, b.dtype),
        preferred_element_type=jnp.float32,
    )
