"""One Gluon forward plan, built the ways its two launchers build it, timed on the same GPU.

Torch and jax launch the same plan's kernel but build it differently:

- torch's launch JIT-compiles it: Triton specializes int arguments divisible by 16 (batch, seq_q,
  seq_k) as such, and Triton's own ptxas assembles the PTX;
- jax's launch (``ejkernel_jax._gluon_call``) compiles it ahead of time (``triton_kernels.aot``:
  ints unspecialized but 1), and jaxlib assembles that PTX with its own PTX compiler.

This probe launches, from torch on the same inputs and outputs, each build it can make: ``jit``
(the torch launch's kernel), ``aot`` (jax's PTX, Triton's ptxas), and with ``--ptxas PATH ...``
(e.g. a CUDA toolkit's; builds are named by the binary's version) both PTXs assembled by each of
those binaries too; then the registered op (``torch.ops.ejkernel.flash_attention_fwd``, the path
torch.compile and the profiler's traces take) and jax's own launch; with ``--idle-us N`` also the
torch launch's kernel with the GPU idle N us before each call. Every output is compared bit
for bit with ``jit``'s. Each round times every build's kernel with torch's profiler (CUPTI: the
flash kernel's device time alone, not the counter's fill), in turn; the medians over rounds are
reported, and each build's time over ``jit``'s. Registers, spills and SASS instruction counts
come with each build.

    python scripts/probe_flash_builds.py [--shapes 1024:64:causal 4096:64:causal]
        [--ptxas /path/to/ptxas ...] [--rounds 7] [--out FILE]

Shapes are the benchmark's (bf16, batch x seq = 16k tokens, heads = 2048 / head_dim).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.common import flash_shape, profiled_kernels  # noqa: E402

CALLS = 20  # kernels per profiled batch


def assemble(compiled, ptxas: str | None = None) -> bytes:
    """``compiled``'s PTX assembled as Triton assembles it (its own flags, which differ between
    Triton versions), by ``ptxas`` (None: Triton's own binary)."""
    from triton import knobs
    from triton.compiler import make_backend

    target = compiled.metadata.target
    backend = make_backend(target)
    metadata = dict(compiled.metadata._asdict())
    metadata.pop("num_warps")  # a warp-specialized kernel's total (say 12) is no valid option; ptxas ignores it
    options = backend.parse_options(metadata)
    with knobs.nvidia.scope():  # restores the environment after
        if ptxas:  # Triton reads its tools' paths from these (the second from Triton 3.7 on)
            os.environ["TRITON_PTXAS_PATH"] = os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas
        return backend.make_cubin(compiled.asm["ptx"], {}, options, target.arch)


def ptxas_version(ptxas: str) -> str:
    text = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+), V([\d.]+)", text)
    return found.group(2) if found else text.strip()[-40:]


def sass_instructions(cubin: bytes) -> int | None:
    """Instruction count of ``cubin``'s SASS (``sass_loops.sass``), None without Triton's cuobjdump."""
    from scripts.sass_loops import sass

    try:
        return len(sass(cubin))
    except Exception:  # no cuobjdump in this Triton: the count is extra information only
        return None


def triton_ptxas() -> str:
    """The ptxas Triton assembles Hopper kernels with (its API took the arch from 3.7 on)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(90).path
    except TypeError:
        return get_ptxas().path


def with_cubin(compiled, cubin: bytes):
    """A copy of the loaded ``compiled`` kernel whose launches run ``cubin`` instead."""
    from triton.runtime import driver

    compiled._init_handles()
    twin = copy.copy(compiled)
    device = driver.active.get_current_device()
    twin.module, twin.function, twin.n_regs, twin.n_spills, _ = driver.active.utils.load_binary(
        compiled.name, cubin, compiled.metadata.shared, device)
    twin.kernel = cubin
    return twin


def builds(plan, features, outputs, ptxases: list[str]) -> dict:
    """name -> (CompiledKernel, facts about it) for each build of ``plan``."""
    from ejkernel_torch import launch as launch_mod
    from triton_kernels.aot import compile_plan, target_for

    with launch_mod._scratch_allocator():
        jit = plan.kernel[plan.grid](*plan.runtime_args(features, outputs), **plan.constexpr_dict,
                                     **plan.compile_options)
    facts = launch_mod.device_facts(features[0].device)
    aot = compile_plan(plan, target_for(facts))
    found = {"jit": jit, "aot": aot}
    # Whether assemble() reproduces Triton's own cubins: then a difference between the builds
    # below is the ptxas binary's, not the flags'.
    same_flags = {name: assemble(kernel) == kernel.kernel
                  for name, kernel in found.items()}
    for path in ptxases:
        version = ptxas_version(path)
        for name, kernel in (("jit", jit), ("aot", aot)):
            found[f"{name}+ptxas{version}"] = with_cubin(kernel, assemble(kernel, path))
    for kernel in found.values():
        kernel._init_handles()
    return {name: (kernel, {"regs": kernel.n_regs, "spills": kernel.n_spills,
                            "sass_instructions": sass_instructions(kernel.kernel),
                            **({"reassembled_by_triton_ptxas_equal": same_flags[name]} if name in same_flags else {})})
            for name, kernel in found.items()}


def same_bits(a, b) -> bool:
    """Whether two torch tensors hold the same bytes (NaNs and signed zeros included)."""
    import torch

    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def kernel_us(fn, wait) -> float:
    """Device time of the flash kernel per call over ``CALLS`` calls, from torch's profiler."""
    times = [e.time_range.elapsed_us() for e in profiled_kernels(fn, CALLS, wait) if "flash_fwd" in e.name]
    if len(times) != CALLS:
        raise RuntimeError(f"expected {CALLS} flash kernels in the profile, found {len(times)}")
    return sum(times) / CALLS


def idle_before(call, idle_us: int):
    """``call`` after the GPU has drained and idled for ``idle_us`` microseconds: how a kernel
    runs when its launch comes late (a host-bound caller), not right behind the previous one."""
    import time

    import torch

    def run():
        torch.cuda.synchronize()
        end = time.perf_counter() + idle_us * 1e-6
        while time.perf_counter() < end:
            pass
        return call()
    return run


def row(seq: int, head_dim: int, causal: bool, ptxases: list[str], rounds: int, idle_us: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import ejkernel_jax
    from benchmarks.flash_attention import HIDDEN, TOKENS, _inputs
    from ejkernel_torch import launch as launch_mod
    from ejkernel_torch.ops import _tuning
    from ejkernel_torch.ops.flash_attention import _features, _op_scalars
    from triton_kernels import flash_attention as fa
    from triton_kernels.tuning import FLASH_FWD

    batch, heads = max(1, TOKENS // seq), HIDDEN // head_dim
    arrays = _inputs(batch, seq, heads, head_dim)[:3]
    q, k, v = (torch.from_numpy(a).to("cuda", torch.bfloat16) for a in arrays)
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    plan = fa.forward_plan(spec, launch_mod.device_facts(q.device), _tuning.resolve(FLASH_FWD, spec, q.device, None))
    if not plan.is_gluon:
        raise SystemExit(f"the plan at {seq}:{head_dim} is not a Gluon kernel ({plan.name})")
    features = _features(q, k, v, None, None, None, None, None, None, cached=True)
    device = q.device

    def outputs():
        return launch_mod._outputs(plan, features, device)  # zeroes the tile counter, as a launch does

    made = builds(plan, features, outputs(), ptxases)

    def runner(kernel):
        run = kernel[launch_mod._grid3(plan.grid)]

        def call():
            outs = outputs()
            with launch_mod._scratch_allocator():
                run(*plan.launch_args(features, outs))
            return outs
        return call

    calls = {name: runner(kernel) for name, (kernel, _) in made.items()}
    want = calls["jit"]()
    result = {"seq": seq, "head_dim": head_dim, "causal": causal, "batch": batch, "heads": heads,
              "plan": plan.name, "builds": {name: dict(info) for name, (_, info) in made.items()}}
    for name, call in calls.items():
        got = call()
        result["builds"][name]["bitwise_equal_jit"] = all(
            same_bits(g, w) for g, w in zip(plan.results(got), plan.results(want)))
    qj, kj, vj = (jnp.asarray(a).astype(jnp.bfloat16) for a in arrays)
    jitted = jax.jit(lambda a, b, c: ejkernel_jax.flash_attention(a, b, c, causal=causal))
    jax_out = jax.block_until_ready(jitted(qj, kj, vj))
    result["jax_output_bitwise_equal_jit"] = same_bits(torch.from_dlpack(jax_out), want[0])
    # The registered op, as torch.compile and the profiler's traces run it: the same plan and
    # kernel, with fresh one-element stand-ins for the unused inputs (six fills a call).
    op_args = (q, k, v, None, None, None, None, None, None, *_op_scalars(spec), None, None)
    calls["registered_op"] = lambda: torch.ops.ejkernel.flash_attention_fwd(*op_args)
    result["registered_op_bitwise_equal_jit"] = same_bits(calls["registered_op"]()[0], want[0])
    if idle_us:  # the torch launch's kernel again, with the GPU idle before each call
        calls[f"jit, {idle_us} us idle"] = idle_before(calls["jit"], idle_us)
    waits = {name: (lambda _: None) for name in calls}
    calls["jax"], waits["jax"] = (lambda: jitted(qj, kj, vj)), jax.block_until_ready
    for name in calls:  # warm up: compiles, the profiler's first-use cost
        kernel_us(calls[name], waits[name])
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name in calls:
            samples[name].append(kernel_us(calls[name], waits[name]))
    medians = {name: statistics.median(s) for name, s in samples.items()}
    result["kernel_us"] = {name: round(us, 2) for name, us in medians.items()}
    result["over_jit"] = {name: round(us / medians["jit"], 4) for name, us in medians.items()}
    result["samples_us"] = {name: [round(x, 2) for x in s] for name, s in samples.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=flash_shape,
                        default=[flash_shape(s) for s in ("1024:64:causal", "1024:128:causal", "1024:64:full",
                                                          "1024:128:full", "4096:64:causal")],
                        help="seq:head_dim:causal|full")
    parser.add_argument("--ptxas", nargs="*", default=[], help="other ptxas binaries to assemble both PTXs with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--idle-us", type=int, default=0,
                        help="also time the torch launch with the GPU idle this long before each call")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    ptxas = triton_ptxas()
    rows = []
    for seq, head_dim, causal in args.shapes:
        rows.append(row(seq, head_dim, causal, args.ptxas, args.rounds, args.idle_us))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples_us"}), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows, calls_per_profile=CALLS, rounds=args.rounds,
                  ptxas={"triton": [ptxas, ptxas_version(ptxas)],
                         **{p: ptxas_version(p) for p in args.ptxas}})


if __name__ == "__main__":
    main()
