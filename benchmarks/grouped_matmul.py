"""Grouped matmul (MoE) on a CUDA GPU: ours launched from torch and from jax vs torch._grouped_mm,
a per-expert torch.matmul loop, a dense torch.matmul of equal FLOPs and jax.lax.ragged_dot.
Forward and forward+backward, TFLOP/s on the useful FLOPs (2 * sum(group_sizes) * k * n per matmul).
The torch methods compared by the goals are timed side by side in rounds, and their ratios taken
within a round (``benchmarks.common.event_rounds``).

    python benchmarks/grouped_matmul.py [--shapes quick|default|full] [--only 0 2 ..] [--sweep] [--out PATH]
    python benchmarks/grouped_matmul.py --smoke     # tiny shapes on CPU: checks the script runs
                                                    # (writes to the temp dir unless --out)

Writes benchmarks/results/grouped_matmul-<gpu>.json and an SVG bar chart next to it. ``--sweep``
also times every config in SWEEP_CONFIGS for our forward (torch) and records the best per shape.
``--only`` picks shapes by index (a run split across several device commands).
``--no-ragged-dot`` leaves the slowest baseline out (its rows then say it was skipped).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# jax's allocator keeps what it grew to; without a cap, ragged_dot's autotuner leaves too little
# for torch's largest shapes on an 80 GB GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")

import numpy as np

from benchmarks.common import (EVENT_ROUNDS, bench_jax, bench_torch, device_name, event_rounds, median_ratio,
                               pin_configs, spread, try_time, value_and_pullback, write_bar_svg, write_json)
from triton_kernels.params import FwdParams

# (experts g, tokens m, k, n): MoE layers from the ranges, largest balanced ones first.
SHAPES = {
    "quick": [(8, 16384, 4096, 2048), (64, 32768, 2048, 1408), (128, 65536, 7168, 2048)],
    "default": [(8, 65536, 4096, 2048), (8, 16384, 4096, 2048), (16, 32768, 7168, 2048),
                (16, 16384, 4096, 4096), (64, 32768, 2048, 1408), (64, 8192, 4096, 1408),
                (128, 65536, 7168, 2048), (128, 16384, 2048, 1408)],
    "full": list(itertools.product((8, 16, 64, 128), (8192, 65536), (2048, 4096, 7168), (1408, 2048, 4096))),
}
ROUTINGS = ("balanced", "skewed")
# Forward configs --sweep tries (tests/test_aot_grouped_matmul.py compiles each for sm_90).
SWEEP_CONFIGS = [FwdParams(blocksize_m=128, blocksize_n=256, blocksize_k=64, num_warps=8, num_stages=3),
                 FwdParams(blocksize_m=128, blocksize_n=128, blocksize_k=64, num_warps=8, num_stages=4),
                 FwdParams(blocksize_m=128, blocksize_n=128, blocksize_k=64, num_warps=4, num_stages=4),
                 FwdParams(blocksize_m=64, blocksize_n=256, blocksize_k=64, num_warps=8, num_stages=3),
                 FwdParams(blocksize_m=64, blocksize_n=128, blocksize_k=64, num_warps=4, num_stages=4)]


def group_sizes(m: int, g: int, routing: str, rng: np.random.Generator) -> np.ndarray:
    """Tokens per expert summing to m: equal, or Zipf-like (expert i gets ~1/(i+1)), shuffled."""
    if routing == "balanced":
        sizes = np.full(g, m // g, np.int64)
    else:
        weights = 1.0 / np.arange(1, g + 1)
        sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
        rng.shuffle(sizes)
    sizes[0] += m - sizes.sum()
    return sizes.astype(np.int32)


# --------------------------------------------------------------------------------------------
# timing: CUDA events (torch) / pipelined wall clock (jax) on GPU; a plain loop in --smoke


def _time_torch(fn, smoke: bool) -> float:
    if not smoke:
        return bench_torch(fn)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _time_jax(fn, args, smoke: bool) -> float:
    if not smoke:
        return bench_jax(fn, *args)
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3


# --------------------------------------------------------------------------------------------
# one shape


def _torch_methods(rhs, sizes_np, device):
    import torch

    import ejkernel_torch

    gs = torch.from_numpy(sizes_np).to(device)
    offs = torch.cumsum(gs, 0, dtype=torch.int32)
    bounds = np.concatenate([[0], np.cumsum(sizes_np)]).tolist()
    total = int(sizes_np.sum())
    dense_w = rhs[0].clone()

    def loop(a, b):
        return torch.cat([a[bounds[i]:bounds[i + 1]] @ b[i] for i in range(b.shape[0])] + [a.new_zeros(
            (a.shape[0] - total, b.shape[2]))])

    return {
        # Checked: a fresh tensor of sizes each call, as a router's counts are each step (the
        # values of a tensor read before and not written since are not read again).
        "ours_torch": lambda a, b: ejkernel_torch.grouped_matmul(a, b, gs.clone()),
        # Without the value checks on group_sizes (one host sync per call), as a training loop with
        # a trusted router would call it.
        "ours_torch_unchecked": lambda a, b: ejkernel_torch.grouped_matmul(a, b, gs, check_values=False),
        # _grouped_mm wants the weights column-major; the transpose copy is made outside the timing.
        "torch._grouped_mm": lambda a, b: torch._grouped_mm(a, b, offs=offs),
        "torch_loop": loop,
        "dense_matmul": lambda a, b: a[:total] @ dense_w,
    }


def _torch_calls(lhs, rhs, cot, sizes_np, device) -> dict:
    """Each torch method's forward and training step as calls without arguments, keyed
    ``fwd/<method>`` and ``fwd+bwd/<method>``."""
    import torch

    rhs_cm = rhs.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major per expert
    total = int(sizes_np.sum())
    calls = {}
    for name, fn in _torch_methods(rhs, sizes_np, device).items():
        weights = rhs_cm if name == "torch._grouped_mm" else rhs
        calls[f"fwd/{name}"] = functools.partial(fn, lhs, weights)
        if name == "dense_matmul":  # one [k, n] weight and the routed rows only: equal FLOPs
            a, b, c = lhs[:total].clone().requires_grad_(True), rhs[0].clone().requires_grad_(True), cot[:total]
            calls[f"fwd+bwd/{name}"] = lambda a=a, b=b, c=c: torch.autograd.grad(a @ b, (a, b), c)
        else:
            a, b = lhs.clone().requires_grad_(True), weights.clone().requires_grad_(True)
            calls[f"fwd+bwd/{name}"] = lambda a=a, b=b, fn=fn: torch.autograd.grad(fn(a, b), (a, b), cot)
    return calls


def _bench_torch(lhs_np, rhs_np, sizes_np, dtype, smoke, rng):
    """Median ms of each torch method (``times``), failures (``errors``), and the side-by-side
    rounds' samples (``rounds``, ``event_rounds``: every method but the loop, whose step takes up
    to 0.4 s), of which the goals' ratios are taken."""
    import torch

    device = "cpu" if smoke else "cuda"
    tdtype = getattr(torch, dtype)
    lhs = torch.from_numpy(lhs_np).to(device, tdtype)
    rhs = torch.from_numpy(rhs_np).to(device, tdtype)
    cot = rng.standard_normal((lhs_np.shape[0], rhs_np.shape[2]), dtype=np.float32)
    cot = torch.from_numpy(cot).to(device, tdtype)
    times, errors, side_by_side = {}, {}, {}
    for key, call in _torch_calls(lhs, rhs, cot, sizes_np, device).items():
        if key.endswith("/torch_loop"):
            try_time(times, errors, key, lambda: _time_torch(call, smoke))
        else:
            side_by_side[key] = call
    if smoke:
        rounds = event_rounds(side_by_side, errors, rounds=2, timer=functools.partial(_time_torch, smoke=True))
    else:
        rounds = event_rounds(side_by_side, errors)
    times.update({key: statistics.median(samples) for key, samples in rounds.items()})
    return times, errors, rounds, (lhs, rhs, cot)


def _bench_jax(lhs_np, rhs_np, sizes_np, dtype, smoke, rng, ragged_dot=True):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax

    lhs, rhs = jnp.asarray(lhs_np).astype(dtype), jnp.asarray(rhs_np).astype(dtype)
    gs = jnp.asarray(sizes_np)
    cot = jnp.asarray(rng.standard_normal((lhs_np.shape[0], rhs_np.shape[2]), dtype=np.float32)).astype(dtype)
    methods = {
        "ours_jax": lambda a, b, s: ejkernel_jax.grouped_matmul(a, b, s),
        "jax.lax.ragged_dot": lambda a, b, s: jax.lax.ragged_dot(a, b, s),
    }
    times, errors = {}, {}
    if not ragged_dot:
        del methods["jax.lax.ragged_dot"]
        errors["fwd/jax.lax.ragged_dot"] = errors["fwd+bwd/jax.lax.ragged_dot"] = "skipped (--no-ragged-dot)"
    for name, fn in methods.items():
        fwd = jax.jit(fn)
        try_time(times, errors, f"fwd/{name}", lambda: _time_jax(fwd, (lhs, rhs, gs), smoke))
        # fwd+bwd: the forward output and both gradients leave the jitted step, as in a training
        # step (the gradients alone do not need the forward, and XLA would drop it).
        step = jax.jit(lambda a, b, s, c, fn=fn: value_and_pullback(lambda x, y: fn(x, y, s), (a, b), c))
        try_time(times, errors, f"fwd+bwd/{name}", lambda: _time_jax(step, (lhs, rhs, gs, cot), smoke))
    return times, errors


def _sweep(lhs, rhs, sizes_np, smoke) -> dict:
    import torch

    import ejkernel_torch

    gs = torch.from_numpy(sizes_np).to(lhs.device)
    out = {}
    for params in SWEEP_CONFIGS:
        key = f"{params.blocksize_m}x{params.blocksize_n}x{params.blocksize_k}-w{params.num_warps}-s{params.num_stages}"
        errors = {}
        call = lambda: ejkernel_torch.grouped_matmul(lhs, rhs, gs, fwd_params=params, check_values=False)  # noqa: E731
        try_time(out, errors, key, lambda: _time_torch(call, smoke))
        if errors:
            out[key] = errors[key]
    return out


def _plan_summary(m, k, n, g, dtype, smoke) -> dict:
    from ejkernel_torch.launch import device_facts
    from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan

    facts = device_facts("cpu" if smoke else "cuda")
    plans = {"fwd": gmm_plan(m, k, n, g, g, False, dtype, dtype, facts),
             "d_lhs": gmm_plan(m, n, k, g, g, True, dtype, dtype, facts),
             "d_rhs": tgmm_plan(m, k, n, g, g, True, dtype, dtype, facts)}
    return {name: {"kernel": p.name, **{c: v for c, v in p.constexprs if c.startswith("BLOCK")}, "num_warps": p.num_warps,
                   "num_stages": p.num_stages, "grid": p.grid[0]} for name, p in plans.items()}


def run_shape(g, m, k, n, routing, dtype, smoke, sweep, seed=0, ragged_dot=True) -> dict:
    rng = np.random.default_rng(seed)
    sizes = group_sizes(m, g, routing, rng)
    lhs_np = rng.standard_normal((m, k), dtype=np.float32)
    rhs_np = rng.standard_normal((g, k, n), dtype=np.float32) / np.sqrt(k)
    flops = 2.0 * float(sizes.sum()) * k * n
    times, errors, rounds, (lhs, rhs, _) = _bench_torch(lhs_np, rhs_np, sizes, dtype, smoke, rng)
    jt, je = _bench_jax(lhs_np, rhs_np, sizes, dtype, smoke, rng, ragged_dot)
    times.update(jt)
    errors.update(je)
    # fwd+bwd does three matmuls of the forward's size (out, d_lhs, d_rhs).
    tflops = {name: (1 if name.startswith("fwd/") else 3) * flops / (ms * 1e-3) / 1e12 for name, ms in times.items()}
    row = {"experts": g, "tokens": m, "k": k, "n": n, "routing": routing, "dtype": dtype,
           "max_group": int(sizes.max()), "ms": times, "rounds_ms": rounds, "tflops": tflops, "errors": errors,
           "plans": _plan_summary(m, k, n, g, dtype, smoke)}
    for phase, mine, base in itertools.product(("fwd", "fwd+bwd"), ("ours_torch", "ours_torch_unchecked"),
                                               ("torch._grouped_mm", "dense_matmul", "torch_loop")):
        ours, theirs = f"{phase}/{mine}", f"{phase}/{base}"
        if ours in rounds and theirs in rounds:  # > 1: ours is faster
            row[f"{phase}: {mine} vs {base}"] = median_ratio(rounds, theirs, ours)
        elif times.get(ours) and times.get(theirs):
            row[f"{phase}: {mine} vs {base}"] = times[theirs] / times[ours]
    for phase in ("fwd", "fwd+bwd"):
        if times.get(f"{phase}/ours_jax") and times.get(f"{phase}/jax.lax.ragged_dot"):
            row[f"{phase}: ours_jax vs ragged_dot"] = times[f"{phase}/jax.lax.ragged_dot"] / times[f"{phase}/ours_jax"]
    if sweep:
        row["sweep_fwd_ms"] = _sweep(lhs, rhs, sizes, smoke)
    return row


# --------------------------------------------------------------------------------------------
# output


def _svg_label(r: dict) -> str:
    return f'g{r["experts"]} m{r["tokens"] // 1024}k k{r["k"]} n{r["n"]} {r["routing"][:4]}'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    parser.add_argument("--routing", nargs="*", default=list(ROUTINGS), choices=ROUTINGS)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_CONFIGS for our forward")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): checks the script")
    parser.add_argument("--only", nargs="*", type=int, default=None, help="indices into the shape list")
    parser.add_argument("--config-cache", default=None, help="tile config cache to use (default: none)")
    parser.add_argument("--no-ragged-dot", action="store_true",
                        help="leave jax.lax.ragged_dot out: on an H200 its XLA autotuner retried a 16 GiB "
                             "allocation every 10 s for minutes at 64 experts / 32k tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    configs = pin_configs(args.config_cache)

    import torch

    if args.smoke:
        shapes, device = [(4, 200, 48, 40), (3, 97, 33, 20)], "cpu"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        shapes, device = SHAPES[args.shapes], device_name()
    if args.only is not None:
        if bad := [i for i in args.only if not 0 <= i < len(shapes)]:
            parser.error(f"--only: {bad} not indices into the {len(shapes)} shapes of this run (0..{len(shapes) - 1})")
        shapes = [shapes[i] for i in args.only]
    rows = []
    for (g, m, k, n), routing in itertools.product(shapes, args.routing):
        row = run_shape(g, m, k, n, routing, args.dtype, args.smoke, args.sweep, ragged_dot=not args.no_ragged_dot)
        rows.append(row)
        t = row["tflops"]
        print(f"g{g:<4d} m{m:<6d} k{k:<5d} n{n:<5d} {routing:8s} fwd TFLOP/s: "
              + ", ".join(f"{name.split('/')[1]} {v:.3g}" for name, v in t.items() if name.startswith("fwd/"))
              + " | fwd+bwd: "
              + ", ".join(f"{name.split('/')[1]} {v:.3g}" for name, v in t.items() if name.startswith("fwd+bwd/")),
              flush=True)
        for name, err in row["errors"].items():
            print(f"    {name}: {err}")
        _write(args, device, rows, configs)  # after every shape: a run cut short keeps what it measured


def default_out(smoke: bool, device: str) -> str:
    """benchmarks/results/grouped_matmul-<gpu>.json; a --smoke run's JSON goes to the temp dir (in
    results/ it left untracked files that read like measurements)."""
    if smoke:
        return os.path.join(tempfile.gettempdir(), "grouped_matmul-cpu-smoke.json")
    return os.path.join(os.path.dirname(__file__), "results", f"grouped_matmul-{device}.json")


def _write(args, device: str, rows: list[dict], configs: dict) -> None:
    import jax
    import torch

    out = args.out or default_out(args.smoke, device)
    ratios = {}
    for key in {k for r in rows for k in r if " vs " in k}:
        values = [r[key] for r in rows if key in r]
        ratios[key] = spread(values)
    write_json(out, {"device": device, "torch": torch.__version__, "jax": jax.__version__, **configs,
                     "method": f"torch: triton.testing.do_bench median (events, L2 flushed), every method but "
                               f"torch_loop in {EVENT_ROUNDS} interleaved rounds of {200 // EVENT_ROUNDS} ms "
                               "after one dropped round, reversed (rounds_ms), its ratios the median over pairs of "
                               "rounds (one of each order) of the geometric mean of the ratios within each round, "
                               "its ms the median of the rounds; jax: median of 9 batches of 50 "
                               "pipelined calls; TFLOP/s on "
                               f"2*sum(group_sizes)*k*n per matmul (x3 for fwd+bwd)",
                     "ratios": ratios, "results": rows})
    for phase, suffix in (("fwd", ""), ("fwd+bwd", "-fwd-bwd")):
        write_bar_svg(out.removesuffix(".json") + f"{suffix}.svg", rows, phase,
                      f"{phase} TFLOP/s (useful FLOPs), higher is better", _svg_label)


if __name__ == "__main__":
    main()
