"""Compile a plan ahead of time for a GPU target, on any machine (no GPU needed).

The signature and specialization are the ones both launchers produce at run time: every array
16-byte aligned, runtime ints unspecialized except the value 1 (a constant), plan constexprs
and compile options verbatim. CI uses this to catch compile errors and shared-memory overflows
for Hopper without hardware.
"""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from .plan import DeviceFacts, LaunchPlan

HOPPER_TARGET = GPUTarget("cuda", 90, 32)


def target_for(facts: DeviceFacts) -> GPUTarget:
    if facts.platform != "cuda" or facts.capability is None:
        raise ValueError(f"ahead-of-time compiles need CUDA device facts, got {facts}")
    major, minor = facts.capability
    return GPUTarget("cuda", major * 10 + minor, 32)


def compile_plan(plan: LaunchPlan, target: GPUTarget = HOPPER_TARGET):
    """``triton.compile`` of ``plan`` for ``target``; returns the CompiledKernel."""
    backend = make_backend(target)
    signature = plan.signature()
    attrs = {
        (plan.kernel.arg_names.index(name),): backend.parse_attr("D")
        for name, ty in signature.items()
        if ty.startswith("*")
    }
    source = _source_class(plan)(plan.kernel, signature, plan.aot_constexprs(), attrs)
    return triton.compile(source, target=target, options=dict(plan.compile_options))


def _source_class(plan: LaunchPlan):
    if plan.is_gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    return ASTSource


def distinct_plans(plans) -> list[LaunchPlan]:
    """The first plan of each ``compile_key``: what an ahead-of-time check needs to compile."""
    seen: dict[tuple, LaunchPlan] = {}
    for plan in plans:
        seen.setdefault(compile_key(plan), plan)
    return list(seen.values())


def compile_key(plan: LaunchPlan) -> tuple:
    """Plans with equal keys compile to the same binary (runtime scalar values aside)."""
    return (plan.kernel.fn, tuple(plan.signature().items()), tuple(sorted(plan.aot_constexprs().items())),
            plan.num_warps, plan.num_stages, plan.enable_fp_fusion, plan.maxnreg)
