"""Host time of the torch grouped matmul, layer by layer, and where a training step's GPU waits for it.

    PYTHONPATH=. python scripts/profile_gmm_host.py [--shape 64,32768,2048,1408] [--host-shape ...] [--cprofile] [--out PATH]

bf16, balanced routing, ``check_values=False`` (the benchmark's unchecked rows). Three parts:

* layers: median host time per call of each layer of the forward and backward path, beside a
  dense matmul's step, on a small problem (``--host-shape``): real launches of little GPU work,
  behind a sleep kernel, so that no launch waits and the host is what is timed;
* gaps: steps at ``--shape`` issued as ``benchmarks/grouped_matmul.py`` times them (do_bench: L2
  flush, step, no sync between steps), with a CUDA event just before and just after each of our
  launches: the GPU's idle time before each kernel, and the host time at which it was issued;
* with ``--cprofile``, a cProfile listing of 200 small steps.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import gmm_shape  # noqa: E402

CALLS = 200


def _median_us(fn, busy) -> float:
    samples = []
    for i in range(CALLS + 20):
        if i % 50 == 0:
            busy()  # keep the GPU ahead of the host: launches queue, never wait
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[20:]) * 1e6


def _layers(ops, launch, gm, lhs, rhs, sizes, cot, busy) -> dict:
    import torch

    offset = torch.zeros(1, dtype=torch.int32, device="cuda")
    plain = [t.detach() for t in (lhs, rhs)]
    problem = ops._gmm_problem(*plain, sizes, offset, False, torch.bfloat16)
    plan = gm.gmm_plan(*problem, launch.device_facts(lhs.device), None, batch=1, shared_rhs=True)
    launch.launch(plan, *plain, sizes, offset)
    key = launch._alignment_key(plan, (*plain, sizes, offset), launch._outputs(plan, plain, lhs.device))
    run = launch._compiled[key]
    out = torch.empty(plan.outputs[0].shape, dtype=torch.bfloat16, device="cuda")

    class Ctx:  # what autograd hands _gmm_backward
        saved_tensors = (*plain, sizes, offset)
        transpose_rhs = False
        needs_input_grad = (True, True, False, False, False, False, False)

    rows = {
        "public forward, no grad": lambda: ops.grouped_matmul(*plain, sizes, check_values=False),
        "public forward, requires grad": lambda: ops.grouped_matmul(lhs, rhs, sizes, check_values=False),
        "  _args": lambda: ops._args(gm.check_gmm, False, ops._gmm_groups_read, *plain, sizes, None, None, None,
                                     None, False),
        "  _gmm_body": lambda: ops._gmm_body(*plain, sizes, offset, False, torch.bfloat16, None),
        "    launch_traceable": lambda: launch.launch_traceable(plan, *plain, sizes, offset),
        "      compiled kernel's launcher": lambda: run(*plan.launch_args((*plain, sizes, offset), [out])),
        "      torch.empty of the output": lambda: torch.empty(plan.outputs[0].shape, dtype=torch.bfloat16,
                                                              device="cuda"),
        "_gmm_backward (both gradients)": lambda: ops._gmm_backward(Ctx(), cot),
        "step: forward + autograd.grad": lambda: torch.autograd.grad(
            ops.grouped_matmul(lhs, rhs, sizes, check_values=False), (lhs, rhs), cot),
        "dense step: a @ b + autograd.grad": lambda: torch.autograd.grad(lhs @ rhs[0], (lhs, rhs), cot),
    }
    return {name: _median_us(fn, busy) for name, fn in rows.items()}


def _gaps(launch, step, flush, reps: int = 30) -> list[list[dict]]:
    """``reps`` steps issued as triton.testing.do_bench issues them (L2 flush, start event, step, end
    event; no sync between reps, so the host may run ahead), with an event pair around each of our
    launches: per rep, each kernel's host issue time (from the rep's start), the GPU's idle time
    before it, and its run time; the rep's total is the "step" entry."""
    import torch

    marks = []
    original = launch._launch_compiled

    def recorded(plan, inputs, outputs):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks.append((plan.name, time.perf_counter(), before, after))
        before.record()
        original(plan, inputs, outputs)
        after.record()

    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    reps_marks = []
    launch._launch_compiled = recorded
    try:
        torch.cuda.synchronize()
        for _ in range(reps):
            marks.clear()
            flush.zero_()
            start, end = event(), event()
            host0 = time.perf_counter()
            start.record()
            step()
            end.record()
            reps_marks.append((host0, start, end, list(marks)))
        torch.cuda.synchronize()
    finally:
        launch._launch_compiled = original
    results = []
    for host0, start, end, marks in reps_marks:
        previous, row = start, []
        for name, host, before, after in marks:
            row.append({"kernel": name, "issued_us": (host - host0) * 1e6,
                        "idle_before_us": previous.elapsed_time(before) * 1e3,
                        "kernel_us": before.elapsed_time(after) * 1e3})
            previous = after
        row.append({"kernel": "step", "issued_us": 0.0, "idle_before_us": previous.elapsed_time(end) * 1e3,
                    "kernel_us": start.elapsed_time(end) * 1e3})
        results.append(row)
    return results


def _summary(steps: list[list[dict]]) -> dict:
    """Medians over the steps of each third of the run (sustained load slows the GPU's clocks):
    per kernel (and for the whole step), issue time, idle time before it, run time."""
    third = max(1, len(steps) // 3)
    parts = {f"steps {lo}-{min(lo + third, len(steps))}": steps[lo:lo + third] for lo in range(0, len(steps), third)}
    return {label: {row["kernel"] + (f" #{j}" if j < len(part[0]) - 1 else ""):
                    {key: statistics.median(step[j][key] for step in part)
                     for key in ("issued_us", "idle_before_us", "kernel_us")}
                    for j, row in enumerate(part[0])}
            for label, part in parts.items() if len(part) == third}


def _inputs(shape: tuple[int, int, int, int]):
    import numpy as np
    import torch

    from benchmarks.grouped_matmul import group_sizes

    g, m, k, n = shape
    sizes = torch.from_numpy(group_sizes(m, g, "balanced", np.random.default_rng(0))).cuda()
    lhs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rhs = torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return lhs, rhs, sizes, cot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=gmm_shape, default=(64, 32768, 2048, 1408),
                        help="experts,tokens,k,n of the timed steps")
    parser.add_argument("--host-shape", type=gmm_shape, default=(64, 4096, 256, 256),
                        help="experts,tokens,k,n of the layer timings: small, so that the host is what is timed")
    parser.add_argument("--reps", type=int, default=30, help="timed steps at --shape")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from ejkernel_torch import launch
    from triton_kernels import grouped_matmul as gm

    ops = importlib.import_module("ejkernel_torch.ops.grouped_matmul")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def stepper(lhs, rhs, sizes, cot):
        return lambda: torch.autograd.grad(ops.grouped_matmul(lhs, rhs, sizes, check_values=False), (lhs, rhs), cot)

    def busy():
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time

    small = _inputs(args.host_shape)
    stepper(*small)()
    torch.cuda.synchronize()
    layers = _layers(ops, launch, gm, *small, busy)
    torch.cuda.synchronize()
    for name, us in layers.items():
        print(f"{name:40s} {us:8.1f} us", flush=True)
    step = stepper(*_inputs(args.shape))
    step()
    gaps = _gaps(launch, step, flush, args.reps)
    summary = _summary(gaps[5:])  # the first steps warm up
    for part, kernels in summary.items():
        print(part, " | ".join(f"{name}: issued {r['issued_us']:.0f}, idle {r['idle_before_us']:.1f}, "
                               f"ran {r['kernel_us']:.1f}" for name, r in kernels.items()), flush=True)
    if args.cprofile:
        busy()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            stepper(*small)()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(35)
        print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "command": "python scripts/profile_gmm_host.py " + " ".join(sys.argv[1:]),
                       "shape": args.shape, "host_shape": args.host_shape, "host_us": layers, "summary": summary, "steps": gaps},
                      f, indent=1)


if __name__ == "__main__":
    main()
