"""Timing helpers shared by the benchmarks (GPU: device events for torch, pipelined wall clock
for jax, whose work runs on its own stream, and for side-by-side comparisons of the two)."""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time


def bench_torch(fn, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds per call, CUDA events around each call, L2 flushed between calls."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def host_ms(fn, sync, calls: int = 20, repeats: int = 5) -> float:
    """Median milliseconds of host time to issue one call of ``fn``: ``calls`` calls issued with
    the device idle at the start and not waited for, ``sync`` after. A method whose host time
    is about its CUDA-event time or more is host-bound: its event time measures the host. An
    upper bound: on an H100 host cuDNN's forward took 0.25 ms here and 0.17 ms a call back to
    back in batches of 126, its kernel included (the first calls after a sync cost more)."""
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    sync()
    return statistics.median(samples)


def wall_batch(fn, wait, calls: int):
    """A timer of one batch: ``calls`` back-to-back calls of ``fn``, then ``wait(last output)``;
    returns milliseconds per call. Back to back, so a launch's host cost hides behind the work
    queued before it, as in a training loop."""
    def sample() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        wait(out)
        return (time.perf_counter() - start) * 1e3 / calls
    return sample


def program_batch(program, args, wait, calls: int):
    """A timer of one jitted ``program`` that makes ``calls`` calls inside itself, run once and
    waited for; returns milliseconds per call. Jax pays its dispatch and its wait once a program,
    so this is the cost of a call within a jitted step (``wall_batch`` pays dispatch per call)."""
    def sample() -> float:
        start = time.perf_counter()
        wait(program(*args))
        return (time.perf_counter() - start) * 1e3 / calls
    return sample


def interleaved(timers: dict, rounds: int = 8, warmup: int = 1) -> dict[str, list[float]]:
    """``rounds`` samples of each timer (``wall_batch``), taken in turn round after round, the
    order reversed every other round, after ``warmup`` unrecorded rounds. Timed seconds apart, one
    method's timings wandered on the H100s here by as much as the differences we look for, so
    methods compared are sampled side by side, and their ratio taken within a pair of rounds, one
    of each order (``median_ratio``: ``rounds`` even). The warm-up rounds keep the alternation
    (the one just before the first recorded round is reversed), so every recorded round follows
    what the same round of the pattern follows: at the power cap a sample's clock depends on the
    method run just before it (``event_rounds``)."""
    names = list(timers)
    for r in range(-warmup, 0):
        for name in _round_order(names, r):
            timers[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in _round_order(names, r):
            samples[name].append(timers[name]())
    return samples


def _round_order(names: list, r: int) -> list:
    """The methods in round ``r``'s order: as given in even rounds, reversed in odd ones."""
    return names if r % 2 == 0 else names[::-1]


# Rounds of CUDA-event timing (``event_rounds``): a method's figure is the median of its rounds,
# a ratio the median of three pairs of rounds (``median_ratio``).
EVENT_ROUNDS = 6


def event_rounds(calls: dict, errors: dict, rounds: int = EVENT_ROUNDS, timer=None,
                 spans: dict | None = None, warmup_ms: int = 10) -> dict[str, list[float]]:
    """``rounds`` samples of each of ``calls`` (name -> call without arguments), taken in turn
    (``interleaved``), each sample ``timer(call)``: by default a ``do_bench`` of 200 / ``rounds`` ms
    after ``warmup_ms`` of untimed calls, so a method gets the time one 200 ms ``do_bench`` gave it.
    Timed one after another, a 10 ms training step read 0.92-1.00x its baseline in three runs of one
    H200 start, depending on what ran before it; within a round the two meet the same clock. Each
    call runs once first (it compiles); one that fails is recorded in ``errors`` (by name) and left
    out. Then one whole round is sampled and dropped, in reversed order (``interleaved``'s warm-up),
    so that the first kept round's first method (ours' forward) follows itself, as in every later
    even round. At the power cap the clock a sample meets depends on what ran before it: with no
    dropped round, or one in the first round's order, that method followed SDPA's slow, cool
    memory-efficient backend and met the full clock, and the median row's first round read ours'
    forward 1-5% (session 56) and 4% (session 57, H200) faster against cuDNN than its later rounds
    did. Given a dict ``spans``, each kept sample's start and end (``time.perf_counter()``) are
    listed there under its name, round by round, so that a ``GpuLog`` can tell the clocks each
    sample met."""
    timer = timer or (lambda call: bench_torch(call, warmup_ms=warmup_ms, rep_ms=200 // rounds))
    timers = {}
    for name, call in calls.items():
        try_time({}, errors, name, call)
        if name not in errors:
            timers[name] = functools.partial(timer, call)
            if spans is not None:
                timers[name] = _stamped(timers[name], spans.setdefault(name, []))
    samples = interleaved(timers, rounds=rounds, warmup=1)
    if spans is not None:
        for name in timers:
            del spans[name][:-rounds]  # the dropped round's
    return samples


def _stamped(sample, spans: list):
    """``sample`` that also appends the ``time.perf_counter()`` readings around it to ``spans``."""
    def run():
        start = time.perf_counter()
        value = sample()
        spans.append((start, time.perf_counter()))
        return value
    return run


def clock_ratio(clocks: dict[str, list[dict]], numerator: str, denominator: str) -> float | None:
    """One method's SM clock over another's (``GpuLog.during`` of each sample, ``event_rounds``'s
    ``spans``), the median over pairs of rounds as ``median_ratio`` takes it; None where a round of
    either has no clock sample."""
    rounds = list(zip(clocks.get(numerator, []), clocks.get(denominator, [])))
    if not rounds or any("sm_mhz" not in a or "sm_mhz" not in b for a, b in rounds):
        return None
    return paired_median([a["sm_mhz"] / b["sm_mhz"] for a, b in rounds])


def median_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """One method's time over another's (``interleaved``): the ratio within each round, the
    geometric mean of each pair of rounds (one in each order), the median of the pairs."""
    return paired_median([a / b for a, b in zip(samples[numerator], samples[denominator])])


def spread(values: list[float]) -> dict | None:
    """Median, min and max of ``values``; None when there are none."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def paired_median(per_round: list[float]) -> float:
    """The median over pairs of rounds (0 and 1, 2 and 3, ...: ``interleaved``'s two orders) of
    the geometric mean of a pair's two values. The order moved ours vs cuDNN by up to 13% on an
    H200 at the power cap, even after 200 ms of warm-up a sample (session 59: one row's five
    rounds read 0.94, 1.07, 0.95, 1.03, 0.96), so a median over single rounds, odd in number,
    took the order that had more rounds; a pair holds one of each."""
    if not per_round or len(per_round) % 2:
        raise ValueError(f"per_round must hold an even, nonzero number of rounds (pairs of orders), "
                         f"got {len(per_round)}")
    return statistics.median(math.sqrt(per_round[i] * per_round[i + 1]) for i in range(0, len(per_round), 2))


# Wall-clock batches last at least this long: a batch's start and its final wait cost a fixed
# few hundred microseconds, more from jax than from torch, which 20 calls of a 0.2 ms kernel do
# not amortise (H100, seq 1024: jax over torch 1.05-1.11 with 20 calls, 1.03-1.04 with 100;
# probe_jax_wall_batches-nvidia-h100-80gb-hbm3.json).
BATCH_MS = 25.0


def calls_per_batch(ms_per_call: float | None) -> int:
    """Calls in a ``wall_batch`` of at least ``BATCH_MS`` (20 to 200; 20 without an estimate)."""
    return 20 if not ms_per_call else min(200, max(20, int(BATCH_MS / ms_per_call) + 1))


def spin_until_ready(tree):
    """Wait for every jax array in ``tree`` by polling it (``Array.is_ready``), as
    ``torch.cuda.synchronize()`` spins (CUDA's default schedule with fewer contexts than cores)
    where ``jax.block_until_ready`` puts the thread to sleep. Tried as the flash benchmark's jax
    wait (``--jax-wait spin``): on an H200 it cut jax's cost per batch at seq 1024 but made its
    seq-16384 figures 4-7% worse, so blocking stays the default (benchmarks/README.md)."""
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        while not leaf.is_ready():
            pass
    return tree


def bench_jax(fn, *args, calls: int = 50, repeats: int = 9) -> float:
    """Median milliseconds per call over ``repeats`` batches of ``calls`` back-to-back calls
    (``fn`` may return a pytree: every leaf is waited for; the first call compiles)."""
    import jax

    samples = interleaved({"fn": wall_batch(lambda: fn(*args), jax.block_until_ready, calls)}, rounds=repeats)
    return statistics.median(samples["fn"])


def bench_torch_wall(fn, calls: int = 20, repeats: int = 7) -> float:
    """Median milliseconds per call over pipelined batches, as ``bench_jax`` times jax."""
    import torch

    samples = interleaved({"fn": wall_batch(fn, lambda _: torch.cuda.synchronize(), calls)}, rounds=repeats)
    return statistics.median(samples["fn"])


def pin_configs(cache_path: str | None) -> dict:
    """Make a run's tiles known: autotuning off, and the config cache at ``cache_path`` (default:
    a new empty file, so every launch uses its plan's heuristic). Without this a run read the
    user's cache (and ``EJKERNEL_AUTOTUNE``), and its JSON could not say which tiles ran.
    Returns what the JSON records."""
    os.environ["EJKERNEL_AUTOTUNE"] = "0"
    given = cache_path is not None
    if not given:
        cache_path = os.path.join(tempfile.mkdtemp(prefix="ejkernel-bench-"), "configs.json")
    os.environ["EJKERNEL_CONFIG_CACHE"] = cache_path
    return {"configs": {"autotune": False,
                        "config_cache": cache_path if given else "none: the plans' heuristic tiles"}}


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name().replace(" ", "-").lower()
    except ImportError:
        pass
    return "cpu-" + platform.machine()


def copy_bandwidth_gbs(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), torch on CUDA."""
    import torch

    src = torch.randn(n_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_torch(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def write_run(path: str, rows: list, **extra) -> None:
    """A probe script's results at ``path``: the GPU, the command that ran (this script and its
    arguments), ``extra`` and the rows."""
    import torch

    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(os.path.dirname(__file__)))
    payload = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else device_name(),
               "torch": torch.__version__, "command": " ".join(["python", script, *sys.argv[1:]]), **extra,
               "rows": rows}
    write_json(path, payload)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def try_time(times: dict, errors: dict, name: str, timer) -> None:
    """``times[name] = timer()``; a method missing on this torch/jax/GPU is recorded in
    ``errors`` (first line of its message), not fatal."""
    try:
        times[name] = timer()
    except Exception as e:
        errors[name] = error_text(e)


def error_text(e: Exception) -> str:
    """A failure as a result: the exception's type and the first line of its message."""
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def value_and_pullback(fn, primals, cotangent):
    """A training step's worth of work: the output and the gradients. Return both from a jitted
    step, or XLA drops whatever the gradients alone do not need (a grouped matmul's forward)."""
    import jax

    out, pullback = jax.vjp(fn, *primals)
    return out, pullback(cotangent)


def write_bar_svg(path: str, rows: list[dict], phase: str, title: str, label, skip=lambda method: False) -> None:
    """Grouped bars of ``row["tflops"]["<phase>/<method>"]`` per row (no plotting library
    needed); ``label(row)`` names a group, ``skip(method)`` leaves a method out."""
    methods = sorted({k.split("/", 1)[1] for r in rows for k in r["tflops"]
                      if k.startswith(phase + "/") and not skip(k.split("/", 1)[1])})
    if not rows or not methods:
        return
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    top = max(r["tflops"].get(f"{phase}/{m}", 0) for r in rows for m in methods) or 1.0
    bar, gap, height, left, legend = 9, 20, 300, 55, 200
    width = left + len(rows) * (len(methods) * bar + gap) + legend
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 150}" font-size="11" '
           'font-family="sans-serif">', f'<text x="{left}" y="16">{title}</text>']
    for t in range(5):
        y = 30 + height - height * t / 4
        out.append(f'<text x="4" y="{y + 4:.0f}">{top * t / 4:.0f}</text>'
                   f'<line x1="{left - 4}" x2="{width - legend}" y1="{y:.0f}" y2="{y:.0f}" stroke="#ddd"/>')
    for i, r in enumerate(rows):
        x0 = left + i * (len(methods) * bar + gap)
        for j, m in enumerate(methods):
            val = r["tflops"].get(f"{phase}/{m}", 0)
            h = height * val / top
            out.append(f'<rect x="{x0 + j * bar}" y="{30 + height - h:.1f}" width="{bar - 1}" height="{h:.1f}" '
                       f'fill="{colors[j % len(colors)]}"><title>{m}: {val:.1f}</title></rect>')
        out.append(f'<text transform="translate({x0 + 2},{height + 40}) rotate(60)">{label(r)}</text>')
    for j, m in enumerate(methods):
        y = 40 + 16 * j
        out.append(f'<rect x="{width - legend + 10}" y="{y - 9}" width="10" height="10" '
                   f'fill="{colors[j % len(colors)]}"/><text x="{width - legend + 25}" y="{y}">{m}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {path}")


# -- kernel-variant probes (scripts/probe_gluon_*_variants.py) ------------------------------------

VARIANT_HEAD_DIMS, VARIANT_SEQS = (128, 64), (1024, 2048, 4096)


def variant_timed_shapes(head_dims=VARIANT_HEAD_DIMS, seqs=VARIANT_SEQS, causal=(True, False)) -> list[tuple]:
    """(batch, seq, seq, heads, head_dim, causal) of the flash benchmark's shapes: 16k tokens,
    2048 / head_dim heads."""
    return [(16384 // s, s, s, 2048 // d, d, c) for d in head_dims for s in seqs for c in causal]


def load_kernel_copy(path: str, prefix: str, rewrite=lambda source: source):
    """(name, module) of a kernel file kept anywhere, loaded from a copy of its source after
    ``rewrite``; the file's stem names it."""
    import importlib.util

    name = os.path.splitext(os.path.basename(path))[0]
    with open(path) as f:
        source = rewrite(f.read())
    copy = os.path.join(tempfile.mkdtemp(prefix=f"{prefix}_"), f"{name}.py")
    with open(copy, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Gluon reads a kernel's source through its module
    spec.loader.exec_module(module)
    return name, module


def time_beside_plan(runs: dict, sync) -> dict[str, tuple[float, float]]:
    """{name: (median ms a call, the plan's time over this one)} for ``runs`` (name -> a call;
    one named "plan"), timed by wall clock side by side (``interleaved``) in batches sized from the
    plan's time: the variants' differences are a few percent, as large as one kernel's drift
    between timings taken seconds apart."""
    calls = calls_per_batch(min(wall_batch(runs["plan"], sync, 20)() for _ in range(3)))
    samples = interleaved({name: wall_batch(fn, sync, calls) for name, fn in runs.items()})
    return {name: (statistics.median(samples[name]), median_ratio(samples, "plan", name)) for name in runs}


def variant_probe_main(description: str, kernel_file: str, checks: list[tuple], load, row) -> None:
    """A variant probe's command line and run: ``load(path)`` gives (name, module) of each
    variant file; ``row(shape, causal, variants, timed)`` checks (and with ``timed``, times) the
    plan's kernels ("plan") and the variants at one shape. Rows: ``checks``, then the benchmark's
    shapes (``variant_timed_shapes``) unless ``--no-time``."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help=f"kernel files (copies of {kernel_file} with a change)")
    parser.add_argument("--no-time", action="store_true", help="only the correctness checks")
    parser.add_argument("--head-dims", nargs="*", type=int, default=list(VARIANT_HEAD_DIMS))
    parser.add_argument("--seqs", nargs="*", type=int, default=list(VARIANT_SEQS))
    parser.add_argument("--causal", nargs="*", default=["true", "false"], choices=["true", "false"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    variants = {"plan": None} | dict(load(p) for p in args.variants)
    runs = [(shape, False) for shape in checks]
    if not args.no_time:
        runs += [(shape, True) for shape in
                 variant_timed_shapes(args.head_dims, args.seqs, tuple(c == "true" for c in args.causal))]
    rows = []
    for shape, timed in runs:
        rows.append(row(shape[:5], shape[5], variants, timed))  # which prints it
        # The file after each row: a variant that hangs the GPU leaves the rows before it (the
        # run is killed by a timeout, not by Python).
        if args.out:
            write_run(args.out, rows, triton=triton.__version__)


def gmm_shape(text: str) -> tuple[int, int, int, int]:
    """argparse type of a grouped-matmul shape ``experts,tokens,k,n``."""
    values = tuple(int(x) for x in text.split(","))
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"expected experts,tokens,k,n, got {text!r}")
    return values


def flash_dims(seq: int, head_dim: int) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim) of the flash benchmark's shape at ``seq`` and ``head_dim``:
    batch x seq = 16k tokens, heads = 2048 / head_dim."""
    return 16384 // seq, seq, 2048 // head_dim, head_dim


def flash_shape(text: str) -> tuple[int, int, bool]:
    """argparse type of a flash-attention shape ``SEQ:HEAD_DIM:full|causal`` (the benchmark's
    batch x seq = 16k tokens and heads = 2048 / head_dim go with it)."""
    seq, head_dim, mask = text.split(":")
    if mask not in ("full", "causal"):
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected SEQ:HEAD_DIM:full|causal")
    return int(seq), int(head_dim), mask == "causal"


def profiled_kernels(fn, calls: int, wait=lambda out: None) -> list:
    """The CUDA kernels (torch profiler events, CUPTI: jax's launches too) of ``calls``
    back-to-back calls of ``fn``, then ``wait(last output)``, in order of their start."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            out = fn()
        wait(out)
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


class GpuLog:
    """The GPU's SM clock (MHz), power (W), temperature (C) and clock-event reasons (a bit mask:
    power cap, thermal slowdown, ...), sampled every ``interval_ms`` by ``nvidia-smi`` in the
    background and stamped with ``time.perf_counter()``, so a timed interval can be told what the
    clocks did meanwhile (``during``). A context manager; without nvidia-smi it logs nothing."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

    def __init__(self, index: int = 0, interval_ms: int = 20):
        self.command = ["nvidia-smi", "-i", str(index), "--format=csv,noheader,nounits", "-lms", str(interval_ms),
                        "--query-gpu=" + ",".join(self.FIELDS)]
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self.process = None

    def __enter__(self):
        import shutil
        import subprocess
        import threading

        if shutil.which("nvidia-smi"):
            probe = subprocess.run(["nvidia-smi", "--query-gpu=" + self.FIELDS[-1], "--format=csv"],
                                   capture_output=True)
            if probe.returncode != 0:  # drivers before 535 name the field clocks_throttle_reasons
                self.command[-1] = self.command[-1].replace("clocks_event_reasons", "clocks_throttle_reasons")
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                            text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            self.samples.append((time.perf_counter(), tuple(f.strip() for f in line.split(","))))

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()

    def during(self, start: float, end: float) -> dict:
        """Mean SM clock and power, the highest temperature and every clock-event reason seen
        between two ``time.perf_counter()`` readings (empty without samples there)."""
        inside = [fields for t, fields in self.samples if start <= t <= end]
        numbers = [(float(c), float(p), float(t), int(r, 16)) for c, p, t, r in
                   (f for f in inside if len(f) == 4) if _numeric(c, p, t) and r.startswith("0x")]
        if not numbers:
            return {}
        reasons = 0
        for *_, r in numbers:
            reasons |= r
        return {"sm_mhz": round(statistics.mean(n[0] for n in numbers)), "power_w": round(statistics.mean(
            n[1] for n in numbers), 1), "max_temp_c": max(n[2] for n in numbers), "reasons": hex(reasons),
            "samples": len(numbers)}


def _numeric(*texts: str) -> bool:
    try:
        for t in texts:
            float(t)
    except ValueError:
        return False
    return True
