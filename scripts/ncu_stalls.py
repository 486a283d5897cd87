"""Where the Gluon flash forward's warps spend their time, from Nsight Compute's stall samples.

    python scripts/ncu_stalls.py [--shapes 1024:64:causal 1024:64:full] [--variant VARIANT.py] [--out PATH]
    python scripts/ncu_stalls.py --baseline cudnn [--shapes ...]     # torch SDPA's cuDNN kernel instead
    python scripts/ncu_stalls.py --csv SOURCE.csv [SOURCE.csv ...]      # summarise saved source pages

On a GPU with ``ncu``: each shape's forward plan (bf16, the benchmark's batch x seq = 16k tokens
and heads = 2048 / head_dim; with ``--variant``, that copy of ``gluon_forward.py``'s kernel) is
launched three times in a child process, ncu samples the third launch (SourceCounters,
WarpStateStats), and its per-instruction source page is read back. ``--baseline cudnn`` samples
the longest kernel of torch SDPA's cuDNN forward at the same shape instead (its SASS is cut the
same way where it is built alike). ``--csv`` summarises such a
page saved earlier (``ncu -i R.ncu-rep --page source --csv --print-source sass``), on any machine.

The SASS is cut into partitions at the ``USETMAXREG`` instructions each warp-specialized
partition starts or ends with. A partition holding a key loop (an innermost loop that issues
wgmma, as ``sass_loops.py`` finds it) is a consumer warpgroup's, split into its code before the
loop (a tile's start: the query and first key block, block 0's QK^T and softmax), the loop, and
after it (the last PV and the epilogue); one holding TMA loads and no key loop is the loader's;
the rest is set-up and the idle warps of the loader's warpgroup. (Consumer warpgroups that share
one copy of the code, as cuDNN's do, are one consumer here.) Reported for each region: its stall
samples, their share of the kernel's and of its consumer's, and the leading stall reasons. Sample
counts compare within a kernel, not across kernels.

Why: the short causal forward moved with its code more than with its arithmetic (session 53);
this says where a consumer's time goes before a variant is written.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scripts.sass_loops import innermost_loops  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(text: str) -> tuple[list[str], list[dict]]:
    """(stall reason columns, instructions) of an ncu source page in CSV: each instruction a dict
    with ``address``, ``sass``, ``samples``, ``executed`` and its samples by stall reason."""
    lines = list(csv.reader(io.StringIO(text)))
    header_at = next(i for i, line in enumerate(lines) if line[:2] == ["Address", "Source"])
    header = lines[header_at]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    instructions = []
    for line in lines[header_at + 1:]:
        row = dict(zip(header, line))
        try:
            address = int(row["Address"], 16)
        except (KeyError, ValueError):
            continue
        instructions.append({"address": address, "sass": row["Source"].strip(),
                             "samples": _number(row.get(SAMPLES, "0")), "executed": _number(row.get(EXECUTED, "0")),
                             "stalls": {r[len("stall_"):]: _number(row[r]) for r in reasons}})
    return [r[len("stall_"):] for r in reasons], instructions


def _partitions(instructions: list[dict]) -> list[list[dict]]:
    """The instructions cut before each ``USETMAXREG`` (a partition's start or end)."""
    parts, current = [], []
    for ins in instructions:
        if "USETMAXREG" in ins["sass"] and current:
            parts.append(current)
            current = []
        current.append(ins)
    return parts + [current] if current else parts


def regions(instructions: list[dict]) -> dict[str, list[dict]]:
    """The instructions by region: ``consumer K before loop``, ``consumer K loop``, ``consumer K
    after loop`` (K in the key loops' address order), ``loader``, ``other``."""
    loops = innermost_loops([(ins["address"], ins["sass"]) for ins in instructions])
    spans = sorted((loop["address"], loop["address"] + 16 * loop["instructions"]) for loop in loops)
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for part in _partitions(instructions):
        inside = [k for k, (start, end) in enumerate(spans) if part[0]["address"] <= start < part[-1]["address"] + 16]
        if inside:
            k = inside[0]
            start, end = spans[k]
            for ins in part:
                where = "before loop" if ins["address"] < start else "loop" if ins["address"] < end else "after loop"
                out[f"consumer {k} {where}"].append(ins)
        elif any("UTMALDG" in ins["sass"] for ins in part):
            out["loader"] += part
        else:
            out["other"] += part
    return dict(out)


def summarise(text: str, top: int = 4) -> dict:
    """Stall samples by region of one ncu source page (``regions``)."""
    _, instructions = read_source_page(text)
    total = sum(ins["samples"] for ins in instructions) or 1.0
    by_region = regions(instructions)
    consumer_total = collections.Counter()
    for name, part in by_region.items():
        if name.startswith("consumer"):
            consumer_total[name.split()[1]] += sum(ins["samples"] for ins in part)
    summary = {}
    for name, part in sorted(by_region.items()):
        samples = sum(ins["samples"] for ins in part)
        reasons = collections.Counter()
        for ins in part:
            reasons.update(ins["stalls"])
        entry = {"samples": samples, "share_of_kernel": round(samples / total, 4),
                 "instructions": len(part), "executed": sum(ins["executed"] for ins in part),
                 "stalls": {r: round(v / (samples or 1.0), 3) for r, v in reasons.most_common(top) if v}}
        if name.startswith("consumer"):
            entry["share_of_consumer"] = round(samples / (consumer_total[name.split()[1]] or 1.0), 4)
        summary[name] = entry
    return summary


def _forward(shape: str, variant: str | None, baseline: str | None):
    """The forward call at ``shape``: the plan's (or ``variant``'s) kernel, or with ``baseline``
    torch SDPA's cuDNN backend on the same arrays (heads-first views, as the benchmark calls it)."""
    import torch

    from benchmarks.common import flash_dims, flash_shape, load_kernel_copy
    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from scripts.probe_gluon_forward_variants import forward_plan_of
    from triton_kernels import flash_attention as fa

    seq, head_dim, causal = flash_shape(shape)
    dims = flash_dims(seq, head_dim)
    q, k, v = (torch.randn(*dims, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if baseline:
        from benchmarks.flash_attention import _sdpa

        sdpa, heads_first = _sdpa(baseline, causal), [t.transpose(1, 2) for t in (q, k, v)]
        return lambda: sdpa(*heads_first)
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    module = load_kernel_copy(variant, "ncu_variant")[1] if variant else None
    plan = forward_plan_of(module, spec, device_facts(q.device))
    arrays = _features(q, k, v, None, None, None, None, None, None)
    return lambda: launch(plan, *arrays)


def _launch(shape: str, variant: str | None, baseline: str | None) -> None:
    """Child of ``profile``: the forward launched three times (ncu samples the third)."""
    import torch

    forward = _forward(shape, variant, baseline)
    for _ in range(3):
        forward()
    torch.cuda.synchronize()


def _longest_kernel(shape: str, baseline: str) -> None:
    """Child of ``profile``: prints the name of the longest kernel of one ``baseline`` forward."""
    from benchmarks.common import profiled_kernels

    forward = _forward(shape, None, baseline)
    forward()
    print(max(profiled_kernels(forward, 1), key=lambda e: e.time_range.elapsed_us()).name)


def profile(shape: str, variant: str | None, baseline: str | None = None) -> str:
    """The ncu source page (CSV text) of the third forward launch at ``shape`` (its longest
    kernel with ``baseline``)."""
    child = [sys.executable, os.path.abspath(__file__), "--shapes", shape] + (["--variant", variant] if variant else [])
    kernel = "regex:flash_fwd_gluon"
    if baseline:
        child += ["--baseline", baseline]
        name = subprocess.run(child + ["--child", "name"], check=True, capture_output=True, text=True).stdout
        kernel = "regex:^" + re.escape(name.strip().splitlines()[-1].split("(")[0].split("<")[0])
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "forward")
        subprocess.run(["ncu", "--kernel-name-base", "demangled", "--kernel-name", kernel, "--launch-skip", "2",
                        "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats",
                        "-o", report, *child, "--child", "launch"], check=True, capture_output=True, text=True)
        return subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                              check=True, capture_output=True, text=True).stdout


def _profiled_rows(shapes: list[str], variant: str | None, baseline: str | None, keep: str | None) -> list[dict]:
    """A summary of each shape's profile, its source page kept in ``keep`` if given."""
    rows = []
    for shape in shapes:
        page = profile(shape, variant, baseline)
        if keep:
            os.makedirs(keep, exist_ok=True)
            with open(os.path.join(keep, f"{baseline or 'ours'}-{shape.replace(':', '_')}.csv"), "w") as f:
                f.write(page)
        rows.append({"shape": shape, "variant": variant, "baseline": baseline, "regions": summarise(page)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["1024:64:causal", "1024:64:full"])
    parser.add_argument("--variant", default=None, help="a copy of gluon_forward.py to profile instead of the plan's")
    parser.add_argument("--baseline", choices=["cudnn"], default=None, help="profile torch SDPA's backend instead")
    parser.add_argument("--csv", nargs="*", default=None, help="summarise saved ncu source pages instead")
    parser.add_argument("--keep", default=None, help="a folder to keep each source page in (CSV)")
    parser.add_argument("--child", choices=["launch", "name"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.child == "launch":
        return _launch(args.shapes[0], args.variant, args.baseline)
    if args.child == "name":
        return _longest_kernel(args.shapes[0], args.baseline)
    if args.csv is not None:
        rows = []
        for path in args.csv:
            with open(path) as f:
                rows.append({"csv": path, "regions": summarise(f.read())})
    else:
        import shutil

        import torch

        if not torch.cuda.is_available() or shutil.which("ncu") is None:
            sys.exit("needs a CUDA GPU and Nsight Compute's ncu")
        rows = _profiled_rows(args.shapes, args.variant, args.baseline, args.keep)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows)


if __name__ == "__main__":
    main()
