"""MultiHeadAttention in torch and Flax: matches plain attention, weights move across frameworks and
give the same outputs, dropout only in training mode."""
import numpy as np
import pytest
import torch

from tests.frameworks import TOLERANCE, rel_error


def _plain_attention(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The same layer with float64 textbook attention (GQA by repeating k/v)."""
    b, s, _ = x.shape
    h, hkv, d = module.num_heads, module.num_kv_heads, module.head_dim
    qkv = torch.nn.functional.linear(x, module.qkv.weight.double(), module.qkv.bias.double()).view(b, s, h + 2 * hkv, d)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([h, hkv, hkv], dim=2))
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=module.causal)
    return torch.nn.functional.linear(out.transpose(1, 2).reshape(b, s, h * d), module.out.weight.double(),
                                      module.out.bias.double())


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1)])
def test_torch_module_matches_plain_attention(heads, kv_heads):
    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(64, heads, kv_heads, dropout=0.5).eval()
    x = torch.randn(2, 13, 64, requires_grad=True)
    out = layer(x)
    out.square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    expected = _plain_attention(layer, x64)
    expected.square().sum().backward()
    assert rel_error(out.detach().numpy(), expected.detach().numpy()) < 1e-5
    assert rel_error(x.grad.numpy(), x64.grad.numpy()) < 2e-5


def test_torch_dropout_only_in_training():
    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 2, dropout=0.5)
    x = torch.randn(1, 9, 32)
    train = layer(x)
    layer.eval()
    assert not torch.equal(train, layer(x)) and torch.equal(layer(x), layer(x))


def test_numpy_dropout_is_a_probability():
    # dropout=np.float32(0.1) (from a config array) was "must be a probability" in both fronts
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    from ejkernel_torch.nn import MultiHeadAttention

    MultiHeadAttention(32, 2, dropout=np.float32(0.1))(torch.zeros(1, 4, 32))
    layer = ejkernel_jax.nn.MultiHeadAttention(32, 2, dropout=np.float32(0.1))
    params = layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 32)))
    layer.apply(params, jnp.zeros((1, 4, 32)), deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})


def test_flax_module_with_torch_weights_gives_torch_outputs():
    import jax
    import jax.numpy as jnp

    from ejkernel_jax.nn import MultiHeadAttention as FlaxMHA
    from ejkernel_jax.nn import params_from_torch
    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4, 2, sliding_window=5).eval()
    flax_layer = FlaxMHA(64, 4, 2, sliding_window=5)
    x = np.random.default_rng(0).standard_normal((2, 11, 64)).astype(np.float32)
    seg = np.array([[1] * 11, [1] * 6 + [0] * 5], np.int32)
    init = flax_layer.init(jax.random.PRNGKey(0), jnp.asarray(x))
    params = {"params": params_from_torch(layer.state_dict())}
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)  # same names and shapes
    got = np.asarray(flax_layer.apply(params, jnp.asarray(x), jnp.asarray(seg)))
    want = layer(torch.from_numpy(x), torch.from_numpy(seg)).detach().numpy()
    assert rel_error(got, want) < 1e-5
    dropped = flax_layer.clone(dropout=0.3).apply(params, jnp.asarray(x), deterministic=False,
                                                  rngs={"dropout": jax.random.PRNGKey(1)})
    assert np.isfinite(np.asarray(dropped)).all() and not np.allclose(np.asarray(dropped), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flax_projections_round_like_torch(dtype):
    # torch's Linear adds the bias to the float32 product and rounds once; rounding the product
    # first (as the Flax layer did) changed 332 of 1152 bf16 outputs of the qkv projection.
    import jax
    import jax.numpy as jnp

    from ejkernel_jax.nn import TorchLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 36, dtype=getattr(torch, dtype))
    x = torch.randn(4, 8, 32, dtype=getattr(torch, dtype))
    with jax.default_device(jax.devices("cpu")[0]):  # torch's device: one summation order, bits comparable
        params = {"params": {"weight": jnp.asarray(linear.weight.detach().float().numpy()).astype(dtype),
                             "bias": jnp.asarray(linear.bias.detach().float().numpy()).astype(dtype)}}
        got = TorchLinear(36, dtype=dtype, param_dtype=dtype).apply(params, jnp.asarray(x.float().numpy()).astype(dtype))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), linear(x).detach().float().numpy())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(embed_dim=30, num_heads=4), ValueError, r"embed_dim \(30\) must be divisible by num_heads \(4\)"),
    (dict(embed_dim=32, num_heads=0), ValueError, "num_heads must be >= 1"),
    (dict(embed_dim=32, num_heads=-4, num_kv_heads=2), ValueError, "num_heads must be >= 1"),
    (dict(embed_dim=32, num_heads=4.0), TypeError, "num_heads must be an int"),
    (dict(embed_dim=32, num_heads=4, head_dim=0), ValueError, "head_dim must be >= 1"),
    (dict(embed_dim=32, num_heads=4, head_dim=-1), ValueError, "head_dim must be >= 1"),
    (dict(embed_dim=32, num_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    (dict(embed_dim=32, num_heads=4, dropout=1.5), ValueError, "dropout must be a probability"),
    (dict(embed_dim=32, num_heads=4, dropout=-0.1), ValueError, "dropout must be a probability"),
    (dict(embed_dim=32, num_heads=4, dropout=float("nan")), ValueError, "dropout must be a probability"),
])
def test_bad_layer_arguments(kwargs, error, match):
    # Both fronts, before any weight is made: these built zero-size or silently narrower layers,
    # crashed deep inside, or (Flax) ignored a bad dropout.
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    with pytest.raises(error, match=match):
        ejkernel_torch.nn.MultiHeadAttention(**kwargs)
    with pytest.raises(error, match=match):
        ejkernel_jax.nn.MultiHeadAttention(**kwargs).init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 32)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(embed_dim=600, num_heads=2), r"between 1 and 256 for flash_attention, got 300 \(embed_dim=600 / num_heads=2"),
    (dict(embed_dim=32, num_heads=4, head_dim=512), r"between 1 and 256 for flash_attention, got 512 \(head_dim=512"),
])
def test_head_dim_past_the_kernels_limit_fails_when_the_layer_is_built(kwargs, match):
    # The torch layer was built and failed at its first forward (the Flax one at init, after its
    # projection), both with "head_dim must be between 1 and 256, got 300", naming no layer size.
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    x = jnp.zeros((1, 4, kwargs["embed_dim"]))
    with pytest.raises(ValueError, match=match):
        ejkernel_torch.nn.MultiHeadAttention(**kwargs)
    with pytest.raises(ValueError, match=match):
        ejkernel_jax.nn.MultiHeadAttention(**kwargs).init(jax.random.PRNGKey(0), x)
    ejkernel_torch.nn.MultiHeadAttention(512, 2)  # head_dim 256: the kernels' limit, built
    plain = lambda q, k, v, **options: v  # another attention_fn may take wider heads
    ejkernel_torch.nn.MultiHeadAttention(**kwargs, attention_fn=plain)
    ejkernel_jax.nn.MultiHeadAttention(**kwargs, attention_fn=plain).init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("torch_kwargs, flax_kwargs, match", [
    (dict(bias="no"), dict(use_bias="no"), "bias must be a bool, got 'no'"),  # built biased layers
    (dict(bias=0), dict(use_bias=0), "bias must be a bool, got 0"),
    (dict(causal="false"), dict(causal="false"), "causal must be a bool, got 'false'"),
])
def test_layer_flags_must_be_bools(torch_kwargs, flax_kwargs, match):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    with pytest.raises(TypeError, match=match):
        ejkernel_torch.nn.MultiHeadAttention(32, 4, **torch_kwargs)
    with pytest.raises(TypeError, match=match):
        ejkernel_jax.nn.MultiHeadAttention(32, 4, **flax_kwargs).init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 32)))
    if "use_bias" in flax_kwargs:
        with pytest.raises(TypeError, match=match):
            ejkernel_jax.nn.TorchLinear(8, **flax_kwargs).init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
    layer = ejkernel_torch.nn.MultiHeadAttention(32, 4, bias=np.False_)  # numpy's bools are bools
    assert layer.qkv.bias is None


def test_bad_layer_inputs():
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    layer = ejkernel_torch.nn.MultiHeadAttention(32, 4)
    flax_layer = ejkernel_jax.nn.MultiHeadAttention(32, 4)
    for shape in [(1, 5, 48), (5, 32)]:  # Flax built [96, 48] weights for the first
        with pytest.raises(ValueError, match=r"x must be \[batch, seq, embed_dim=32\]"):
            layer(torch.zeros(shape))
        with pytest.raises(ValueError, match=r"x must be \[batch, seq, embed_dim=32\]"):
            flax_layer.init(jax.random.PRNGKey(0), jnp.zeros(shape))
    with pytest.raises(TypeError, match="x must have the layer's dtype"):
        layer(torch.zeros(1, 5, 32, dtype=torch.float16))
    # A numpy x: "'str' object has no attribute 'type'" (its .device is a str). An int x made
    # Flax cast the weights to int32, then name q.
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        layer(np.zeros((1, 5, 32), np.float32))
    with pytest.raises(TypeError, match="x must be a floating-point array, got int32"):
        flax_layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 32), jnp.int32))


def _layer_output(fw, x: np.ndarray, segment_ids):
    """MultiHeadAttention(32, 4) of ``fw`` applied to ``x`` (a fresh layer)."""
    if fw.name == "torch":
        from ejkernel_torch.nn import MultiHeadAttention

        return MultiHeadAttention(32, 4).to(fw.device)(fw.asarray(x), segment_ids)
    import jax

    from ejkernel_jax.nn import MultiHeadAttention

    return MultiHeadAttention(32, 4).init_with_output(jax.random.PRNGKey(0), fw.asarray(x), segment_ids)[0]


@pytest.mark.parametrize("ids, error, match", [
    (np.ones((2, 5), np.float32), TypeError,
     r"segment_ids must be an integer array \(int8, int16, int32, int64, uint8\), got float32"),
    (np.ones((2, 5), bool), TypeError, r"segment_ids must be an integer array \(.*\), got bool"),
    (np.ones((2, 6), np.int32), ValueError,
     r"segment_ids must have shape \(2, 5\) \[batch, seq\] \(as x\), got \(2, 6\)"),
    (np.ones((5,), np.int32), ValueError, r"segment_ids must have shape \(2, 5\) \[batch, seq\] \(as x\), got \(5,\)"),
    ([[1] * 5] * 2, TypeError, r"segment_ids must be a (torch\.Tensor|jax\.Array), got list"),
], ids=["float32", "bool", "longer seq", "1-D", "list"])
def test_bad_segment_ids_are_named_as_the_layers_argument(fw, ids, error, match):
    """Both layers named them q_segment_ids (flash_attention's argument), which the layer does not have."""
    x = np.zeros((2, 5, 32), np.float32)
    with pytest.raises(error, match=f"^{match}"):  # (jax appends a note on its filtered traceback)
        _layer_output(fw, x, fw.asarray(ids) if isinstance(ids, np.ndarray) else ids)
    if fw.name == "torch":  # (numpy ids are arrays to the Flax layer, as to flash_attention)
        with pytest.raises(TypeError, match="^segment_ids must be a torch.Tensor, got ndarray$"):
            _layer_output(fw, x, np.asarray(ids))


def test_layer_segment_ids_of_any_integer_dtype_run(fw):
    x = np.zeros((2, 5, 32), np.float32)
    for dtype in (np.int64, np.uint8):
        assert tuple(_layer_output(fw, x, fw.asarray(np.ones((2, 5), dtype))).shape) == (2, 5, 32)


def test_layer_dtype_flash_attention_cannot_take_is_named():
    """float64 layers failed at every call naming q, which the user never passed. (A float64 torch
    layer may still be built: to hold or convert weights, test_params_from_torch_keeps_dtypes.)"""
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    layer = ejkernel_torch.nn.MultiHeadAttention(32, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"compute in float64 \(from the layer's dtype\); flash_attention takes"):
        layer(torch.zeros(1, 5, 32, dtype=torch.float64))
    with jax.enable_x64(True):
        flax_layer = ejkernel_jax.nn.MultiHeadAttention(32, 4, param_dtype=jnp.float64)
        with pytest.raises(TypeError, match=r"float64 \(from x's dtype, dtype=None\)"):
            flax_layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 32), jnp.float64))
        flax_layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 32), jnp.float32))  # float64 params, float32 math
        flax_layer = ejkernel_jax.nn.MultiHeadAttention(32, 4, dtype=jnp.float64)
        with pytest.raises(TypeError, match=r"compute in float64 \(from dtype\)"):
            flax_layer.init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 32), jnp.float32))
    # Another attention_fn may compute in float64 (a reference run)
    reference = ejkernel_torch.nn.MultiHeadAttention(32, 4, dtype=torch.float64, attention_fn=lambda *a, **k: a[0])
    assert reference(torch.zeros(1, 5, 32, dtype=torch.float64)).dtype == torch.float64


def test_zero_kv_heads_is_an_error():
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        ejkernel_torch.nn.MultiHeadAttention(32, 4, num_kv_heads=0)
    module = ejkernel_jax.nn.MultiHeadAttention(embed_dim=32, num_heads=4, num_kv_heads=0)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 32)))


@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_flax_deterministic_must_be_a_bool(value):
    # deterministic="no" (or 0/None) was read by truthiness: the string ran without dropout, 0 and
    # None ran with it, and a traced value failed inside bool() with a TracerBoolConversionError.
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn

    layer = ejkernel_jax.nn.MultiHeadAttention(32, 4, dropout=0.5)
    x = jnp.ones((1, 4, 32))
    params = layer.init(jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        layer.apply(params, x, deterministic=value, rngs={"dropout": jax.random.PRNGKey(1)})
    layer.apply(params, x, deterministic=np.True_)  # numpy's bools are bools


def test_flax_traced_deterministic_says_how_to_keep_it_static():
    # nn.remat traces call arguments outside static_argnums (keyword ones always): the error named
    # a JitTracer and not what to do about it.
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn

    x = jnp.ones((1, 4, 32))
    layer = nn.remat(ejkernel_jax.nn.MultiHeadAttention)(32, 4, dropout=0.5)
    params = layer.init(jax.random.PRNGKey(0), x)
    for args, kwargs in (((x, None, False), {}), ((x,), {"deterministic": False})):
        with pytest.raises(TypeError, match=r"deterministic is traced .*static_argnums=\(3,\)"):
            layer.apply(params, *args, **kwargs, rngs={"dropout": jax.random.PRNGKey(1)})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_params_from_torch_keeps_dtypes(dtype):
    # Every weight went through .float(): a bf16/fp16 torch layer gave float32 Flax params (not the
    # param_dtype=bf16 tree the Flax layer inits, so optimizer state and checkpoints differed), and
    # float64 weights lost precision under jax's x64 mode.
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    torch.manual_seed(0)
    layer = ejkernel_torch.nn.MultiHeadAttention(32, 4, dtype=getattr(torch, dtype))
    with jax.enable_x64(dtype == "float64"):
        params = {"params": ejkernel_jax.nn.params_from_torch(layer.state_dict())}
        init = ejkernel_jax.nn.MultiHeadAttention(32, 4, param_dtype=dtype).init(jax.random.PRNGKey(0),
                                                                                  jnp.zeros((1, 4, 32), "float32"))
        assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), init)
        got = np.asarray(params["params"]["qkv"]["weight"].astype(jnp.float64 if dtype == "float64" else jnp.float32))
    np.testing.assert_array_equal(got, layer.qkv.weight.detach().to(torch.float64).cpu().numpy())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sliding_window=-3), ValueError, "sliding_window must be >= 0"),
    (dict(sliding_window=(1, 2, 3)), ValueError, "sliding_window must be an int or a"),
    (dict(sliding_window=1.5), TypeError, r"sliding_window \(left\) must be an int"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be a finite number > 0"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale must be a float or None"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
])
def test_bad_attention_options_fail_when_the_layer_is_built(kwargs, error, match):
    # The torch layer took these and failed only at its first forward (as causal='false' did);
    # the Flax layer checks them at init, before any weight.
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn
    import ejkernel_torch.nn

    with pytest.raises(error, match=match):
        ejkernel_torch.nn.MultiHeadAttention(32, 4, **kwargs)
    with pytest.raises(error, match=match):
        ejkernel_jax.nn.MultiHeadAttention(32, 4, **kwargs).init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 32)))


def test_torch_layer_takes_other_dtypes_under_autocast():
    # The layer refused x whose dtype differs from its weights' (a clearer error than nn.Linear's);
    # under autocast nn.Linear casts both, so bf16 hidden states with fp32 weights must run.
    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, 2).eval()
    x = torch.randn(2, 9, 32).bfloat16()
    with pytest.raises(TypeError, match="x must have the layer's dtype"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = layer(x), layer(x.float())  # autocast rounds x.float() back to the same bf16
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flax_params_load_into_the_torch_layer(dtype):
    """params_to_torch inverts params_from_torch: a Flax-initialised layer's weights load into the
    torch twin (strict names and shapes), keep their dtype and give the Flax outputs."""
    import jax
    import jax.numpy as jnp

    from ejkernel_jax.nn import MultiHeadAttention as FlaxMHA
    from ejkernel_jax.nn import params_from_torch, params_to_torch
    from ejkernel_torch.nn import MultiHeadAttention

    flax_layer = FlaxMHA(32, 4, 2, param_dtype=dtype)
    x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype(np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        params = flax_layer.init(jax.random.PRNGKey(3), jnp.asarray(x).astype(dtype))["params"]
        want = np.asarray(flax_layer.apply({"params": params}, jnp.asarray(x).astype(dtype)).astype(jnp.float32))
    state = params_to_torch(params)
    layer = MultiHeadAttention(32, 4, 2, dtype=getattr(torch, dtype)).eval()
    layer.load_state_dict(state)  # strict: every name and shape matches
    assert all(t.dtype == getattr(torch, dtype) for t in state.values())
    back = params_from_torch(layer.state_dict())
    assert all(np.array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
               for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    got = layer(torch.from_numpy(x).to(getattr(torch, dtype))).detach().float().numpy()
    assert rel_error(got, want) < TOLERANCE[dtype]


def test_torch_linear_refuses_integer_compute():
    # An int x (dtype=None) made TorchLinear cast the weights to int32 and return all zeros plus a
    # truncated bias, silently; flax's Dense promotes, torch's Linear raises.
    import jax
    import jax.numpy as jnp

    from ejkernel_jax.nn import TorchLinear

    x = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    with pytest.raises(TypeError, match="x must be a floating-point array .*got int32"):
        TorchLinear(3).init(jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype, got int32"):
        TorchLinear(3, dtype=jnp.int32).init(jax.random.PRNGKey(0), x.astype(jnp.float32))
    out, params = TorchLinear(3, dtype=jnp.float32).init_with_output(jax.random.PRNGKey(0), x)
    want = np.asarray(x, np.float32) @ np.asarray(params["params"]["weight"]).T + np.asarray(params["params"]["bias"])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_flax_layer_takes_float64_that_jax_computes_in_float32():
    # Without jax_enable_x64 a numpy float64 x (or dtype=float / jnp.float64) computes in float32,
    # as in flax's Dense; the layer refused it as "would compute in float64".
    import jax
    import jax.numpy as jnp

    import ejkernel_jax.nn

    if jax.config.jax_enable_x64:
        pytest.skip("float64 is float64 under x64 (test_layer_dtype_flash_attention_cannot_take_is_named)")
    x = np.random.default_rng(0).standard_normal((1, 5, 32))
    layer = ejkernel_jax.nn.MultiHeadAttention(32, 4)
    want, params = layer.init_with_output(jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32))
    got = layer.apply(params, x)
    assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), np.asarray(want))
    for dtype in (float, jnp.float64):
        got = layer.clone(dtype=dtype).apply(params, jnp.asarray(x, jnp.float32))
        assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), np.asarray(want))
