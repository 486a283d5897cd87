"""PyTorch <-> JAX through DLPack: zero-copy arrays and JAX functions as torch functions.

* :func:`to_jax` / :func:`to_torch` move one array across, sharing memory whenever the other
  side can describe the layout, in stream order on CUDA (no device sync).
* :func:`jax_to_torch` turns a JAX function into a torch function with autograd (the VJP
  comes from ``jax.vjp``), compiled once per (shapes, dtypes, static arguments).

Devices: torch ``cpu`` <-> jax cpu, torch ``cuda:i`` <-> the jax GPU with local hardware id i.
Dtypes: bool, uint8-64, int8-64, float16, bfloat16, float32, float64, complex64/128 directly;
fp8 (``float8_e4m3fn``, ``float8_e5m2``, and the fnuz/e8m0 variants both libraries have)
natively where both sides' DLPack knows them, else through a uint8 bit-cast.

Aliasing: a zero-copy result shares memory with its source. jax treats arrays as immutable,
so do not modify a tensor in place while a jax array made from it (or jax work reading it) is
alive; ``copy=True`` gives an independent copy. Inside :func:`jax_to_torch`'s autograd graph
torch's in-place check guards this (modifying a saved input/output raises on backward).
Its outputs and gradients are fresh buffers that jax keeps no other reference to (residuals
are separate buffers, or the saved inputs), so in-place updates of them corrupt nothing on the
jax side; one saved for backward is guarded like an input.

Closures: a jax array that a traced function (``jax.jit``, :func:`jax_to_torch`) closes over
instead of receiving it is copied into the compiled function as a constant when it is traced.
If it came from :func:`to_jax`, an in-place update of the tensor afterwards changes the array
but not the constant, and no gradient reaches the tensor: pass tensors as arguments.
:func:`to_jax` called while a ``jax_to_torch`` function is being traced raises.
"""
from __future__ import annotations

import torch

from ._interop import _convert
from ._interop._bridge import BridgedFunction, _compiler_disable, jax_to_torch, tracing_function
from ._interop._convert import ConversionError

__all__ = ["to_jax", "to_torch", "jax_to_torch", "BridgedFunction"]


def _check_copy(copy) -> None:
    if not (copy is None or copy is True or copy is False):  # not `in`: 1 == True, 0 == False
        raise TypeError(f"copy must be None, True or False, got {copy!r}")


def _check_not_tracing() -> None:
    """A tensor converted while a bridged function is traced becomes a constant of its compiled
    function: its gradient was silently dropped, and later in-place updates were seen by some
    cache entries (those traced after the update) and not by others."""
    traced = tracing_function()
    if traced is not None:
        raise TypeError(
            f"to_jax: argument 'tensor' is converted inside {traced!r}, while JAX traces it: its value "
            "would be baked into the compiled function (later in-place updates and its gradient would be "
            "ignored); pass the tensor to the bridged function as an argument instead"
        )


def to_jax(tensor: torch.Tensor, *, copy: bool | None = None):
    """torch.Tensor -> jax.Array on the matching jax device.

    ``copy=None``: share memory when jax can alias the layout (any permutation of a compact
    layout, 64-byte aligned on CPU), else make a contiguous copy. ``copy=False``: share memory
    or raise ValueError. ``copy=True``: always an independent copy.

    A tensor that requires grad is exported detached: the jax array carries no autograd link
    (use :func:`jax_to_torch` to differentiate through JAX code). On CUDA, work queued on
    torch's current stream is ordered before any jax work on the result.
    """
    _check_copy(copy)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax: argument 'tensor' must be a torch.Tensor, got {type(tensor).__name__}")
    _check_not_tracing()
    try:
        return _convert.tensor_to_jax(tensor, copy)
    except ConversionError as err:
        err.reraise("to_jax: argument 'tensor'")


def to_torch(array, *, copy: bool | None = None) -> torch.Tensor:
    """jax.Array -> torch.Tensor on the matching torch device (cpu or cuda:i).

    ``copy=None``/``False`` share memory (fp8 without native DLPack support is the one case
    that copies; ``copy=False`` then raises); ``copy=True`` returns an independent copy.
    Waits for the array to be computed without a device sync: on CUDA, torch's current
    stream is made to wait on the event that defines the buffer.
    """
    _check_copy(copy)
    try:
        return _convert.array_to_torch(array, copy)
    except ConversionError as err:
        err.reraise("to_torch: argument 'array'")


# dynamo cannot trace DLPack exchange: a documented graph break, never a silent wrong trace.
to_jax = _compiler_disable(to_jax, "ejkernel_torch.interop.to_jax exchanges memory through DLPack")
to_torch = _compiler_disable(to_torch, "ejkernel_torch.interop.to_torch exchanges memory through DLPack")
