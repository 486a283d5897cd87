"""Single-head causal self-attention over left-padded batches, three ways:

1. a Flax module with plain jnp attention (the reference),
2. the same module calling ``ejkernel_jax.padded_attention`` (one Triton kernel),
3. a torch ``nn.Module`` twin calling ``ejkernel_torch.padded_attention``, loaded with the Flax
   weights.

    python examples/shcsa.py

Prints how closely the three agree (outputs and input gradients).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch

import ejkernel_jax
import ejkernel_torch


class SHCSA(nn.Module):
    """x [batch, seq, features] -> [batch, seq, features]; the first n_pad[b] tokens are padding."""

    head_dim: int
    use_kernel: bool = True

    @nn.compact
    def __call__(self, x, n_pad):
        q, k, v = (nn.Dense(self.head_dim, use_bias=False, name=n)(x) for n in ("query", "key", "value"))
        if self.use_kernel:
            h = ejkernel_jax.padded_attention(q, k, v, n_pad)
        else:
            h = ejkernel_jax.reference.padded_attention(q, k, v, n_pad).astype(x.dtype)
        return nn.Dense(x.shape[-1], use_bias=False, name="out")(h)


class TorchSHCSA(torch.nn.Module):
    def __init__(self, features: int, head_dim: int):
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(features, head_dim, bias=False) for _ in range(3))
        self.out = torch.nn.Linear(head_dim, features, bias=False)

    def forward(self, x, n_pad):
        h = ejkernel_torch.padded_attention(self.query(x), self.key(x), self.value(x), n_pad)
        return self.out(h)

    def load_flax(self, params) -> "TorchSHCSA":
        with torch.no_grad():
            for name in ("query", "key", "value", "out"):
                kernel = np.asarray(params[name]["kernel"])  # flax Dense kernel is [in, out]
                getattr(self, name).weight.copy_(torch.from_numpy(kernel.T.copy()))
        return self


def main() -> None:
    batch, seq, features, head_dim = 4, 97, 48, 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, seq, features)).astype(np.float32)
    n_pad = np.array([0, 5, 40, seq], np.int32)  # the last sequence is all padding

    kernel_mod, plain_mod = SHCSA(head_dim), SHCSA(head_dim, use_kernel=False)
    params = kernel_mod.init(jax.random.PRNGKey(0), jnp.asarray(x), n_pad)["params"]

    def loss(mod):
        return lambda x: jnp.sum(mod.apply({"params": params}, x, n_pad) ** 2)

    y_kernel = np.asarray(kernel_mod.apply({"params": params}, x, n_pad))
    y_plain = np.asarray(plain_mod.apply({"params": params}, x, n_pad))
    g_kernel = np.asarray(jax.grad(loss(kernel_mod))(jnp.asarray(x)))
    g_plain = np.asarray(jax.grad(loss(plain_mod))(jnp.asarray(x)))

    twin = TorchSHCSA(features, head_dim).load_flax(params)
    xt = torch.from_numpy(x).requires_grad_(True)
    y_torch = twin(xt, torch.from_numpy(n_pad))
    (y_torch ** 2).sum().backward()

    def gap(a, b):
        return float(np.max(np.abs(a - b)))

    print(f"flax kernel vs flax plain jnp : output {gap(y_kernel, y_plain):.2e}, grad {gap(g_kernel, g_plain):.2e}")
    print(f"torch twin  vs flax kernel    : output {gap(y_torch.detach().numpy(), y_kernel):.2e}, "
          f"grad {gap(xt.grad.numpy(), g_kernel):.2e}")
    assert not np.isnan(y_kernel).any() and not y_kernel[-1].any(), "all-padding rows must be zeros"
    # float32 gaps: outputs about 5e-7, gradients about 8e-6 against a largest gradient of about
    # 40 (2e-7 of it). The bounds were 1e-4 and 1e-4 * 40, 200x and 500x those: an attention
    # output off by 3e-5 of itself, or its input gradients by 5e-5, passed.
    assert gap(y_kernel, y_plain) < 1e-5 and gap(y_torch.detach().numpy(), y_kernel) < 1e-5, "outputs disagree"
    # The gradients are judged too (they were only printed: a wrong backward passed), relative
    # to the largest one.
    scale = float(np.max(np.abs(g_plain)))
    assert gap(g_kernel, g_plain) < 2e-6 * scale and gap(xt.grad.numpy(), g_kernel) < 2e-6 * scale, \
        "input gradients disagree"


if __name__ == "__main__":
    main()
