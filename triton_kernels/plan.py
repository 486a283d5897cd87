"""Launch plans: everything about a kernel launch that is decided once, from shapes and device facts.

A ``LaunchPlan`` names the kernel, the grid, which kernel parameters are input arrays, runtime
scalars, outputs and constexprs, and the compile options (``num_warps``, ``num_stages``,
``enable_fp_fusion``). The torch launcher and the jax launcher both obey a plan verbatim, so the
same inputs compile to the same PTX in both frameworks (torch's launch assembles it with Triton's
ptxas, jaxlib with XLA's PTX compiler; the GPU tests check that the results are bitwise equal).

Kernel parameter order is fixed by jax-triton's calling convention, which the torch launcher
follows too: input arrays and runtime scalars (in any order), then the outputs, then constexprs.

Why the plan also controls specialization: Triton specializes an integer argument on whether it
is divisible by 16 when launched from torch, while jax-triton never does (it only turns the value
1 into a constant). The extra divisibility fact changes the layout the compiler picks, hence the
order of floating-point reductions, hence the last bit of a softmax. Every kernel used by a plan
must therefore list its runtime scalars in ``do_not_specialize_on_alignment``; the plan checks it.
"""
from __future__ import annotations

import functools
import math
import struct
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

# Max dynamic shared memory per block (opt-in), bytes, by compute capability. Both fronts use
# this table (jax cannot query it), so both derive the same plan on the same GPU.
_SHARED_MEMORY = {
    (7, 0): 98_304,
    (7, 5): 65_536,
    (8, 0): 166_912,
    (8, 6): 101_376,
    (8, 7): 166_912,
    (8, 9): 101_376,
    (9, 0): 232_448,
    (10, 0): 232_448,
    (12, 0): 101_376,
}

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_TRITON_TYPE = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}


def hash_fields_once(obj) -> int:
    """``__hash__`` for frozen dataclasses that key caches on every op call (specs, device facts,
    plans): the fields are hashed on first use only. Declared in the class body, so that
    ``dataclass`` keeps it; equality stays the generated field-by-field one."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(obj, f.name) for f in fields(obj)))
        object.__setattr__(obj, "_hash", h)
    return h


def state_without_hash(obj) -> dict:
    """``__getstate__`` beside ``hash_fields_once``: string hashes differ between processes, so a
    pickled copy must not carry the memo."""
    return {k: v for k, v in obj.__dict__.items() if k != "_hash"}


@dataclass(frozen=True)
class DeviceFacts:
    """Plain facts about the device a plan is made for. Plans depend on nothing else."""

    platform: str  # "cpu" (Triton interpreter) or "cuda"
    capability: tuple[int, int] | None = None
    shared_memory: int = 1 << 30  # bytes one program may use; the interpreter has no limit
    num_sms: int = 1
    # The front's launcher can run this device's Gluon kernels (a Triton with Gluon, and for jax a
    # jaxlib whose Triton call provides global scratch); plans pick them only then, and kernels
    # that need global scratch for tensor descriptors too (``LaunchPlan.global_scratch``).
    gluon: bool = False

    __hash__, __getstate__ = hash_fields_once, state_without_hash

    @classmethod
    def cpu(cls) -> "DeviceFacts":
        return cls("cpu")

    @classmethod
    def cuda(cls, capability: tuple[int, int], num_sms: int, gluon: bool = False) -> "DeviceFacts":
        capability = tuple(capability)
        smem = _SHARED_MEMORY.get(capability)
        if smem is None:  # unknown part: the largest known value at or below its capability
            known = [c for c in _SHARED_MEMORY if c <= capability] or [min(_SHARED_MEMORY)]
            smem = _SHARED_MEMORY[max(known)]
        return cls("cuda", capability, smem, int(num_sms), bool(gluon))

    @property
    def is_cpu(self) -> bool:
        return self.platform == "cpu"


HOPPER = DeviceFacts.cuda((9, 0), 132)
# The same H100 seen by a front whose launcher can run Gluon kernels and provide global scratch.
HOPPER_GLUON = DeviceFacts.cuda((9, 0), 132, gluon=True)


@dataclass(frozen=True)
class Output:
    name: str
    shape: tuple[int, ...]
    dtype: str
    zeroed: bool = False  # the launcher fills it with zeros before the launch
    # False: a buffer only the kernel uses (a tile counter): allocated and passed, not returned
    returned: bool = True
    # A zeroed output the kernel leaves zero again when it ends (a tile counter): a launcher may
    # keep one for launches that run one after another instead of zeroing a new one each launch.
    resets: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Held by an interpreted launch while it has interpreted twins swapped into kernel modules
# (``interpret``); a plan takes it to hash its kernel (``LaunchPlan.__post_init__``).
twins_lock = threading.RLock()


@dataclass(frozen=True)
class LaunchPlan:
    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    inputs: tuple[str, ...]  # array parameters, in kernel order
    input_dtypes: tuple[str, ...]
    outputs: tuple[Output, ...]
    scalars: tuple[tuple[str, int | float], ...] = ()
    constexprs: tuple[tuple[str, Any], ...] = ()
    num_warps: int = 4
    num_stages: int = 2
    enable_fp_fusion: bool = True
    maxnreg: int | None = None  # registers per thread, for warp-specialized kernels that move them
    # (input index, output index): the output starts as a copy of that input.
    aliases: tuple[tuple[int, int], ...] = field(default=())
    # The kernel builds tensor descriptors on the device (TMA), in global scratch that its launch
    # must provide, as a Gluon kernel's does (``needs_scratch``).
    global_scratch: bool = False

    def __post_init__(self):
        # Built while another thread runs an interpreted launch, a plan function reads that
        # launch's interpreted twin of its kernel from the module (``interpret``): use the kernel.
        object.__setattr__(self, "kernel", getattr(self.kernel, "jit_function", self.kernel))
        # Its first hash parses the kernel and resolves every name it calls in its module, where
        # such a launch may have put twins: "Unsupported function referenced: <_Twin ...>" (an
        # eager shard_map's backward built the next plan while a callback thread ran the last).
        # Hashed with no twins in place, the kernel keeps that hash for good; a hashed kernel
        # (JITFunction.hash set) needs no wait.
        if getattr(self.kernel, "hash", None) is None:
            with twins_lock:
                getattr(self.kernel, "cache_key", None)
        _check_plan(self)

    __hash__, __getstate__ = hash_fields_once, state_without_hash

    # -- what the launchers need ------------------------------------------------
    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @functools.cached_property
    def is_gluon(self) -> bool:
        """A Gluon kernel: compiled from GluonASTSource, never interpreted, and its launch
        provides global scratch (its TMA descriptors are built on the device). Asked per launch."""
        return getattr(self.kernel, "is_gluon", lambda: False)()

    @functools.cached_property
    def needs_scratch(self) -> bool:
        """Its launch must provide global scratch: a Gluon kernel, or a Triton kernel that makes
        tensor descriptors (``global_scratch``). jax-triton provides none, nor does torch's
        ``wrap_triton``; both launchers route such plans as they route Gluon ones."""
        return self.is_gluon or self.global_scratch

    @functools.cached_property
    def compile_options(self) -> dict[str, Any]:
        """Triton's compile options for this plan, as the torch launcher and ``aot`` pass them."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages, enable_fp_fusion=self.enable_fp_fusion)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    @property
    def is_empty(self) -> bool:
        return 0 in self.grid  # asked on every launch: no generator

    @functools.cached_property
    def constexpr_dict(self) -> dict[str, Any]:
        return dict(self.constexprs)

    def with_constexprs(self, **changes: Any) -> "LaunchPlan":
        """This plan with some constexprs set otherwise (variants that probes and tests run beside
        it); a name the plan does not have is an error, not a silent no-op."""
        unknown = sorted(set(changes) - set(self.constexpr_dict))
        if unknown:
            raise ValueError(f"{self.name} has no constexpr {', '.join(unknown)}")
        return replace(self, constexprs=tuple((n, changes.get(n, v)) for n, v in self.constexprs))

    @functools.cached_property
    def scalar_dict(self) -> dict[str, int | float]:
        return dict(self.scalars)

    @functools.cached_property
    def _arg_layout(self) -> tuple[list, list[int], list[int]]:
        """(template with scalars filled in, input positions, output positions), kernel order."""
        names = [n for n in self.kernel.arg_names if n not in self.constexpr_dict]
        template = [self.scalar_dict.get(n) for n in names]
        return template, [names.index(n) for n in self.inputs], [names.index(o.name) for o in self.outputs]

    def runtime_args(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
        """Input arrays, scalars and outputs in kernel parameter order (constexprs excluded)."""
        return self._filled(self._arg_layout, inputs, outputs)

    def _filled(self, layout: tuple[list, list[int], list[int]], inputs: Sequence[Any],
                outputs: Sequence[Any]) -> list[Any]:
        """``layout``'s template with ``inputs`` and ``outputs`` put at its positions for them."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name}: expected {len(self.inputs)} inputs, got {len(inputs)}")
        template, input_pos, output_pos = layout
        args = list(template)
        for pos, x in zip(input_pos, inputs):
            args[pos] = x
        for pos, x in zip(output_pos, outputs):
            args[pos] = x
        return args

    @functools.cached_property
    def _launch_layout(self) -> tuple[list, list[int], list[int]]:
        """(every parameter in kernel order, constexprs and scalars filled in; input positions;
        output positions)."""
        names = list(self.kernel.arg_names)
        template = [self.constexpr_dict[n] if n in self.constexpr_dict else self.scalar_dict.get(n) for n in names]
        return template, [names.index(n) for n in self.inputs], [names.index(o.name) for o in self.outputs]

    def launch_args(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
        """Every kernel parameter in order, constexprs included: the argument list a compiled
        Triton kernel's launcher takes (a relaunch builds it on every launch)."""
        return self._filled(self._launch_layout, inputs, outputs)

    @functools.cached_property
    def _returned(self) -> tuple[int, ...] | None:
        """Positions of the outputs a launch returns; None when it returns them all."""
        kept = tuple(i for i, o in enumerate(self.outputs) if o.returned)
        return None if len(kept) == len(self.outputs) else kept

    @functools.cached_property
    def result_names(self) -> tuple[str, ...]:
        """The names of what ``results`` returns, in its order."""
        return tuple(o.name for o in self.outputs if o.returned)

    def inputs_from(self, arrays: Mapping[str, Any]) -> tuple[Any, ...]:
        """This plan's inputs taken from ``arrays`` by name, in its order (plans chained by name,
        each taking what the others returned: ``result_names``)."""
        return tuple(arrays[name] for name in self.inputs)

    def results(self, outputs: Sequence[Any]) -> tuple[Any, ...]:
        """What a launch returns of the ``outputs`` it allocated: all but the unreturned ones."""
        kept = self._returned
        return tuple(outputs) if kept is None else tuple(outputs[i] for i in kept)

    def signature(self) -> dict[str, str]:
        """Triton signature as jax-triton builds it (used for ahead-of-time compiles)."""
        sig = {}
        dtypes = dict(zip(self.inputs, self.input_dtypes))
        dtypes.update((o.name, o.dtype) for o in self.outputs)
        for name in self.kernel.arg_names:
            if name in dtypes:
                sig[name] = "*" + _TRITON_TYPE[dtypes[name]]
            elif name in self.scalar_dict:
                value = self.scalar_dict[name]
                sig[name] = "constexpr" if _is_one(value) else scalar_type(value)
            else:
                sig[name] = "constexpr"
        return sig

    def aot_constexprs(self) -> dict[str, Any]:
        consts = dict(self.constexprs)
        consts.update((n, 1) for n, v in self.scalars if _is_one(v))
        return consts


def _is_one(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 1


def scalar_type(value: int | float) -> str:
    """Triton type of a plan's runtime scalar: int32 or float32 (see ``_check_scalar``)."""
    return "fp32" if isinstance(value, float) else "i32"


def fp32(value: float) -> float:
    """``value`` rounded to float32, so every launcher passes the same bits."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_scalar(plan_name: str, name: str, value) -> None:
    # torch's launcher types a Python float as fp32 and jax-triton as fp64 (unless it is a
    # numpy float32); ints >= 2**31 are i64 in one and u32 in the other. Plans therefore hold
    # only int32-range ints and fp32-exact floats; the jax launcher passes floats as float32.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{plan_name}: scalar {name} must be int or float, got {value!r}")
    if isinstance(value, int) and not -(2**31) <= value < 2**31:
        raise ValueError(f"{plan_name}: scalar {name}={value} does not fit int32")
    if isinstance(value, float) and fp32(value) != value:
        raise ValueError(f"{plan_name}: scalar {name}={value!r} is not float32-exact; use fp32()")


MAX_GRID = (2**31 - 1, 65_535, 65_535)


def _check_plan(plan: LaunchPlan) -> None:
    kernel = plan.kernel
    names = list(kernel.arg_names)
    params = {p.name: p for p in kernel.params}
    runtime = set(plan.inputs) | set(plan.scalar_dict)
    outs = [o.name for o in plan.outputs]
    consts = set(plan.constexpr_dict)
    given = list(plan.inputs) + list(plan.scalar_dict) + outs + list(consts)
    if sorted(given) != sorted(names):
        raise ValueError(f"plan for {plan.name} binds {sorted(given)}, kernel takes {sorted(names)}")
    order = [n for n in names]
    first_out = min(order.index(o) for o in outs) if outs else len(order)
    last_runtime = max((order.index(n) for n in runtime), default=-1)
    first_const = min((order.index(n) for n in consts), default=len(order))
    last_out = max((order.index(o) for o in outs), default=-1)
    if not (last_runtime < first_out and last_out < first_const):
        raise ValueError(f"{plan.name}: kernel parameters must be inputs/scalars, outputs, constexprs")
    for n in consts:
        if not params[n].is_constexpr:
            raise ValueError(f"{plan.name}: {n} is passed as constexpr but not declared tl.constexpr")
    for n, value in plan.scalars:
        _check_scalar(plan.name, n, value)
        if isinstance(value, int) and not params[n].do_not_specialize_on_alignment:
            raise ValueError(
                f"{plan.name}: runtime scalar {n} must be listed in do_not_specialize_on_alignment "
                "(otherwise torch and jax-triton compile different binaries)"
            )
    if len(plan.input_dtypes) != len(plan.inputs):
        raise ValueError(f"{plan.name}: one dtype per input expected")
    if not 1 <= len(plan.grid) <= 3 or any(g < 0 for g in plan.grid):
        raise ValueError(f"{plan.name}: bad grid {plan.grid}")
    # CUDA's limits, checked on every device so that a call fails alike everywhere, up front.
    if any(g > limit for g, limit in zip(plan.grid, MAX_GRID)):
        raise ValueError(f"{plan.name}: grid {plan.grid} exceeds CUDA's limits {MAX_GRID} (a batch or head "
                         "count too large for one launch)")


def fold_chunks(n: int, per_sample: int, limit: int) -> list[tuple[int, int]]:
    """(first sample, samples) of each launch that a vmap over ``n`` samples folds into one
    launch axis (the fronts' vmap rules), where each sample takes ``per_sample`` of that axis and
    one launch at most ``limit`` (a grid axis, an int32 row count): at most ``limit //
    per_sample`` samples a launch, at least one (a sample past the limit fails in its own checks,
    naming its own argument). One launch for ``n`` = 0."""
    step = max(1, limit // per_sample) if per_sample else max(n, 1)
    return [(start, min(step, n - start)) for start in range(0, n, step)] or [(0, 0)]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_float_dtype(name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}")


def shapes_key(shapes: Mapping[str, Sequence[int]]) -> tuple:
    return tuple(sorted((k, tuple(v)) for k, v in shapes.items()))
