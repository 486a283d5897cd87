"""Manual-axis types inside ``jax.shard_map``: the mesh axes over which a value varies.

Under ``shard_map`` (``check_vma=True``, its default) every value is typed with the manual mesh
axes it varies over, and jax's own primitives cast invariant operands to varying when they
meet varying ones; the cast's transpose sums a cotangent over those axes. Host callbacks,
jax-triton calls, ``pallas_call`` out_shapes and custom VJPs do none of this by themselves:
the ops use these helpers to type their values as jax's own ops would be typed.
"""
from __future__ import annotations

import jax


def varying_axes(*xs) -> frozenset:
    """The manual mesh axes over which any of ``xs`` varies (empty outside ``shard_map``)."""
    axes = frozenset()
    for x in xs:
        aval = jax.typeof(x)
        mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; before: aval.vma
        axes |= frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return axes


def cast_varying(x, axes: frozenset):
    """``x`` typed as varying over ``axes`` too."""
    missing = axes - varying_axes(x)
    return jax.lax.pcast(x, tuple(missing), to="varying") if missing else x


def vary_together(tree):
    """``tree`` with each float array typed as varying over every axis any of its arrays varies over.

    What jax does to a primitive's operands, done before a custom VJP: its backward rule must
    give each input's cotangent that input's type, and ours compute them from all inputs at
    once, so a k/v or bias replicated over the mesh axis q is sharded on got a varying gradient
    ("manual axis types do not match"). Cast here, the cast's transpose sums that gradient over
    the shards, as the unsharded gradient of a replicated input is."""
    leaves, treedef = jax.tree.flatten(tree)
    axes = varying_axes(*(x for x in leaves if isinstance(x, jax.Array)))
    if not axes:
        return tree
    leaves = [cast_varying(x, axes) if _differentiable(x) else x for x in leaves]
    return jax.tree.unflatten(treedef, leaves)


def _differentiable(x) -> bool:
    # Integer operands (sizes, offsets, ids, seeds) get no cotangent and keep their type: jax's
    # Pallas interpreter cannot index with varying scalar-prefetch values (pallas/tpu/grouped_matmul).
    return isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` out_shape typed as varying over every axis an operand varies over.

    Inside ``shard_map`` with ``check_vma=True`` pallas_call refuses an out_shape without a
    ``manual_axis_type`` (it cannot infer one: the kernel body is opaque to the type system);
    outside shard_map the type is ignored."""
    mat = jax.sharding.ManualAxisType(varying=varying_axes(*operands))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
