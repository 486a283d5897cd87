"""The ops inside the machinery training code wraps them in: activation checkpointing (torch
checkpoint, jax.checkpoint), layer scans, grad modes, shard_map. Every result is compared
bitwise with the plain call: the same kernels run on the same inputs."""
import numpy as np
import pytest

# -- jax: shard_map ----------------------------------------------------------------------------


def _jax_cases(jax_fw, rng):
    """(name, fn of float arrays, float inputs) for each Triton-backed jax op; batch leading."""
    fw, ek = jax_fw, jax_fw.ops
    a = lambda *shape: fw.asarray(rng.standard_normal(shape))
    n_pad = fw.asarray(np.array([1, 3], np.int32))
    sizes = fw.asarray(np.array([1, 2, 1], np.int32))
    return [
        ("flash_attention", lambda q, k, v, b: ek.flash_attention(q, k, v, causal=True, bias=b),
         [a(2, 8, 2, 16), a(2, 8, 2, 16), a(2, 8, 2, 16), a(2, 2, 8, 8)]),
        ("padded_attention", lambda q, k, v: ek.padded_attention(q, k, v, n_pad), [a(2, 8, 16)] * 3),
        ("padded_softmax_v", lambda s, v: ek.padded_softmax_v(s, v, n_pad), [a(2, 8, 8), a(2, 8, 16)]),
        ("softmax", ek.softmax, [a(2, 8, 8)]),
        ("grouped_matmul", lambda lhs, rhs: ek.grouped_matmul(lhs, rhs, sizes), [a(4, 8), a(3, 8, 6)]),
    ]


def test_shard_map_gradients_match_the_plain_call(jax_fw, rng):
    # Inside shard_map the ops' outputs were typed invariant across the mesh axes although their
    # inputs varied: every gradient failed the custom VJPs' type check (ValueError).
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    for name, fn, inputs in _jax_cases(jax_fw, rng):
        def vjp(*xs, fn=fn):
            out, pullback = jax.vjp(fn, *xs)
            return out, pullback(jax.numpy.cos(out))

        plain = vjp(*inputs)
        sharded = jax.jit(jax.shard_map(vjp, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))(*inputs)
        for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(jax_fw.to_numpy(got), jax_fw.to_numpy(want), err_msg=name)


def test_shard_map_refuses_a_per_shard_result_as_replicated(jax_fw, rng):
    # out_specs=P() says the result is the same on every shard; for an op of sharded inputs it is
    # not, and shard_map refuses that for jax's own ops. Ours passed, and the result was one shard's.
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    for name, fn, inputs in _jax_cases(jax_fw, rng):
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("batch"), out_specs=P()))(*inputs)
