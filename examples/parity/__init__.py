"""Registry of parity cases for examples/parity_report.py.

An op joins the report by adding a module to this package that calls ``register(...)``; the
report discovers every module here, so no list is edited anywhere else.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Case:
    op: str  # public op name, the same in ejkernel_torch and ejkernel_jax
    label: str  # shape summary for the table
    dtype: str
    make_inputs: Callable[[np.random.Generator], Sequence[np.ndarray]]
    reference: Callable  # float64 torch reference taking the same positional inputs
    n_diff: int = 0  # gradients are checked w.r.t. the first n_diff inputs
    kwargs: dict = field(default_factory=dict)
    # Callable(module) -> the op; default: getattr(module, op).
    resolve: Callable | None = None

    def fn(self, module):
        return self.resolve(module) if self.resolve else getattr(module, self.op)


_CASES: list[Case] = []


def register(*cases: Case) -> None:
    _CASES.extend(cases)


def all_cases() -> list[Case]:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return list(_CASES)
