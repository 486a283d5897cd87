"""Framework adapters for the shared suite: numpy <-> framework arrays, VJPs, devices.

Tests use only this interface, so each test runs unchanged for torch and for jax:

    x = fw.asarray(np_x, "bfloat16")       # on the framework's default device
    y = fw.ops.softmax(x)                   # fw.ops is ejkernel_torch or ejkernel_jax
    np_y = fw.to_numpy(y)                   # float arrays come back as float64
    grads = fw.vjp(fn, [x], cotangent)      # list of numpy arrays
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


@functools.cache
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Framework:
    name: str

    def __str__(self) -> str:
        return self.name

    # -- modules --------------------------------------------------------------
    @property
    def ops(self):
        if self.name == "torch":
            import ejkernel_torch

            return ejkernel_torch
        import ejkernel_jax

        return ejkernel_jax

    def launch(self, plan, *arrays):
        """Run a LaunchPlan through this framework's launcher."""
        import importlib

        return importlib.import_module(f"ejkernel_{self.name}.launch").launch(plan, *arrays)

    @property
    def device(self) -> str:
        return "cuda" if cuda_available() else "cpu"

    # -- arrays ---------------------------------------------------------------
    def dtype(self, name: str):
        if self.name == "torch":
            import torch

            return getattr(torch, name)
        import jax.numpy as jnp

        return jnp.dtype(name)

    def asarray(self, a, dtype: str | None = None):
        """float64 data goes through float32 first in both frameworks (jax has no x64 here),
        so both see bit-identical inputs after the cast to ``dtype``."""
        a = np.asarray(a)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        if self.name == "torch":
            import torch

            t = torch.from_numpy(np.array(a, copy=True, order="C")).to(self.device)
            return t.to(self.dtype(dtype)) if dtype else t
        import jax.numpy as jnp

        x = jnp.asarray(a)
        return x.astype(dtype) if dtype else x

    def to_numpy(self, x) -> np.ndarray:
        """Float arrays come back as float64 (bf16 has no numpy dtype), ints unchanged."""
        if self.name == "torch":
            import torch

            x = x.detach().cpu()
            if x.is_floating_point():
                x = x.to(torch.float64)
            return x.numpy()
        a = np.asarray(x)
        if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16":
            return a.astype(np.float64)
        return a

    # -- transforms -------------------------------------------------------------
    def vmap(self, fn: Callable, in_dims) -> Callable:
        """``fn`` mapped over axis ``in_dims`` of its arguments (None: unbatched), output axis 0."""
        if self.name == "torch":
            import torch

            return torch.func.vmap(fn, in_dims=in_dims)
        import jax

        return jax.vmap(fn, in_axes=in_dims)

    def grad(self, fn: Callable, argnums: tuple[int, ...]) -> Callable:
        """The gradients of the scalar ``fn`` w.r.t. the arguments ``argnums`` (a tuple)."""
        if self.name == "torch":
            import torch

            return torch.func.grad(fn, argnums=argnums)
        import jax

        return jax.grad(fn, argnums=argnums)

    def has_loop(self, fn: Callable, *args) -> bool:
        """Whether jax's jaxpr of ``fn(*args)`` holds a loop (scan, while: e.g. one launch per
        vmapped sample). jax only."""
        import jax

        jaxpr = str(jax.make_jaxpr(fn)(*args))
        return "scan[" in jaxpr or "while[" in jaxpr

    # -- autodiff ---------------------------------------------------------------
    def vjp(self, fn: Callable, primals: Sequence[Any], cotangent) -> list[np.ndarray]:
        """Gradients of ``sum(fn(*primals) * cotangent)`` w.r.t. every primal."""
        if self.name == "torch":
            leaves = [p.detach().clone().requires_grad_(True) for p in primals]
            out = fn(*leaves)
            out.backward(cotangent)
            return [self.to_numpy(p.grad) for p in leaves]
        import jax

        _, pullback = jax.vjp(fn, *primals)
        return [self.to_numpy(g) for g in pullback(cotangent)]


def x64(fw: Framework):
    """A context in which ``fw`` keeps 64-bit arrays: jax's x64 mode (torch always keeps them)."""
    if fw.name == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


@functools.cache
def registered_ops():
    """A torch-function mode that passes every call through unchanged: while it is active the
    torch ops are not in plain eager mode (``ejkernel_torch.launch.plain_eager``) and run their
    registered ops, what the plain eager paths are compared with."""
    import torch

    class _PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return _PassThrough()


def get(name: str) -> Framework:
    return Framework(name)


def lse_error(lse: np.ndarray, ref: np.ndarray) -> float:
    """Error of a log-sum-exp: relative where |lse| is large, absolute where it is near 0.

    lse enters attention as exp(s - lse), so its absolute error is what reaches the output; a
    plain relative error is ill-conditioned for a row whose lse happens to be ~0 (one key with
    a logit of 1e-4 has lse 1e-4). Normalised by max(||ref||, sqrt(n)): rms error below 1 unit."""
    out = np.asarray(lse, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), np.sqrt(ref.size), 1e-30))


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in ``out`` gives inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


# Relative-error bounds vs a float64 reference, per input dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def run_on_two_host_devices(script: str) -> None:
    """Run ``script`` in a fresh Python with jax on two host CPU devices (the flag must be set
    before jax is imported, so not in this process); fails with its stderr if it fails."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
