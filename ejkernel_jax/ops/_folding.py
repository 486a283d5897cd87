"""vmap by folding: the mapped axis joins an op's leading (batch or row) axis, one launch for all
samples. The launches' own vmap rule runs one launch per sample, in sequence (lax.map); kernels
that treat every leading index on its own give the same values folded, in one launch."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ejkernel_jax.launch import any_traced
from triton_kernels.plan import fold_chunks


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


def in_chunks(chunks, n: int, arrays, in_batched, call, shared: tuple = ()) -> tuple:
    """``call(size, arrays)`` on each chunk of the ``n`` mapped samples (``(start, size)`` pairs:
    the mapped arrays sliced, the others whole), the outputs concatenated along their folded axis,
    except ``shared`` ones (the same for every sample: the first chunk's)."""
    pieces = []
    for start, size in chunks:
        chunk = [x[start:start + size] if b and x is not None and size != n else x for x, b in zip(arrays, in_batched)]
        pieces.append(tuple(call(size, chunk)))
    if len(pieces) == 1:
        return pieces[0]
    return tuple(p[0] if i in shared else jnp.concatenate(p) for i, p in enumerate(zip(*pieces)))


def call_folding(kernels, static: tuple, *arrays, limit=None) -> tuple:
    """``kernels(*static, *arrays)``, a tuple of arrays, where every array (inputs and outputs)
    has the same leading axis and ``kernels`` treats each of its indices on its own. Under
    ``vmap`` the mapped axis is folded into that axis. Concrete arrays, which no vmap can be
    batching, call ``kernels`` directly (a ``custom_vmap`` function traces itself on each call).
    ``limit``: given a sample's shape of the first array, the most of that leading axis one
    launch takes (a grid axis, an int32 row count); past it the samples go to several launches
    (``fold_chunks``), whose outputs are concatenated. None: no limit."""
    if not any_traced(*arrays):
        return tuple(kernels(*static, *arrays))
    return _folding(kernels, static, limit)(*arrays)


@functools.lru_cache(maxsize=256)
def _folding(kernels, static: tuple, limit=None):
    @jax.custom_batching.custom_vmap
    def run(*arrays):
        return tuple(kernels(*static, *arrays))

    @run.def_vmap
    def _rule(n, in_batched, *arrays):
        sample = arrays[0].shape[1:] if in_batched[0] else arrays[0].shape
        batch = sample[0]
        chunks = [(0, n)] if limit is None else fold_chunks(n, batch, limit(tuple(sample)))
        outputs = in_chunks(chunks, n, arrays, in_batched,  # an outer vmap folds again
                            lambda size, chunk: run(*(fold(x, b, size) for x, b in zip(chunk, in_batched))))
        return tuple(unfold(o, n, batch) for o in outputs), (True,) * len(outputs)

    return run
