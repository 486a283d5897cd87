"""Flash attention on a CUDA GPU: ours launched from torch and from jax vs torch SDPA (flash, cuDNN,
efficient backends) and ``jax.nn.dot_product_attention(implementation="cudnn")``, forward and
forward+backward, TFLOP/s.

Shapes follow the issue: batch * seq = 16k tokens, heads = 2048 / head_dim, seq 1k..16k, head_dim
64 and 128, causal and not. FLOPs: 4 * B * H * S^2 * D, halved when causal; forward+backward
counts 3.5x the forward (the backward is 2.5x).

    python benchmarks/flash_attention.py [--dtypes bfloat16 float16] [--seqs 1024 4096] [--sweep]
    python benchmarks/flash_attention.py --long        # also seq 65,536 (memory O(seq))
    python benchmarks/flash_attention.py --overhead    # eager per-call cost vs a direct launch
    python benchmarks/flash_attention.py --smoke       # tiny shapes on CPU: checks the script runs

Timing: torch by ``triton.testing.do_bench`` (CUDA events), ours and SDPA's backends in
interleaved rounds, ours over the best backend taken within a round (``event_rounds``). The
jax-vs-torch ratios come from wall clock over pipelined batches of calls, ours and cuDNN each
launched from torch and from jax, the four sampled in interleaved rounds and each ratio taken
within a round (``bench_side_by_side``). Timed seconds apart, one method's timings wandered by as
much as the differences in question. The forward from jax is also timed as one jitted program of a
batch's calls (``chained_program``: ``*_program``), which pays jax's dispatch once, as a call
inside a jitted training step does. Writes benchmarks/results/flash_attention-<gpu>.json and SVG
charts next to it.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

from benchmarks.common import (EVENT_ROUNDS, GpuLog, calls_per_batch, clock_ratio, device_name, event_rounds,
                               host_ms, interleaved, median_ratio, pin_configs, program_batch, spin_until_ready, spread,
                               try_time, value_and_pullback, wall_batch, write_bar_svg, write_json)
from triton_kernels.params import BwdParams, FwdParams

TOKENS = 16384
HIDDEN = 2048
# The grid (the defaults; scripts/flash_goals.py checks a run against it).
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
SEQS = (1024, 2048, 4096, 8192, 16384)
# Untimed calls before each CUDA-event sample, in ms. At the power cap (the long rows without a
# mask, H200) a sample 10 ms after the method before it still met that method's clock: one row's
# forward ratio moved 0.98-1.05 between repeats. After 200 ms each method runs at the clock of its
# own power draw and repeats agree within 2% (scripts/probe_bench_order.py, benchmarks/README.md).
EVENT_WARMUP_MS = 200
# SDPA's backends timed beside ours, and those of the seq-65,536 rows (--long): there the
# memory-efficient one, 3.5-4x slower than cuDNN in every row, took 4-6 s a sample (one 0.8 s
# call of do_bench's five to size a sample, and more); the two long rows' host costs, microseconds
# against calls of 30-240 ms, took 87 s more (session 59).
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
LONG_SDPA_BACKENDS = ("flash", "cudnn")
# Configs --sweep times for our kernels (tests/test_aot_flash_attention.py compiles them for sm_90).
SWEEP_FWD = [FwdParams(blocksize_m=bm, blocksize_n=bn, num_warps=w, num_stages=s)
             for bm, bn, w, s in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3),
                                  (64, 64, 4, 3), (128, 32, 8, 4), (64, 64, 4, 4))]
SWEEP_BWD = [BwdParams(blocksize_m=bm, blocksize_n=bn, num_warps=w, num_stages=s)
             for bm, bn, w, s in ((32, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 2),
                                  (64, 128, 8, 2), (64, 64, 8, 2), (32, 128, 8, 2))]


def flops(batch, heads, seq, head_dim, causal, phase) -> float:
    f = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return f * (3.5 if phase == "fwd+bwd" else 1.0)


# --------------------------------------------------------------------------------------------
# torch


def _sdpa(backend_name: str, causal: bool):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]

    def call(q, k, v):  # q/k/v [batch, heads, seq, dim]: SDPA's own layout
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def _torch_step(fn, q, k, v, dout):
    import torch

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


def bench_torch_impls(q, k, v, dout, causal, fwd_params=None, bwd_params=None,
                      sdpa=SDPA_BACKENDS, warmup_ms=EVENT_WARMUP_MS) -> tuple[dict, dict, dict, dict]:
    """Ours and SDPA's backends from torch, timed by CUDA events side by side (``event_rounds``,
    each sample after ``warmup_ms`` of untimed calls).
    Returns (median ms by "phase/method", errors, the rounds' samples, and the clocks each sample
    met: ``GpuLog.during``, empty dicts without nvidia-smi). The long calls without a mask run at
    the power cap, where the SM clock moves 1.5-1.9 GHz (H200): a ratio can come from the clock."""
    import ejkernel_torch

    ours = lambda a, b, c: ejkernel_torch.flash_attention(a, b, c, causal=causal, fwd_params=fwd_params,  # noqa: E731
                                                          bwd_params=bwd_params)
    impls = {"ours_torch": (ours, (q, k, v), dout)}
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)] if sdpa else []
    for name in sdpa:
        impls[f"sdpa_{name}"] = (_sdpa(name, causal), heads_first[:3], heads_first[3])
    errors, spans = {}, {}
    with GpuLog() as log:
        rounds = event_rounds({f"{phase}/{name}": _torch_call(fn, args, cot, phase)
                               for name, (fn, args, cot) in impls.items() for phase in ("fwd", "fwd+bwd")},
                              errors, spans=spans, warmup_ms=warmup_ms)
    clocks = {name: [log.during(*span) for span in spans.get(name, [])] for name in rounds}
    return {name: statistics.median(samples) for name, samples in rounds.items()}, errors, rounds, clocks


def _ours_and_cudnn(q, k, v, dout, causal) -> dict:
    """name -> (fn, args, cotangent) of ours and of SDPA's cuDNN backend, launched from torch."""
    import ejkernel_torch

    ours = lambda a, b, c: ejkernel_torch.flash_attention(a, b, c, causal=causal)  # noqa: E731
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    return {"ours_torch": (ours, (q, k, v), dout),
            "sdpa_cudnn": (_sdpa("cudnn", causal), heads_first[:3], heads_first[3])}


def _torch_call(fn, args, cot, phase: str):
    """One call of ``phase`` ("fwd" or "fwd+bwd") of a torch method."""
    return (lambda: fn(*args)) if phase == "fwd" else _torch_step(fn, *args, cot)


def host_costs(q, k, v, dout, causal, times: dict) -> dict:
    """Host milliseconds to issue one call (``benchmarks.common.host_ms``) of ours and of cuDNN
    from torch, and each over its CUDA-event time: near 1, the event time measured the host (the
    eager op's Python per call), not the kernels."""
    import torch

    entries = {}
    for name, (fn, args, cot) in _ours_and_cudnn(q, k, v, dout, causal).items():
        for phase in ("fwd", "fwd+bwd"):
            if f"{phase}/{name}" in times:
                host = host_ms(_torch_call(fn, args, cot, phase), torch.cuda.synchronize)
                entries[f"{phase}: {name} host ms"] = host
                entries[f"{phase}: {name} host / event time"] = host / times[f"{phase}/{name}"]
    return entries


# --------------------------------------------------------------------------------------------
# jax


def _jax_impls(causal) -> dict:
    import jax

    import ejkernel_jax

    return {"ours_jax": lambda a, b, c: ejkernel_jax.flash_attention(a, b, c, causal=causal),
            "jax_cudnn": lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal,
                                                                       implementation="cudnn")}


def chained_program(fn, calls: int):
    """One jitted program of ``calls`` forward calls of ``fn``, each call's output the next one's
    query (an output has the query's shape and dtype): the last output depends on every call, so
    XLA can neither merge nor drop one. Timed by ``program_batch``, it is the cost
    of a call inside a jitted step, without jax's dispatch of one program per call."""
    import jax

    def program(q, k, v):
        for _ in range(calls):
            q = fn(q, k, v)
        return q
    return jax.jit(program)


def _wall_timers(torch_fns: dict, jax_arrays, causal, phase, calls, errors, jax_wait) -> dict:
    """Wall-clock batch timers (``wall_batch``, ``calls`` calls a batch) of ours and cuDNN, each
    launched from torch (``torch_fns``: name -> (fn, args, cotangent)) and from jax (on
    ``jax_arrays``: q, k, v, dout), for one phase; for the forward also jax's ``calls`` calls in one
    program (``<name>_program``, ``chained_program``). A method that fails its first call is left
    out (``errors``). ``jax_wait`` waits for a jax batch's last output."""
    import jax
    import torch

    qj, kj, vj, doj = jax_arrays
    timers = {}
    for name, (fn, args, cot) in torch_fns.items():
        timers[name] = wall_batch(_torch_call(fn, args, cot, phase), lambda _: torch.cuda.synchronize(), calls)
    for name, fn in _jax_impls(causal).items():
        if phase == "fwd":
            jitted = jax.jit(fn)
            call = lambda jitted=jitted: jitted(qj, kj, vj)  # noqa: E731
        else:
            # The output and all three gradients leave the jitted step, as in a training step: XLA
            # drops whatever is not returned and not needed.
            step = jax.jit(lambda a, b, c, d, fn=fn: value_and_pullback(fn, (a, b, c), d))
            call = lambda step=step: step(qj, kj, vj, doj)  # noqa: E731
        timers[name] = wall_batch(call, jax_wait, calls)
        if phase == "fwd":
            program = chained_program(fn, calls)
            timers[f"{name}_program"] = program_batch(program, (qj, kj, vj), jax_wait, calls)
    working = {}
    for name, timer in timers.items():
        try_time({}, errors, f"{phase}/{name}", timer)  # compiles; records a failure
        if f"{phase}/{name}" not in errors:
            working[name] = timer
    return working


def bench_side_by_side(q, k, v, dout, arrays, dtype, causal, estimates: dict,
                       jax_wait=None) -> tuple[dict, dict, dict]:
    """Ours and cuDNN launched from torch and from jax, all four timed by wall clock in
    interleaved rounds (``interleaved``), so the jax-over-torch ratios compare like with like at
    the same moment; ``estimates`` (ms per call of ours from torch, by "phase/ours_torch") sizes
    the batches. Torch's batches end with ``torch.cuda.synchronize()``, which spins; jax's with
    ``jax_wait``, by default ``jax.block_until_ready``, whose thread sleeps (``spin_until_ready``
    polls instead: on an H200 it made jax's figures worse, see benchmarks/README.md). Returns
    (median ms per method, the ratios and batch sizes for the row, errors)."""
    import jax
    import jax.numpy as jnp

    jax_wait = jax_wait or jax.block_until_ready

    torch_fns = {f"{name}_wall": method for name, method in _ours_and_cudnn(q, k, v, dout, causal).items()}
    jax_arrays = [jnp.asarray(a).astype(dtype) for a in arrays]
    times, entries, errors = {}, {}, {}
    pairs = {"ours_jax time / ours_torch time": ("ours_jax", "ours_torch_wall"),
             "jax_cudnn time / sdpa_cudnn time": ("jax_cudnn", "sdpa_cudnn_wall"),
             "ours_jax vs jax_cudnn": ("jax_cudnn", "ours_jax"),
             "ours_jax_program time / ours_torch time": ("ours_jax_program", "ours_torch_wall"),
             "jax_cudnn_program time / sdpa_cudnn time": ("jax_cudnn_program", "sdpa_cudnn_wall")}
    for phase in ("fwd", "fwd+bwd"):
        calls = calls_per_batch(estimates.get(f"{phase}/ours_torch"))
        entries[f"{phase}: wall-clock calls a batch"] = calls
        samples = interleaved(_wall_timers(torch_fns, jax_arrays, causal, phase, calls, errors, jax_wait))
        times.update({f"{phase}/{name}": statistics.median(s) for name, s in samples.items()})
        for label, (num, den) in pairs.items():
            if num in samples and den in samples:
                entries[f"{phase}: {label}"] = median_ratio(samples, num, den)
    return times, entries, errors


# --------------------------------------------------------------------------------------------
# one shape


def _inputs(batch, seq, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, seq, heads, head_dim), dtype=np.float32) for _ in range(4)]


@contextlib.contextmanager
def _timed(seconds: dict, part: str):
    """Records the seconds the ``with`` block took under ``part``."""
    start = time.perf_counter()
    yield
    seconds[part] = time.perf_counter() - start


def run_shape(seq, head_dim, causal, dtype, sweep=False, batch=None, with_jax=True, jax_wait=None,
              warmup_ms=EVENT_WARMUP_MS, sdpa=SDPA_BACKENDS, with_host=True) -> dict:
    import torch

    batch = batch or max(1, TOKENS // seq)
    heads = HIDDEN // head_dim
    arrays = _inputs(batch, seq, heads, head_dim)
    q, k, v, dout = (torch.from_numpy(a).to("cuda", getattr(torch, dtype)) for a in arrays)
    seconds = {}  # where a row's device time goes: a whole run with jax takes most of a session's device time
    with _timed(seconds, "torch events"):
        times, errors, rounds, clocks = bench_torch_impls(q, k, v, dout, causal, sdpa=sdpa, warmup_ms=warmup_ms)
    side_ratios = {}
    if with_host:
        with _timed(seconds, "host costs"):
            side_ratios = host_costs(q, k, v, dout, causal, times)
    if with_jax:
        with _timed(seconds, "wall clock, with jax"):
            wall, ratios, wall_errors = bench_side_by_side(q, k, v, dout, arrays, dtype, causal, times, jax_wait)
        side_ratios.update(ratios)
        times.update(wall)
        errors.update(wall_errors)
    row = {"batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim, "causal": causal, "dtype": dtype,
           "seconds": seconds, "ms": times, "rounds_ms": rounds, "rounds_clocks": clocks, "errors": errors,
           "tflops": {n: flops(batch, heads, seq, head_dim, causal, n.split("/")[0]) / (ms * 1e-3) / 1e12
                      for n, ms in times.items()}}
    for phase in ("fwd", "fwd+bwd"):
        sdpa_ms = {f"sdpa_{n}": times[f"{phase}/sdpa_{n}"] for n in SDPA_BACKENDS if f"{phase}/sdpa_{n}" in times}
        if sdpa_ms and f"{phase}/ours_torch" in times:
            best = min(sdpa_ms, key=sdpa_ms.get)  # by its median; the ratio is taken within each round
            row[f"{phase}: ours_torch vs best sdpa"] = median_ratio(rounds, f"{phase}/{best}", f"{phase}/ours_torch")
            row[f"{phase}: best sdpa"] = best
            clock = clock_ratio(clocks, f"{phase}/ours_torch", f"{phase}/{best}")
            if clock is not None:  # > 1: ours met the higher SM clock
                row[f"{phase}: ours_torch clock / best sdpa clock"] = clock
    row.update(side_ratios)  # time ratios > 1: jax is slower; "vs" ratios > 1: ours is faster
    if sweep:
        row["sweep"] = sweep_configs(q, k, v, dout, causal)
    return row


def _label(p) -> str:
    return f"{p.blocksize_m}x{p.blocksize_n}-w{p.num_warps}-s{p.num_stages}"


def sweep_configs(q, k, v, dout, causal) -> dict:
    out = {"fwd": {}, "fwd+bwd": {}}
    for p in SWEEP_FWD:
        t, e, *_ = bench_torch_impls(q, k, v, dout, causal, fwd_params=p, sdpa=())
        out["fwd"][_label(p)] = t.get("fwd/ours_torch") or e.get("fwd/ours_torch")
    for p in SWEEP_BWD:
        t, e, *_ = bench_torch_impls(q, k, v, dout, causal, bwd_params=p, sdpa=())
        out["fwd+bwd"][_label(p)] = t.get("fwd+bwd/ours_torch") or e.get("fwd+bwd/ours_torch")
    return out


# --------------------------------------------------------------------------------------------
# eager per-call overhead


def measure_overhead(device: str) -> dict:
    """Per-call host cost on a tiny problem: the public op, the plan launched directly, and the
    bare Triton kernel call (the floor), each median microseconds over many calls."""
    import torch

    import ejkernel_torch
    from ejkernel_torch.launch import _scratch_allocator, device_facts, launch
    from triton_kernels.flash_attention import forward_plan
    from triton_kernels.flash_attention.spec import dense_spec

    q, k, v = (torch.randn(1, 128, 4, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    spec = dense_spec(tuple(q.shape), tuple(k.shape), tuple(v.shape), ("bfloat16",) * 3)
    plan = forward_plan(spec, device_facts(device))
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    inputs = (q, k, v, q.new_zeros(1), dummy, dummy, dummy, dummy, dummy)
    out, lse = torch.empty_like(q), torch.empty(spec.lse_shape, device=device)
    scalars = [value for _, value in plan.scalars]
    consts = dict(plan.constexprs)

    def bare():
        with _scratch_allocator():  # the Gluon kernels build TMA descriptors in global scratch
            plan.kernel[plan.grid](*inputs, *scalars, out, lse, **consts, **plan.compile_options)

    calls = {"op": lambda: ejkernel_torch.flash_attention(q, k, v),
             "launch(plan)": lambda: launch(plan, *inputs)}
    if device == "cuda":  # the interpreter has no bare launch
        calls["bare kernel[grid]"] = bare
    result = {}
    for name, fn in calls.items():
        for _ in range(20 if device == "cuda" else 1):
            fn()
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(200 if device == "cuda" else 3):
                fn()
            samples.append((time.perf_counter() - start) * 1e6 / (200 if device == "cuda" else 3))
        if device == "cuda":
            torch.cuda.synchronize()
        result[name] = statistics.median(samples)
    if "bare kernel[grid]" in result:
        result["op / bare"] = result["op"] / result["bare kernel[grid]"]
    return result


# --------------------------------------------------------------------------------------------
# output


def _svg_label(r: dict) -> str:
    return f'{r["dtype"][:4]} d{r["head_dim"]} s{r["seq"] // 1024}k{" causal" if r["causal"] else ""}'


def _versus(row: dict) -> str:
    """Ours over the best SDPA backend, each phase, and the SM clocks they met: the row's ratios."""
    parts = []
    for phase in ("fwd", "fwd+bwd"):
        if f"{phase}: ours_torch vs best sdpa" in row:
            part = f"{phase} vs {row[f'{phase}: best sdpa']} {row[f'{phase}: ours_torch vs best sdpa']:.3f}"
            clock = row.get(f"{phase}: ours_torch clock / best sdpa clock")
            parts.append(part + (f" (clock ratio {clock:.3f})" if clock is not None else ""))
    return ", ".join(parts)


def ratio_spreads(rows: list[dict]) -> dict:
    """Each ratio the rows report ("phase: ..." keys) -> its median, min and max over the rows."""
    ratios = {}
    for key in sorted({k for r in rows for k, v in r.items() if ": " in k and isinstance(v, float)}):
        values = [r[key] for r in rows if key in r]
        ratios[key] = spread(values)
    return ratios


def _failures(rows: list[dict]) -> dict:
    """The methods that failed, by row: such a row's ratios compare with the baselines that ran
    (its best SDPA backend is the best of those), which the run-level ``ratios`` do not show."""
    return {_svg_label(r): sorted(r["errors"]) for r in rows if r["errors"]}


def smoke() -> None:
    """Tiny CPU run through every code path of ours (the interpreter): checks the script."""
    import torch

    q, k, v, dout = (torch.from_numpy(a) for a in _inputs(1, 40, 2, 32))
    times, errors = {}, {}
    for causal in (False, True):
        import ejkernel_torch

        fn = lambda a, b, c: ejkernel_torch.flash_attention(a, b, c, causal=causal)  # noqa: E731
        start = time.perf_counter()
        _torch_step(fn, q, k, v, dout)()
        times[f"fwd+bwd causal={causal}"] = (time.perf_counter() - start) * 1e3
    print({"ms": times, "errors": errors, "overhead_us": measure_overhead("cpu")})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--head-dims", nargs="*", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--seqs", nargs="*", type=int, default=list(SEQS))
    parser.add_argument("--causal", nargs="*", default=["false", "true"], choices=["false", "true"])
    parser.add_argument("--sweep", action="store_true", help="also time SWEEP_FWD / SWEEP_BWD for ours")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--long", action="store_true", help="also run seq 65,536 (batch 1)")
    parser.add_argument("--overhead", action="store_true", help="eager per-call cost vs a direct launch")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script")
    parser.add_argument("--config-cache", default=None, help="tile config cache to use (default: none)")
    parser.add_argument("--autograd-threads", default="on", choices=["on", "off"],
                        help="off: run backward passes on the calling thread "
                             "(torch.autograd.set_multithreading_enabled(False)), for every torch method")
    parser.add_argument("--jax-wait", default="block", choices=["block", "spin"],
                        help="how a jax batch is waited for: block (jax.block_until_ready, the thread sleeps; "
                             "default) or spin (poll Array.is_ready, as torch.cuda.synchronize spins)")
    parser.add_argument("--warmup-ms", type=int, default=EVENT_WARMUP_MS,
                        help="untimed calls before each CUDA-event sample, in ms (sessions before 58 ran 10)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    configs = pin_configs(args.config_cache)
    if args.smoke:
        return smoke()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --smoke)")
    # A backward of CUDA tensors runs on autograd's device thread by default; handing it there and
    # back costs a host more than the backward's own Python on some machines (VMs).
    torch.autograd.set_multithreading_enabled(args.autograd_threads == "on")
    # first: a run cut short has them
    extras = {**configs, "event_warmup_ms": args.warmup_ms, "autograd_threads": args.autograd_threads,
              "jax_wait": args.jax_wait, **_extras(args)}
    rows = []
    jax_wait = spin_until_ready if args.jax_wait == "spin" else None  # None: jax.block_until_ready
    for dtype, d, seq, causal in itertools.product(args.dtypes, args.head_dims, args.seqs, args.causal):
        row = run_shape(seq, d, causal == "true", dtype, sweep=args.sweep, with_jax=not args.no_jax, jax_wait=jax_wait,
                        warmup_ms=args.warmup_ms)
        rows.append(row)
        t = row["tflops"]
        print(f"{dtype:9s} d{d:<4d} s{seq:<6d} {'causal' if causal == 'true' else 'full  '} "
              + " | ".join(f"{phase}: " + ", ".join(f"{n.split('/')[1]} {v:.0f}" for n, v in t.items()
                                                   if n.startswith(phase + "/"))
                           for phase in ("fwd", "fwd+bwd")), flush=True)
        print("    " + _versus(row), flush=True)
        print("    seconds: " + ", ".join(f"{part} {t:.1f}" for part, t in row["seconds"].items()), flush=True)
        for name, err in row["errors"].items():
            print(f"    {name}: {err}")
        if "sweep" in row:
            print("    sweep ms:", row["sweep"], flush=True)
        _write(args, rows, extras)  # after every shape: a run cut short keeps what it measured
    print("ratios:", ratio_spreads(rows))
    if _failures(rows):
        print("failed (those rows compare with the methods that ran):", _failures(rows))


def _extras(args) -> dict:
    extras = {}
    if args.long:
        long_rows = []
        for causal in (False, True):
            long_rows.append(run_shape(65536, 128, causal, args.dtypes[0], batch=1, with_jax=False,
                                       warmup_ms=args.warmup_ms, sdpa=LONG_SDPA_BACKENDS, with_host=False))
            print("seq 65536:", {n: round(v) for n, v in long_rows[-1]["tflops"].items()}, flush=True)
        extras["seq_65536"] = long_rows
    if args.overhead:
        extras["eager_overhead_us"] = measure_overhead("cuda")
        print("eager overhead (us):", extras["eager_overhead_us"], flush=True)
    return extras


def _write(args, rows: list[dict], extras: dict) -> None:
    import jax
    import torch

    payload = {"device": device_name(), "torch": torch.__version__, "jax": jax.__version__,
               "method": f"torch: triton.testing.do_bench (CUDA events, L2 flushed), the methods in {EVENT_ROUNDS} "
                         f"interleaved rounds of {200 // EVENT_ROUNDS} ms, each after {extras['event_warmup_ms']} "
                         "ms of untimed calls (event_warmup_ms), after one dropped round, reversed "
                         "(rounds_ms; rounds_clocks: the SM clock each sample met, by nvidia-smi), each one's ms the "
                         "median of its rounds, ours vs best sdpa the median over pairs of rounds (one of each order) of "
                         "the geometric mean of their two ratios; jax and "
                         "*_wall: median of pipelined batches of >= 25 ms (20-200 calls), jax's waited for as "
                         "jax_wait says (block: jax.block_until_ready; spin: polled), the wall-clock methods in 8 "
                         "interleaved rounds, jax/torch ratios paired as ours vs sdpa; *_program: a forward "
                         "batch as one jitted program of chained calls, in the same rounds; TFLOP/s on 4*B*H*S^2*D "
                         "(x0.5 causal, x3.5 fwd+bwd)",
               "ratios": ratio_spreads(rows), "failed": _failures(rows), "results": rows, **extras}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"flash_attention-{device_name()}.json")
    write_json(out, payload)
    for phase in ("fwd", "fwd+bwd"):
        write_bar_svg(out.removesuffix(".json") + f"-{phase.replace('+', '-')}.svg", rows, phase,
                      f"flash attention {phase}: TFLOP/s", _svg_label, skip=lambda m: m.endswith(("_wall", "_program")))


if __name__ == "__main__":
    main()
