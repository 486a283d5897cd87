"""Run a ``LaunchPlan`` on torch tensors.

CUDA tensors: the compiled kernel, on the current stream of the tensors' device, with the plan's
``num_warps``/``num_stages``/``enable_fp_fusion``. CPU tensors: the Triton interpreter, chosen
for this launch only. Outputs are allocated here (zeroed where the plan says so, poisoned with
NaN under ``triton_kernels.debug.poison_outputs`` otherwise).
"""
from __future__ import annotations

import functools
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


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts plans are made from; the same on the same GPU as the jax front's."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_facts(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return DeviceFacts.cpu()
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
