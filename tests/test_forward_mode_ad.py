"""Forward-mode AD: the ops have reverse-mode rules only, so jvp must fail loudly in both
fronts (jax refuses a custom_vjp; torch used to return zero or missing tangents silently)."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import rel_error

B, S, H, D = 2, 5, 2, 16


def _ops(fw, rng):
    """(name, function of one float array, that array) for every public op."""
    ops, x = fw.ops, lambda *shape: fw.asarray(rng.standard_normal(shape), "float32")
    ints = lambda values: fw.asarray(np.asarray(values, np.int32))
    n_pad, kv = ints([1, 0]), x(B, S, H, D)
    lhs, sizes = x(7, 4), ints([3, 0, 4])
    return [
        ("softmax", ops.softmax, x(3, 7)),
        ("padded_softmax", lambda s: ops.padded_softmax(s, n_pad), x(B, S, S)),
        ("padded_softmax_v", lambda s: ops.padded_softmax_v(s, x(B, S, D), n_pad), x(B, S, S)),
        ("padded_attention", lambda q: ops.padded_attention(q, q, q, n_pad), x(B, S, D)),
        ("flash_attention", lambda q: ops.flash_attention(q, kv, kv, causal=True), x(B, S, H, D)),
        ("flash_attention_varlen", lambda q: ops.flash_attention_varlen(
            q, q, q, ints([0, 2, 5]), ints([0, 2, 5]), 3, 3), x(S, H, D)),
        ("grouped_matmul", lambda r: ops.grouped_matmul(lhs, r, sizes), x(3, 4, 6)),
        ("transposed_grouped_matmul", lambda r: ops.transposed_grouped_matmul(r, x(7, 6), sizes), x(4, 7)),
    ]


def _jvp(fw, fn, primal):
    if fw.name == "torch":
        import torch

        return torch.func.jvp(fn, (primal,), (torch.ones_like(primal),))
    import jax
    import jax.numpy as jnp

    return jax.jvp(fn, (primal,), (jnp.ones_like(primal),))


def test_jvp_of_every_op_is_an_error(fw, rng):
    error, message = (NotImplementedError, "forward-mode") if fw.name == "torch" else (TypeError, "forward-mode")
    for name, fn, primal in _ops(fw, rng):
        with pytest.raises(error, match=message):
            _jvp(fw, fn, primal)
            pytest.fail(f"{name}: jvp returned")


def test_torch_dual_tensors_and_hessian_are_errors(torch_fw, rng):
    import torch
    import torch.autograd.forward_ad as fwd

    for name, fn, primal in _ops(torch_fw, rng):
        with fwd.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
            fn(fwd.make_dual(primal, torch.ones_like(primal)))
            pytest.fail(f"{name}: a dual tensor went through")
    x = torch_fw.asarray(rng.standard_normal((2, 5)), "float32")
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.hessian(lambda x: torch_fw.ops.softmax(x).pow(3).sum())(x)


def test_torch_constants_under_a_dual_level_still_work(torch_fw, rng):
    """Ops on tensors without a tangent are fine while a forward-AD level is open."""
    import torch.autograd.forward_ad as fwd

    c_np, x_np, t_np = (rng.standard_normal((3, 7)) for _ in range(3))
    c, x, t = (torch_fw.asarray(a, "float32") for a in (c_np, x_np, t_np))
    probs = ref.forward(ref.softmax, torch_fw.to_numpy(c))
    with fwd.dual_level():
        y = torch_fw.ops.softmax(c) * fwd.make_dual(x, t)
        assert rel_error(torch_fw.to_numpy(fwd.unpack_dual(y).tangent), probs * torch_fw.to_numpy(t)) < 1e-6


@pytest.mark.parametrize("op", ["softmax", "padded_softmax", "padded_softmax_v", "padded_attention", "flash_attention",
                                "flash_attention_varlen"])
def test_jax_second_derivative_names_the_op(jax_fw, op):
    """grad of grad failed inside the backward kernels' callbacks ("Pure callbacks do not support
    JVP", on a GPU jax-triton's error), naming no op; torch says "<op> has no second derivative"."""
    import jax
    import jax.numpy as jnp

    ops = jax_fw.ops
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 5)), jnp.float32)
    n_pad = jnp.asarray([0, 2], jnp.int32)
    qkv = lambda a: (a[:, :, None, :4],) * 3  # noqa: E731
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    packed = lambda a: a.reshape(10, 1, 5)[:, :, :4]  # noqa: E731
    calls = {
        "softmax": lambda a: ops.softmax(a),
        "padded_softmax": lambda a: ops.padded_softmax(a, n_pad),
        "padded_softmax_v": lambda a: ops.padded_softmax_v(a, a, n_pad),
        "padded_attention": lambda a: ops.padded_attention(a, a, a, n_pad),
        "flash_attention": lambda a: ops.flash_attention(*qkv(a), causal=True),
        "flash_attention_varlen": lambda a: ops.flash_attention_varlen(*(packed(a),) * 3, cu, cu, 6, 6),
    }
    loss = lambda a: (calls[op](a) ** 2).sum()  # noqa: E731
    assert np.isfinite(np.asarray(jax.grad(loss)(x))).all()  # first order works
    name = "flash_attention" if op.startswith("flash") else op
    with pytest.raises(NotImplementedError, match=f"{name} has no second derivative"):
        jax.grad(lambda a: jax.grad(loss)(a).sum())(x)
