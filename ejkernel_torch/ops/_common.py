"""Small helpers the torch ops share: argument normalisation before any kernel runs."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

from ejkernel_torch.launch import (device_facts, dtype_name, functorch_active, plain_eager, reject_forward_ad,
                                  vmap_only)
from ejkernel_torch.ops._folding import register_folding
from triton_kernels import checks


def tensor_arg(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    # The kernels read strided memory: a jagged nested tensor passed the shape checks with its
    # ragged size and failed in the dispatcher, sparse/mkldnn/nested ones inside torch, naming
    # no argument.
    if x.is_nested or x.layout != torch.strided:
        got = "a nested tensor" if x.is_nested else f"layout {x.layout}"
        raise TypeError(f"{name} must be a dense tensor (layout torch.strided), got {got}")
    return x


def autocast(*tensors):
    """``tensors`` as ``torch.autocast`` hands them to matmul and SDPA: a float16, bfloat16 or
    float32 tensor in the autocast dtype of its device type while autocast is on there; anything
    else (None, integer, float64) as given. The attention ops and grouped matmuls call this on
    their operands, so fp32 weights meet bf16 activations under AMP as they would in a matmul."""
    device_type = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)
    if device_type is None or not autocasting(device_type):  # the usual call: one query, no cast
        return tensors
    return tuple(_autocast_one(t) for t in tensors)


def autocasting(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type``."""
    # Asking about a type without autocast (meta) raises; dynamo in torch 2.11 cannot trace the
    # availability check, and tensors being traced are on real device types.
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def _autocast_one(t):
    if not isinstance(t, torch.Tensor) or t.dtype not in _AUTOCAST_ELIGIBLE or not autocasting(t.device.type):
        return t
    return t.to(torch.get_autocast_dtype(t.device.type))


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)  # as torch's own: float64 is never cast


def same_device(**tensors: torch.Tensor) -> torch.device:
    items = list(tensors.items())
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {items[0][0]} is on {device}; move them to one device")
    device_facts(device)  # unsupported device types fail here, before any work
    return device


def name_of(x: torch.Tensor) -> str:
    try:
        return dtype_name(x.dtype)
    except TypeError:
        return str(x.dtype).removeprefix("torch.")


def static_shape(x: torch.Tensor) -> tuple[int, ...]:
    # Plans need concrete sizes: under dynamic-shape tracing this specializes (guards) on them.
    return tuple(int(n) for n in x.shape)


def values_readable(*tensors: torch.Tensor) -> bool:
    """Whether argument checks may read tensor values (a host sync on CUDA) now: not while
    torch.compile traces (the values are unknown), nor while a CUDA graph is captured (a sync
    is illegal then), nor for ``tensors`` a ``torch.func`` transform wraps (vmap's batched ones
    have no storage: "Cannot access data pointer of Tensor that doesn't have storage"; autotuning
    cannot launch candidates on them either), nor for fake tensors (FakeTensorMode, make_fx's
    fake and symbolic tracing: reading raised DataDependentOutputException). The kernels clamp
    what goes unchecked, as under ``jax.jit``. ``None`` entries are skipped."""
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(t is not None and (wrapped(t) or isinstance(t, FakeTensor)) for t in tensors):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


# Values read_later has read, by tensor object: (the version counter it had then, the values). A
# model passes one tensor of sizes to many calls (an MoE layer's router counts to its gate, up and
# down projections; one cu_seqlens to every attention layer), and each read is a host sync that
# drains the launch queue; one read per tensor and version is enough. An in-place write through
# torch bumps the version, so the tensor is read again; a write torch does not count (a raw kernel
# launch on its data pointer, a write through ``.data`` or through a numpy array sharing its
# memory) is not noticed. Weak keys: an entry lives as long as its tensor.
_READ = WeakIdKeyDictionary()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor, which has none (not remembered)."""
    return None if t.is_inference() else t._version


def _remembered(t: torch.Tensor):
    entry = _READ.get(t)
    return entry[1] if entry is not None and entry[0] == _version(t) else None


def read_later(*tensors: torch.Tensor):
    """Start copying ``tensors`` (one device) to the host and return a function that waits for the
    copies and returns their values as (nested) lists of Python numbers. On CUDA each copy is
    queued without waiting (into pinned memory), so the host work between the two calls runs
    while the GPU gets to it: a check that must read values before a launch (a host sync) then
    leaves the GPU idle only for what follows the wait, not for the whole argument handling. The
    values are copied as they are and reduced on the host: no kernel launches ahead of the copy.
    Tensors read before and not written since (``_READ``) are not read again: with all of them
    known, nothing is copied and the wait is free."""
    known = [_remembered(t) for t in tensors]
    if all(values is not None for values in known):
        return lambda: known
    versions = [_version(t) for t in tensors]  # as the copies see them: queued after every write so far
    if tensors[0].device.type != "cuda":
        read = lambda: [_values(t) for t in tensors]  # noqa: E731
    else:
        host = [t.to("cpu", non_blocking=True) for t in tensors]  # device-to-host: pinned, asynchronous
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list:
            copied.synchronize()
            return [_values(t) for t in host]

    def wait() -> list:
        values = read()
        for t, version, v in zip(tensors, versions, values):
            if version is not None:
                _READ[t] = (version, v)
        return values
    return wait


def _values(t: torch.Tensor) -> list:
    if t._is_zerotensor():  # torch's efficient zeros have no memory to read ("unallocated storage")
        return torch.zeros(t.shape, dtype=t.dtype).tolist()
    return t.tolist()


_SIGN_BIT = -(2**63)


def ordered_int64(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An integer tensor as int64 in the order of its values, and what to add to a value read back
    to get the original. A plain cast wraps uint64 values from 2**63 up to negatives, which were
    then read, clamped and reported wrongly (2**63 + 1 as -2**63 + 1, clamped to 0); flipping the
    sign bit maps each uint64 ``u`` to ``u - 2**63`` instead. (torch has no min, max or clamp for
    uint16/32/64, so these cannot be done in the tensor's own dtype.)"""
    v = x.to(torch.int64)
    if x.dtype != torch.uint64:
        return v, 0
    return v ^ _SIGN_BIT, 2**63


def clamp_to_int32(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``x`` (any integer dtype) clamped into ``[lo, hi]`` (within int32), as int32, on the device:
    clamped before the narrowing cast, which would wrap an int64 2**32 + 1 to 1."""
    v, shift = ordered_int64(x)
    v = v.clamp(max(lo - shift, _SIGN_BIT), hi - shift)
    return (v ^ _SIGN_BIT if shift else v).to(torch.int32)


def n_pad_arg(n_pad, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Validate ``n_pad`` (values too: a host sync on CUDA) and return it as int32 on ``device``.

    Under ``torch.compile``, during CUDA graph capture and for an n_pad batched by
    ``torch.func.vmap`` the values are not read (as under ``jax.jit``): the kernels clamp them.
    """
    n_pad = tensor_arg("n_pad", n_pad)
    checks.n_pad(tuple(n_pad.shape), name_of(n_pad), batch)
    if n_pad.device != device:
        raise ValueError(f"n_pad is on {n_pad.device} but the other inputs are on {device}")
    if not values_readable(n_pad):
        # Unchecked: clamp before the int32 cast, which would wrap int64 values (2**32 + 2 -> 2).
        # Bounds in n_pad's dtype (a uint8 n_pad cannot hold seq 300, nor need clamping to it).
        info = torch.iinfo(n_pad.dtype)
        n_pad = n_pad.clamp(max(0, info.min), min(seq_len, info.max))
    elif batch:
        checks.n_pad_values(int(n_pad.min()), int(n_pad.max()), seq_len)
    return n_pad.to(torch.int32).contiguous()


def declare_kernels(op_name: str, kernels) -> None:
    """Name the Triton kernels the registered op ``op_name`` may launch, for torch.compile's
    on-disk caches. torch keys a cached graph on the source of the kernels it finds in a
    triton_op's body (and of their helpers), and finds none behind our plans: a graph cached by an
    older version of this library then ran that version's plan texts against today's kernels
    (CI failed so after the flash dq kernel took new parameters: "plan for flash_bwd_dq_kernel
    binds ..."). torch keeps the table privately; without it (an older torch) there is nothing
    to add to."""
    from torch._library import triton as library_triton

    table = getattr(library_triton, "triton_ops_to_kernels", None)
    if table is not None:
        found = list(table.get(op_name, []))
        table[op_name] = found + [k for k in kernels if k is not None and k not in found]


class KernelOp:
    """``body`` (plans built from its tensors' shapes, run by ``launch_traceable``) as the
    ``torch.library.triton_op`` ``ejkernel::name`` (``.op``). torch.compile cannot trace the plan
    code (nor the interpreter): it sees the registered op instead, and traces it with
    ``fullgraph=True`` too, specialized on every size (see ``ejkernel_torch.ops.flash_attention``:
    new shapes recompile, ``mark_dynamic`` raises). Calling it runs ``body`` directly in plain
    eager mode, without the dispatcher's Python layers, else the op (see ``no_grad_op``). Its
    gradient, if any, is ``register_autograd``'s; ``KernelFunction`` registers one for the forward
    ops and records eager gradients itself. ``folds_under_vmap``: every tensor argument and output
    has one leading axis whose indices the kernels treat on their own; under ``torch.func.vmap``
    the mapped axis folds into it (``register_folding``), one launch for all samples, instead of
    torch's per-sample fallback. ``fold_limit``: given a sample's shape of the first tensor
    argument, the most of that leading axis one launch takes (a grid axis, an int32 row count);
    past it the samples go to several launches. None: no limit. ``kernels``: those ``body``'s
    plans launch (``declare_kernels``)."""

    def __init__(self, name: str, body, *, kernels=(), folds_under_vmap: bool = False, fold_limit=None):
        self.body = body
        self.fold_limit = fold_limit
        self.op = torch.library.triton_op(f"ejkernel::{name}", body, mutates_args=())
        declare_kernels(f"ejkernel::{name}", kernels)
        self.differentiable = False
        if folds_under_vmap:
            register_folding(self)

    def __call__(self, *args):
        if plain_eager(*(a for a in args if isinstance(a, torch.Tensor))):
            return self.body(*args)
        return no_grad_op(self.op, *args)

    def register_autograd(self, backward, setup_context) -> None:
        """Give the op a derivative (``torch.library.register_autograd``'s arguments)."""
        self.op.register_autograd(backward, setup_context=setup_context)
        self.differentiable = True


def no_grad_op(op, *args):
    """``op(*args)`` for a registered op without a derivative of its own (an autograd function's
    kernels). Under ``torch.func`` transforms it runs without grad mode: the op's autograd wrapper
    refuses those transforms (see ``functorch_active``) and has nothing to record anyway."""
    if not functorch_active():
        return op(*args)
    with torch.no_grad():
        return op(*args)


def saved_tensors(ctx) -> tuple:
    """``ctx.saved_tensors`` for a backward to launch kernels on. The function ``torch.func.vjp``
    returns runs the backward after its transform has ended: the tensors saved under it are then
    dead functorch wrappers, which torch's own ops unwrap but which have no storage to launch on."""
    tensors = ctx.saved_tensors
    if not under_torch_func(ctx):
        return tensors
    unwrap = torch._C._functorch.unwrap_if_dead  # live wrappers stay as they are
    return tuple(t if t is None else unwrap(t) for t in tensors)


def under_torch_func(ctx) -> bool:
    """Whether ``ctx`` was set up by a function ``autograd_function(transforms=True)`` made."""
    return getattr(ctx, "under_torch_func", False)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes an op's gradients through; differentiating them raises. The backward kernels have
    no derivative: a create_graph=True gradient had no graph through them, so a second derivative
    silently dropped their terms. (``once_differentiable`` does not help: its error node has no
    edge to the inputs, and ``torch.autograd.grad`` never reaches it.) ``torch.func.grad`` always
    builds that graph, hence ``setup_context`` and the vmap rule (what torch.func requires)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(name, n_grads, *tensors):
        return tuple(g.view_as(g) for g in tensors[:n_grads])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(f"{ctx.name} has no second derivative (its backward kernels are not differentiable)")


def first_order(name: str, grads: tuple, inputs: tuple) -> tuple:
    """An autograd backward's ``grads``, linked to ``inputs`` so that differentiating them raises.
    A no-op outside ``create_graph=True`` (grad mode is off in a backward then)."""
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not inputs:
        return grads
    live = [i for i, g in enumerate(grads) if g is not None]
    linked = iter(_NoDoubleBackward.apply(name, len(live), *(grads[i] for i in live), *inputs))
    return tuple(next(linked) if g is not None else None for g in grads)


def autograd_function(name: str, forward, setup_context, backward, *, transforms: bool) -> type:
    """A ``torch.autograd.Function`` made of ``forward(*inputs)``, ``setup_context(ctx, inputs,
    output)`` and ``backward``. ``transforms=True``: the setup_context form with a generated vmap
    rule, which ``torch.func`` transforms (grad, vjp, jacrev, vmap) require. Else the combined
    ``forward(ctx, *inputs)`` form, for everything else: torch's ``apply`` binds the setup_context
    form's arguments with ``inspect.signature`` on every call (about 15 us of host time)."""
    if transforms:
        def setup(ctx, inputs, output):
            ctx.under_torch_func = True
            setup_context(ctx, inputs, output)

        methods = {"forward": forward, "setup_context": setup}
    else:
        def combined(ctx, *inputs):
            output = forward(*inputs)
            setup_context(ctx, inputs, output)
            return output

        methods = {"forward": combined}
    methods = {k: staticmethod(f) for k, f in (*methods.items(), ("backward", backward))}
    return type(name, (torch.autograd.Function,), {**methods, "generate_vmap_rule": transforms})


class KernelFunction:
    """An op's ``forward`` (a ``KernelOp``) with its gradient: ``setup_context`` and ``backward``
    as ``torch.autograd.Function`` and ``register_autograd`` take them. Calling it runs
    ``forward`` alone when no input needs a gradient (autograd's bookkeeping costs about as much
    as the kernel launch itself on small inputs; under ``torch.func.vmap`` alone, ``vmap_only``,
    the ops' vmap rules serve), else through an autograd function (see ``autograd_function``)."""

    def __init__(self, name: str, forward: KernelOp, setup_context, backward):
        # The op's own derivative serves where the op is reached outside this function: under
        # torch.compile, torch.func.vmap's batched tensors hide requires_grad, so the op is called
        # directly and its vmap rule (register_folding) runs it on tensors that require grad.
        forward.register_autograd(backward, setup_context)
        self.forward = forward
        self.function = autograd_function(name, forward, setup_context, backward, transforms=False)
        self.transforms_function = autograd_function(f"{name}Transforms", forward, setup_context, backward,
                                                     transforms=True)

    def __call__(self, *args):
        reject_forward_ad(*args)
        if functorch_active():  # even with no requires_grad: vmap's batched tensors hide it (zero gradients)
            if vmap_only(*args):  # nothing to differentiate: the ops' vmap rules serve alone
                return self.forward(*args)
            return self.transforms_function.apply(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if torch.compiler.is_exporting():
                # Strict torch.export traced the autograd function's forward under no_grad
                # (wrap_with_set_grad_enabled(False)): the exported program recorded no gradient for
                # the op (a loss through it alone raised "does not require grad", one with other
                # terms silently left out its share). The op's registered derivative exports.
                return self.forward(*args)
            if torch.compiler.is_compiling():
                args = _distinct_tensors(args)
            return self.function.apply(*args)
        return self.forward(*args)


def _distinct_tensors(args) -> tuple:
    """``args`` with a tensor passed again (``padded_attention(q, kv, kv)``) replaced by a view of
    it: dynamo refuses an autograd.Function given one tensor twice ("duplicate tensor input"),
    which broke torch.compile(fullgraph=True) and strict export. Gradients add up as before."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and any(a is b for b in out):
            a = a.view_as(a)
        out.append(a)
    return tuple(out)
