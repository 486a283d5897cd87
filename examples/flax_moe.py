"""The Flax twin of examples/torch_moe.py: a tiny mixture-of-experts MLP (top-2 routing) trained
twice from the same weights on the same batches, with ``ejkernel_jax.grouped_matmul`` for the
experts and with a plain loop of per-expert matmuls. Prints both loss curves and fails if they
differ. The parameters have torch_moe.py's shapes (the router's kernel is ``router.weight.T``).

    python examples/flax_moe.py [--steps 30]

Uses jax's default backend; on CPU the kernels run in the Triton interpreter (about 20 s for 30 steps).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The plain loop's matmuls in float32, as the kernel's (a GPU's default is TF32: the curves were
# 1.0e-4 apart on an H200, ten times TOLERANCE). Set before jax is imported.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ejkernel_jax import grouped_matmul

# Small on purpose: on CPU every kernel program runs in the (slow) Triton interpreter.
TOKENS, DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 32, 4, 2
# max |loss difference| over the run (float32). The curves differ by 3e-8 to 6e-8 over 30 steps;
# at 1e-4 an expert output scaled by 1 + 5e-5 passed (its curve 5e-5 off).
TOLERANCE = 1e-5


def grouped_experts(x, group_sizes, w_up, w_down):
    """Rows of ``x`` sorted by expert, ``group_sizes[e]`` of them for expert ``e``: two grouped matmuls.
    Under jit the sizes are traced and never read; check_values=False keeps eager calls from reading them."""
    h = nn.gelu(grouped_matmul(x, w_up, group_sizes, check_values=False), approximate=False)
    return grouped_matmul(h, w_down, group_sizes, check_values=False)


def looped_experts(x, group_sizes, w_up, w_down):
    """The reference: one pair of matmuls per expert. Under jit a slice cannot have a traced
    length, so each expert multiplies every row and keeps its own."""
    owner = jnp.repeat(jnp.arange(EXPERTS), group_sizes, total_repeat_length=x.shape[0])  # row -> expert
    y = jnp.zeros((x.shape[0], w_down.shape[-1]), x.dtype)
    for e in range(EXPERTS):
        y = jnp.where((owner == e)[:, None], nn.gelu(x @ w_up[e], approximate=False) @ w_down[e], y)
    return y


class MoE(nn.Module):
    """``y = sum_k weight_k * expert_k(x)`` over each token's top-k experts."""
    experts_fn: callable = grouped_experts

    @nn.compact
    def __call__(self, x):  # [tokens, dim]
        probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(x))
        w_up = self.param("w_up", nn.initializers.normal(DIM ** -0.5), (EXPERTS, DIM, HIDDEN))
        w_down = self.param("w_down", nn.initializers.normal(HIDDEN ** -0.5), (EXPERTS, HIDDEN, DIM))
        weights, experts = jax.lax.top_k(probs, TOP_K)  # [tokens, k] each
        weights = weights / weights.sum(-1, keepdims=True)
        experts = experts.reshape(-1)  # token t's choices at rows t * k ... t * k + k - 1
        order = jnp.argsort(experts, stable=True)  # rows grouped by expert
        group_sizes = jnp.bincount(experts, length=EXPERTS).astype(jnp.int32)
        y = self.experts_fn(x[order // TOP_K], group_sizes, w_up, w_down)
        y = jnp.zeros_like(y).at[order].set(y)  # back to token order
        return (y.reshape(-1, TOP_K, DIM) * weights[..., None]).sum(1)


def batches(steps: int, seed: int = 1):
    """Regression onto a fixed random smooth map of the input."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((DIM, DIM), np.float32) / DIM ** 0.5
    for _ in range(steps):
        x = rng.standard_normal((TOKENS, DIM), np.float32)
        yield x, np.sin(x @ teacher)


def train(model: MoE, params, steps: int) -> list[float]:
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = jax.jit(opt.init)(params), []
    for x, y in batches(steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ours, plain = MoE(), MoE(looped_experts)
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), jnp.zeros((TOKENS, DIM)))  # same start for both
    curves = {"ejkernel": train(ours, params, args.steps), "plain": train(plain, params, args.steps)}
    print(f"{'step':>4}  {'ejkernel':>9}  {'plain':>9}")
    for i, (a, b) in enumerate(zip(*curves.values())):
        print(f"{i:4d}  {a:9.6f}  {b:9.6f}")
    diff = float(np.max(np.abs(np.subtract(*curves.values())), initial=0.0))  # NaN if either has one
    print(f"max |loss difference|: ejkernel vs plain {diff:.2e} (tolerance {TOLERANCE:g})")
    learned = args.steps < 20 or curves["ejkernel"][-1] < 0.5 * curves["ejkernel"][0]
    if not (diff <= TOLERANCE and learned):
        sys.exit("loss curves disagree or the model did not learn")


if __name__ == "__main__":
    main()
