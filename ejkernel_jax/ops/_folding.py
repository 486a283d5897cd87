"""vmap by folding: the mapped axis joins an op's leading (batch or row) axis, one launch for all
samples. The launches' own vmap rule runs one launch per sample, in sequence (lax.map); kernels
that treat every leading index on its own give the same values folded, in one launch."""
from __future__ import annotations

import jax.numpy as jnp


def fold(x, batched: bool, n: int, batch: int | None = None):
    """``x`` as ``[n * batch, ...]``: it is ``[n, batch|1, ...]`` when mapped, else
    ``[batch|1, ...]`` (the same for every sample). ``batch`` defaults to x's own leading size."""
    if not batched:
        x = jnp.broadcast_to(x, (n,) + x.shape)
    batch = x.shape[1] if batch is None else batch
    x = jnp.broadcast_to(x, (n, batch) + x.shape[2:])
    return x.reshape((n * batch,) + x.shape[2:])


def unfold(x, n: int, batch: int):
    """A folded ``[n * batch, ...]`` result as ``[n, batch, ...]`` (batch given: n may be 0)."""
    return x.reshape((n, batch) + x.shape[1:])
