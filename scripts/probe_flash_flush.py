"""Why the causal seq-1024 forward reads below cuDNN in the benchmark: the kernel on a cold L2,
a host that had not issued it when the flush ended, or the GPU's clocks.

``triton.testing.do_bench`` (the benchmark's event timer) runs, per call: an L2 flush (a 256 MB
zero fill), a start event, the call, an end event. If the host needed longer to issue the call
than the GPU the flush, the GPU would idle after the start event, and the idle time would count
as the call's. This probe times ours and SDPA's cuDNN backend from torch, in turn, round after
round (CUDA events around each call, median of ``--calls``):

- ``flush``: do_bench's order; ``flush_us`` and ``host_us``: the flush's own time, and the host
  time from the start event's record to the call's return;
- ``flush+sleep``: a GPU spin of ``--sleep-us`` after the flush, so the call is queued before
  the start event fires (cold L2, the host hidden);
- ``warm+sleep``: the spin without the flush (warm L2, the host hidden);
- ``do_bench``: the benchmark's own timer (one 40 ms ``do_bench``), and with ``--backward``
  ``do_bench fwd+bwd``: each front's training step, as the benchmark puts it between forwards;
and profiles the ``flush+sleep`` calls to split a call's time into its kernels. Every sample
carries the SM clock, power, temperature and clock-event reasons ``nvidia-smi`` logged while it
ran (``benchmarks.common.GpuLog``).

    python scripts/probe_flash_flush.py [--shapes 1024:64:causal 1024:128:causal] [--backward]
        [--dtype bfloat16] [--calls 100] [--rounds 7] [--sleep-us 500] [--out FILE]

Shapes are the benchmark's (batch x seq = 16k tokens, heads = 2048 / head_dim).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import GpuLog, flash_shape, profiled_kernels  # noqa: E402

SPIN = "spin"  # torch.cuda._sleep's kernel name contains it


def flush_buffer():
    """The buffer do_bench zero-fills between calls (Triton's own where it exposes one)."""
    import torch
    import triton

    driver = triton.runtime.driver.active
    if hasattr(driver, "get_empty_cache_for_benchmark"):
        return driver.get_empty_cache_for_benchmark()
    return torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")


def spin_cycles(sleep_us: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``sleep_us`` microseconds."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return int(cycles * sleep_us / (start.elapsed_time(end) * 1e3))


def timed_calls(fn, calls: int, cache, cycles: int, flush: bool, sleep: bool) -> dict:
    """Median event microseconds of ``calls`` calls of ``fn``, each after the flush and/or the
    spin; with the flush, also its own median time, and the host's issue time of a call."""
    import torch

    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(calls)]
    host = []
    torch.cuda.synchronize()
    for before, start, end in events:
        before.record()
        if flush:
            cache.zero_()
        if sleep:
            torch.cuda._sleep(cycles)
        start.record()
        issued = time.perf_counter()
        fn()
        host.append(time.perf_counter() - issued)
        end.record()
    torch.cuda.synchronize()
    result = {"call_us": statistics.median(s.elapsed_time(e) * 1e3 for _, s, e in events)}
    if flush and not sleep:
        result["flush_us"] = statistics.median(b.elapsed_time(s) * 1e3 for b, s, _ in events)
        result["host_us"] = statistics.median(host) * 1e6
    return result


def kernels_after_the_spin(fn, calls: int, cache, cycles: int) -> dict[str, float]:
    """Mean microseconds of each kernel a call runs after flush + spin, and the idle time
    between the spin's end and the call's last kernel's end beyond those kernels."""
    def call():
        cache.zero_()
        torch.cuda._sleep(cycles)
        fn()

    import torch

    kernels = profiled_kernels(call, calls)
    spins = [i for i, e in enumerate(kernels) if SPIN in e.name]
    ends = spins[1:] + [len(kernels) + 1]
    durations: dict[str, list[float]] = {}
    idle = []
    for spin, next_spin in zip(spins, ends):
        mine = kernels[spin + 1:next_spin - 1]  # the next call's flush is just before its spin
        for e in mine:
            durations.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
        span = mine[-1].time_range.end - kernels[spin].time_range.end
        idle.append(span - sum(e.time_range.elapsed_us() for e in mine))
    result = {name: round(statistics.mean(d), 2) for name, d in durations.items()}
    result["idle between them"] = round(statistics.mean(idle), 2)
    return result


def row(seq: int, head_dim: int, causal: bool, dtype: str, calls: int, rounds: int, sleep_us: float,
        backward: bool, log) -> dict:
    import torch

    from benchmarks.common import EVENT_ROUNDS, bench_torch
    from benchmarks.flash_attention import HIDDEN, TOKENS, _inputs, _ours_and_cudnn, _torch_step

    batch, heads = max(1, TOKENS // seq), HIDDEN // head_dim
    arrays = _inputs(batch, seq, heads, head_dim)
    q, k, v, dout = (torch.from_numpy(a).to("cuda", getattr(torch, dtype)) for a in arrays)
    # (fn, args, cotangent) of each, as the benchmark calls them
    fronts = dict(zip(("ours", "cudnn"), _ours_and_cudnn(q, k, v, dout, causal).values()))
    cache, cycles = flush_buffer(), spin_cycles(sleep_us)
    # way -> front -> a sample (a dict with "call_us"); do_bench as the benchmark calls it.
    ways = {way: (lambda fn, args, _, flags=flags: timed_calls(lambda: fn(*args), calls, cache, cycles, *flags))
            for way, flags in {"flush": (True, False), "flush+sleep": (True, True),
                               "warm+sleep": (False, True)}.items()}
    rep_ms = 200 // EVENT_ROUNDS  # a round of the benchmark's event timing
    ways["do_bench"] = lambda fn, args, _: {"call_us": 1e3 * bench_torch(lambda: fn(*args), 10, rep_ms)}
    if backward:
        ways["do_bench fwd+bwd"] = lambda fn, args, cot: {
            "call_us": 1e3 * bench_torch(_torch_step(fn, *args, cot), 10, rep_ms)}
    for fn, args, cot in fronts.values():
        for way in ways.values():
            way(fn, args, cot)  # compile and warm up
    samples = {(f, w): [] for f in fronts for w in ways}
    for r in range(rounds):  # in turn, the order reversed every other round
        order = [(f, w) for w in ways for f in fronts]
        for front, way in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            sample = ways[way](*fronts[front])
            sample.update(log.during(start, time.perf_counter()))
            samples[front, way].append(sample)
    result = {"seq": seq, "head_dim": head_dim, "causal": causal, "dtype": dtype, "batch": batch, "heads": heads}
    for front, (fn, args, _) in fronts.items():
        result[front] = {}
        for way in ways:
            runs = samples[front, way]
            for key in ("call_us", "flush_us", "host_us"):
                if key in runs[0]:
                    name = way if key == "call_us" else f"{way}: {key}" if way != "flush" else key
                    result[front][name] = round(statistics.median(run[key] for run in runs), 2)
            result[front][f"{way}: rounds"] = [{k: round(v, 2) if isinstance(v, float) else v for k, v in run.items()}
                                               for run in runs]
        result[front]["kernels after flush+sleep"] = kernels_after_the_spin(lambda: fn(*args), calls, cache, cycles)
    for way in ways:
        ratios = [a["call_us"] / b["call_us"] for a, b in zip(samples["ours", way], samples["cudnn", way])]
        result[f"{way}: ours / cudnn"] = round(statistics.median(ratios), 4)
        result[f"{way}: ours / cudnn by round"] = [round(x, 4) for x in ratios]
    return result


def summary(result: dict) -> dict:
    """A row without its per-round samples (the printed line)."""
    return {k: ({n: x for n, x in v.items() if not n.endswith("rounds")} if isinstance(v, dict) else v)
            for k, v in result.items() if not k.endswith("by round")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=flash_shape,
                        default=[flash_shape(s) for s in ("1024:64:causal", "1024:128:causal", "1024:64:full")],
                        help="seq:head_dim:causal|full")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--calls", type=int, default=100, help="timed calls a round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every front and way, in turn")
    parser.add_argument("--sleep-us", type=float, default=500.0, help="GPU spin before the start event")
    parser.add_argument("--backward", action="store_true",
                        help="also time each front's forward + backward step (do_bench), in the same rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from scripts.probe_flash_gaps import plain_eager_under_the_profiler

    plain_eager_under_the_profiler()  # the profiled calls take the path unprofiled calls take
    rows = []
    with GpuLog() as log:
        for seq, head_dim, causal in args.shapes:
            rows.append(row(seq, head_dim, causal, args.dtype, args.calls, args.rounds, args.sleep_us, args.backward,
                            log))
            print(json.dumps(summary(rows[-1])), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows, dtype=args.dtype, calls=args.calls, rounds=args.rounds, sleep_us=args.sleep_us)


if __name__ == "__main__":
    main()
