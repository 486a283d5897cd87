"""Gluon plans from jax: compiled here, run by jaxlib's Triton custom call.

jax-triton compiles ``@triton.jit`` kernels only, and passes no global scratch, where Gluon
kernels build their TMA descriptors. jaxlib's own ``TritonKernel`` takes a compiled kernel and
its scratch size (since jaxlib 0.11), so a Gluon plan is compiled by ``triton_kernels.aot`` (the
specialization torch's launcher gives it: pointers 16-byte aligned, which XLA's buffers are, ints
unspecialized but 1) and handed to the ``triton_kernel_call`` custom call through a primitive of
our own. Torch launches the same PTX (assembled by Triton's ptxas, where jaxlib assembles it with
XLA's PTX compiler), and both fronts give the same bits (``tests/test_flash_gluon.py`` checks it
on a GPU).
"""
from __future__ import annotations

import functools
import zlib
from typing import Sequence

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
    if plan.aliases:
        raise NotImplementedError(f"{plan.name}: the Gluon launcher has no aliased outputs")
    out_types = tuple((o.shape, o.dtype) for o in plan.outputs)
    return _primitive().bind(*inputs, call=_call(plan, facts), out_types=out_types)


@functools.lru_cache(maxsize=256)
def _call(plan: LaunchPlan, facts: DeviceFacts) -> bytes:
    """The serialized ``TritonKernelCall`` of ``plan`` on ``facts``' GPU."""
    from jax._src.lib import gpu_triton

    target = target_for(facts)
    compiled = compile_plan(plan, target)
    md = compiled.metadata
    kernel = gpu_triton.TritonKernel(md.name, md.num_warps, 1, md.shared, compiled.asm["ptx"], "", target.arch,
                                     md.global_scratch_size, md.global_scratch_align)
    # XLA hands the kernel its buffers in operand order, inputs then outputs, which is the plans'
    # parameter order; scalars sit between them. Constexprs (the value-1 ints too) are compiled in.
    signature, constexprs = plan.signature(), plan.aot_constexprs()
    # The call zeroes the first bytes of an array parameter that asks (zeroed outputs), before the launch.
    zero_bytes = {o.name: o.numel * jnp.dtype(o.dtype).itemsize if o.zeroed else 0 for o in plan.outputs}
    zero_bytes.update((name, 0) for name in plan.inputs)
    params = []
    for name in plan.kernel.arg_names:
        if name in constexprs:
            continue
        if name in zero_bytes:
            params.append(gpu_triton.create_array_parameter(zero_bytes[name], 16))
        else:
            params.append(gpu_triton.create_scalar_parameter(plan.scalar_dict[name], signature[name]))
    grid = (*plan.grid, *(1,) * (3 - len(plan.grid)))
    call = gpu_triton.TritonKernelCall(kernel, *grid, params)
    return zlib.compress(call.to_proto(md.name, b""))


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
