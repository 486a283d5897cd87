"""What the torch grouped matmul's value checks cost an MoE layer, and what reading once saves.

    PYTHONPATH=. python scripts/probe_moe_value_checks.py [--shapes 64,32768,2048,1408 ...] [--out PATH]

An MoE MLP on one router's counts: ``gate = gmm(x, w_gate)``, ``up = gmm(x, w_up)``,
``y = gmm(silu(gate) * up, w_down)`` (experts, tokens, hidden, ffn per ``--shapes``; bf16,
balanced routing). Three ways to call it, timed by wall clock over back-to-back steps in
interleaved rounds (``benchmarks.common.interleaved``), forward and forward + backward:

* ``unchecked``: ``check_values=False``, no host sync;
* ``checked, one tensor``: the default checks on one fresh counts tensor a step, shared by the
  three calls: read by the first (one sync), remembered by the other two;
* ``checked, a tensor a call``: a fresh counts tensor for each call, three syncs a step, as the
  three calls cost before values read were remembered.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import (calls_per_batch, device_name, gmm_shape, interleaved, median_ratio,  # noqa: E402
                               wall_batch, write_run)

VARIANTS = ("unchecked", "checked, one tensor", "checked, a tensor a call")


def _layer(sizes, weights, variant: str):
    """The MoE MLP's forward on ``x`` as ``variant`` calls it (``sizes``: the step's counts)."""
    import torch

    import ejkernel_torch

    w_gate, w_up, w_down = weights

    def gmm(a, w, counts):
        return ejkernel_torch.grouped_matmul(a, w, counts, check_values=variant != "unchecked")

    def forward(x):
        if variant == "checked, a tensor a call":
            counts = [sizes.clone() for _ in range(3)]
        else:
            counts = [sizes.clone()] * 3  # one fresh tensor a step, as a router's bincount gives
        hidden = torch.nn.functional.silu(gmm(x, w_gate, counts[0])) * gmm(x, w_up, counts[1])
        return gmm(hidden, w_down, counts[2])
    return forward


def _timers(x, sizes, weights, cot, calls: dict) -> dict:
    import torch

    timers = {}
    for variant in VARIANTS:
        forward = _layer(sizes, weights, variant)
        timers[f"fwd/{variant}"] = wall_batch(lambda f=forward: f(x), lambda _: torch.cuda.synchronize(), calls["fwd"])
        step = lambda f=forward: torch.autograd.grad(f(x), (x, *weights), cot)  # noqa: E731
        timers[f"fwd+bwd/{variant}"] = wall_batch(step, lambda _: torch.cuda.synchronize(), calls["fwd+bwd"])
    return timers


def run_shape(experts: int, tokens: int, hidden: int, ffn: int) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x = randn(tokens, hidden).requires_grad_(True)
    weights = tuple(randn(*shape, scale=shape[1] ** -0.5).requires_grad_(True)
                    for shape in ((experts, hidden, ffn), (experts, hidden, ffn), (experts, ffn, hidden)))
    cot = randn(tokens, hidden)
    sizes = torch.full((experts,), tokens // experts, dtype=torch.int32, device="cuda")
    sizes[0] += tokens - int(sizes.sum())
    estimate = _layer(sizes, weights, "unchecked")
    estimate(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    estimate(x)
    end.record()
    end.synchronize()
    fwd_ms = start.elapsed_time(end)
    calls = {"fwd": calls_per_batch(fwd_ms), "fwd+bwd": calls_per_batch(3 * fwd_ms)}
    timers = _timers(x, sizes, weights, cot, calls)
    for timer in timers.values():
        timer()  # compiles, warms up
    samples = interleaved(timers)
    row = {"experts": experts, "tokens": tokens, "hidden": hidden, "ffn": ffn, "calls_a_batch": calls,
           "ms": {name: statistics.median(s) for name, s in samples.items()}, "rounds_ms": samples}
    for phase in ("fwd", "fwd+bwd"):
        for variant in VARIANTS[1:]:  # > 1: slower than unchecked
            row[f"{phase}: {variant} / unchecked"] = median_ratio(samples, f"{phase}/{variant}", f"{phase}/unchecked")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", type=gmm_shape, default=[(64, 32768, 2048, 1408)],
                        help="experts,tokens,hidden,ffn")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for shape in args.shapes:
        rows.append(run_shape(*shape))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "rounds_ms"},
              flush=True)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                                   f"probe_moe_value_checks-{device_name()}.json")
    write_run(out, rows, method="wall clock over back-to-back steps (batches of >= 25 ms), the six timers in 9 "
                                "interleaved rounds, ratios the median of per-round ratios")


if __name__ == "__main__":
    main()
