"""Backward rules whose own derivative raises, naming the op: the backward kernels (Triton
launches, Pallas calls) have no derivative, and grad of grad otherwise failed inside them with
an error naming no op ("Pure callbacks do not support JVP", jax-triton's, or Pallas's bare
NotImplementedError)."""
from __future__ import annotations

import functools

import jax


def first_order(name: str, tree):
    """``tree`` (a backward rule's residuals or cotangents) with its arrays passed through an
    identity whose derivative raises, naming ``name``. Other leaves (None, flags, symbolic
    zeros) pass untouched."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in zip(at, _no_derivative(name)(tuple(leaves[i] for i in at))):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


@functools.cache
def _no_derivative(name: str):
    @jax.custom_jvp
    def identity(arrays):
        return arrays

    @identity.defjvp
    def _raise(primals, tangents):
        raise NotImplementedError(f"{name} has no second derivative (its backward kernels are not differentiable)")

    return identity
