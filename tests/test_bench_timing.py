"""The benchmarks' side-by-side timing (benchmarks/common.py): which sample lands where.

The jax-vs-torch ratios in benchmarks/flash_attention.py are only as good as the pairing of
samples, so the pairing is checked here with fake timers that record when they ran.
"""
from benchmarks.common import interleaved, median_ratio, wall_batch


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
    assert log == ["a", "a", "b", "b", "c", "c",  # warm-up, not recorded
                   "a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    # Each method's samples are its own calls, in round order.
    assert samples == {"a": [7.0, 12.0, 13.0, 18.0], "b": [8.0, 11.0, 14.0, 17.0], "c": [9.0, 10.0, 15.0, 16.0]}


def test_median_ratio_pairs_samples_within_a_round():
    # Method a drifts 2x over the run, b with it; within a round a is always 1.1x b. Medians of
    # each taken apart would give 1.2 / 1.0 here; the per-round ratio gives 1.1.
    samples = {"a": [1.1, 1.32, 2.2], "b": [1.0, 1.2, 2.0]}
    assert abs(median_ratio(samples, "a", "b") - 1.1) < 1e-12
    assert abs(median_ratio({"a": [1.0, 5.0, 2.0], "b": [1.0, 1.0, 1.0]}, "a", "b") - 2.0) < 1e-12


def test_wall_batch_calls_back_to_back_then_waits_for_the_last_output():
    calls, waited = [], []
    sample = wall_batch(lambda: calls.append(len(calls)) or len(calls), waited.append, calls=5)
    ms = sample()
    assert calls == [0, 1, 2, 3, 4] and waited == [5]
    assert ms >= 0.0
