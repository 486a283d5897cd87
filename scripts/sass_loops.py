"""The Gluon flash forward's machine code, on this machine (no GPU): its size and its key loops.

    python scripts/sass_loops.py [VARIANT.py ...] [--shapes 1024:64:causal 1024:64:full] [--out PATH]

Each shape's forward plan (bf16, the benchmark's batch x seq = 16k tokens and heads = 2048 /
head_dim) is compiled for sm_90 ahead of time, with the plan's kernel and with each VARIANT.py's
(a copy of ``triton_kernels/flash_attention/gluon_forward.py`` with one change, taken and
launched as ``probe_gluon_forward_variants.py`` does), and Triton's cuobjdump lists its SASS.
Reported: the instruction count, and each innermost loop that issues wgmma (a consumer
warpgroup's loop over key blocks; one a warpgroup, as each is a partition of its own) with its
first instruction's byte address, its instructions, its exp2s (``MUFU.EX2``) and its wgmmas
(``HGMMA``).

Why: at short causal shapes the forward's speed moved more with its code than with its
arithmetic. On an H200 a 64-wide path for the diagonal block, compiled in but never taken, cost
2-4% at head_dim 64, and ptxas had scheduled the same-length key loop differently; 776 fewer
instructions outside the loop did not help (benchmarks/README.md, session 53). This shows what a
variant changes in the machine code before a GPU times it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(\S.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+0x([0-9a-f]+)")
_WGMMA = re.compile(r"\bHGMMA\b")


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of ``cubin``'s one kernel, by Triton's bundled cuobjdump."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, text.splitlines()) if m]


def innermost_loops(code: list[tuple[int, str]]) -> list[dict]:
    """The loops (a backward branch and its target) that hold no other loop and issue wgmma."""
    index = {address: i for i, (address, _) in enumerate(code)}
    spans = []
    for i, (address, text) in enumerate(code):
        branch = _BRANCH.search(text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target <= address and target in index:
            spans.append((index[target], i))
    loops = []
    for start, end in spans:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in spans):
            continue
        body = [text for _, text in code[start:end + 1]]
        wgmma = sum(bool(_WGMMA.search(t)) for t in body)
        if wgmma:
            loops.append({"address": code[start][0], "instructions": len(body),
                          "exp2": sum("MUFU.EX2" in t for t in body), "wgmma": wgmma})
    return loops


def report(plan) -> dict:
    from triton_kernels.aot import compile_plan

    code = sass(compile_plan(plan).asm["cubin"])
    return {"instructions": len(code), "key_loops": innermost_loops(code)}


def _plan(shape, module):
    """The forward plan of a benchmark shape, with ``module``'s kernel as the variant probe runs it."""
    from benchmarks.common import flash_dims
    from scripts.probe_gluon_forward_variants import forward_plan_of
    from triton_kernels import HOPPER
    from triton_kernels import flash_attention as fa

    seq, head_dim, causal = shape
    dims = flash_dims(seq, head_dim)
    return forward_plan_of(module, fa.dense_spec(dims, dims, dims, ("bfloat16",) * 3, causal=causal), HOPPER)


def main() -> None:
    from benchmarks.common import flash_shape

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help="kernel files (copies of gluon_forward.py with a change)")
    parser.add_argument("--shapes", nargs="*", type=flash_shape, default=[(1024, 64, True), (1024, 64, False),
                                                                          (1024, 128, True), (1024, 128, False)])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from benchmarks.common import load_kernel_copy

    kernels = {"plan": None, **dict(load_kernel_copy(path, "sass_variant") for path in args.variants)}
    rows = []
    for seq, head_dim, causal in args.shapes:
        row = {"seq": seq, "head_dim": head_dim, "causal": causal}
        for name, module in kernels.items():
            row[name] = report(_plan((seq, head_dim, causal), module))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        import triton

        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "triton": triton.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
