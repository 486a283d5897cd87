"""Run a launch plan under the Triton interpreter, chosen per launch.

No process-wide ``TRITON_INTERPRET`` switch: the kernel's raw Python function is wrapped in an
``InterpretedFunction`` for this launch only. Two things make that work in a process that also
compiles kernels for a GPU:

* ``@triton.jit`` functions the kernel reaches (our helpers, and ``tl.zeros``/``tl.max``/...
  from Triton's own standard library) are ``JITFunction`` objects that refuse to run outside a
  compiled kernel. For the launch they are swapped for interpreted twins, which is what
  ``TRITON_INTERPRET=1`` does once at import time.
* The interpreter patches ``triton.language`` (builtins, tensor methods) while it runs and does
  not always undo nested patches. Every namespace touched is snapshotted before the launch and
  restored after it, so a later GPU compile in the same process sees pristine modules.

Both steps hold one lock; do not compile GPU kernels from another thread while an interpreted
launch runs (building plans there is fine: ``LaunchPlan`` swaps a twin back for its kernel,
and hashes the kernel under the lock, ``plan.twins_lock``).
The interpreter reads and writes memory through torch-style CPU tensors (``data_ptr``,
``untyped_storage``); callers pass CPU torch tensors (the jax front wraps its numpy buffers
without copying).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Sequence

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .plan import LaunchPlan, twins_lock

try:  # Imported lazily by the launch path; load it now, while jit functions are still unswapped.
    import triton.experimental.gluon  # noqa: F401
except ImportError:
    pass

_lock = twins_lock  # held for a whole launch, twins and patches included


class _Twin(InterpretedFunction):
    """The interpreted stand-in for the JITFunction ``jit_function``, swapped into module
    namespaces for a launch. It keeps the function it stands in for: a plan built meanwhile on
    another thread (jax runs callbacks on threads of its own) reads the twin from the kernel's
    module, and ``LaunchPlan`` puts the original back."""

    def __init__(self, jit_function: JITFunction):
        super().__init__(jit_function.fn)
        self.jit_function = jit_function


_twins: dict[int, _Twin] = {}  # by id of the JITFunction (hashing one parses its source)


def _twin(jit_function: JITFunction) -> _Twin:
    twin = _twins.get(id(jit_function))
    if twin is None:  # a twin keeps its JITFunction alive: the id stays its own
        twin = _twins[id(jit_function)] = _Twin(jit_function)
    return twin


def _language_namespaces() -> list[Any]:
    # A copy in one C call: another thread's import (jax runs host callbacks on several threads)
    # can land while a Python-level iteration walks sys.modules ("dictionary changed size").
    modules = [m for name, m in sys.modules.copy().items() if name.startswith("triton.language") and m]
    classes = [v for v in vars(tl.core).values() if inspect.isclass(v)]
    return modules + classes


def _reachable_module_dicts(fn) -> list[dict]:
    """Globals of ``fn`` and of every jit function reachable through module globals."""
    dicts, seen, todo = [], set(), [fn.__globals__] + [vars(m) for m in _language_namespaces()
                                                       if inspect.ismodule(m)]
    while todo:
        namespace = todo.pop()
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        dicts.append(namespace)
        todo.extend(v.fn.__globals__ for v in list(namespace.values()) if isinstance(v, JITFunction))
    return dicts


@contextlib.contextmanager
def _restored(objects: Sequence[Any]):
    """Put back every attribute of ``objects`` (modules or classes) changed inside the block.

    Names the interpreter *adds* to a module (it injects its own globals next to the functions
    it rewrites, and caches those rewrites) are kept: they shadow nothing.
    """
    saved = [(obj, dict(vars(obj))) for obj in objects]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()


def _index(tensor) -> int:
    return int(tensor.handle.data.reshape(-1)[0])


def _patch_lang_tensor_fixed(tensor, scope):
    # Triton 3.6's interpreter converts a block index to int with ``int(array)``, which numpy
    # >= 2.5 refuses for a 1-element 1-D array, so ``range(tl.program_id(0), ...)`` fails there.
    _original_patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", _index)


_original_patch_lang_tensor = getattr(_interpreter, "_patch_lang_tensor", None)
_original_patch_lang = getattr(_interpreter, "_patch_lang", None) if hasattr(_interpreter, "_LangPatchScope") else None


def _patch_lang_once_per_launch():
    """A ``_patch_lang`` that patches each language module once per launch.

    The interpreter patches ``triton.language`` at the launch and again at every call of a
    ``@triton.jit`` helper from inside it (``InterpretedFunction.__call__``), about 2 ms of
    ``inspect.getmembers`` each time that changes nothing: a patched builtin is no longer a
    builtin. That was 40% of the GPT example's time on CPU. The launch's own patch is undone
    when it ends (and ``_restored`` puts everything back anyway); a helper that reaches a module
    the launch did not patch (``triton.language.core`` from Triton's standard library) still
    gets it patched.
    """
    patched: set[int] = set()
    langs_of: dict[int, frozenset[int]] = {}  # by id of a module's globals; they live the launch

    def patch_lang(fn):
        langs = langs_of.get(id(fn.__globals__))
        if langs is None:
            langs = langs_of[id(fn.__globals__)] = frozenset(
                id(v) for v in list(fn.__globals__.values()) if inspect.ismodule(v) and v in (tl, tl.core))
        if langs and langs <= patched:
            return _interpreter._LangPatchScope()  # nothing to change, nothing to undo
        scope = _original_patch_lang(fn)
        patched.update(langs)
        return scope

    return patch_lang


def _bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (what compiled kernels do)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x40)).astype(np.uint16)  # a NaN must not round to inf
    return np.where(np.isnan(x), quiet_nan, rounded).reshape(np.shape(x))


def _cast_impl_fixed(builder, src, dst_type):
    # Triton's interpreter turns float32 into bfloat16 by dropping the low 16 bits (round toward
    # zero), where compiled kernels round to nearest even: every bfloat16 result on CPU carried
    # up to twice the rounding error of the GPU's.
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return _interpreter.TensorHandle(_bfloat16_bits(src.data), dst_type.scalar)
    return _original_cast_impl(builder, src, dst_type)


_builder_class = getattr(_interpreter, "InterpreterBuilder", None)
_original_cast_impl = getattr(_builder_class, "cast_impl", None)


@contextlib.contextmanager
def _interpreter_scope(fn):
    module_dicts = _reachable_module_dicts(fn)
    builder = [_builder_class] if _original_cast_impl is not None else []
    with _restored(_language_namespaces() + [_interpreter] + builder):
        if _original_patch_lang_tensor is not None:
            _interpreter._patch_lang_tensor = _patch_lang_tensor_fixed
        if _original_patch_lang is not None:
            _interpreter._patch_lang = _patch_lang_once_per_launch()
        if builder:
            _builder_class.cast_impl = _cast_impl_fixed
        swapped = []
        for namespace in module_dicts:
            for name, value in list(namespace.items()):
                if isinstance(value, JITFunction):
                    namespace[name] = _twin(value)
                    swapped.append((namespace, name, value))
        try:
            yield
        finally:
            for namespace, name, value in swapped:
                namespace[name] = value


def run_interpreted(plan: LaunchPlan, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Launch ``plan`` on CPU torch tensors; ``outputs`` are written in place."""
    if plan.is_empty:
        return
    args = plan.runtime_args(inputs, outputs)
    # numpy warns where a GPU computes IEEE results silently (garbage padding times a masked zero,
    # an exp that overflows to inf on purpose); the kernels' masks decide what is kept.
    with _lock, _interpreter_scope(plan.kernel.fn), np.errstate(all="ignore"):
        _twin(plan.kernel)[plan.grid](*args, **plan.constexpr_dict)
