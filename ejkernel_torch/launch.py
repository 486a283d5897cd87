"""Run a ``LaunchPlan`` on torch tensors.

CUDA tensors: the compiled kernel, on the current stream of the tensors' device, with the plan's
``num_warps``/``num_stages``/``enable_fp_fusion``. CPU tensors: the Triton interpreter, chosen
for this launch only. Outputs are allocated here (zeroed where the plan says so, poisoned with
NaN under ``triton_kernels.debug.poison_outputs`` otherwise).
"""
from __future__ import annotations

import functools
import importlib
import json
from typing import Sequence

import torch

from triton_kernels import debug
from triton_kernels.interpret import run_interpreted
from triton_kernels.plan import DeviceFacts, LaunchPlan, Output

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    return DeviceFacts.cuda((props.major, props.minor), props.multi_processor_count)


_CPU_FACTS = DeviceFacts.cpu()


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts plans are made from; the same on the same GPU as the jax front's."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return _CPU_FACTS
    raise ValueError(f"no Triton launcher for device {device} (expected cuda or cpu tensors)")


def _allocate(out: Output, device: torch.device) -> torch.Tensor:
    dtype = torch_dtype(out.dtype)
    if out.zeroed:
        return torch.zeros(out.shape, dtype=dtype, device=device)
    t = torch.empty(out.shape, dtype=dtype, device=device)
    if debug.poisoning():
        t.fill_(float("nan") if dtype.is_floating_point else debug.POISON_INT)
    return t


def _launch_compiled(plan: LaunchPlan, inputs, outputs) -> None:
    plan.kernel[plan.grid](
        *plan.runtime_args(inputs, outputs),
        **plan.constexpr_dict,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        enable_fp_fusion=plan.enable_fp_fusion,
    )


def launch(plan: LaunchPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run ``plan`` on ``inputs`` (contiguous, one device) and return its outputs."""
    device = inputs[0].device
    for name, x, dtype in zip(plan.inputs, inputs, plan.input_dtypes):
        if x.device != device or not x.is_contiguous() or dtype_name(x.dtype) != dtype:
            raise ValueError(
                f"{plan.name}: input {name} must be a contiguous {dtype} tensor on {device}, got "
                f"{x.dtype} on {x.device} (contiguous={x.is_contiguous()})"
            )
    outputs = [_allocate(o, device) for o in plan.outputs]
    for i, o in plan.aliases:
        outputs[o].copy_(inputs[i])
    if plan.is_empty:
        return tuple(outputs)
    if device.type == "cpu":
        run_interpreted(plan, inputs, outputs)
    elif device.type == "cuda":
        if device.index == torch.cuda.current_device():  # skip the device guard when it is a no-op
            _launch_compiled(plan, inputs, outputs)
        else:
            with torch.cuda.device(device):
                _launch_compiled(plan, inputs, outputs)
    else:
        raise ValueError(f"{plan.name}: no Triton launcher for device {device}")
    return tuple(outputs)


# -- launching inside torch.library ops ------------------------------------------------------------
#
# ``launch_traceable`` is ``launch`` for the body of a ``torch.library.triton_op``: on CUDA the
# kernel goes through ``wrap_triton`` (torch.compile sees it and traces no graph break); on CPU
# the plan runs in the opaque ``ejkernel::interpret_plan`` op (the interpreter cannot be traced).
# Plans cannot be op arguments, so that op receives the plan as JSON text: compiled graphs that
# torch caches on disk stay valid in other processes.


@functools.lru_cache(maxsize=1024)
def plan_text(plan: LaunchPlan) -> str:
    fn = plan.kernel.fn
    doc = {
        "kernel": f"{fn.__module__}:{fn.__name__}", "grid": plan.grid, "inputs": plan.inputs,
        "input_dtypes": plan.input_dtypes, "outputs": [[o.name, o.shape, o.dtype, o.zeroed] for o in plan.outputs],
        "scalars": plan.scalars, "constexprs": plan.constexprs, "num_warps": plan.num_warps,
        "num_stages": plan.num_stages, "enable_fp_fusion": plan.enable_fp_fusion, "aliases": plan.aliases,
    }
    return json.dumps(doc)


@functools.lru_cache(maxsize=1024)
def plan_from_text(text: str) -> LaunchPlan:
    doc = json.loads(text)
    module, name = doc.pop("kernel").split(":")
    tuples = lambda rows: tuple(tuple(r) for r in rows)  # noqa: E731
    return LaunchPlan(
        kernel=getattr(importlib.import_module(module), name), grid=tuple(doc["grid"]), inputs=tuple(doc["inputs"]),
        input_dtypes=tuple(doc["input_dtypes"]),
        outputs=tuple(Output(n, tuple(shape), dtype, zeroed) for n, shape, dtype, zeroed in doc["outputs"]),
        scalars=tuples(doc["scalars"]), constexprs=tuples(doc["constexprs"]), num_warps=doc["num_warps"],
        num_stages=doc["num_stages"], enable_fp_fusion=doc["enable_fp_fusion"], aliases=tuples(doc["aliases"]),
    )


@torch.library.custom_op("ejkernel::interpret_plan", mutates_args=(), device_types="cpu")
def _interpret_plan(inputs: list[torch.Tensor], plan: str) -> list[torch.Tensor]:
    return list(launch(plan_from_text(plan), *inputs))


@_interpret_plan.register_fake
def _interpret_plan_fake(inputs, plan):
    return [inputs[0].new_empty(o.shape, dtype=torch_dtype(o.dtype)) for o in plan_from_text(plan).outputs]


def _check_traceable_inputs(plan: LaunchPlan, inputs) -> torch.device:
    device = inputs[0].device
    for name, x, dtype in zip(plan.inputs, inputs, plan.input_dtypes):
        if x.device != device or dtype_name(x.dtype) != dtype:
            raise ValueError(f"{plan.name}: input {name} must be a {dtype} tensor on {device}, "
                             f"got {x.dtype} on {x.device}")
    return device


def launch_traceable(plan: LaunchPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``launch`` for use inside ``torch.library.triton_op`` bodies (inputs must be contiguous)."""
    device = _check_traceable_inputs(plan, inputs)
    if device.type == "cpu":
        return tuple(torch.ops.ejkernel.interpret_plan(list(inputs), plan_text(plan)))
    if device.type != "cuda":
        raise ValueError(f"{plan.name}: no Triton launcher for device {device}")
    if not plan.enable_fp_fusion:  # not a launch option torch.compile forwards
        raise NotImplementedError(f"{plan.name}: launch_traceable needs enable_fp_fusion=True")
    outputs = [_allocate(o, device) for o in plan.outputs]
    for i, o in plan.aliases:
        outputs[o].copy_(inputs[i])
    if plan.is_empty:
        return tuple(outputs)
    if device.index is None or device.index == torch.cuda.current_device():
        _launch_wrapped(plan, inputs, outputs)
    else:
        with torch.cuda.device(device):
            _launch_wrapped(plan, inputs, outputs)
    return tuple(outputs)


def _launch_wrapped(plan: LaunchPlan, inputs, outputs) -> None:
    torch.library.wrap_triton(plan.kernel)[plan.grid](
        *plan.runtime_args(inputs, outputs), **plan.constexpr_dict,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
