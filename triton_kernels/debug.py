"""Debug switches shared by both launchers (no framework imports here)."""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def poisoning() -> bool:
    """Whether launchers fill freshly allocated outputs with NaN / a sentinel before a launch."""
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poison_outputs(enabled: bool = True):
    """Poison kernel outputs before each launch so elements a kernel forgets to write show up.

    Float outputs become NaN and integer outputs ``POISON_INT`` (``poison_int`` where it does not fit). Outputs the plan zeroes are
    left zeroed. Applies where the launcher allocates the buffers itself (torch on any device,
    jax on the interpreter path).
    """
    previous = poisoning()
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = previous


POISON_INT = -0x5EED


def poison_int(lowest: int, highest: int) -> int:
    """The integer sentinel for a dtype of range [lowest, highest]: ``POISON_INT`` where it fits
    (int16 and wider), else the end of the range nearest to it (int8: -128; unsigned: highest)."""
    if lowest <= POISON_INT <= highest:
        return POISON_INT
    return lowest if lowest < 0 else highest
