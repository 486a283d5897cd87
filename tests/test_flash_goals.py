"""scripts/flash_goals.py: one whole flash benchmark run, read from its files, against issue 3's goals."""
import itertools
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import flash_goals  # noqa: E402


def _row(dtype, head_dim, seq, causal, fwd=1.05, fwd_bwd=0.95, jax=1.0):
    return {"dtype": dtype, "head_dim": head_dim, "seq": seq, "causal": causal,
            flash_goals.FWD: fwd, flash_goals.FWD_BWD: fwd_bwd,
            flash_goals.JAX["fwd"]: jax, flash_goals.JAX["fwd+bwd"]: jax, flash_goals.PROGRAM: jax,
            "rounds_ms": {"fwd/ours_torch": [1.0] * 4, "fwd/sdpa_cudnn": [1.2, 1.1, 1.1, 1.0]},
            "seconds": {"torch events": 2.0}, "tflops": {"fwd/ours_torch": 500.4}}


def _grid():
    return [_row(*key) for key in itertools.product(flash_goals.DTYPES, flash_goals.HEAD_DIMS, flash_goals.SEQS,
                                                    (False, True))]


def _write(tmp_path, name, rows, long_rows=None):
    path = tmp_path / name
    payload = {"results": rows}
    if long_rows is not None:
        payload["seq_65536"] = long_rows
    path.write_text(json.dumps(payload))
    return str(path)


def _long(errors=None):
    return [{"causal": c, "ms": {"fwd/ours_torch": 9.0, "fwd+bwd/ours_torch": 30.0}, "errors": errors or {}}
            for c in (False, True)]


def test_a_run_split_over_files_that_meets_every_goal(tmp_path):
    rows = _grid()
    paths = [_write(tmp_path, "a.json", rows[:25]), _write(tmp_path, "b.json", rows[25:], _long())]
    misses = flash_goals.goals(*flash_goals.load(paths))
    assert not any(misses.values()), misses


def test_each_goal_names_the_rows_that_miss_it(tmp_path):
    rows = _grid()
    rows[0][flash_goals.FWD] = 0.999  # bf16 d64 s1024 full
    rows[3][flash_goals.FWD_BWD] = 0.849  # bf16 d64 s2048 causal
    rows[5][flash_goals.JAX["fwd+bwd"]] = 1.031  # bf16 d64 s4096 causal
    rows[7][flash_goals.JAX["fwd"]] = 0.95  # jax faster: no miss
    del rows[9]  # bf16 d64 s16384 causal
    misses = flash_goals.goals(*flash_goals.load([_write(tmp_path, "a.json", rows, _long({"fwd/ours_torch": "OOM"}))]))
    assert misses == {"every row of the grid measured": ["bfloat16 d64 s16384 causal"],
                      "forward >= 1.0x best SDPA": ["bfloat16 d64 s1024 full: 0.999"],
                      "forward+backward >= 0.85x best SDPA": ["bfloat16 d64 s2048 causal: 0.849"],
                      "jax within 3% of torch (fwd, fwd+bwd)": ["bfloat16 d64 s4096 causal fwd+bwd: 1.031"],
                      "seq 65,536 runs": ["causal=False: ['fwd/ours_torch']", "causal=True: ['fwd/ours_torch']"]}


def test_long_rows_must_time_ours_forward_and_backward(tmp_path):
    long_rows = _long()
    del long_rows[1]["ms"]["fwd+bwd/ours_torch"]
    misses = flash_goals.goals(*flash_goals.load([_write(tmp_path, "a.json", _grid(), long_rows)]))
    assert misses["seq 65,536 runs"] == ["causal=True: not timed forward and backward"]


def test_a_torch_only_run_or_one_without_the_long_rows_does_not_meet_the_goals(tmp_path):
    rows = _grid()
    for row in rows:
        for name in (*flash_goals.JAX.values(), flash_goals.PROGRAM):
            del row[name]
    misses = flash_goals.goals(*flash_goals.load([_write(tmp_path, "a.json", rows)]))
    assert len(misses["jax within 3% of torch (fwd, fwd+bwd)"]) == 80
    assert misses["seq 65,536 runs"] == ["no --long rows in these files"]


def test_a_row_measured_twice_is_not_one_run(tmp_path):
    rows = _grid()
    with pytest.raises(ValueError, match="more than one"):
        flash_goals.load([_write(tmp_path, "a.json", rows), _write(tmp_path, "b.json", rows[:1])])


def test_summary_and_table(tmp_path):
    rows, _ = flash_goals.load([_write(tmp_path, "a.json", _grid())])
    lines = flash_goals.summary(rows)
    assert lines[0] == "forward vs best SDPA: median 1.050, 1.050-1.050"
    assert lines[3].endswith("median 1.091, 1.091-1.091")  # (1.2 / 1.0) over the median of 1.1, 1.1, 1.0
    assert lines[4].endswith("median 1.095, 1.095-1.095")  # even rounds' median 1.15 over odd ones' 1.05
    assert lines[5] == "seconds: torch events 80"
    table = flash_goals.table(rows)
    assert len(table) == 2 + 10
    assert table[2] == "| 64 | 1024 | 500 / 500 | " + " | ".join(["1.05 / 1.05"] * 2 + ["0.95 / 0.95"] * 2
                                                                   + ["1.00 / 1.00"] * 4) + " |"


def test_summary_reads_runs_that_did_not_record_rounds_or_seconds(tmp_path):
    rows = _grid()
    for row in rows:
        del row["rounds_ms"], row["seconds"]
    lines = flash_goals.summary(flash_goals.load([_write(tmp_path, "a.json", rows)])[0])
    assert lines[3].endswith(": none") and lines[4].endswith(": none") and lines[5] == "seconds: not recorded"
