"""The benchmarks' side-by-side timing (benchmarks/common.py): which sample lands where.

The jax-vs-torch ratios in benchmarks/flash_attention.py are only as good as the pairing of
samples, so the pairing is checked here with fake timers that record when they ran.
"""
import json
import math
import sys
import time

import pytest

from benchmarks.common import (calls_per_batch, clock_ratio, error_text, event_rounds, host_ms, interleaved,
                               median_ratio, program_batch, spin_until_ready, time_beside_plan, wall_batch, write_run)


def _recording_timers(names, log):
    def timer(name):
        def sample():
            log.append(name)
            return float(len(log))  # a distinct value per call: which call a sample came from
        return sample
    return {name: timer(name) for name in names}


def test_interleaved_warms_up_then_alternates_the_order():
    log = []
    samples = interleaved(_recording_timers(["a", "b", "c"], log), rounds=4, warmup=2)
    assert log == ["a", "b", "c", "c", "b", "a",  # warm-up rounds, not recorded
                   "a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    # Each method's samples are its own calls, in round order.
    assert samples == {"a": [7.0, 12.0, 13.0, 18.0], "b": [8.0, 11.0, 14.0, 17.0], "c": [9.0, 10.0, 15.0, 16.0]}


@pytest.mark.parametrize("warmup", [1, 2, 3])
def test_every_recorded_round_follows_what_its_place_in_the_pattern_follows(warmup):
    # At the power cap a sample's clock depends on the call before it: the first recorded round
    # must follow the same method as every later round of its parity does.
    log = []
    interleaved(_recording_timers(["a", "b", "c"], log), rounds=5, warmup=warmup)
    first_calls = [warmup * 3 + 3 * r for r in range(5)]  # each recorded round's first call
    before = [log[i - 1] for i in first_calls]
    assert before[0::2] == ["a"] * 3  # even rounds start with "a", after a reversed round
    assert before[1::2] == ["c"] * 2


def test_median_ratio_pairs_samples_within_a_round():
    # Method a drifts 2x over the run, b with it; within a round a is always 1.1x b. Medians of
    # each taken apart would give 1.2 / 1.0 here; the per-round ratio gives 1.1.
    samples = {"a": [1.1, 1.32, 2.2, 1.76], "b": [1.0, 1.2, 2.0, 1.6]}
    assert median_ratio(samples, "a", "b") == pytest.approx(1.1, abs=1e-12)
    # Per-round ratios 1, 4 | 4, 4 | 1, 1: pairs 2, 4, 1 (geometric means), their median 2.
    assert median_ratio({"a": [1.0, 4.0, 4.0, 4.0, 1.0, 1.0], "b": [1.0] * 6}, "a", "b") == pytest.approx(2.0)


def test_median_ratio_weighs_both_orders_of_a_round_alike():
    # The round order alternates; here a is 5% slower whenever it runs first (even rounds), b
    # 5% slower whenever it does (odd rounds). The median of five single rounds took the even
    # rounds' ratio, 1.05 * 1.05 (three of the five); each pair of rounds holds one of each order.
    even, odd = 1.05 * 1.05, 1 / (1.05 * 1.05)
    samples = {"a": [even, odd] * 3, "b": [1.0] * 6}
    assert median_ratio(samples, "a", "b") == pytest.approx(1.0)


@pytest.mark.parametrize("rounds", [0, 1, 3, 5])
def test_median_ratio_wants_whole_pairs_of_rounds(rounds):
    with pytest.raises(ValueError, match="even, nonzero number of rounds"):
        median_ratio({"a": [1.0] * rounds, "b": [1.0] * rounds}, "a", "b")


def test_wall_batch_calls_back_to_back_then_waits_for_the_last_output():
    calls, waited = [], []
    sample = wall_batch(lambda: calls.append(len(calls)) or len(calls), waited.append, calls=5)
    ms = sample()
    assert calls == [0, 1, 2, 3, 4] and waited == [5]
    assert ms >= 0.0


def test_host_ms_times_issuing_calls_between_syncs():
    import time

    log = []

    def call():
        log.append("call")
        time.sleep(0.002)

    ms = host_ms(call, lambda: log.append("sync"), calls=3, repeats=2)
    # A sync before each batch (the device idle at its start), the batch not waited for, one at the end.
    assert log == ["sync", "call", "call", "call", "sync", "call", "call", "call", "sync"]
    assert 2.0 <= ms < 50.0  # per call, in milliseconds


def test_host_costs_divide_host_time_by_event_time(monkeypatch):
    import torch

    from benchmarks import flash_attention as bench

    issued = []
    monkeypatch.setattr(bench, "host_ms", lambda call, sync: issued.append(call) or 0.5)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    q, k, v, dout = (torch.from_numpy(a) for a in bench._inputs(1, 8, 2, 16))
    times = {"fwd/ours_torch": 0.25, "fwd+bwd/ours_torch": 1.0, "fwd/sdpa_cudnn": 0.2}  # no cuDNN fwd+bwd time
    entries = bench.host_costs(q, k, v, dout, False, times)
    assert len(issued) == 3  # a method without an event time is not issued
    assert entries["fwd: ours_torch host ms"] == 0.5
    assert entries["fwd: ours_torch host / event time"] == 2.0
    assert entries["fwd+bwd: ours_torch host / event time"] == 0.5
    assert entries["fwd: sdpa_cudnn host / event time"] == 2.5
    assert "fwd+bwd: sdpa_cudnn host ms" not in entries


def test_time_beside_plan_sizes_batches_from_the_plan_and_pairs_rounds(monkeypatch):
    import benchmarks.common as common

    sized = []

    def fake_wall_batch(fn, wait, calls):
        sized.append((fn, calls))
        return lambda: fn()  # a "sample" is the fake call's value: ms a call

    monkeypatch.setattr(common, "wall_batch", fake_wall_batch)
    # Three sizing samples, a warm-up round (not recorded), then eight rounds.
    plan_ms = iter([0.5, 0.35, 0.4, 9.0, 1.2, 1.3, 0.9, 1.4, 1.5, 0.8, 1.6, 1.7])
    runs = {"plan": lambda: next(plan_ms), "variant": lambda: 0.5}
    got = time_beside_plan(runs, lambda _: None)
    # Sized from the plan's fastest of three 20-call batches (0.35 ms -> 72 calls a batch).
    assert [calls for _, calls in sized] == [20, 20, 20, 72, 72]
    assert got["plan"] == (pytest.approx(1.35), 1.0)
    # The plan's time over the variant's: rounds' ratios 2.4 2.6 | 1.8 2.8 | 3.0 1.6 | 3.2 3.4,
    # the pairs' geometric means' median.
    assert got["variant"][0] == 0.5
    assert got["variant"][1] == pytest.approx((math.sqrt(2.4 * 2.6) + math.sqrt(1.8 * 2.8)) / 2)


def test_error_text_is_the_type_and_first_line():
    assert error_text(ValueError("bad shape\nmore")) == "ValueError: bad shape"
    assert error_text(RuntimeError()) == "RuntimeError: "
    assert error_text(KeyError("x" * 300)).startswith("KeyError: 'xxx") and len(error_text(KeyError("x" * 300))) == 210


def test_side_by_side_ratios_pair_the_right_methods(monkeypatch):
    import jax
    import torch

    from benchmarks import flash_attention as bench

    ms = {"ours_torch_wall": 1.0, "ours_jax": 1.02, "sdpa_cudnn_wall": 0.9, "jax_cudnn": 0.99}
    seen_calls, seen_waits = [], []

    def fake_timers(torch_fns, jax_arrays, causal, phase, calls, errors, jax_wait):
        seen_calls.append(calls)
        seen_waits.append(jax_wait)
        return {name: (lambda v=v: v) for name, v in ms.items()}

    monkeypatch.setattr(bench, "_wall_timers", fake_timers)
    arrays = bench._inputs(1, 8, 2, 16)
    q, k, v, dout = (torch.from_numpy(a) for a in arrays)
    times, entries, errors = bench.bench_side_by_side(q, k, v, dout, arrays, "bfloat16", False,
                                                      {"fwd/ours_torch": 0.2, "fwd+bwd/ours_torch": 5.0})
    assert errors == {} and seen_calls == [126, 20]  # 25 ms batches: 0.2 ms calls -> 126, 5 ms -> 20
    assert seen_waits == [jax.block_until_ready] * 2  # the default: jax's own wait
    assert times["fwd/ours_jax"] == 1.02 and times["fwd+bwd/sdpa_cudnn_wall"] == 0.9
    assert abs(entries["fwd: ours_jax time / ours_torch time"] - 1.02) < 1e-12
    assert abs(entries["fwd+bwd: jax_cudnn time / sdpa_cudnn time"] - 1.1) < 1e-12
    assert abs(entries["fwd: ours_jax vs jax_cudnn"] - 0.99 / 1.02) < 1e-12
    assert entries["fwd: wall-clock calls a batch"] == 126


class _Pending:
    """A stand-in for a jax array that becomes ready on its ``polls``-th ``is_ready()``."""

    def __init__(self, polls):
        self.polls, self.asked = polls, 0

    def is_ready(self):
        self.asked += 1
        return self.asked >= self.polls


def test_spin_until_ready_polls_every_leaf_until_it_is_ready():
    a, b = _Pending(3), _Pending(1)
    tree = {"out": a, "grads": (b,)}
    assert spin_until_ready(tree) is tree
    assert (a.asked, b.asked) == (3, 1)


def test_spin_until_ready_waits_for_real_jax_arrays():
    import jax.numpy as jnp

    out = spin_until_ready((jnp.arange(5) * 2, [jnp.ones(3)]))
    assert out[0].is_ready() and out[1][0].is_ready() and int(out[0].sum()) == 20


def test_batches_last_at_least_25_ms_within_20_to_200_calls():
    assert calls_per_batch(None) == 20 and calls_per_batch(5.0) == 20
    assert calls_per_batch(0.19) == 132 and calls_per_batch(0.35) == 72  # >= 25 ms
    assert calls_per_batch(0.01) == 200


def test_write_run_records_the_command_and_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/../" + __file__, "--seqs", "1024"])
    write_run(str(tmp_path / "run.json"), [{"seq": 1024}], calls=7)
    got = json.loads((tmp_path / "run.json").read_text())
    assert got["command"] == "python tests/test_bench_timing.py --seqs 1024"
    assert got["rows"] == [{"seq": 1024}] and got["calls"] == 7 and got["device"] and got["torch"]


def test_failed_methods_are_listed_by_row():
    # A row whose cuDNN failed compares with the best backend that ran; the run-level ratios
    # mixed such rows in without a word.
    from benchmarks import flash_attention as bench

    row = dict(dtype="bfloat16", head_dim=64, seq=2048, causal=True)
    rows = [dict(row, errors={}), dict(row, causal=False, errors={"fwd/sdpa_cudnn": "RuntimeError: no kernel",
                                                                   "fwd+bwd/sdpa_cudnn": "RuntimeError: no kernel"})]
    assert bench._failures(rows) == {"bflo d64 s2k": ["fwd+bwd/sdpa_cudnn", "fwd/sdpa_cudnn"]}
    assert bench._failures(rows[:1]) == {}


def test_event_rounds_time_each_working_call_in_turn_after_one_untimed_call():
    log, errors = [], {}

    def call(name):
        def run():
            log.append(("call", name))
            if name == "missing":
                raise RuntimeError("no such kernel\nmore")
        return run

    def timer(fn):  # stands in for do_bench: runs the call once, a distinct value per sample
        fn()
        return float(len(log))

    calls = {name: call(name) for name in ("a", "missing", "b")}
    samples = event_rounds(calls, errors, rounds=3, timer=timer)
    assert errors == {"missing": "RuntimeError: no such kernel"}  # recorded, not timed, not fatal
    # One untimed call each (compiles), one round sampled and dropped, reversed (the first kept
    # round then follows what every even round follows), then rounds in turn, alternating.
    assert [name for _, name in log] == ["a", "missing", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert samples == {"a": [6.0, 9.0, 10.0], "b": [7.0, 8.0, 11.0]}


def test_event_rounds_warm_each_sample_up_for_the_given_milliseconds(monkeypatch):
    from benchmarks import common

    seen = []
    monkeypatch.setattr(common, "bench_torch", lambda call, warmup_ms, rep_ms: seen.append((warmup_ms, rep_ms)) or 1.0)
    event_rounds({"a": lambda: None}, {}, rounds=2, warmup_ms=150)
    assert seen == [(150, 100)] * 3  # the dropped round's sample, then two kept ones


@pytest.mark.parametrize("given, expected", [({}, 200), ({"warmup_ms": 7}, 7)])
def test_flash_rows_warm_each_event_sample_up_for_200_ms_unless_told(monkeypatch, given, expected):
    # 200 ms: at the power cap a sample 10 ms after the method before it met that method's clock.
    import torch

    from benchmarks import flash_attention as bench

    seen = []
    monkeypatch.setattr(bench, "event_rounds",
                        lambda calls, errors, spans, warmup_ms: seen.append(warmup_ms) or {k: [1.0, 1.0] for k in calls})
    monkeypatch.setattr(bench, "host_costs", lambda *args: {})
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: t)
    bench.run_shape(64, 16, False, "bfloat16", batch=1, with_jax=False, **given)
    assert seen == [expected]


def test_flash_row_times_the_backends_it_is_given_and_host_costs_unless_told(monkeypatch):
    import torch

    from benchmarks import flash_attention as bench

    timed, host = [], []
    monkeypatch.setattr(bench, "event_rounds",
                        lambda calls, errors, spans, warmup_ms: timed.append(sorted(calls)) or {k: [1.0, 1.0] for k in calls})
    monkeypatch.setattr(bench, "host_costs", lambda *args: host.append(args) or {})
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: t)
    row = bench.run_shape(64, 16, True, "bfloat16", batch=1, with_jax=False, sdpa=("cudnn",), with_host=False)
    assert timed == [["fwd+bwd/ours_torch", "fwd+bwd/sdpa_cudnn", "fwd/ours_torch", "fwd/sdpa_cudnn"]]
    assert host == [] and set(row["seconds"]) == {"torch events"}
    assert row["fwd: best sdpa"] == "sdpa_cudnn"
    bench.run_shape(64, 16, True, "bfloat16", batch=1, with_jax=False)
    assert {name.split("/")[1] for name in timed[1]} == {"ours_torch", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
    assert len(host) == 1


def test_flash_long_rows_leave_out_the_efficient_backend_and_host_costs(monkeypatch):
    import argparse

    from benchmarks import flash_attention as bench

    calls = []
    monkeypatch.setattr(bench, "run_shape", lambda *args, **kwargs: calls.append((args, kwargs)) or {"tflops": {}})
    args = argparse.Namespace(long=True, overhead=False, dtypes=["bfloat16"], warmup_ms=200)
    extras = bench._extras(args)
    assert len(extras["seq_65536"]) == 2
    assert [a for a, _ in calls] == [(65536, 128, False, "bfloat16"), (65536, 128, True, "bfloat16")]
    for _, kwargs in calls:
        assert kwargs["sdpa"] == ("flash", "cudnn") and kwargs["with_host"] is False and kwargs["with_jax"] is False
        assert kwargs["batch"] == 1 and kwargs["warmup_ms"] == 200


def test_flash_ours_vs_best_sdpa_is_taken_within_rounds(monkeypatch):
    # cuDNN is the best backend by its median; the row reports the ratios within rounds (1.0 / 1.1,
    # 1.5 / 1.2 | 2.0 / 2.2, 1.8 / 2.0 | 1.2 / 1.0, 1.0 / 1.0), paired, the median pair the first,
    # not the ratio of the two medians (1.35 / 1.15).
    import torch

    from benchmarks import flash_attention as bench

    rounds = {"fwd/ours_torch": [1.1, 1.2, 2.2, 2.0, 1.0, 1.0], "fwd/sdpa_cudnn": [1.0, 1.5, 2.0, 1.8, 1.2, 1.0],
              "fwd/sdpa_flash": [1.7] * 6}
    for name in list(rounds):
        rounds[name.replace("fwd/", "fwd+bwd/")] = rounds[name]
    monkeypatch.setattr(bench, "event_rounds",
                        lambda calls, errors, spans, warmup_ms: {k: rounds[k] for k in calls if k in rounds})
    monkeypatch.setattr(bench, "host_costs", lambda *args: {})
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: t)  # the inputs stay on the CPU
    row = bench.run_shape(64, 16, False, "bfloat16", batch=1, with_jax=False)
    assert row["fwd: best sdpa"] == "sdpa_cudnn"
    assert row["fwd: ours_torch vs best sdpa"] == pytest.approx(math.sqrt(1.0 / 1.1 * 1.5 / 1.2))
    assert row["ms"]["fwd/sdpa_cudnn"] == pytest.approx(1.35) and row["rounds_ms"]["fwd/ours_torch"][:3] == [1.1, 1.2, 2.2]
    assert "fwd: ours_torch clock / best sdpa clock" not in row  # no clock samples: no ratio
    assert set(row["seconds"]) == {"torch events", "host costs"}  # what the row's parts took
    assert all(0 <= t < 60 for t in row["seconds"].values())


def test_flash_row_reports_the_clocks_each_method_met_within_rounds(monkeypatch):
    # Each sample's span is stamped with the clock a fake GpuLog reports for it; the row gives
    # the clocks per round and ours' over the best backend's within rounds (0.8, 1.25 | 1.2, 1.2),
    # paired as times are: 1.1, not the ratio of medians (1800 / 1550).
    import torch

    from benchmarks import flash_attention as bench

    mhz = {"ours_torch": [1600, 2000, 1800, 1800], "sdpa_cudnn": [2000, 1600, 1500, 1500], "sdpa_flash": [1980] * 4}
    ms = {"ours_torch": [1.0] * 4, "sdpa_cudnn": [1.1] * 4, "sdpa_flash": [2.0] * 4}

    def event_rounds(calls, errors, spans, warmup_ms):
        for name in calls:
            if name.split("/")[1] in mhz:  # efficient: taken as failed, as in the test above
                spans[name] = [(clock, clock) for clock in mhz[name.split("/")[1]]]
        return {name: ms[name.split("/")[1]] for name in calls if name.split("/")[1] in ms}

    class FakeLog:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def during(self, start, end):
            return {"sm_mhz": start}

    monkeypatch.setattr(bench, "event_rounds", event_rounds)
    monkeypatch.setattr(bench, "GpuLog", FakeLog)
    monkeypatch.setattr(bench, "host_costs", lambda *args: {})
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: t)
    row = bench.run_shape(64, 16, False, "bfloat16", batch=1, with_jax=False)
    assert [c["sm_mhz"] for c in row["rounds_clocks"]["fwd/ours_torch"]] == [1600, 2000, 1800, 1800]
    assert row["fwd: ours_torch clock / best sdpa clock"] == pytest.approx(1.1)
    assert row["fwd+bwd: ours_torch clock / best sdpa clock"] == pytest.approx(1.1)
    assert bench._versus(row) == ("fwd vs sdpa_cudnn 1.100 (clock ratio 1.100), "
                                  "fwd+bwd vs sdpa_cudnn 1.100 (clock ratio 1.100)")


def test_event_rounds_stamp_each_sample_in_the_order_they_ran():
    ticks, when = iter(range(100)), {}

    def timer(fn):
        tick = float(next(ticks))
        when[tick] = time.perf_counter()
        return tick

    spans = {}
    samples = event_rounds({"a": lambda: None, "b": lambda: None}, {}, rounds=3, timer=timer, spans=spans)
    assert samples == {"a": [2.0, 5.0, 6.0], "b": [3.0, 4.0, 7.0]}  # (b a dropped), a b, b a, a b
    assert [len(spans[n]) for n in "ab"] == [3, 3]  # the kept rounds' only
    for name in "ab":  # each span is its own sample's
        assert all(start <= when[tick] <= end for (start, end), tick in zip(spans[name], samples[name]))
    # The second round ran b before a, the third a before b.
    assert spans["b"][1][1] <= spans["a"][1][0] and spans["a"][2][1] <= spans["b"][2][0]


def test_clock_ratio_is_paired_within_rounds_and_none_without_samples():
    clocks = {"x": [{"sm_mhz": 1500}, {"sm_mhz": 1800}, {"sm_mhz": 1600}, {"sm_mhz": 1500}],
              "y": [{"sm_mhz": 1500}, {"sm_mhz": 1500}, {"sm_mhz": 2000}, {"sm_mhz": 1500}]}
    # rounds 1.0, 1.2 | 0.8, 1.0: the median of the pairs' geometric means
    assert clock_ratio(clocks, "x", "y") == pytest.approx((math.sqrt(1.2) + math.sqrt(0.8)) / 2)
    assert clock_ratio({"x": clocks["x"], "y": [{}, {"sm_mhz": 1}, {"sm_mhz": 1}, {"sm_mhz": 1}]}, "x", "y") is None
    assert clock_ratio(clocks, "x", "missing") is None


def test_program_batch_runs_the_program_once_and_divides_by_its_calls():
    runs, waited = [], []
    sample = program_batch(lambda x: runs.append(x) or "out", (7,), waited.append, calls=4)
    ms = sample()
    assert runs == [7] and waited == ["out"]
    assert ms >= 0.0


def test_chained_program_feeds_each_output_to_the_next_call():
    import jax
    import jax.numpy as jnp

    from benchmarks.flash_attention import chained_program

    def fn(q, k, v):
        return q * k + v

    q, k, v = jnp.full(8, 1.0), jnp.full(8, 2.0), jnp.full(8, 3.0)
    # Each call's output is the next call's query: 1 -> 5 -> 13 -> 29.
    assert float(chained_program(fn, calls=3)(q, k, v)[0]) == 29.0

    def multiplies(jitted):
        return jitted.lower(q, k, v).compile().as_text().count(" multiply(")

    # XLA keeps every call of the chain, where it merges calls on the same inputs into one.
    assert multiplies(chained_program(fn, calls=5)) == 5
    assert multiplies(jax.jit(lambda q, k, v: [fn(q, k, v) for _ in range(5)][-1])) == 1


def test_flash_shape_parses_seq_head_dim_and_mask():
    import argparse

    from benchmarks.common import flash_shape

    assert flash_shape("1024:64:causal") == (1024, 64, True)
    assert flash_shape("4000:128:full") == (4000, 128, False)
    with pytest.raises(argparse.ArgumentTypeError, match="SEQ:HEAD_DIM"):
        flash_shape("1024:64:sliding")


def test_gpu_log_summarises_the_samples_inside_an_interval():
    from benchmarks.common import GpuLog

    log = GpuLog()
    log.samples = [(1.0, ("1980", "650.5", "60", "0x0000000000000004")),  # power cap
                   (2.0, ("1700", "700", "61", "0x0000000000000001")),  # idle
                   (3.0, ("[N/A]", "1", "1", "0x0")),  # not a number: left out
                   (4.0, ("1500", "500", "70"))]  # a short line: left out
    assert log.during(0.5, 2.5) == {"sm_mhz": 1840, "power_w": 675.2, "max_temp_c": 61.0, "reasons": "0x5",
                                    "samples": 2}
    assert log.during(1.5, 2.0)["sm_mhz"] == 1700
    assert log.during(2.5, 5.0) == {}
