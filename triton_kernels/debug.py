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

    Float outputs become NaN and integer outputs ``POISON_INT``. Outputs the plan zeroes are
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
