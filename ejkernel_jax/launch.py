"""Run a ``LaunchPlan`` on jax arrays.

GPU backend: ``jax_triton.triton_call`` with exactly the plan's grid, constexprs, ``num_warps``,
``num_stages`` and ``enable_fp_fusion`` (jax-triton is imported lazily: it fails to import on a
CPU-only jaxlib); Gluon plans through jaxlib's Triton call directly (``_gluon_call``). Any other backend: ``jax.pure_callback`` running the Triton interpreter on the
host buffers. Both work under ``jax.jit``; ``jax.vmap`` goes through a batching rule that maps
the launch over the batch axis.

Importing jax-triton sets ``TRITON_CACHE_DIR`` to "" for the whole process, after which every
torch-side Triton launch fails with "Could not create or locate cache dir". The import below
puts the variable back as it was (and drops an empty one left by an earlier import).
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_jax._vma import cast_varying, varying_axes
from triton_kernels.plan import DeviceFacts, LaunchPlan


def _restore_triton_cache_dir(saved: str | None) -> None:
    if saved:
        os.environ["TRITON_CACHE_DIR"] = saved
    elif os.environ.get("TRITON_CACHE_DIR") == "":
        del os.environ["TRITON_CACHE_DIR"]


@functools.cache
def _jax_triton():
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as e:
        raise ImportError(
            "running Triton kernels from jax on a GPU needs jax-triton: pip install 'ejkernel-bridge[gpu]'"
        ) from e
    finally:
        _restore_triton_cache_dir(saved)
    return jax_triton


def backend() -> str:
    """The platform the ops launch for: that of jax's default device when one is set
    (``jax.default_device(...)``, the ``jax_default_device`` option), else the default backend.
    On a GPU machine inside ``jax.default_device(cpu)`` the GPU path failed to lower for the
    CPU ("MLIR translation rule for primitive 'triton_kernel_call' not found")."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    platform = device if isinstance(device, str) else device.platform
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def device_facts() -> DeviceFacts:
    """Facts for the default jax backend; the same as the torch front's on the same GPU."""
    if backend() != "gpu":
        return DeviceFacts.cpu()
    return _gpu_facts()


@functools.cache
def _gpu_facts() -> DeviceFacts:
    device = jax.devices("gpu")[0]
    major, minor = (int(p) for p in str(device.compute_capability).split(".")[:2])
    from triton_kernels.flash_attention import gluon_forward

    from . import _gluon_call

    return DeviceFacts.cuda((major, minor), int(device.core_count),
                            gluon=gluon_forward.enabled() and _gluon_call.supported())


def launch(plan: LaunchPlan, *inputs: jax.Array) -> tuple[jax.Array, ...]:
    """Run ``plan`` on ``inputs`` and return its outputs (a tuple, one per plan output)."""
    for name, x, dtype in zip(plan.inputs, inputs, plan.input_dtypes):
        if jnp.dtype(x.dtype).name != dtype:
            raise ValueError(f"{plan.name}: input {name} must be {dtype}, got {x.dtype}")
    if plan.is_empty and not plan.aliases:
        outputs = tuple(jnp.zeros(o.shape, o.dtype) for o in plan.outputs if o.returned)
    else:
        run = _batchable(plan) if any_traced(*inputs) else functools.partial(_run, plan)
        outputs = tuple(run(*inputs))
    return _varying_like(outputs, inputs)


def any_traced(*xs) -> bool:
    """Whether any of ``xs`` is a tracer: only then can a ``vmap`` be batching the call. A
    ``custom_vmap`` function traces itself on every eager call (about 0.2 ms of host time per
    call on CPU), so concrete inputs skip the vmap rules."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _run(plan: LaunchPlan, *xs):
    return _launch_gpu(plan, xs) if backend() == "gpu" else _launch_interpreted(plan, xs)


def _varying_like(outputs: tuple, inputs) -> tuple:
    """``outputs`` typed as varying over every manual axis an input varies over. Neither a host
    callback nor a jax-triton call carries that type through: inside ``shard_map`` the outputs
    came out invariant, so a gradient failed the custom VJPs' type check and an ``out_specs=P()``
    for a per-shard result was accepted (keeping one shard's value) instead of refused."""
    axes = varying_axes(*inputs)
    if not axes:
        return outputs
    return tuple(cast_varying(o, axes) for o in outputs)


@functools.lru_cache(maxsize=1024)
def _batchable(plan: LaunchPlan):
    """The launch as a function of its array inputs, with a vmap rule that maps over the batch."""

    @jax.custom_batching.custom_vmap
    def run(*xs):
        return _run(plan, *xs)

    @run.def_vmap
    def _rule(axis_size, in_batched, *xs):
        xs = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
              for x, batched in zip(xs, in_batched)]
        outs = jax.lax.map(lambda args: tuple(run(*args)), tuple(xs))
        return tuple(outs), (True,) * len(outs)

    return run


def _out_shapes(plan: LaunchPlan, every: bool = False):
    """The outputs a launch returns, or with ``every`` all the kernel writes (``Output.returned``)."""
    return tuple(jax.ShapeDtypeStruct(o.shape, jnp.dtype(o.dtype)) for o in plan.outputs if every or o.returned)


def _launch_gpu(plan: LaunchPlan, inputs: Sequence[jax.Array]):
    if plan.needs_scratch:  # jax-triton passes no global scratch
        from . import _gluon_call

        return plan.results(_gluon_call.launch(plan, _gpu_facts(), inputs))
    jt = _jax_triton()
    by_name = dict(zip(plan.inputs, inputs))
    # jax-triton types a Python float as fp64; plans hold float32 values.
    by_name.update((n, np.float32(v) if isinstance(v, float) else v) for n, v in plan.scalars)
    args = [by_name[n] for n in plan.kernel.arg_names if n in by_name]
    return plan.results(jt.triton_call(
        *args,
        kernel=plan.kernel,
        out_shape=_out_shapes(plan, every=True),
        grid=plan.grid,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        enable_fp_fusion=plan.enable_fp_fusion,
        zeroed_outputs=tuple(i for i, o in enumerate(plan.outputs) if o.zeroed),
        input_output_aliases=dict(plan.aliases),
        **plan.constexpr_dict,
    ))


def _launch_interpreted(plan: LaunchPlan, inputs: Sequence[jax.Array]):
    # Imported here, while tracing, not first inside the callback: a result nobody waited for runs
    # its callback during interpreter shutdown, where torch's import fails ("can't register atexit
    # after shutdown") and jax prints the traceback from its atexit handlers.
    from ejkernel_torch.launch import launch as torch_launch  # the interpreter speaks torch tensors

    return jax.pure_callback(
        functools.partial(_run_on_host, torch_launch, plan), _out_shapes(plan), *inputs, vmap_method="sequential"
    )


# -- host side of the interpreter path -----------------------------------------------------------


def _to_torch(a: np.ndarray):
    """Zero-copy view of a host buffer as a CPU torch tensor (what the interpreter reads)."""
    import torch

    a = np.require(a, requirements="C")
    with warnings.catch_warnings():  # jax hands out read-only buffers; kernels never write inputs
        warnings.simplefilter("ignore", UserWarning)
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def _to_numpy(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _run_on_host(torch_launch, plan: LaunchPlan, *arrays: np.ndarray):
    outputs = torch_launch(plan, *(_to_torch(a) for a in arrays))
    return tuple(_to_numpy(o) for o in outputs)
