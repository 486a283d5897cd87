"""What folding a vmapped axis into the batch buys flash_attention: ``vmap`` over n samples
(one launch per kernel), against a per-sample loop (what vmap ran before: jax's ``lax.map`` of
the launches, torch's fallback for ops without a batching rule) and against one plain call on
the samples stacked into the batch (the ideal). Forward, and per-sample gradients (vmap of grad).

    python scripts/probe_vmap_fold.py [--out PATH]

bf16, head_dim 128, 16 heads, causal; prints one JSON row per (front, shape, phase, variant).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import bench_jax, bench_torch, device_name, pin_configs, write_json  # noqa: E402

SHAPES = [(8, 1, 1024), (8, 2, 2048), (4, 1, 4096)]  # (samples, batch per sample, seq)
HEADS, HEAD_DIM = 16, 128


def _torch_rows(n, b, s):
    import torch

    import ejkernel_torch as ek

    q, k, v = (torch.randn(n, b, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = lambda q, k, v: ek.flash_attention(q, k, v, causal=True)  # noqa: E731
    loss = lambda q, k, v: f(q, k, v).float().square().sum()  # noqa: E731
    grad = torch.func.grad(loss, argnums=(0, 1, 2))
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    flat_grad = [t.requires_grad_() for t in (x.clone() for x in flat)]

    def plain_grad():
        return torch.autograd.grad(loss(*flat_grad), flat_grad)

    yield "forward", "vmap", bench_torch(lambda: torch.func.vmap(f)(q, k, v))
    yield "forward", "per-sample loop", bench_torch(lambda: torch.stack([f(q[i], k[i], v[i]) for i in range(n)]))
    yield "forward", "one stacked call", bench_torch(lambda: f(*flat))
    yield "vmap(grad)", "vmap", bench_torch(lambda: torch.func.vmap(grad)(q, k, v))
    yield "vmap(grad)", "per-sample loop", bench_torch(lambda: [grad(q[i], k[i], v[i]) for i in range(n)])
    yield "vmap(grad)", "one stacked call", bench_torch(plain_grad)


def _jax_rows(n, b, s):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ej

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (n, b, s, HEADS, HEAD_DIM), jnp.bfloat16) for key in keys)
    f = lambda q, k, v: ej.flash_attention(q, k, v, causal=True)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(jnp.square(f(q, k, v).astype(jnp.float32)))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    flat = [x.reshape((n * b,) + x.shape[2:]) for x in (q, k, v)]
    per_sample = lambda g: jax.jit(lambda *a: jax.lax.map(lambda x: g(*x), a))  # noqa: E731

    yield "forward", "vmap", bench_jax(jax.jit(jax.vmap(f)), q, k, v)
    yield "forward", "per-sample loop", bench_jax(per_sample(f), q, k, v)
    yield "forward", "one stacked call", bench_jax(jax.jit(f), *flat)
    yield "vmap(grad)", "vmap", bench_jax(jax.jit(jax.vmap(grad)), q, k, v)
    yield "vmap(grad)", "per-sample loop", bench_jax(per_sample(grad), q, k, v)
    yield "vmap(grad)", "one stacked call", bench_jax(jax.jit(grad), *flat)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    pinned = pin_configs(None)
    rows = []
    for front, rows_of in (("torch", _torch_rows), ("jax", _jax_rows)):
        for n, b, s in SHAPES:
            for phase, variant, ms in rows_of(n, b, s):
                rows.append({"front": front, "samples": n, "batch": b, "seq": s, "phase": phase, "variant": variant,
                             "ms": round(ms, 4)})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {"device": device_name(), "pinned": pinned, "heads": HEADS, "head_dim": HEAD_DIM,
                              "dtype": "bfloat16", "causal": True,
                              "command": "python scripts/probe_vmap_fold.py " + " ".join(sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
