"""How the GPT examples judge a run: our attention's loss curve against plain attention's."""
from __future__ import annotations

import math

# max |loss difference| over the run (float32). The curves differ by 2.4e-7 (torch and flax)
# over the default 50 steps; at 2e-3 an attention output 2% off passed (5.4e-4 apart
# after 10 steps of torch_gpt).
TOLERANCE = 1e-5


def judge(curves: dict[str, list[float]], steps: int) -> tuple[float, bool]:
    """(max |loss difference|, whether the run passes). A NaN difference counts as the max:
    ``max()`` skipped one after the first step, so a NaN loss passed runs too short to check
    learning (``steps < 20``)."""
    diffs = [abs(a - b) for a, b in zip(*curves.values())]
    diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    ours = curves["ejkernel"]
    learned = steps < 20 or ours[-1] < ours[0] - 0.5
    return diff, diff <= TOLERANCE and learned
