"""Per-call host cost of each layer of the torch ``flash_attention`` forward path.

Where do the microseconds between ``ejkernel_torch.flash_attention(q, k, v)`` and a direct
``launch(plan, *inputs)`` go? Each layer of the path is called on its own, many times, with the
arguments the layer above would pass it, and its median per-call time is reported:

    flash_attention (public)                   the whole call
      checks: _qkv + shapes/dtypes             argument normalisation
      spec: dense_spec                         FlashSpec (lru-cached)
      params: _params                          fwd_params/bwd_params overrides
      autotune gate: _autotune                 opt-in autotuning check
      op scalars: _op_scalars                  the spec as the op's scalar arguments
      eager direct: _forward                   the body without the dispatcher (if the module has one)
      registered op: torch.ops.ejkernel...     dispatcher + autograd + custom-op wrappers + body
        op body (no dispatcher)                the triton_op body, called as a plain function
          _spec_of                             FlashSpec rebuilt from the op's scalars
          tuning resolve                       config cache lookup (ejkernel_torch.ops._tuning.resolve)
            device fingerprint, cache.generation()   its parts
          forward_plan                         LaunchPlan (lru-cached)
          _features                            the nine kernel inputs, dummies for unused ones
          launch_traceable                     input checks, output allocation, kernel launch
            launch(plan)                       the plain launcher (allocation + launch)
    bare kernel[grid]                          (cuda only) the Triton launch with preallocated outputs
    compiled kernel's launcher                 (cuda only) what launch() calls after a plan's first launch
    with --grad: the public call and the registered op with q.requires_grad (forward only), and
    the public call's forward + backward (three more kernels, stubbed on CPU too); on cuda also
    torch SDPA's forward + backward and a no-op Python autograd.Function's (the floor)

Rows are timed separately, so a parent is roughly, not exactly, the sum of its children (the
rest is glue: argument passing, tuple building). ``--cprofile`` adds a cProfile listing of the
public call.

On CPU (the default) the Triton interpreter would dominate everything, so the narrowest point
that actually runs a kernel, ``ejkernel_torch.launch.run_interpreted``, is replaced by a stub:
outputs are still allocated by ``launch``, only the interpreter is skipped. Everything above it
runs for real. With ``--device cuda`` nothing is stubbed: real launches, and every timing loop
ends with ``torch.cuda.synchronize()`` (the loop is long enough that launches queue up, so the
figure is host cost as long as the kernels are shorter than it).

    PYTHONPATH=. python scripts/profile_op_overhead.py                  # cpu, stubbed
    PYTHONPATH=. python scripts/profile_op_overhead.py --device cuda --cprofile
    PYTHONPATH=. python scripts/profile_op_overhead.py --grad           # also q.requires_grad=True
    PYTHONPATH=. python scripts/profile_op_overhead.py --device cuda --grad --causal --shape 16,1024,16,128

Prints a table, then one line ``PROFILE_JSON {...}``.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import ejkernel_torch  # noqa: E402
from ejkernel_torch import launch as launch_mod  # noqa: E402
from ejkernel_torch.ops import _tuning  # noqa: E402
from triton_kernels import config_cache  # noqa: E402
from triton_kernels import flash_attention as fa  # noqa: E402
from triton_kernels.tuning import FLASH_FWD  # noqa: E402

op_mod = importlib.import_module("ejkernel_torch.ops.flash_attention")


def stub_interpreter() -> None:
    """Skip the Triton interpreter: outputs stay as ``launch`` allocated them."""
    launch_mod.run_interpreted = lambda plan, inputs, outputs: None


def per_call_us(fn, iters: int, repeats: int, sync) -> float:
    for _ in range(max(3, iters // 10)):  # warm caches (lru, memo, Triton's kernel cache)
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6 / iters)
    return statistics.median(samples)


def layers(q, k, v, device: torch.device, causal: bool = False) -> list[tuple[int, str, object]]:
    """(depth, name, zero-argument callable) for each layer that exists in this checkout."""
    public = lambda: ejkernel_torch.flash_attention(q, k, v, causal=causal)  # noqa: E731
    rows: list[tuple[int, str, object]] = [(0, "flash_attention (public)", public)]

    def add(depth, name, make):
        try:
            fn = make()
            fn()
        except Exception as e:  # a layer this version of the code does not have (or calls differently)
            print(f"  (skipped {name}: {type(e).__name__}: {e})", file=sys.stderr)
            return
        rows.append((depth, name, fn))

    def checks():
        def fn():
            q2, k2, v2, _ = op_mod._qkv(q, k, v)
            op_mod._shapes_and_dtypes(q2, k2, v2)
        return fn

    shapes, dtypes = op_mod._shapes_and_dtypes(q, k, v)
    spec = fa.dense_spec(*shapes, dtypes, causal=causal, softmax_scale=None, sliding_window=None,
                         logits_soft_cap=None, bias_shape=None, bias_dtype=None, q_segment_shape=None,
                         q_segment_dtype=None, kv_segment_shape=None, kv_segment_dtype=None, dropout_p=0.0)
    arrays = (q, k, v, None, None, None, None, None, None)
    scalars = op_mod._op_scalars(spec)
    params = (None, None)
    add(1, "checks: _qkv + shapes/dtypes", checks)
    add(1, "spec: dense_spec (cached)", lambda: lambda: fa.dense_spec(
        *shapes, dtypes, causal=causal, softmax_scale=None, sliding_window=None, logits_soft_cap=None,
        bias_shape=None, bias_dtype=None, q_segment_shape=None, q_segment_dtype=None, kv_segment_shape=None,
        kv_segment_dtype=None, dropout_p=0.0))
    add(1, "params: _params", lambda: lambda: op_mod._params(spec, None, None, device))
    add(1, "autotune gate: _autotune", lambda: lambda: op_mod._autotune(spec, arrays, params, None, device))
    add(1, "op scalars: _op_scalars", lambda: lambda: op_mod._op_scalars(spec))
    if hasattr(op_mod, "_forward"):
        add(1, "eager direct: _forward (no dispatcher)", lambda: lambda: op_mod._forward(spec, arrays, None))
    op_args = (*arrays, *scalars, *params)
    add(1, "registered op: torch.ops.ejkernel.flash_attention_fwd",
        lambda: lambda: torch.ops.ejkernel.flash_attention_fwd(*op_args))
    body = op_mod.flash_attention_fwd._abstract_fn  # the triton_op body (also its fake kernel)
    add(2, "op body, called directly", lambda: lambda: body(*op_args))
    add(3, "_spec_of", lambda: lambda: op_mod._spec_of(q, k, None, None, None, *scalars))
    add(3, "tuning resolve: _tuning.resolve", lambda: lambda: _tuning.resolve(FLASH_FWD, spec, device, None))
    fingerprint = getattr(_tuning, "_fingerprint", _tuning.device_fingerprint)  # what resolve calls
    add(4, "device fingerprint", lambda: lambda: fingerprint(device))
    add(4, "config cache generation() (stat)", lambda: lambda: config_cache.get_cache().generation())
    facts = launch_mod.device_facts(device)
    plan = fa.forward_plan(spec, facts, None)
    add(3, "forward_plan (cached)", lambda: lambda: fa.forward_plan(spec, facts, None))
    features = op_mod._features(*arrays)
    add(3, "_features (dummies)", lambda: lambda: op_mod._features(*arrays))
    add(3, "launch_traceable", lambda: lambda: launch_mod.launch_traceable(plan, *features))
    add(4, "launch(plan) (plain launcher)", lambda: lambda: launch_mod.launch(plan, *features))
    if device.type == "cuda":
        # Every output of the plan, a claimed-tile plan's counter too. It is zeroed once here, so
        # relaunches of such a plan find no tiles left: these rows time the launch's host cost.
        outputs = launch_mod._outputs(plan, features, device)
        runtime = plan.runtime_args(features, outputs)
        consts = plan.constexpr_dict

        # A Gluon plan builds its TMA descriptors in global scratch: its launches need the
        # allocator that launch() scopes to them (and the plan's maxnreg, in compile_options).
        scratch = launch_mod._scratch_allocator if plan.is_gluon else contextlib.nullcontext

        def bare():
            with scratch():
                return plan.kernel[plan.grid](*runtime, **consts, **plan.compile_options)

        def floor():
            with scratch():
                runner(*args)
        add(0, "bare kernel[grid] (Triton's launch)", lambda: bare)
        runner, args = bare()[launch_mod._grid3(plan.grid)], plan.launch_args(features, outputs)
        add(0, "compiled kernel's launcher (floor)" + (" + scratch allocator" if plan.is_gluon else ""),
            lambda: floor)
    return rows


class _Identity(torch.autograd.Function):
    """A Python autograd.Function that saves q, k, v and does no work: the floor that any
    Python-level op pays for forward + backward (autograd's engine and its CUDA worker thread)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def baselines(qg, k, v, dout, causal: bool = False) -> list:
    """Forward + backward rows to compare with ours in the same run: torch SDPA (a C++ autograd
    node) and the floor of a Python autograd.Function."""
    qt, kt, vt, dt = (x.detach().transpose(1, 2) for x in (qg, k, v, dout))
    qt.requires_grad_()

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(dt)
        qt.grad = None

    def floor():
        _Identity.apply(qg, k, v).backward(dout)
        qg.grad = None

    return [("baseline: torch SDPA forward + backward", sdpa), ("floor: no-op autograd.Function forward + backward", floor)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="1,128,4,64", help="q/k/v shape [batch, seq, heads, head_dim]")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=None, help="calls per sample (default 2000 cpu, 500 cuda)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--grad", action="store_true", help="also time calls with q requiring grad, and a backward")
    parser.add_argument("--causal", action="store_true", help="causal calls (the SDPA baseline too)")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the public call too")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
    else:
        stub_interpreter()
        sync = lambda: None  # noqa: E731
    iters = args.iters or (2000 if device.type == "cpu" else 500)
    shape = tuple(int(n) for n in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))

    results = {}
    print(f"{'layer':58s} {'us/call':>9s} {'% of op':>8s}")
    rows = layers(q, k, v, device, args.causal)
    total = None
    for depth, name, fn in rows:
        us = per_call_us(fn, iters, args.repeats, sync)
        total = us if total is None else total
        results[name] = round(us, 2)
        print(f"{'  ' * depth + name:58s} {us:9.2f} {100 * us / total:7.0f}%", flush=True)
    if args.grad:  # forward only (the autograd node is recorded), then forward + backward
        qg = q.detach().requires_grad_()
        spec = fa.dense_spec(tuple(q.shape), tuple(k.shape), tuple(v.shape), (args.dtype,) * 3,
                             causal=args.causal)
        op_args = (qg, k, v, None, None, None, None, None, None, *op_mod._op_scalars(spec), None, None)
        dout = torch.randn_like(q)

        def fwd_bwd():
            ejkernel_torch.flash_attention(qg, k, v, causal=args.causal).backward(dout)
            qg.grad = None

        grad_rows = [("flash_attention (public), q.requires_grad",
                      lambda: ejkernel_torch.flash_attention(qg, k, v, causal=args.causal)),
                     ("  registered op, q.requires_grad", lambda: torch.ops.ejkernel.flash_attention_fwd(*op_args)),
                     ("flash_attention forward + backward", fwd_bwd)]
        if device.type == "cuda":  # on CPU these would compute for real: not host cost
            grad_rows += baselines(qg, k, v, dout, args.causal)
        for name, fn in grad_rows:
            us = per_call_us(fn, iters, args.repeats, sync)
            results[name.strip()] = round(us, 2)
            print(f"{name:58s} {us:9.2f} {100 * us / total:7.0f}%", flush=True)
    floor = results.get("launch(plan) (plain launcher)")
    if floor:
        print(f"\nop layer overhead: public call - launch(plan) = {total - floor:.1f} us "
              f"({total / floor:.1f}x launch(plan))")

    if args.cprofile:
        prof = cProfile.Profile()
        fn = rows[0][2]
        prof.enable()
        for _ in range(iters):
            fn()
        sync()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"\ncProfile of {iters} public calls (sorted by own time; profiling inflates small functions):")
        print(text.getvalue())

    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(), "stubbed_interpreter": device.type == "cpu", "shape": shape,
            "dtype": args.dtype, "causal": args.causal, "torch": torch.__version__, "iters": iters,
            "repeats": args.repeats}
    doc = {"meta": meta, "us_per_call": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print("PROFILE_JSON " + json.dumps(doc))


if __name__ == "__main__":
    main()
