"""Per-call cost of the torch <-> jax bridge (ejkernel_torch.interop).

Compares, for a 3-input / 1-output function ``x * y + z``:

* ``torch_noop``      -- a torch dispatcher no-op (``aten.alias``), the floor of any torch call;
* ``torch_native``    -- the same function in torch;
* ``raw_dlpack``      -- the hand-written round trip with the public API:
                         3x ``jax.dlpack.from_dlpack`` + the jitted fn + ``torch.from_dlpack``;
* ``raw_dlpack_min``  -- the same round trip with the bridge's own converters (the floor: what
                         is left of bridge / raw_dlpack_min is the bridge's Python overhead);
* ``bridge``          -- ``jax_to_torch(fn)(x, y, z)``;

and with grad, forward + backward of each (``raw_dlpack`` then uses a jitted ``jax.vjp`` that
returns its pullback, and a jitted pullback call, with the same DLPack conversions a careful
user would write; ``raw_dlpack_grad_min`` the same with the bridge's converters, and
``raw_dlpack_grad_min_autograd`` that inside a minimal ``torch.autograd.Function`` -- the
floor for anything torch's autograd can call). ``*_1thread`` variants run the backward under
``torch.autograd.set_multithreading_enabled(False)``: on CUDA torch's engine otherwise runs
backward on a per-device worker thread (the JAX pullback is then called from that thread, with
two thread hand-offs per backward); on CPU it changes nothing. ``*_grad_chain`` variants chain
CHAIN calls (``h = f(h, y, z)``) into one graph and run one backward, as a model with several
bridged layers would: the engine's per-backward cost is then shared, and
``bridge_grad_marginal_over_raw_marginal`` compares what each extra call adds. Also: bytes copied for compact
tensors (by pointer comparison on the conversions the bridge performs) and the jit-cache hit
rate after warm-up. ``scripts/probe_grad_overhead.py`` breaks the grad overhead down further.

Timings are medians over many calls after warm-up, with the variants interleaved in rounds so
that drift on a shared machine hits them alike. On CUDA each timed call ends with
``torch.cuda.synchronize()``.

    python benchmarks/interop.py --device cpu --out benchmarks/results/interop-cpu.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from ejkernel_torch import interop  # noqa: E402
from ejkernel_torch._interop import _bridge, _convert  # noqa: E402


CHAIN = 8  # bridged calls in one autograd graph for the *_chain variants


def fn(x, y, z):
    return x * y + z


def setup(device: str, shape, dtype=torch.float32) -> SimpleNamespace:
    """What every variant (and ``scripts/probe_grad_overhead.py``) works on: three inputs, their
    ``requires_grad`` copies, a cotangent, the device sync, and ``fn`` jitted three ways: plain,
    as a ``jax.vjp`` returning its pullback, and that pullback's call."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn(shape, generator=gen, dtype=dtype).to(device) for _ in range(3)]

    @jax.jit
    def jfwd(x, y, z):
        return jax.vjp(fn, x, y, z)

    @jax.jit
    def jbwd(pullback, ct):
        return pullback(ct)

    return SimpleNamespace(
        xs=xs, xs_g=[x.clone().requires_grad_(True) for x in xs],
        ct=torch.randn(shape, generator=gen, dtype=dtype).to(device),
        sync=torch.cuda.synchronize if device == "cuda" else (lambda: None),
        jfn=jax.jit(fn), jfwd=jfwd, jbwd=jbwd)


def minimal_function(jfwd, jbwd) -> type[torch.autograd.Function]:
    """The least a torch autograd wrapper around the jitted vjp and pullback can do."""

    class MinimalFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            a = [_convert.tensor_to_jax(t, None) for t in ts]
            out, ctx.pullback = jfwd(*a)
            return _convert.array_to_torch(out, None)

        @staticmethod
        def backward(ctx, g):
            grads = jbwd(ctx.pullback, _convert.tensor_to_jax(g, None))
            return tuple(_convert.array_to_torch(x, None) for x in grads)

    return MinimalFunction


def make_variants(device: str, shape, dtype):
    env = setup(device, shape, dtype)
    xs, xs_g, ct, sync, jfn, jfwd, jbwd = env.xs, env.xs_g, env.ct, env.sync, env.jfn, env.jfwd, env.jbwd
    bridged = interop.jax_to_torch(fn)

    def torch_noop():
        torch.ops.aten.alias(xs[0])
        sync()

    def torch_native():
        fn(*xs)
        sync()

    def raw_dlpack():
        a = [jax.dlpack.from_dlpack(t) for t in xs]
        torch.from_dlpack(jfn(*a))
        sync()

    def raw_dlpack_min():
        # Same primitives the bridge uses (jaxlib's import without from_dlpack's Python layer):
        # the floor for a hand-written round trip; bridge / this = the bridge's own overhead.
        a = [_convert.tensor_to_jax(t, None) for t in xs]
        _convert.array_to_torch(jfn(*a), None)
        sync()

    def bridge():
        bridged(*xs)
        sync()

    def torch_native_grad():
        out = fn(*xs_g)
        out.backward(ct)
        sync()

    def raw_dlpack_grad():
        a = [jax.dlpack.from_dlpack(t.detach()) for t in xs_g]
        out, pullback = jfwd(*a)
        torch.from_dlpack(out)
        grads = jbwd(pullback, jax.dlpack.from_dlpack(ct))
        [torch.from_dlpack(g) for g in grads]
        sync()

    def raw_dlpack_grad_min():
        a = [_convert.tensor_to_jax(t, None) for t in xs_g]
        out, pullback = jfwd(*a)
        _convert.array_to_torch(out, None)
        grads = jbwd(pullback, _convert.tensor_to_jax(ct, None))
        [_convert.array_to_torch(g, None) for g in grads]
        sync()

    MinimalFunction = minimal_function(jfwd, jbwd)

    def raw_dlpack_grad_min_autograd():
        MinimalFunction.apply(*xs_g).backward(ct)
        sync()

    def bridge_grad():
        out = bridged(*xs_g)
        out.backward(ct)
        sync()

    def bridge_grad_forward():
        bridged(*xs_g)
        sync()

    def raw_dlpack_grad_chain():
        # CHAIN calls in one graph, driven by hand: what a model with several bridged layers pays
        # without torch's autograd (the cotangent of y and z summed over the calls, as autograd would).
        h, pullbacks = xs_g[0].detach(), []
        for _ in range(CHAIN):
            out, pullback = jfwd(*[_convert.tensor_to_jax(t, None) for t in (h, xs_g[1].detach(), xs_g[2].detach())])
            h = _convert.array_to_torch(out, None)
            pullbacks.append(pullback)
        g, gy, gz = ct, 0, 0
        for pullback in reversed(pullbacks):
            gx_j, gy_j, gz_j = jbwd(pullback, _convert.tensor_to_jax(g, None))
            g = _convert.array_to_torch(gx_j, None)
            gy = gy + _convert.array_to_torch(gy_j, None)
            gz = gz + _convert.array_to_torch(gz_j, None)
        sync()

    def bridge_grad_chain():
        h = xs_g[0]
        for _ in range(CHAIN):
            h = bridged(h, xs_g[1], xs_g[2])
        h.backward(ct)
        sync()

    single_thread = getattr(torch.autograd, "set_multithreading_enabled", None)

    def raw_dlpack_grad_min_autograd_1thread():
        with single_thread(False):
            MinimalFunction.apply(*xs_g).backward(ct)
        sync()

    def bridge_grad_1thread():
        with single_thread(False):
            bridged(*xs_g).backward(ct)
        sync()

    variants = {
        "torch_noop": torch_noop,
        "torch_native": torch_native,
        "raw_dlpack": raw_dlpack,
        "raw_dlpack_min": raw_dlpack_min,
        "bridge": bridge,
        "torch_native_grad": torch_native_grad,
        "raw_dlpack_grad": raw_dlpack_grad,
        "raw_dlpack_grad_min": raw_dlpack_grad_min,
        "raw_dlpack_grad_min_autograd": raw_dlpack_grad_min_autograd,
        "bridge_grad": bridge_grad,
        "bridge_grad_forward_only": bridge_grad_forward,
        "raw_dlpack_grad_chain": raw_dlpack_grad_chain,
        "bridge_grad_chain": bridge_grad_chain,
    }
    if single_thread is not None:  # torch >= 2.0
        variants["raw_dlpack_grad_min_autograd_1thread"] = raw_dlpack_grad_min_autograd_1thread
        variants["bridge_grad_1thread"] = bridge_grad_1thread
    return variants, bridged, xs, xs_g


def time_variants(variants, rounds: int, per_round: int, warmup: int):
    for f in variants.values():
        for _ in range(warmup):
            f()
    samples = {k: [] for k in variants}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, f in variants.items():
            buf = samples[name]
            for _ in range(per_round):
                t0 = clock()
                f()
                buf.append(clock() - t0)
    return {
        name: {
            "median_us": statistics.median(v) / 1e3,
            "p10_us": float(np.percentile(v, 10)) / 1e3,
            "p90_us": float(np.percentile(v, 90)) / 1e3,
            "n": len(v),
        }
        for name, v in samples.items()
    }


def bytes_copied(run) -> dict:
    """Run ``run()`` once recording every bridge conversion: bytes whose pointer changed."""
    records = []
    to_jax, to_torch = _convert.tensor_to_jax, _convert.array_to_torch

    def rec_to_jax(t, copy, **kw):
        a = to_jax(t, copy, **kw)
        records.append(("to_jax", t.numel() * t.element_size(), a.unsafe_buffer_pointer() != t.data_ptr()))
        return a

    def rec_to_torch(a, copy, **kw):
        t = to_torch(a, copy, **kw)
        records.append(("to_torch", t.numel() * t.element_size(), a.unsafe_buffer_pointer() != t.data_ptr()))
        return t

    _bridge.cv.tensor_to_jax, _bridge.cv.array_to_torch = rec_to_jax, rec_to_torch
    try:
        run()
    finally:
        _bridge.cv.tensor_to_jax, _bridge.cv.array_to_torch = to_jax, to_torch
    return {
        "conversions": len(records),
        "bytes_moved": sum(n for _, n, _ in records),
        "bytes_copied": sum(n for _, n, copied in records if copied),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=Path, default=None, help="write JSON results here")
    p.add_argument("--shape", type=int, nargs="+", default=[64, 64])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=200)
    p.add_argument("--warmup", type=int, default=300)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA build of torch and a GPU")

    shape = tuple(args.shape)
    variants, bridged, xs, xs_g = make_variants(args.device, shape, torch.float32)

    # Correctness guard: the numbers are only meaningful if the bridge is right.
    ref = fn(*xs)
    got = bridged(*xs)
    torch.testing.assert_close(got, ref)  # XLA fuses x*y+z into an FMA: not bit-equal

    gc.collect()
    timings = time_variants(variants, args.rounds, args.per_round, args.warmup)

    # jit-cache hit rate after warm-up: count traces over a fresh batch of calls.
    before = bridged.cache_info()
    n = 2000
    for _ in range(n):
        bridged(*xs)
    for _ in range(n // 4):
        bridged(*xs_g).backward(torch.ones(shape, device=args.device))
    after = bridged.cache_info()
    calls = after["calls"] - before["calls"]
    new_traces = (after["traces"] - before["traces"]) + (after["backward_traces"] - before["backward_traces"])
    hit_rate = 1.0 - new_traces / calls

    med = {k: v["median_us"] for k, v in timings.items()}
    result = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "shape": list(shape),
        "dtype": "float32",
        "timings": timings,
        "ratios": {
            "bridge_over_raw_dlpack": med["bridge"] / med["raw_dlpack"],
            "bridge_over_raw_dlpack_min": med["bridge"] / med["raw_dlpack_min"],
            "bridge_grad_over_raw_dlpack_grad": med["bridge_grad"] / med["raw_dlpack_grad"],
            "bridge_grad_over_raw_dlpack_grad_min": med["bridge_grad"] / med["raw_dlpack_grad_min"],
            "bridge_grad_over_raw_dlpack_grad_min_autograd": med["bridge_grad"]
            / med["raw_dlpack_grad_min_autograd"],
            **({
                "bridge_grad_1thread_over_raw_dlpack_grad": med["bridge_grad_1thread"] / med["raw_dlpack_grad"],
                "bridge_grad_1thread_over_raw_dlpack_grad_min": med["bridge_grad_1thread"]
                / med["raw_dlpack_grad_min"],
            } if "bridge_grad_1thread" in med else {}),
            # A graph of CHAIN bridged calls: torch's autograd engine is paid once per backward,
            # so the per-call cost of a model's bridged layers is this, not the single-call ratio.
            "bridge_grad_chain_over_raw_dlpack_grad_chain": med["bridge_grad_chain"] / med["raw_dlpack_grad_chain"],
            "bridge_grad_marginal_over_raw_marginal": (med["bridge_grad_chain"] - med["bridge_grad"])
            / (med["raw_dlpack_grad_chain"] - med["raw_dlpack_grad_min"]),
            "bridge_over_torch_noop": med["bridge"] / med["torch_noop"],
            "raw_dlpack_over_torch_noop": med["raw_dlpack"] / med["torch_noop"],
        },
        "copies": {
            "no_grad": bytes_copied(lambda: bridged(*xs)),
            "grad_forward_backward": bytes_copied(
                lambda: bridged(*xs_g).backward(torch.ones(shape, device=args.device))
            ),
        },
        "jit_cache": {"calls_after_warmup": calls, "new_traces": new_traces, "hit_rate": hit_rate},
        "import_path": _convert._import_impl.__name__ if _convert._import_impl else None,
        "goal": "bridge <= 1.2x raw DLPack round trip; 0 bytes copied; 100% jit-cache hits",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
