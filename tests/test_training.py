"""The ops inside the machinery training code wraps them in: activation checkpointing (torch
checkpoint, jax.checkpoint), layer scans, grad modes, shard_map. Every result is compared
bitwise with the plain call: the same kernels run on the same inputs."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def _replicated_cases(jax_fw, rng):
    """(name, fn, inputs, which are replicated) for ops of batch-sharded and replicated inputs
    (k/v shared by every batch row, a bias, an expert weight), broadcast inside ``fn``."""
    import jax.numpy as jnp

    fw, ek = jax_fw, jax_fw.ops
    a = lambda *shape: fw.asarray(rng.standard_normal(shape))
    rows = lambda x, like: jnp.broadcast_to(x, like.shape[:1] + x.shape[1:])
    n_pad = fw.asarray(np.array([1], np.int32))
    return [
        ("flash_attention", lambda q, k, v, b: ek.flash_attention(q, rows(k, q), rows(v, q), causal=True, bias=b),
         [a(2, 8, 2, 16), a(1, 8, 2, 16), a(1, 8, 2, 16), a(1, 2, 8, 8)], (False, True, True, True)),
        ("padded_attention", lambda q, k, v: ek.padded_attention(q, rows(k, q), rows(v, q), rows(n_pad, q)),
         [a(2, 8, 16), a(1, 8, 16), a(1, 8, 16)], (False, True, True)),
        ("padded_softmax_v", lambda s, v: ek.padded_softmax_v(s, rows(v, s), rows(n_pad, s)),
         [a(2, 8, 8), a(1, 8, 16)], (False, True)),
        ("grouped_matmul", lambda lhs, rhs: ek.grouped_matmul(lhs, rhs, jnp.array([1, 0, 1], jnp.int32)),
         [a(2, 8), a(3, 8, 6)], (False, True)),
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shard_map_gradients_of_replicated_inputs(jax_fw, rng, jit):
    # A custom VJP's backward must give each input's gradient that input's mesh-axis type. Ours
    # computed every gradient from all inputs together, so an input replicated over the axis the
    # others are sharded on (k/v, a bias, expert weights) got a varying gradient: ValueError
    # "manual axis types do not match", with and without jit. Eager (no jit), the grouped matmul
    # also failed on another thread's interpreted launch (see test_launch).
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    for name, fn, inputs, replicated in _replicated_cases(jax_fw, rng):
        def vjp(*xs, fn=fn):
            out, pullback = jax.vjp(fn, *xs)
            return out, pullback(jax.numpy.cos(out))

        specs = tuple(P() if r else P("batch") for r in replicated)
        sharded = jax.shard_map(vjp, mesh=mesh, in_specs=specs, out_specs=(P("batch"), specs))
        got = (jax.jit(sharded) if jit else sharded)(*inputs)
        for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(vjp(*inputs))):
            np.testing.assert_array_equal(jax_fw.to_numpy(g), jax_fw.to_numpy(want), err_msg=name)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shard_map_of_pallas_kernels_with_check_vma(jax_fw, rng, jit):
    # The Pallas kernels (interpret mode here) refused shard_map's default check_vma=True:
    # "manual_axis_type on jax.ShapeDtypeStruct must not be None" (their out_shapes carried no
    # mesh-axis type). Outputs and gradients, k/v and expert weights replicated, as unsharded.
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from ejkernel_jax.pallas.tpu import grouped_matmul as pallas_gm
    from ejkernel_jax.pallas.tpu.blocksparse_attention import blocksparse_attention

    a = lambda *shape: jax_fw.asarray(rng.standard_normal(shape))
    rows = lambda x, like: jnp.broadcast_to(x, like.shape[:1] + x.shape[1:])
    sizes = jnp.array([96, 0, 32, 0], jnp.int32)
    cases = [
        ("blocksparse_attention", lambda q, k, v: blocksparse_attention(q, rows(k, q), rows(v, q), causal=True),
         [a(1, 128, 2, 64), a(1, 128, 2, 64), a(1, 128, 2, 64)], (False, True, True)),
        ("grouped_matmul", lambda lhs, rhs: pallas_gm.grouped_matmul(lhs, rhs, sizes), [a(128, 64), a(4, 64, 32)],
         (False, True)),
        ("transposed_grouped_matmul", lambda lhs, rhs: pallas_gm.transposed_grouped_matmul(lhs, rhs, sizes),
         [a(64, 128), a(128, 32)], (True, True)),
    ]
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    for name, fn, inputs, replicated in cases:
        def vjp(*xs, fn=fn):
            out, pullback = jax.vjp(fn, *xs)
            return out, pullback(jnp.cos(out))

        specs = tuple(P() if r else P("batch") for r in replicated)
        out_spec = P() if all(replicated) else P("batch")
        sharded = jax.shard_map(vjp, mesh=mesh, in_specs=specs, out_specs=(out_spec, specs))
        plain = jax.jit(vjp) if jit else vjp
        got = (jax.jit(sharded) if jit else sharded)(*inputs)
        for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(plain(*inputs))):
            np.testing.assert_array_equal(jax_fw.to_numpy(g), jax_fw.to_numpy(want), err_msg=name)


def test_shard_map_refuses_a_per_shard_result_as_replicated(jax_fw, rng):
    # out_specs=P() says the result is the same on every shard; for an op of sharded inputs it is
    # not, and shard_map refuses that for jax's own ops. Ours passed, and the result was one shard's.
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    for name, fn, inputs in _jax_cases(jax_fw, rng):
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("batch"), out_specs=P()))(*inputs)


def test_batch_sharded_over_two_devices_gives_the_unsharded_result():
    # jit over batch-sharded inputs and shard_map over the batch, on 2 host CPU devices (a flag
    # read when jax starts: a subprocess), forward and gradients bitwise equal to the plain call.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import ejkernel_jax as ek

        mesh = Mesh(np.array(jax.devices()), ("batch",))
        assert mesh.size == 2
        rng = np.random.default_rng(0)
        q, k, v, dout = (jnp.asarray(rng.standard_normal((2, 8, 2, 16)), jnp.float32) for _ in range(4))

        def step(q, k, v, dout):
            out, pullback = jax.vjp(lambda q, k, v: ek.flash_attention(q, k, v, causal=True), q, k, v)
            return out, *pullback(dout)

        plain = step(q, k, v, dout)
        sharded = [jax.device_put(t, NamedSharding(mesh, P("batch"))) for t in (q, k, v, dout)]
        shard_mapped = jax.shard_map(step, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
        for fn in (jax.jit(step), jax.jit(shard_mapped), shard_mapped):
            for got, want in zip(fn(*sharded), plain):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

        # k/v shared by both batch rows, replicated on both devices: their gradients are summed
        # over the shards, as the unsharded gradient sums them over the rows.
        def shared_step(q, k, v, dout):
            rows = lambda x: jnp.broadcast_to(x, q.shape)
            attend = lambda q, k, v: ek.flash_attention(q, rows(k), rows(v), causal=True)
            out, pullback = jax.vjp(attend, q, k, v)
            return out, *pullback(dout)

        plain = shared_step(q, k[:1], v[:1], dout)
        shard_mapped = jax.shard_map(shared_step, mesh=mesh, in_specs=(P("batch"), P(), P(), P("batch")),
                                     out_specs=(P("batch"), P("batch"), P(), P()))
        for fn in (jax.jit(shard_mapped), shard_mapped):
            for got, want in zip(fn(q, k[:1], v[:1], dout), plain):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_vmap_with_shard_map_over_two_devices_folds_the_samples():
    # vmap inside shard_map over the batch, and shard_map inside vmap, on 2 host CPU devices (a
    # subprocess: the flag is read when jax starts): each op's fold rules still launch once for
    # all samples (padded_attention and softmax ran a lax.map loop before they folded), and the
    # outputs and gradients are bitwise those of the plain vmap. k/v shared by the batch rows and
    # replicated on both devices get their gradients summed over the shards.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import ejkernel_jax as ek

        mesh = Mesh(np.array(jax.devices()), ("batch",))
        assert mesh.size == 2
        rng = np.random.default_rng(0)
        a = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
        n, q, dout, kv = 3, a(3, 2, 8, 2, 16), a(3, 2, 8, 2, 16), a(1, 8, 2, 16)
        n_pad = jnp.asarray([[0, 3], [2, 8], [1, 1]], jnp.int32)

        def vjp(fn, *xs):
            out, pullback = jax.vjp(fn, *xs[:-1])
            return out, *pullback(xs[-1])

        def flash(q, k, dout):  # k (and v) shared by the batch rows
            rows = lambda k: jnp.broadcast_to(k, q.shape[:1] + k.shape[1:])
            return vjp(lambda q, k: ek.flash_attention(q, rows(k), rows(k), causal=True), q, k, dout)

        def padded(q, dout, n_pad):
            return vjp(lambda q: ek.padded_attention(q, q, q, n_pad), q, dout)

        def softmax(x, dout):
            return vjp(ek.softmax, x, dout)

        B, S = P(None, "batch"), P("batch")  # the batch axis, with and without the samples' axis before it
        cases = [(flash, (q, kv, dout), (0, None, 0), ((B, P(), B), (B, B, P())), ((S, P(), S), (S, S, P()))),
                 (padded, (q[..., 0, :], dout[..., 0, :], n_pad), (0, 0, 0), (B, B), (S, S)),
                 (softmax, (q[..., 0, :], dout[..., 0, :]), (0, 0), (B, B), (S, S))]
        for step, args, in_axes, (vmapped_in, vmapped_out), (in_specs, out_specs) in cases:
            plain = jax.vmap(step, in_axes=in_axes)(*args)
            for fn in (jax.shard_map(jax.vmap(step, in_axes=in_axes), mesh=mesh, in_specs=vmapped_in,
                                     out_specs=vmapped_out),
                       jax.vmap(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                                in_axes=in_axes)):
                jaxpr = str(jax.make_jaxpr(fn)(*args))
                assert "scan[" not in jaxpr and "while[" not in jaxpr, step.__name__
                for got, want in zip(jax.jit(fn)(*args), plain):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# -- activation checkpointing --------------------------------------------------------------------


def _checkpointed(fw, fn, **torch_options):
    """``fn`` with its forward recomputed in the backward (torch checkpoint / jax.checkpoint)."""
    if fw.name == "jax":
        import jax

        return jax.checkpoint(fn)
    from torch.utils.checkpoint import checkpoint

    return lambda *xs: checkpoint(fn, *xs, **torch_options)


def _torch_options(fw):
    return [{"use_reentrant": False}, {"use_reentrant": True}] if fw.name == "torch" else [{}]


@pytest.mark.parametrize("seed", ["explicit", "default"])
def test_checkpointed_dropout_recomputes_the_same_mask(fw, rng, seed):
    # The recomputed forward must draw the same dropout mask, or the gradients belong to another
    # forward than the output. The default seed (torch only) is a draw from torch's generator,
    # which torch's checkpoint restores for the recomputation.
    if seed == "default" and fw.name == "jax":
        pytest.skip("jax needs an explicit dropout_seed")
    q, k, v, dout = (fw.asarray(rng.standard_normal((1, 8, 2, 16))) for _ in range(4))
    dropout_seed = 7 if seed == "explicit" else None
    fn = lambda q, k, v: fw.ops.flash_attention(q, k, v, causal=True, dropout_p=0.3, dropout_seed=dropout_seed)

    def out_and_grads(f):
        if fw.name == "torch":
            import torch

            torch.manual_seed(0)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = f(*leaves)
            out.backward(dout)
            return [fw.to_numpy(t) for t in (out, *(t.grad for t in leaves))]
        import jax

        out, pullback = jax.vjp(f, q, k, v)
        return [fw.to_numpy(t) for t in (out, *pullback(dout))]

    plain = out_and_grads(fn)
    for options in _torch_options(fw):
        for got, want in zip(out_and_grads(_checkpointed(fw, fn, **options)), plain):
            np.testing.assert_array_equal(got, want, err_msg=str(options))


def test_checkpointed_attention_layer_in_training(fw, rng):
    # The layers draw their dropout seed inside the recomputed region (torch's generator, the
    # Flax "dropout" stream): checkpointing must not change the output or any gradient.
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    if fw.name == "torch":
        import torch
        from torch.utils.checkpoint import checkpoint

        from ejkernel_torch.nn import MultiHeadAttention

        torch.manual_seed(0)
        layer = MultiHeadAttention(32, 4, 2, dropout=0.3).to(fw.device).train()

        def run(options):
            layer.zero_grad()
            torch.manual_seed(1)
            xx = fw.asarray(x).requires_grad_()
            out = layer(xx) if options is None else checkpoint(layer, xx, **options)
            out.backward(torch.cos(out.detach()))
            return [fw.to_numpy(t) for t in (out, xx.grad, *(p.grad for p in layer.parameters()))]

        plain = run(None)
        for options in _torch_options(fw):
            for got, want in zip(run(options), plain):
                np.testing.assert_array_equal(got, want, err_msg=str(options))
        return
    import flax.linen as nn
    import jax

    from ejkernel_jax.nn import MultiHeadAttention

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            return MultiHeadAttention(32, 4, 2, dropout=0.3)(x, deterministic=deterministic)

    x = fw.asarray(x)
    plain_block, remat_block = Block(), nn.remat(Block, static_argnums=(2,))()
    params = plain_block.init(jax.random.key(0), x, True)

    def loss(params, block):
        out = block.apply(params, x, False, rngs={"dropout": jax.random.key(1)})
        return (out * jax.numpy.sin(out)).sum(), out

    plain = jax.grad(loss, has_aux=True)(params, plain_block)
    remat = jax.grad(loss, has_aux=True)(params, remat_block)
    for got, want in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(fw.to_numpy(got), fw.to_numpy(want))


@pytest.mark.parametrize("remat", ["remat", "checkpoint"])
def test_flax_remat_of_the_attention_layer_itself(jax_fw, rng, remat):
    # Flax's idiom, nn.remat(Layer, static_argnums=...), failed on the layer itself: its
    # deterministic was keyword-only, so it could not be static, and nn.remat traced it
    # ("deterministic must be a bool, got JitTracer"). Gradients in training equal the plain call.
    import flax.linen as nn
    import jax

    from ejkernel_jax.nn import MultiHeadAttention

    x = jax_fw.asarray(rng.standard_normal((2, 8, 32)))
    layer = MultiHeadAttention(32, 4, 2, dropout=0.3)
    remat_layer = getattr(nn, remat)(MultiHeadAttention, static_argnums=(3,))(32, 4, 2, dropout=0.3)
    params = layer.init(jax.random.key(0), x)

    def loss(params, module):
        out = module.apply(params, x, None, False, rngs={"dropout": jax.random.key(1)})
        return (out * jax.numpy.sin(out)).sum(), out

    plain = jax.grad(loss, has_aux=True)(params, layer)
    got = jax.grad(loss, has_aux=True)(params, remat_layer)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(jax_fw.to_numpy(g), jax_fw.to_numpy(want))


def test_jax_scan_over_layers_matches_the_unrolled_layers(jax_fw, rng):
    # A stack of layers run by lax.scan (the usual way to compile a deep model once), each with
    # its own traced dropout seed, gives each layer's plain call, gradients too.
    import jax

    fw = jax_fw
    q, k, v, dout = (fw.asarray(rng.standard_normal((3, 1, 8, 2, 16))) for _ in range(4))
    seeds = fw.asarray(np.array([5, 6, 7], np.int32))
    layer = lambda q, k, v, seed: fw.ops.flash_attention(q, k, v, causal=True, dropout_p=0.2, dropout_seed=seed)

    def stack(q, k, v):
        return jax.lax.scan(lambda carry, xs: (carry, jax.checkpoint(layer)(*xs)), 0, (q, k, v, seeds))[1]

    out, pullback = jax.vjp(stack, q, k, v)
    got = [out, *pullback(dout)]
    for i in range(3):
        out_i, pullback_i = jax.vjp(lambda q, k, v: layer(q, k, v, seeds[i]), q[i], k[i], v[i])
        for g, want in zip(got, [out_i, *pullback_i(dout[i])]):
            np.testing.assert_array_equal(fw.to_numpy(g[i]), fw.to_numpy(want))


# -- torch grad modes --------------------------------------------------------------------------


def test_torch_grad_modes_and_partial_requires_grad(torch_fw, rng):
    # no_grad / inference_mode: no graph, no error; gradients for only some of q/k/v/bias equal
    # those of the full call; a retained graph gives the same gradients on a second backward.
    import torch

    fw, ek = torch_fw, torch_fw.ops
    q, k, v, dout = (fw.asarray(rng.standard_normal((1, 8, 2, 16))) for _ in range(4))
    bias = fw.asarray(rng.standard_normal((1, 2, 8, 8)))
    fn = lambda q, k, v, b: ek.flash_attention(q, k, v, causal=True, bias=b, dropout_p=0.2, dropout_seed=3)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert not fn(q.requires_grad_(), k, v, bias).requires_grad
            assert not ek.padded_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], fw.asarray(np.array([2]))).requires_grad
    q.requires_grad_(False)

    def grads(wanted):
        leaves = [t.clone().requires_grad_(w) for t, w in zip((q, k, v, bias), wanted)]
        out = fn(*leaves)
        out.backward(dout, retain_graph=True)
        first = [t.grad.clone() if t.grad is not None else None for t in leaves]
        for t in leaves:
            t.grad = None
        out.backward(dout)
        assert all((a is None and t.grad is None) or torch.equal(a, t.grad) for a, t in zip(first, leaves))
        return first

    full = grads((True,) * 4)
    for wanted in ((True, False, False, False), (False, True, True, False), (False, False, False, True)):
        for got, want, w in zip(grads(wanted), full, wanted):
            assert got is None if not w else torch.equal(got, want)
