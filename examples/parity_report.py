"""The main job: run every op from torch and from jax on the default device, compare each with a
float64 reference and with each other, print one table and write parity_report.json.

    python examples/parity_report.py [--out parity_report.json] [--only softmax,...]

Without a GPU both frameworks run the Triton interpreter (CPU); with one, the compiled kernels.
Columns: max relative error ||out - ref|| / ||ref|| of each framework vs float64, the largest
|torch - jax| difference, whether the two are bit-for-bit equal, and the median time per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

from examples.parity import Case, all_cases
from tests import frameworks
from tests import references as ref
from tests.frameworks import rel_error


def _sync(fw, value):
    if fw.name == "jax":
        import jax

        jax.block_until_ready(value)
    elif fw.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return value


def _timed(fw, fn, repeats: int) -> tuple[object, float]:
    out = _sync(fw, fn())  # warm-up (compiles), also the result we check
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _sync(fw, fn())
        times.append(time.perf_counter() - start)
    return out, statistics.median(times) * 1e3


def _run_case(case: Case, fw, inputs: list[np.ndarray], cotangent: np.ndarray, repeats: int):
    arrays = [fw.asarray(a, case.dtype if np.issubdtype(a.dtype, np.floating) else None) for a in inputs]
    op = case.fn(fw.ops)
    out, ms = _timed(fw, lambda: op(*arrays, **case.kwargs), repeats)
    results = {"out": fw.to_numpy(out), "out_dtype": str(out.dtype).removeprefix("torch.")}
    if case.n_diff:
        n = case.n_diff
        grads = fw.vjp(lambda *d: op(*d, *arrays[n:], **case.kwargs), arrays[:n], fw.asarray(cotangent, case.dtype))
        results.update({f"grad{i}": g for i, g in enumerate(grads)})
    seen = [fw.to_numpy(a) for a in arrays]  # inputs as the kernel saw them (after rounding)
    return results, seen, ms


def _rows_for(case: Case, rng, repeats: int) -> list[dict]:
    torch_fw, jax_fw = frameworks.get("torch"), frameworks.get("jax")
    inputs = list(case.make_inputs(rng))
    out_shape = np.asarray(ref.forward(case.reference, *inputs, **case.kwargs)).shape
    cotangent = rng.standard_normal(out_shape).astype(np.float32)
    t_res, seen, t_ms = _run_case(case, torch_fw, inputs, cotangent, repeats)
    j_res, _, j_ms = _run_case(case, jax_fw, inputs, cotangent, repeats)
    cot_seen = torch_fw.to_numpy(torch_fw.asarray(cotangent, case.dtype))
    expected = {"out": ref.forward(case.reference, *seen, **case.kwargs)}
    if case.n_diff:
        grads = ref.vjp(case.reference, seen, cot_seen, n_diff=case.n_diff, **case.kwargs)
        expected.update({f"grad{i}": g for i, g in enumerate(grads)})
    rows = []
    for key, want in expected.items():
        a, b = t_res[key], j_res[key]
        rows.append({
            "op": case.op if key == "out" else f"{case.op} d/d{key[4:]}",
            "shape": case.label, "dtype": case.dtype, "device": torch_fw.device,
            "rel_err_torch": rel_error(a, want), "rel_err_jax": rel_error(b, want),
            "rel_diff": rel_error(a, b), "max_abs_diff": float(np.max(np.abs(a - b))) if a.size else 0.0,
            "out_dtypes": [t_res["out_dtype"], j_res["out_dtype"]] if key == "out" else None,
            "bitwise_equal": a.tobytes() == b.tobytes(),
            "ms_torch": t_ms if key == "out" else None, "ms_jax": j_ms if key == "out" else None,
        })
    return rows


# Bounds per dtype on the relative errors: the test suite's (tests.frameworks.TOLERANCE for
# outputs, the suites' GRAD_TOLERANCE for gradients). They were 1e-4 / 5e-2 for every row, 300x
# the largest float32 error the report measures (3e-7) and 17x the largest bfloat16 one (3e-3):
# every kernel's output scaled by 1 + 5e-5 (float32) or 1 + 3e-2 (bfloat16) passed the job.
BOUNDS = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
GRAD_BOUNDS = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def bound_of(row: dict) -> float:
    """The bound of a row: a gradient row (op "... d/dN") takes GRAD_BOUNDS, an output row BOUNDS."""
    return (GRAD_BOUNDS if " d/d" in row.get("op", "") else BOUNDS)[row["dtype"]]


def failed_rows(rows: list[dict]) -> list[dict]:
    """Rows that fail the job: a NaN or a wrong result in either framework, the two
    frameworks apart by more than the same bound (relative to jax's result), or outputs of two
    dtypes. An error that is NaN (a reference with a NaN in it) fails too: ``max(nan, x) > bound``
    was False, so such a row passed whatever the framework returned."""
    def ok(r):
        bound = bound_of(r)
        same_dtype = r["out_dtypes"] is None or r["out_dtypes"][0] == r["out_dtypes"][1]
        return r["rel_err_torch"] <= bound and r["rel_err_jax"] <= bound and r["rel_diff"] <= bound and same_dtype

    return [r for r in rows if not ok(r)]


def _progress(i: int, total: int, label: str) -> None:
    filled = int(30 * i / total)
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {i}/{total} {label:<40}", end="", file=sys.stderr, flush=True)


def _print_table(rows: list[dict]) -> None:
    header = f"{'op':<36}{'shape':<22}{'dtype':<10}{'device':<7}{'err torch':>11}{'err jax':>11}" \
             f"{'|t-j| max':>11}{'bitwise':>9}{'ms torch':>10}{'ms jax':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        ms = lambda v: f"{v:10.2f}" if v is not None else f"{'':>10}"
        print(f"{r['op']:<36}{r['shape']:<22}{r['dtype']:<10}{r['device']:<7}{r['rel_err_torch']:11.2e}"
              f"{r['rel_err_jax']:11.2e}{r['max_abs_diff']:11.2e}{str(r['bitwise_equal']):>9}"
              f"{ms(r['ms_torch'])}{ms(r['ms_jax'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="parity_report.json")
    parser.add_argument("--only", default="", help="comma-separated op names")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cases, only = all_cases(), [name for name in args.only.split(",") if name]
    known = sorted({c.op for c in cases})
    unknown = [name for name in only if name not in known]
    if unknown:
        parser.error(f"--only: unknown op name(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    cases = [c for c in cases if not only or c.op in only]
    rng = np.random.default_rng(0)
    rows = []
    for i, case in enumerate(cases):
        _progress(i, len(cases), f"{case.op} {case.label} {case.dtype}")
        rows.extend(_rows_for(case, rng, args.repeats))
    _progress(len(cases), len(cases), "done")
    print(file=sys.stderr)
    _print_table(rows)
    with open(args.out, "w") as f:
        json.dump({"device": frameworks.get("torch").device, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    bad = failed_rows(rows)
    for r in bad:
        print(f"FAILED: {r['op']} {r['shape']} {r['dtype']}: errors {r['rel_err_torch']:.2e} / {r['rel_err_jax']:.2e}, "
              f"torch vs jax {r['rel_diff']:.2e} (bound {bound_of(r):.1e})" + (f", dtypes {r['out_dtypes']}" if r["out_dtypes"] else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
