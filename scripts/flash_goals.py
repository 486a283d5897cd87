"""Does one whole run of ``benchmarks/flash_attention.py`` meet issue 3's performance goals?

A whole run is split over several calls (one call may not outlast the device's limit), so this
reads all their JSONs as one run and checks, against the issue's grid (bf16 and fp16, head_dim 64
and 128, seq 1024-16384, causal and not: 40 rows):

* forward >= 1.0x the best SDPA backend, every row;
* forward+backward >= 0.85x, every row;
* jax-launched within 3% of torch-launched: ours_jax time over ours_torch time <= 1.03, forward
  and forward+backward, every row (jax being faster is no miss);
* seq 65,536 runs, forward and backward (the ``--long`` rows).

It prints each goal with its misses, then the run's medians, the first round's bias (its ratio
over the median of the later rounds) and where the device time went; ``--table`` prints the
top-level README's table instead.

    python scripts/flash_goals.py benchmarks/results/flash_attention-*-s58-nvidia-h200.json [--table]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import spread  # noqa: E402
from benchmarks.flash_attention import DTYPES, HEAD_DIMS, SEQS, ratio_spreads  # noqa: E402

FWD, FWD_BWD = "fwd: ours_torch vs best sdpa", "fwd+bwd: ours_torch vs best sdpa"
JAX = {"fwd": "fwd: ours_jax time / ours_torch time", "fwd+bwd": "fwd+bwd: ours_jax time / ours_torch time"}
PROGRAM = "fwd: ours_jax_program time / ours_torch time"


def load(paths: list[str]) -> tuple[dict, list[dict]]:
    """The rows of all ``paths`` by (dtype, head_dim, seq, causal), and their ``seq_65536`` rows.
    A row found twice is a ValueError: one whole run measures each row once."""
    rows, long_rows = {}, []
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        for row in payload["results"]:
            key = (row["dtype"], row["head_dim"], row["seq"], row["causal"])
            if key in rows:
                raise ValueError(f"row {key} is in more than one of the files given")
            rows[key] = row
        long_rows += payload.get("seq_65536", [])
    return rows, long_rows


def _figure(row: dict, name: str) -> str:
    return f"{row[name]:.3f}" if name in row else "not measured"


def _label(key) -> str:
    dtype, head_dim, seq, causal = key
    return f"{dtype} d{head_dim} s{seq} {'causal' if causal else 'full'}"


def goals(rows: dict, long_rows: list[dict]) -> dict[str, list[str]]:
    """Each goal -> its misses (rows as labels, with the figure); an empty list: met."""
    grid = list(itertools.product(DTYPES, HEAD_DIMS, SEQS, (False, True)))
    misses = {"every row of the grid measured": [_label(k) for k in grid if k not in rows],
              "forward >= 1.0x best SDPA": [], "forward+backward >= 0.85x best SDPA": [],
              "jax within 3% of torch (fwd, fwd+bwd)": [], "seq 65,536 runs": []}
    for key in (k for k in grid if k in rows):
        row = rows[key]
        for goal, name, floor in (("forward >= 1.0x best SDPA", FWD, 1.0),
                                  ("forward+backward >= 0.85x best SDPA", FWD_BWD, 0.85)):
            if row.get(name, 0.0) < floor:  # a row without the ratio (a failed method) misses
                misses[goal].append(f"{_label(key)}: {_figure(row, name)}")
        for phase, name in JAX.items():
            if row.get(name, float("inf")) > 1.03:
                misses["jax within 3% of torch (fwd, fwd+bwd)"].append(f"{_label(key)} {phase}: {_figure(row, name)}")
    if not long_rows:
        misses["seq 65,536 runs"].append("no --long rows in these files")
    for row in long_rows:
        failed = sorted(name for name in row.get("errors", {}) if "ours" in name)
        timed = all(f"{phase}/ours_torch" in row.get("ms", {}) for phase in ("fwd", "fwd+bwd"))
        if failed or not timed:
            misses["seq 65,536 runs"].append(f"causal={row['causal']}: {failed or 'not timed forward and backward'}")
    return misses


def _text(spread: dict | None) -> str:
    return f"median {spread['median']:.3f}, {spread['min']:.3f}-{spread['max']:.3f}" if spread else "none"


def summary(rows: dict) -> list[str]:
    """The run's medians, the first round's bias, the rounds' order effect and the seconds its
    parts took."""
    spreads = ratio_spreads(list(rows.values()))
    bias, order = [], []
    for row in rows.values():
        rounds = row.get("rounds_ms", {})  # older runs did not record their rounds
        ours, sdpa = rounds.get("fwd/ours_torch", []), rounds.get("fwd/sdpa_cudnn", [])
        ratios = [s / o for o, s in zip(ours, sdpa)]
        if len(ratios) > 1:
            bias.append(ratios[0] / statistics.median(ratios[1:]))
            order.append(statistics.median(ratios[0::2]) / statistics.median(ratios[1::2]))
    seconds = {}
    for row in rows.values():
        for part, t in row.get("seconds", {}).items():
            seconds[part] = seconds.get(part, 0.0) + t
    return [f"forward vs best SDPA: {_text(spreads.get(FWD))}",
            f"forward+backward vs best SDPA: {_text(spreads.get(FWD_BWD))}",
            f"jax / torch, forward: {_text(spreads.get(JAX['fwd']))}; in one program: {_text(spreads.get(PROGRAM))}; "
            f"forward+backward: {_text(spreads.get(JAX['fwd+bwd']))}",
            f"first round over the later rounds' median (ours vs cuDNN, forward): {_text(spread(bias))}",
            f"rounds in the given order over reversed ones (ours vs cuDNN, forward; even over odd rounds' "
            f"medians): {_text(spread(order))}",
            "seconds: " + (", ".join(f"{part} {t:.0f}" for part, t in seconds.items()) or "not recorded")]


def table(rows: dict) -> list[str]:
    """The top-level README's table: full / causal in each cell."""
    def cell(dtype, head_dim, seq, name, fmt="{:.2f}"):
        return " / ".join(fmt.format(rows[(dtype, head_dim, seq, c)][name])
                          if name in rows.get((dtype, head_dim, seq, c), {}) else "-" for c in (False, True))

    def tflops(head_dim, seq):
        return " / ".join(f"{rows[('bfloat16', head_dim, seq, c)]['tflops']['fwd/ours_torch']:.0f}"
                          if ("bfloat16", head_dim, seq, c) in rows else "-" for c in (False, True))

    lines = ["| head_dim | seq | fwd TFLOP/s, bf16 | fwd vs cuDNN, bf16 | fwd vs cuDNN, fp16 | fwd+bwd vs cuDNN, bf16 "
             "| fwd+bwd vs cuDNN, fp16 | jax / torch fwd, bf16 | jax / torch fwd, fp16 "
             "| jax in one program / torch, bf16 | fp16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for head_dim, seq in itertools.product(HEAD_DIMS, SEQS):
        cells = [cell(dtype, head_dim, seq, name) for name in (FWD, FWD_BWD, JAX["fwd"], PROGRAM) for dtype in DTYPES]
        lines.append(f"| {head_dim} | {seq} | {tflops(head_dim, seq)} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="the JSONs of one whole run")
    parser.add_argument("--table", action="store_true", help="print the README's table instead")
    args = parser.parse_args()
    rows, long_rows = load(args.files)
    if args.table:
        print("\n".join(table(rows)))
        return
    misses = goals(rows, long_rows)
    for goal, missed in misses.items():
        print(f"{'met    ' if not missed else 'MISSED '} {goal}" + "".join(f"\n          {m}" for m in missed))
    print("all goals met" if not any(misses.values()) else "not all goals met")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
