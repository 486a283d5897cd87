"""The Flax twin of examples/torch_gpt.py: a tiny GPT trained twice from the same weights on the
same batches, with ``ejkernel_jax.nn.MultiHeadAttention`` (flash-attention kernels) and with the
same layer running plain jnp attention. Prints both loss curves and fails if they differ.

    python examples/flax_gpt.py [--steps 50]

Uses jax's default backend; on CPU the kernels run in the Triton interpreter.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The plain attention's matmuls in float32, as the kernel's (a GPU's default is TF32, ~1e-3),
# so the curves can be held to loss_curves.TOLERANCE. Set before jax is imported.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ejkernel_jax import flash_attention
from ejkernel_jax.nn import MultiHeadAttention
from examples.loss_curves import TOLERANCE, judge

# Small on purpose: on CPU every kernel program runs in the (slow) Triton interpreter.
VOCAB, SEQ, BATCH, EMBED, HEADS, KV_HEADS, LAYERS = 32, 32, 4, 32, 2, 1, 2


def plain_attention(q, k, v, *, causal, **_):
    """[b, s, h, d] textbook attention, k/v repeated for GQA (dropout off)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


class Block(nn.Module):
    attention_fn: callable

    @nn.compact
    def __call__(self, x):
        attention = MultiHeadAttention(EMBED, HEADS, KV_HEADS, causal=True, attention_fn=self.attention_fn)
        x = x + attention(nn.LayerNorm()(x))
        h = nn.Dense(EMBED)(nn.gelu(nn.Dense(4 * EMBED)(nn.LayerNorm()(x)), approximate=False))
        return x + h


class GPT(nn.Module):
    attention_fn: callable

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, EMBED)(tokens) + nn.Embed(SEQ, EMBED)(jnp.arange(tokens.shape[1]))
        for _ in range(LAYERS):
            x = Block(self.attention_fn)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def corpus(n_tokens: int, seed: int = 0) -> np.ndarray:
    """Text from a random sparse Markov chain: learnable, so the loss falls within 50 steps."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((VOCAB, VOCAB)) * 3
    cdf = np.cumsum(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), axis=1)
    tokens = [0]
    for u in rng.random(n_tokens - 1):
        tokens.append(min(int(np.searchsorted(cdf[tokens[-1]], u, side="right")), VOCAB - 1))
    return np.array(tokens, np.int32)


def batches(data: np.ndarray, steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        window = np.stack([data[s:s + SEQ + 1] for s in rng.integers(0, len(data) - SEQ - 1, BATCH)])
        yield window[:, :-1], window[:, 1:]


def train(model: GPT, params, data: np.ndarray, steps: int) -> list[float]:
    opt = optax.adam(3e-3)

    @jax.jit
    def step(params, state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = jax.jit(opt.init)(params), []
    for x, y in batches(data, steps):
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    data = corpus(20_000)
    ours, plain = GPT(attention_fn=flash_attention), GPT(attention_fn=plain_attention)
    params = jax.jit(plain.init)(jax.random.PRNGKey(0), jnp.zeros((BATCH, SEQ), jnp.int32))  # same start for both
    curves = {"ejkernel": train(ours, params, data, args.steps), "plain": train(plain, params, data, args.steps)}
    print(f"{'step':>4}  {'ejkernel':>9}  {'plain':>9}")
    for i, (a, b) in enumerate(zip(*curves.values())):
        print(f"{i:4d}  {a:9.5f}  {b:9.5f}")
    diff, ok = judge(curves, args.steps)
    print(f"max |loss difference| = {diff:.2e} (tolerance {TOLERANCE:g})")
    if not ok:
        sys.exit("loss curves disagree or the model did not learn")


if __name__ == "__main__":
    main()
