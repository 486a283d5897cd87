"""What running vmapped samples as one launch's batch of problems buys grouped_matmul: ``vmap``
over n samples, each with its own routing (group sizes), against a per-sample loop (what vmap
ran before: jax's ``lax.map`` of the launches, torch's fallback for ops without a batching
rule) and against one plain call with the samples' tokens in one problem (the same FLOPs; the
ideal). Forward with the expert weights mapped (an ensemble of MoE layers) and shared (vmap of
a layer), and per-sample gradients (vmap of grad, weights shared).

    python scripts/probe_vmap_gmm.py [--out PATH]

bf16, balanced routing, ``check_values=False`` (vmap skips the checks; the loop and the plain
call would sync on them); prints one JSON row per (front, shape, phase, variant).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import bench_jax, bench_torch, device_name, pin_configs, write_json  # noqa: E402

SHAPES = [(8, 4096, 2048, 1408, 64), (4, 8192, 4096, 2048, 8), (16, 1024, 2048, 1408, 16)]  # (samples, tokens, k, n, g)


def _sizes(n, m, g):
    import numpy as np

    base = np.full((n, g), m // g, np.int32)
    base[:, : m % g] += 1
    return base


def _torch_rows(n, m, k, width, g):
    import torch

    import ejkernel_torch as ek

    dev, dt = "cuda", torch.bfloat16
    lhs = torch.randn(n, m, k, device=dev, dtype=dt)
    rhs = torch.randn(n, g, k, width, device=dev, dtype=dt) / k ** 0.5
    sizes = torch.from_numpy(_sizes(n, m, g)).to(dev)
    f = lambda x, w, s: ek.grouped_matmul(x, w, s, check_values=False)  # noqa: E731
    loss = lambda x, w, s: f(x, w, s).float().square().sum()  # noqa: E731
    grad = torch.func.grad(loss, argnums=(0, 1))
    flat, total = lhs.flatten(0, 1), sizes.sum(0, dtype=torch.int32)  # all tokens in one problem
    shared = rhs[0]

    yield "forward, weights mapped", "vmap", bench_torch(lambda: torch.func.vmap(f)(lhs, rhs, sizes))
    yield "forward, weights mapped", "per-sample loop", bench_torch(
        lambda: torch.stack([f(lhs[i], rhs[i], sizes[i]) for i in range(n)]))
    yield "forward, weights shared", "vmap", bench_torch(
        lambda: torch.func.vmap(f, in_dims=(0, None, 0))(lhs, shared, sizes))
    yield "forward, weights shared", "per-sample loop", bench_torch(
        lambda: torch.stack([f(lhs[i], shared, sizes[i]) for i in range(n)]))
    yield "forward, weights shared", "one plain call", bench_torch(lambda: f(flat, shared, total))
    vg = torch.func.vmap(grad, in_dims=(0, None, 0))
    yield "vmap(grad), weights shared", "vmap", bench_torch(lambda: vg(lhs, shared, sizes))
    yield "vmap(grad), weights shared", "per-sample loop", bench_torch(
        lambda: [grad(lhs[i], shared, sizes[i]) for i in range(n)])


def _jax_rows(n, m, k, width, g):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ej

    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    lhs = jax.random.normal(keys[0], (n, m, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (n, g, k, width), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(_sizes(n, m, g))
    f = lambda x, w, s: ej.grouped_matmul(x, w, s, check_values=False)  # noqa: E731
    loss = lambda x, w, s: jnp.sum(jnp.square(f(x, w, s).astype(jnp.float32)))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    shared = rhs[0]
    loop = lambda fn: jax.jit(lambda *a: jax.lax.map(lambda x: fn(*x), a))  # noqa: E731

    yield "forward, weights mapped", "vmap", bench_jax(jax.jit(jax.vmap(f)), lhs, rhs, sizes)
    yield "forward, weights mapped", "per-sample loop", bench_jax(loop(f), lhs, rhs, sizes)
    yield "forward, weights shared", "vmap", bench_jax(jax.jit(jax.vmap(f, (0, None, 0))), lhs, shared, sizes)
    yield "forward, weights shared", "per-sample loop", bench_jax(
        jax.jit(lambda x, s: jax.lax.map(lambda a: f(a[0], shared, a[1]), (x, s))), lhs, sizes)
    yield "forward, weights shared", "one plain call", bench_jax(
        jax.jit(f), lhs.reshape(n * m, k), shared, sizes.sum(0, dtype=jnp.int32))
    yield "vmap(grad), weights shared", "vmap", bench_jax(jax.jit(jax.vmap(grad, (0, None, 0))), lhs, shared, sizes)
    yield "vmap(grad), weights shared", "per-sample loop", bench_jax(
        jax.jit(lambda x, s: jax.lax.map(lambda a: grad(a[0], shared, a[1]), (x, s))), lhs, sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fronts", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    pinned = pin_configs(None)
    rows = []
    for front in args.fronts:
        rows_of = _torch_rows if front == "torch" else _jax_rows
        for n, m, k, width, g in SHAPES:
            for phase, variant, ms in rows_of(n, m, k, width, g):
                rows.append({"front": front, "samples": n, "tokens": m, "k": k, "n": width, "experts": g,
                             "phase": phase, "variant": variant, "ms": round(ms, 4)})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {"device": device_name(), "pinned": pinned, "dtype": "bfloat16", "routing": "balanced",
                              "command": "python scripts/probe_vmap_gmm.py " + " ".join(sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
