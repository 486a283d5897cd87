"""Run a ``LaunchPlan`` on torch tensors.

CUDA tensors: the compiled kernel, on the current stream of the tensors' device, with the plan's
``num_warps``/``num_stages``/``enable_fp_fusion``. CPU tensors: the Triton interpreter, chosen
for this launch only. Outputs are allocated here (zeroed where the plan says so, poisoned with
NaN under ``triton_kernels.debug.poison_outputs`` otherwise).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
from typing import Callable

import torch
import torch.autograd.forward_ad as _forward_ad
import triton
from torch import _C
from triton.runtime import _allocation

from triton_kernels import debug
from triton_kernels.flash_attention import gluon_forward
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
    # Gluon kernels need only this Triton's Gluon: the launch scopes its scratch allocator (below).
    return DeviceFacts.cuda((props.major, props.minor), props.multi_processor_count, gluon=gluon_forward.enabled())


_CPU_FACTS = DeviceFacts.cpu()


def uncached_while_compiling(cached_fn):
    """``cached_fn`` (an ``lru_cache`` of a pure function), or the function under it while
    torch.compile traces: Dynamo traces through the cache anyway, warning the user each time."""
    return cached_fn.__wrapped__ if torch.compiler.is_compiling() else cached_fn


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts plans are made from; the same on the same GPU as the jax front's."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cuda":
        return uncached_while_compiling(_cuda_facts)(device.index if device.index is not None
                                                     else torch.cuda.current_device())
    if device.type == "cpu":
        return _CPU_FACTS
    raise ValueError(f"no Triton launcher for device {device} (expected cuda or cpu tensors)")


@functools.lru_cache(maxsize=1024)
def _output_layout(plan: LaunchPlan) -> tuple[tuple[tuple[int, ...], torch.dtype, bool, bool], ...]:
    """(shape, torch dtype, zeroed, kept zeroed) of each output: read once per plan, not per launch."""
    return tuple((o.shape, torch_dtype(o.dtype), o.zeroed, o.zeroed and o.resets) for o in plan.outputs)


def _allocate(shape, dtype: torch.dtype, zeroed: bool, device: torch.device, poison: bool) -> torch.Tensor:
    if zeroed:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if poison:
        t.fill_(float("nan") if dtype.is_floating_point else _poison_int(dtype))
    return t


def _poison_int(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return debug.poison_int(info.min, info.max)


def _launch_compiled(plan: LaunchPlan, inputs, outputs, scratch=None) -> None:
    # Every step here runs per launch, four a training step of flash attention: the tensors'
    # addresses are read once, and the scratch allocator is set without a context manager. On an
    # H100 host that took an eager forward + backward from 933 to 852 us (tiny problem).
    key = _alignment_key(plan, inputs, outputs)
    if not plan.needs_scratch:
        _launch_keyed(plan, key, inputs, outputs)
        return
    if not all(key[2:2 + len(inputs)]):  # the inputs' flags in the key; TMA needs 16-byte aligned bases
        inputs = _aligned(inputs)
        key = _alignment_key(plan, inputs, outputs)
    token = _allocation._allocator.set(scratch or _torch_scratch)  # as _scratch_allocator, without its generator
    try:
        _launch_keyed(plan, key, inputs, outputs)
    finally:
        _allocation._allocator.reset(token)


def _launch_keyed(plan: LaunchPlan, key: tuple, inputs, outputs) -> None:
    run = _compiled.get(key)
    if run is not None:
        run(*plan.launch_args(inputs, outputs))
        return
    compiled = plan.kernel[plan.grid](*plan.runtime_args(inputs, outputs), **plan.constexpr_dict,
                                      **plan.compile_options)
    _remember(plan, key, compiled)


# -- what Gluon kernels need from a launch (and Triton ones that make tensor descriptors) ---------
#
# They build TMA descriptors on the device, in global scratch that Triton's launcher asks its
# allocator for on every launch. The allocator is a context variable: set here for the launch
# only, so that a process-wide ``triton.set_allocator`` of the user's is left alone. TMA also
# needs 16-byte aligned base addresses, which a contiguous view at an odd offset may not have.

def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # A fresh allocation each launch (a few us). A buffer kept for later launches is cheaper, but
    # one first allocated while torch.compile's CUDA graphs warm up lives in their memory pool,
    # which must hold nothing but tracked outputs (tests/test_gpu_cuda_graphs.py fails then): only
    # the public functions' plain eager launches keep theirs (``_kept_scratch``).
    # The caching allocator's blocks are 512-byte aligned, beyond any scratch alignment Triton asks.
    return torch.empty(size, dtype=torch.int8, device="cuda")


_kept: dict[tuple, torch.Tensor] = {}  # (device, stream, bytes) -> scratch; (..., shape, dtype) -> zeros
_KEPT_LIMIT = 64


def _kept_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """``_torch_scratch`` for the public functions' plain eager launches (``launch_prechecked``):
    one buffer per device, stream and size, kept from launch to launch (a stream runs its
    launches one after another). Those launches never run in a CUDA-graph warm-up (compiled code
    calls the registered ops, which allocate afresh); under a graph capture they allocate afresh
    too (``_launch_on``), so that the graph's memory pool owns what its kernels use."""
    return _keep((_C._cuda_getDevice(), stream, size), _torch_scratch, size, alignment, stream)


def _keep(key: tuple, make: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """``_kept[key]``, made by ``make(*args, **kwargs)`` the first time (the dict bounded by
    clearing it)."""
    kept = _kept.get(key)
    if kept is None:
        if len(_kept) >= _KEPT_LIMIT:
            _kept.clear()
        kept = _kept[key] = make(*args, **kwargs)
    return kept


@contextlib.contextmanager
def _scratch_allocator():
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _aligned(inputs) -> tuple:
    return tuple(x if x.data_ptr() % 16 == 0 else x.clone() for x in inputs)


# -- launching a plan's compiled kernel again ---------------------------------------------------
#
# Triton's ``kernel[grid](...)`` binds and specializes every argument and rebuilds its cache key
# on every call: tens of microseconds of Python per launch on a GPU host, more than a small
# kernel runs. A plan fixes all of that but the device and one fact per tensor, whether its
# address is 16-byte aligned (what Triton specializes pointers on; the plan's dtypes are
# checked, its scalars are fixed). So after the first launch of a plan with a given alignment,
# its compiled kernel is launched directly, with the arguments ``kernel[grid]`` would give it.
# (Triton settings changed after that first launch, e.g. TRITON_DEBUG, do not reach it.)

_compiled: dict[tuple, Callable[..., None]] = {}  # alignment key -> the compiled kernel's runner
_COMPILED_LIMIT = 4096


def _alignment_key(plan: LaunchPlan, inputs, outputs) -> tuple:
    return (plan, inputs[0].device.index, *[t.data_ptr() % 16 == 0 for t in (*inputs, *outputs)])


def _remember(plan: LaunchPlan, key: tuple, compiled) -> None:
    """Keep the compiled kernel ``kernel[grid]`` returned, as a launcher of ``plan.grid`` for
    launches with alignment ``key``, when this Triton has the pieces (a compiled kernel indexable
    by its grid, no pre-run hooks)."""
    if (getattr(plan.kernel, "pre_run_hooks", None) or not hasattr(compiled, "__getitem__")
            or not hasattr(compiled, "launch_metadata")):
        return
    if len(_compiled) >= _COMPILED_LIMIT:
        _compiled.clear()
    _compiled[key] = compiled[_grid3(plan.grid)]


def _grid3(grid) -> tuple[int, int, int]:
    return (*grid, *(1,) * (3 - len(grid)))


@functools.lru_cache(maxsize=1024)
def _input_dtypes(plan: LaunchPlan) -> tuple[torch.dtype, ...]:
    return tuple(map(torch_dtype, plan.input_dtypes))


def _check_inputs(plan: LaunchPlan, inputs, *, densify: bool = False) -> tuple[tuple, torch.device]:
    """The inputs as the kernels read them and their device, after checking that every input is a
    contiguous tensor of the plan's dtype on it (the kernels index inputs as dense row-major
    arrays: a strided view would be read wrongly). Runs on every launch, so the happy path
    compares dtypes by identity. A lazy tensor (``_lazy``: its memory does not hold its values)
    is materialised, as the dispatcher does for a registered op; ``densify``: a strided input is
    copied instead of refused (see ``launch_traceable``)."""
    device = inputs[0].device
    for x, dtype in zip(inputs, _input_dtypes(plan)):
        if x.dtype is not dtype or not x.is_contiguous() or x.device != device or _lazy(x):
            return _repaired_inputs(plan, inputs, device, densify), device
    return inputs, device


def _repaired_inputs(plan: LaunchPlan, inputs, device: torch.device, densify: bool) -> tuple:
    inputs = tuple(_materialised(x, densify) for x in inputs)
    for name, x, dtype in zip(plan.inputs, inputs, plan.input_dtypes):
        if x.dtype is not torch_dtype(dtype) or not x.is_contiguous() or x.device != device:
            raise ValueError(f"{plan.name}: input {name} must be a contiguous {dtype} tensor on {device}, got "
                             f"{x.dtype} on {x.device} (contiguous={x.is_contiguous()})")
    return inputs


def _materialised(x: torch.Tensor, densify: bool) -> torch.Tensor:
    if x._is_zerotensor():  # no memory at all (its data pointer is null)
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    x = x.resolve_neg()
    return x.contiguous() if densify else x


def launch(plan: LaunchPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run ``plan`` on ``inputs`` (contiguous, one device) and return its outputs."""
    return _launch_on(plan, *_check_inputs(plan, inputs))


def launch_prechecked(plan: LaunchPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``launch`` without its input checks, for inputs known to pass them: what a checked launch
    took or made, e.g. the tensors a backward saved from its forward's launch (autograd refuses
    saved tensors modified in place since, strides and sizes too). The checks cost a fraction of
    a microsecond per input, a few per backward of two or three launches. For the public functions'
    plain eager launches only: their kernels' scratch and the zeroed outputs a kernel leaves zero
    (a tile counter) are kept from launch to launch (``_kept_scratch``, ``_kept_zeros``)."""
    return _launch_on(plan, inputs, inputs[0].device, kept=True)


def _launch_on(plan: LaunchPlan, inputs, device: torch.device, kept: bool = False) -> tuple[torch.Tensor, ...]:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{plan.name}: no Triton launcher for device {device}")
    kept = kept and device.type == "cuda" and not _C._cuda_isCurrentStreamCapturing()
    outputs = _outputs(plan, inputs, device, kept)
    if plan.is_empty:
        return plan.results(outputs)
    if device.type == "cpu":
        run_interpreted(plan, inputs, outputs)
    else:
        with _on_device(device):
            _launch_compiled(plan, inputs, outputs, _kept_scratch if kept else None)
    return plan.results(outputs)


def _outputs(plan: LaunchPlan, inputs, device: torch.device, kept: bool = False) -> list[torch.Tensor]:
    poison = debug.poisoning()
    outputs = [_kept_zeros(shape, dtype, device) if kept and resets else
               _allocate(shape, dtype, zeroed, device, poison)
               for shape, dtype, zeroed, resets in _output_layout(plan)]
    for i, o in plan.aliases:
        outputs[o].copy_(inputs[i])
    return outputs


def _kept_zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed output that the kernel leaves zero again (``Output.resets``: a tile counter), kept
    per device, stream, shape and dtype for the public functions' plain eager launches, instead
    of a new one and its fill kernel each launch (a stream runs its launches one after another)."""
    key = (device.index, _C._cuda_getCurrentRawStream(device.index), shape, dtype)
    return _keep(key, torch.zeros, shape, dtype=dtype, device=device)


def _on_device(device: torch.device):
    """The CUDA device guard, skipped when it would be a no-op (it costs microseconds a launch)."""
    if device.index is None or device.index == _C._cuda_getDevice():  # CUDA is up: a tensor is on it
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# -- launching inside torch.library ops ------------------------------------------------------------
#
# ``launch_traceable`` is ``launch`` for the body of a ``torch.library.triton_op``: on CUDA the
# kernel goes through ``wrap_triton`` (torch.compile sees it and traces no graph break); on CPU
# the plan runs in the opaque ``ejkernel::interpret_plan`` op (the interpreter cannot be traced), and
# so do plans that need global scratch on CUDA (``plan.needs_scratch``: ``wrap_triton`` traces only
# ``@triton.jit`` kernels, and launches without a scratch allocator). The op kept its
# first name when it took CUDA too: graphs torch cached on disk call it by name.
# Plans cannot be op arguments, so that op receives the plan as JSON text: compiled graphs that
# torch caches on disk stay valid in other processes.
#
# In plain eager mode (``plain_eager``) neither indirection has anything to trace, so the plan is
# launched as ``launch`` would: no JSON round trip and opaque op on CPU, no wrapper on CUDA.


def plain_eager(*tensors) -> bool:
    """True when nothing but torch's plain eager execution can see a call on ``tensors``: not
    traced (torch.compile, torch.jit.trace), no torch-function or dispatch mode active (fake
    tensors, functionalization, make_fx, opcheck's checkers, ``set_default_device``), no
    functorch transform (vmap/grad/jvp) or forward-AD level open, no profiler recording (its
    traces keep showing the registered ops), and every tensor a plain ``torch.Tensor`` or
    ``nn.Parameter`` (no other subclass). ``None`` entries are skipped.

    Then calling an op's body directly does what the dispatcher would end up doing, minus its
    Python layers (tens of microseconds a call); autograd is still the caller's to record.
    Anything unusual answers False, and the registered op handles the call as it always did."""
    return _plain_eager_state() and _plain_tensors(tensors, lazy_ok=False)


def _plain_eager_state() -> bool:
    return not (torch.compiler.is_compiling() or _C._len_torch_dispatch_stack() or _C._len_torch_function_stack()
                or _C._functorch.peek_interpreter_stack() is not None or _forward_ad._current_level >= 0
                or _C._get_tracing_state() is not None or _profiling())


def _profiling() -> bool:
    """Whether a profiler records (its traces keep showing the registered ops). Its own function so
    that a probe timing the plain eager path under a profiler can say no (scripts/probe_flash_gaps.py)."""
    return _C._autograd._profiler_enabled()


def _plain_tensors(tensors, *, lazy_ok: bool) -> bool:
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSOR_TYPES or _legacy_batched(t) or (not lazy_ok and _lazy(t))):
            return False
    return True


def _lazy(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory does not hold its values: a lazy negation (the neg bit,
    ``_neg_view``) or a ZeroTensor (torch's efficient zeros, no memory). The dispatcher's
    fallbacks materialise them for a registered op; a body called directly read the memory: the
    result of the negated input, silently, or torch's "Attempted to access the data pointer on an
    invalid python storage" (a ZeroTensor gradient reaching a backward, say)."""
    return t.is_neg() or t._is_zerotensor()


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# The batched tensors of torch's older vmap (autograd.grad(is_grads_batched=True),
# jacobian(vectorize=True)) are plain torch.Tensors without storage: launched on, they failed
# inside the launcher ("Cannot access storage of BatchedTensorImpl").
_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)  # not a public API


def functorch_active() -> bool:
    """True while a ``torch.func`` transform (grad, vjp, jacrev, vmap, ...) is running eagerly.
    The registered ops' autograd (``register_autograd``) refuses these transforms (it builds an
    ``autograd.Function`` without ``setup_context``: pytorch/pytorch#168393, #179652), so the ops
    take their gradients from their own functions then."""
    return not torch.compiler.is_compiling() and _C._functorch.peek_interpreter_stack() is not None


def vmap_only(*tensors) -> bool:
    """True under ``torch.func.vmap`` alone (no grad/vjp/jvp level) with nothing to differentiate:
    an op's own vmap rule then serves, without the autograd.Function whose functorch machinery
    made most of a vmapped call's host time (about 0.5 ms on CPU, 1.3 ms on an H100 host).
    Batched tensors hide ``requires_grad``: it is read on what they wrap. ``None`` entries skipped.
    ``torch.func.functionalize`` levels count as vmap's: they differentiate nothing, and the
    autograd.Function failed there with torch's "NYI: Functionalize rule for custom_function_call"
    where the registered ops run."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(i.key() not in _NON_DIFFERENTIATING for i in retrieve_all_functorch_interpreters()):
        return False
    return not (torch.is_grad_enabled() and any(requires_grad_beneath(t) for t in tensors))


_NON_DIFFERENTIATING = (_C._functorch.TransformType.Vmap, _C._functorch.TransformType.Functionalize)


def requires_grad_beneath(t) -> bool:
    """Whether ``t`` is a tensor that requires grad, read beneath vmap's batching (batched
    tensors hide it)."""
    while isinstance(t, torch.Tensor) and _C._functorch.is_batchedtensor(t):
        t = _C._functorch.get_unwrapped(t)
    return isinstance(t, torch.Tensor) and t.requires_grad


def reject_forward_ad(*tensors) -> None:
    """Raise when forward-mode AD would differentiate a call on ``tensors``: the ops have no
    forward-mode rule, and torch would drop the tangents silently (``torch.func.jvp`` gave zero
    tangents, ``forward_ad`` dual tensors lost theirs). jax's ``jvp`` of a ``custom_vjp`` raises
    too. Tensors without a tangent (constants under ``jvp``) pass. ``None`` entries are skipped."""
    if torch.compiler.is_compiling() or (_forward_ad._current_level < 0 and _C._functorch.peek_interpreter_stack() is None):
        return  # the usual call: no forward-mode AD can be recording
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if _forward_ad._current_level >= 0 and any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        _forward_ad_error()
    if _C._functorch.peek_interpreter_stack() is not None and _jvp_under_other_transforms():
        # e.g. hessian (jacfwd over jacrev): the tangents are not visible at the inner level, but
        # the jvp will differentiate this call's backward.
        if any(_C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            _forward_ad_error()


def _jvp_under_other_transforms() -> bool:
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    outer = retrieve_all_functorch_interpreters()[:-1]  # outermost first; the last is the current one
    return any(i.key() == _C._functorch.TransformType.Jvp for i in outer)


def _forward_ad_error():
    raise NotImplementedError("ejkernel ops have no forward-mode AD rule (torch.func.jvp, jacfwd, hessian, "
                              "torch.autograd.forward_ad); use reverse mode (backward, torch.func.vjp/grad/jacrev)")


@functools.lru_cache(maxsize=1024)
def plan_text(plan: LaunchPlan) -> str:
    fn = plan.kernel.fn
    doc = {
        "kernel": f"{fn.__module__}:{fn.__name__}", "grid": plan.grid, "inputs": plan.inputs,
        "input_dtypes": plan.input_dtypes,
        "outputs": [[o.name, o.shape, o.dtype, o.zeroed, o.returned, o.resets] for o in plan.outputs],
        "scalars": plan.scalars, "constexprs": plan.constexprs, "num_warps": plan.num_warps,
        "num_stages": plan.num_stages, "enable_fp_fusion": plan.enable_fp_fusion, "maxnreg": plan.maxnreg,
        "aliases": plan.aliases, "global_scratch": plan.global_scratch,
    }
    return json.dumps(doc)


@functools.lru_cache(maxsize=1024)
def plan_from_text(text: str) -> LaunchPlan:
    doc = json.loads(text)
    module, name = doc.pop("kernel").split(":")
    kernel = getattr(importlib.import_module(module), name)
    tuples = lambda rows: tuple(tuple(r) for r in rows)  # noqa: E731
    return LaunchPlan(
        kernel=kernel, grid=tuple(doc["grid"]), inputs=tuple(doc["inputs"]),
        input_dtypes=tuple(doc["input_dtypes"]),
        # (an output's "returned" and "resets" flags are absent from the texts in graphs cached before they existed)
        outputs=tuple(Output(n, tuple(shape), dtype, *flags) for n, shape, dtype, *flags in doc["outputs"]),
        scalars=tuples(doc["scalars"]), constexprs=_with_defaults(kernel, tuples(doc["constexprs"])),
        num_warps=doc["num_warps"],
        num_stages=doc["num_stages"], enable_fp_fusion=doc["enable_fp_fusion"], aliases=tuples(doc["aliases"]),
        maxnreg=doc.get("maxnreg"),  # absent from the texts in graphs cached before it existed
        global_scratch=doc.get("global_scratch", False),  # (so is this)
    )


def _with_defaults(kernel, constexprs: tuple) -> tuple:
    """``constexprs`` plus the kernel's defaults for those it lacks. torch.compile's on-disk caches
    key a graph before the op bodies in it are traced, so a graph cached by an older version of
    a kernel carries that version's plan text: a constexpr added since (with a default that keeps
    the old behavior, as the grouped matmuls' BATCH) failed the plan's binding check. (Where torch
    keys its caches on the kernels the ops declare, ``ops._common.declare_kernels``, such a graph
    is compiled again instead; this serves a torch without that key.)"""
    bound = {name for name, _ in constexprs}
    return constexprs + tuple((p.name, p.default) for p in kernel.params
                              if p.is_constexpr and p.has_default and p.name not in bound)


@torch.library.custom_op("ejkernel::interpret_plan", mutates_args=(), device_types=("cpu", "cuda"))
def _launch_plan_op(inputs: list[torch.Tensor], plan: str) -> list[torch.Tensor]:
    return list(launch(plan_from_text(plan), *inputs))


@_launch_plan_op.register_fake
def _launch_plan_fake(inputs, plan):
    return [inputs[0].new_empty(o.shape, dtype=torch_dtype(o.dtype)) for o in plan_from_text(plan).outputs
            if o.returned]


@torch.compiler.assume_constant_result  # read while torch.compile traces, not traced (it reads the environment)
def _triton_fusion_default() -> bool | None:
    """Whether Triton fuses floating-point multiply-adds in a kernel launched without
    ``enable_fp_fusion`` (``TRITON_DEFAULT_FP_FUSION``: yes up to Triton 3.9, no from 3.10 on);
    None where it is forced off for every kernel (``TRITON_FORCE_DISABLE_FP_FUSION``, Triton 3.9)."""
    language = triton.knobs.language  # Triton >= 3.4
    if getattr(language, "force_disable_fp_fusion", False):
        return None
    return bool(language.default_fp_fusion)


def _traced_fusion_as_planned(plan: LaunchPlan) -> bool:
    """Whether the kernel that ``wrap_triton`` hands to torch.compile fuses as ``plan`` asks.
    torch.compile does not forward ``enable_fp_fusion``, so that kernel gets Triton's default;
    where it differs, the plan runs in the opaque op, whose launch passes the plan's own, so
    compiled code fuses as eager code does."""
    default = _triton_fusion_default()
    return default is None or default == plan.enable_fp_fusion


def launch_traceable(plan: LaunchPlan, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``launch`` for use inside ``torch.library.triton_op`` bodies. In plain eager mode it is
    ``launch``: neither indirection has anything to trace there (and ``wrap_triton`` outside an op
    body would still route the launch through its higher-order op).
    A strided input is copied, not refused: a body's arguments come through the dispatcher,
    which hands over a ZeroTensor (torch's efficient zeros, e.g. an unused output's gradient) as
    a zero scalar expanded to its shape, whatever the caller made contiguous."""
    inputs, device = _check_inputs(plan, inputs, densify=True)
    if _plain_eager_state() and _plain_tensors(inputs, lazy_ok=True):  # plain_eager; lazy ones resolved above
        return _launch_on(plan, inputs, device)
    opaque = plan.needs_scratch or not _traced_fusion_as_planned(plan)  # what wrap_triton cannot launch as planned
    if device.type == "cpu" or (device.type == "cuda" and opaque):
        return tuple(torch.ops.ejkernel.interpret_plan(list(inputs), plan_text(plan)))
    if device.type != "cuda":
        raise ValueError(f"{plan.name}: no Triton launcher for device {device}")
    outputs = _outputs(plan, inputs, device)
    if not plan.is_empty:
        with _on_device(device):
            torch.library.wrap_triton(plan.kernel)[plan.grid](
                *plan.runtime_args(inputs, outputs), **plan.constexpr_dict,
                num_warps=plan.num_warps, num_stages=plan.num_stages)
    return plan.results(outputs)
