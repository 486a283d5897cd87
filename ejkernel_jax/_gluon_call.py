"""Gluon plans from jax: compiled here, run by jaxlib's Triton custom call.

jax-triton compiles ``@triton.jit`` kernels only, and passes no global scratch, where Gluon
kernels build their TMA descriptors. jaxlib's own ``TritonKernel`` takes a compiled kernel and
its scratch size (since jaxlib 0.11), so a Gluon plan is compiled by ``triton_kernels.aot`` (the
specialization torch's launcher gives it: pointers 16-byte aligned, which XLA's buffers are, ints
unspecialized but 1) and handed to the ``triton_kernel_call`` custom call through a primitive of
our own. Torch launches the same PTX (assembled by Triton's ptxas, where jaxlib assembles it with
XLA's PTX compiler), and both fronts give the same bits (``tests/test_flash_gluon.py`` checks it
on a GPU).

Global scratch comes from XLA, not from jaxlib. Asked for scratch, jaxlib allocates it on the
stream for every launch and frees it after (``cuMemAllocAsync`` / ``cuMemFreeAsync``), which left
the GPU idle 0.6-3.8 us longer a call than without (on an H200, flash forwards at seq 1024-4096,
``scripts/probe_flash_gaps.py --jax``; torch's launcher keeps its scratch). So jaxlib is told the
kernel needs none, and the custom call gets one more output, the scratch, which XLA places with
the others (no work on the stream) and which ``launch`` does not return. It is passed as the last
array parameter: Triton's ABI takes the global scratch pointer right after the kernel's own
parameters, so ours lands there; jaxlib's own (null) pointers follow it, in the profile scratch
slot (unused) and past the kernel's parameters, where CUDA reads nothing.
"""
from __future__ import annotations

import functools
import math
import zlib
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir

from triton_kernels.aot import compile_plan, target_for
from triton_kernels.plan import DeviceFacts, LaunchPlan


@functools.cache
def supported() -> bool:
    """Whether this jaxlib's Triton call provides global scratch (jaxlib >= 0.11 on CUDA)."""
    try:
        from jax._src.lib import gpu_triton

        # (name, warps, ctas, shared bytes, ptx, ttir, capability, scratch bytes, scratch alignment)
        gpu_triton.TritonKernel("probe", 4, 1, 0, "", "", 90, 0, 1)
    except (ImportError, AttributeError, TypeError):
        return False
    return True


def launch(plan: LaunchPlan, facts: DeviceFacts, inputs: Sequence[jax.Array]) -> list[jax.Array]:
    """The outputs of ``plan`` run on ``inputs``, one per plan output (the scratch left out)."""
    if plan.aliases:
        raise NotImplementedError(f"{plan.name}: the Gluon launcher has no aliased outputs")
    call, scratch_bytes = _call(plan, facts)
    out_types = tuple((o.shape, o.dtype) for o in plan.outputs)
    if scratch_bytes:
        out_types += (((scratch_bytes,), "uint8"),)
    return _primitive().bind(*inputs, call=call, out_types=out_types)[:len(plan.outputs)]


class Array(NamedTuple):
    """An array parameter of the Triton call: bytes it zeroes before the launch, pointer alignment."""
    zero_bytes: int
    divisibility: int


class Scalar(NamedTuple):
    value: int | float
    triton_type: str


def parameters(plan: LaunchPlan, scratch_align: int | None) -> list[Array | Scalar]:
    """The Triton call's parameters for ``plan``, in kernel order (constexprs, the value-1 ints
    too, are compiled in): XLA hands the kernel its buffers in operand order, inputs then outputs,
    which is the plans' parameter order, scalars between them. With ``scratch_align`` (the kernel
    takes global scratch) a last array parameter is the scratch output (module docstring)."""
    signature, constexprs = plan.signature(), plan.aot_constexprs()
    zero_bytes = {o.name: o.numel * jnp.dtype(o.dtype).itemsize if o.zeroed else 0 for o in plan.outputs}
    zero_bytes.update((name, 0) for name in plan.inputs)
    params: list[Array | Scalar] = []
    for name in plan.kernel.arg_names:
        if name in constexprs:
            continue
        if name in zero_bytes:
            params.append(Array(zero_bytes[name], 16))
        else:
            params.append(Scalar(plan.scalar_dict[name], signature[name]))
    if scratch_align is not None:
        params.append(Array(0, max(16, scratch_align)))
    return params


def scratch_bytes(plan: LaunchPlan, per_program: int) -> int:
    """Bytes of global scratch a launch of ``plan`` takes: ``per_program`` for each program."""
    return per_program * math.prod(plan.grid)


@functools.lru_cache(maxsize=256)
def _call(plan: LaunchPlan, facts: DeviceFacts) -> tuple[bytes, int]:
    """The serialized ``TritonKernelCall`` of ``plan`` on ``facts``' GPU, and the bytes of scratch
    its last output holds (0: none)."""
    from jax._src.lib import gpu_triton

    target = target_for(facts)
    compiled = compile_plan(plan, target)
    md = compiled.metadata
    scratch = scratch_bytes(plan, md.global_scratch_size)
    # jaxlib is asked for no scratch: the call's last output is the scratch (module docstring).
    kernel = gpu_triton.TritonKernel(md.name, md.num_warps, 1, md.shared, compiled.asm["ptx"], "", target.arch, 0, 1)
    params = [gpu_triton.create_array_parameter(*p) if isinstance(p, Array) else
              gpu_triton.create_scalar_parameter(*p)
              for p in parameters(plan, md.global_scratch_align if scratch else None)]
    grid = (*plan.grid, *(1,) * (3 - len(plan.grid)))
    call = gpu_triton.TritonKernelCall(kernel, *grid, params)
    return zlib.compress(call.to_proto(md.name, b"")), scratch


@functools.cache
def _primitive() -> Primitive:
    prim = Primitive("ejkernel_gluon_call")
    prim.multiple_results = True
    prim.def_abstract_eval(
        lambda *avals, call, out_types: [jax.core.ShapedArray(shape, dtype) for shape, dtype in out_types])
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))

    def lower(ctx, *args, call, out_types):
        return jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=call)(ctx, *args)

    mlir.register_lowering(prim, lower, platform="cuda")
    return prim
