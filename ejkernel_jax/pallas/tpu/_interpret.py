"""The ``interpret`` argument of the Pallas kernels."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def resolve_interpret(interpret) -> Any:
    """``None``: Pallas interpret mode unless jax's default backend is a TPU. Else a bool (numpy's
    too) or a ``pltpu.InterpretParams``, as given. Anything else is refused: it was read by
    truthiness, so ``interpret="no"`` ran in interpret mode."""
    if interpret is None:
        return jax.default_backend() != "tpu"
    if isinstance(interpret, (bool, np.bool_)):
        return bool(interpret)
    if type(interpret).__name__.endswith("InterpretParams"):
        return interpret
    raise TypeError(f"interpret must be None, a bool or a pltpu.InterpretParams, got {interpret!r}")
