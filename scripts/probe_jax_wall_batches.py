"""Is jax's wall clock above torch's for the same flash kernel, and by a cost per call or per batch?

The same compiled kernel runs from both fronts (``profile_flash_jax_vs_torch.py``), yet by wall
clock over batches of 20 calls jax took up to 1.11x torch's time at seq 1024. This times ours from
torch and from jax in interleaved rounds with batches of 20 and of 100 calls, beside torch's CUDA
events over 100 calls: a cost per batch (the first dispatch, the final wait) shrinks with longer
batches, a cost per call does not. cuDNN's attention from both fronts (torch SDPA, and
``jax.nn.dot_product_attention(implementation="cudnn")``) is timed in the same rounds as a
baseline that is none of our code. Each row fits jax's excess over torch with a cost per batch
and one per call (``*_excess_ms_per_batch``, ``*_excess_us_per_call``, from the two batch
lengths' medians). Both from jax also run as one jitted program of the batch's chained calls
(``program``, ``cudnn_program``: ``benchmarks.flash_attention.chained_program``), which pays jax's
dispatch once a batch; "per added call" compares what 80 more calls a batch cost, where costs per
batch cancel. Run it again with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to take
XLA's CUDA graphs out.

Torch waits for a batch with ``torch.cuda.synchronize()``, which spins (CUDA's default schedule
with fewer contexts than cores); jax waits with ``jax.block_until_ready``. ``jax_spin``,
``program_spin`` and ``cudnn_jax_spin`` time the same jax calls waited for by polling
``Array.is_ready()`` instead, so that both fronts wait alike: what they gain over ``jax`` is
what jax's own wait costs.

    PYTHONPATH=. python scripts/probe_jax_wall_batches.py [--shapes 8192:64:causal 4096:128:full ...]
        [--dtype float16] [--out PATH]

Prints one JSON line per shape (bf16 unless ``--dtype``; the benchmark's batch x seq and heads);
``--out`` also writes them to a JSON file.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.common import flash_shape  # noqa: E402

SHAPES = ((1024, 64, False), (1024, 128, True), (16384, 64, False))  # (seq, head_dim, causal)


def _events_timer(fn, calls):
    import torch

    def sample() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls
    return sample


def run(seq, head_dim, causal, dtype: str = "bfloat16") -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import ejkernel_jax
    import ejkernel_torch
    from benchmarks.common import interleaved, median_ratio, program_batch, spin_until_ready, wall_batch
    from benchmarks.flash_attention import HIDDEN, TOKENS, _inputs, _sdpa, chained_program

    arrays = _inputs(TOKENS // seq, seq, HIDDEN // head_dim, head_dim)[:3]
    q, k, v = (torch.from_numpy(a).to("cuda", getattr(torch, dtype)) for a in arrays)
    qj, kj, vj = (jnp.asarray(a).astype(dtype) for a in arrays)
    ours_fn = lambda a, b_, c: ejkernel_jax.flash_attention(a, b_, c, causal=causal)  # noqa: E731
    cudnn_fn = lambda a, b_, c: jax.nn.dot_product_attention(a, b_, c, is_causal=causal,  # noqa: E731
                                                             implementation="cudnn")
    ours_jax, cudnn_jax = jax.jit(ours_fn), jax.jit(cudnn_fn)
    ours_torch = lambda: ejkernel_torch.flash_attention(q, k, v, causal=causal)  # noqa: E731
    heads_first = [t.transpose(1, 2) for t in (q, k, v)]  # SDPA's layout (views, as the benchmark's)
    sdpa_cudnn = _sdpa("cudnn", causal)
    cudnn_torch = lambda: sdpa_cudnn(*heads_first)  # noqa: E731
    timers = {}
    for calls in (20, 100):
        timers[f"torch{calls}"] = wall_batch(ours_torch, lambda _: torch.cuda.synchronize(), calls)
        timers[f"jax{calls}"] = wall_batch(lambda: ours_jax(qj, kj, vj), jax.block_until_ready, calls)
        timers[f"jax_spin{calls}"] = wall_batch(lambda: ours_jax(qj, kj, vj), spin_until_ready, calls)
        timers[f"cudnn_torch{calls}"] = wall_batch(cudnn_torch, lambda _: torch.cuda.synchronize(), calls)
        timers[f"cudnn_jax{calls}"] = wall_batch(lambda: cudnn_jax(qj, kj, vj), jax.block_until_ready, calls)
        timers[f"cudnn_jax_spin{calls}"] = wall_batch(lambda: cudnn_jax(qj, kj, vj), spin_until_ready, calls)
        programs = {"program": chained_program(ours_fn, calls), "cudnn_program": chained_program(cudnn_fn, calls)}
        for name, program in programs.items():
            timers[f"{name}{calls}"] = program_batch(program, (qj, kj, vj), jax.block_until_ready, calls)
        timers[f"program_spin{calls}"] = program_batch(programs["program"], (qj, kj, vj), spin_until_ready, calls)
    timers["torch_events100"] = _events_timer(ours_torch, 100)
    samples = interleaved(timers, rounds=8)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    return {"seq": seq, "head_dim": head_dim, "causal": causal, "dtype": dtype,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            **medians,
            "jax/torch, 20 calls": median_ratio(samples, "jax20", "torch20"),
            "jax/torch, 100 calls": median_ratio(samples, "jax100", "torch100"),
            "jax spinning/torch, 20 calls": median_ratio(samples, "jax_spin20", "torch20"),
            "jax spinning/torch, 100 calls": median_ratio(samples, "jax_spin100", "torch100"),
            "program spinning/torch, 100 calls": median_ratio(samples, "program_spin100", "torch100"),
            "cudnn jax/torch, 20 calls": median_ratio(samples, "cudnn_jax20", "cudnn_torch20"),
            "cudnn jax/torch, 100 calls": median_ratio(samples, "cudnn_jax100", "cudnn_torch100"),
            "cudnn jax spinning/torch, 100 calls": median_ratio(samples, "cudnn_jax_spin100", "cudnn_torch100"),
            "program/torch, 20 calls": median_ratio(samples, "program20", "torch20"),
            "program/torch, 100 calls": median_ratio(samples, "program100", "torch100"),
            "cudnn program/torch, 100 calls": median_ratio(samples, "cudnn_program100", "cudnn_torch100"),
            "program/torch, per added call": _slope_ratio(samples, "program", "torch"),
            "cudnn program/torch, per added call": _slope_ratio(samples, "cudnn_program", "cudnn_torch"),
            **_excess_fit("ours", medians, "jax", "torch"),
            **_excess_fit("ours_spinning", medians, "jax_spin", "torch"),
            **_excess_fit("cudnn", medians, "cudnn_jax", "cudnn_torch"),
            **_excess_fit("ours_program", medians, "program", "torch")}


def _slope_ratio(samples: dict, numerator: str, denominator: str) -> float:
    """The median over rounds of what 80 more calls a batch cost one method over the other
    (100-call batches less 20-call ones, each in ms a call): a cost per batch, such as jax's
    dispatch of a program and its wait, cancels; the time each further call adds remains."""
    def added(name, r):
        return 100 * samples[f"{name}100"][r] - 20 * samples[f"{name}20"][r]
    return statistics.median(added(numerator, r) / added(denominator, r) for r in range(len(samples["torch20"])))


def _excess_fit(label: str, medians: dict, jax_name: str, torch_name: str) -> dict:
    """jax's time over torch's as ``per_batch + calls * per_call``, from 20- and 100-call batches
    (milliseconds a call in ``medians``)."""
    excess = {calls: calls * (medians[f"{jax_name}{calls}"] - medians[f"{torch_name}{calls}"]) for calls in (20, 100)}
    per_call = (excess[100] - excess[20]) / 80
    return {f"{label}_excess_ms_per_batch": excess[20] - 20 * per_call, f"{label}_excess_us_per_call": per_call * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=flash_shape, default=list(SHAPES), help="SEQ:HEAD_DIM:full|causal")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for shape in args.shapes:
        rows.append(run(*shape, dtype=args.dtype))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from benchmarks.common import device_name, write_json

        write_json(args.out, {"device": device_name(), "torch": torch.__version__, "results": rows})


if __name__ == "__main__":
    main()
