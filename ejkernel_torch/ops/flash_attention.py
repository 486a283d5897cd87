"""flash_attention and flash_attention_varlen on torch tensors.

Both are registered ops (``torch.ops.ejkernel.flash_attention_fwd`` / ``_bwd``) made with
``torch.library.triton_op``: on CUDA their bodies launch the shared Triton kernels through
``wrap_triton``, so ``torch.compile(fullgraph=True)`` traces them without a graph break; on CPU
they run the Triton interpreter inside an opaque op. Autograd is ``register_autograd``; under
``torch.func`` transforms (grad, vjp, jacrev, vmap of those), which that refuses, the same setup
and backward run in ``_FlashAttentionTransformsFn``.
Plans are built from concrete sizes, so ``torch.compile`` and ``torch.export`` specialize on every
tensor size: each new shape recompiles, even with ``dynamic=True`` (past
``torch._dynamo.config.recompile_limit`` shapes a ``fullgraph=True`` function raises), and
``mark_dynamic`` or an export ``Dim`` on a size raises a constraint violation (``maybe_mark_dynamic``
and ``Dim.AUTO`` specialize instead).

In plain eager mode the public functions skip the dispatcher and run the op bodies directly
(``_call_forward``; the same autograd functions through ``_FlashAttentionFn`` when a gradient is
recorded): same plans, same kernels, same results, tens of microseconds less host time a call.
Those calls also memoize what their kernels are resolved with (``_resolved``: the forward plan,
the backward's tuned params) until the config cache changes, so that a forward + backward checks
the cache once and builds nothing again.
``scripts/profile_op_overhead.py`` measures each layer.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ejkernel_torch.launch import (device_facts, dtype_name, functorch_active, launch_prechecked,
                                   launch_traceable, plain_eager, reject_forward_ad, torch_dtype,
                                   uncached_while_compiling, vmap_only)
from ejkernel_torch.ops import _tuning
from ejkernel_torch.ops._common import (KernelOp, autocast, autocasting, autograd_function, declare_kernels,
                                        first_order, name_of, no_grad_op, read_later, same_device, saved_tensors,
                                        tensor_arg, values_readable)
from ejkernel_torch.ops._folding import fold, in_chunks, unfold
from triton_kernels import checks, flash_attention as fa, tuning
from triton_kernels.flash_attention.spec import dropout as check_dropout, dropout_mask_sizes
from triton_kernels.params import BwdParams, FwdParams, decode_params, encode_params, op_params
from triton_kernels.plan import DeviceFacts, LaunchPlan
from triton_kernels.config_cache import check_autotune
from triton_kernels.tuning import FLASH_BWD, FLASH_FWD, autotune_enabled

# --------------------------------------------------------------------------------------------
# the registered ops: arrays + the spec's static fields as plain scalars

_NO_WINDOW = -1  # window_left/right of a call without a positional mask
_NO_SOFTCAP = 0.0


def _op_scalars(spec: fa.FlashSpec) -> tuple:
    left, right = spec.window or (_NO_WINDOW, _NO_WINDOW)
    max_q, max_k = (spec.seq_q, spec.seq_k) if spec.varlen else (0, 0)
    return (max_q, max_k, spec.softmax_scale, left, right, spec.softcap or _NO_SOFTCAP, spec.dropout_p)


@functools.lru_cache(maxsize=1024)
def _spec(q_shape, k_shape, dtype, bias_shape, bias_dtype, segment_dtype, n_cu, max_q, max_k, scale, left, right,
          softcap, dropout_p) -> fa.FlashSpec:
    """The FlashSpec an op call was made from (the public functions already checked it)."""
    fields = dict(heads_q=q_shape[-2], heads_kv=k_shape[-2], head_dim=q_shape[-1], dtype=dtype, softmax_scale=scale,
                  window=None if left == _NO_WINDOW else (left, right), softcap=softcap or None,
                  bias=None if bias_shape is None else tuple(bias_shape[:2]), bias_dtype=bias_dtype,
                  segments=segment_dtype is not None, segment_dtype=segment_dtype or "int32", dropout_p=dropout_p)
    if n_cu:  # varlen: cu_seqlens has n_seq + 1 entries
        return fa.FlashSpec(batch=n_cu - 1, seq_q=max_q, seq_k=max_k, varlen=True, total_q=q_shape[0],
                            total_k=k_shape[0], **fields)
    return fa.FlashSpec(batch=q_shape[0], seq_q=q_shape[1], seq_k=k_shape[1], **fields)


def _static(shape) -> tuple[int, ...]:
    # Plans need concrete sizes: under dynamic-shape tracing this specializes (guards) on them.
    return tuple(int(n) for n in shape)


def _spec_of(q, k, bias, q_seg, cu_q, max_q, max_k, scale, left, right, softcap, dropout_p) -> fa.FlashSpec:
    # A window side clamped to seq_q + seq_k is symbolic where the sizes are, and dynamo traces
    # int arguments (max_seqlen_*) as SymInts once they vary: concrete like the sizes.
    left, right, max_q, max_k = int(left), int(right), int(max_q), int(max_k)
    bias_shape = None if bias is None else _static(bias.shape)
    return _spec(_static(q.shape), _static(k.shape), dtype_name(q.dtype), bias_shape,
                 None if bias is None else dtype_name(bias.dtype), None if q_seg is None else dtype_name(q_seg.dtype),
                 0 if cu_q is None else int(cu_q.shape[0]), max_q, max_k, scale, left, right, softcap, dropout_p)


# One-element zero stand-ins for unused kernel inputs, per (device, dtype). Making them afresh
# costs an allocation per unused input and call (plus a fill kernel launch each on CUDA). They
# are only ever kernel inputs, which the kernels never write, and never returned or saved for
# backward, so no caller can get hold of one and write into it.
_dummies: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype, cached: bool) -> Tensor:
    if not cached:  # traced (fake/functional tensors, compile): a real cached tensor must not leak in
        return torch.zeros(1, dtype=dtype, device=device)
    t = _dummies.get((device, dtype))
    if t is None:
        t = torch.zeros(1, dtype=dtype, device=device)
        # Allocated during CUDA graph capture it would live in the graph's private pool and its
        # fill would only run on replay: use it for this call, keep none.
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _dummies[(device, dtype)] = t
    return t


def _features(q, k, v, bias, q_seg, kv_seg, cu_q, cu_k, seed, cached: Optional[bool] = None) -> list[Tensor]:
    """The kernels' nine feature inputs, with one-element stand-ins for unused ones (cached ones
    when ``cached``; default: in plain eager mode)."""
    device, cached = q.device, plain_eager(q) if cached is None else cached
    i32 = _dummy(device, torch.int32, True) if cached else None  # cached: one tensor, looked up once

    def int32(x):
        return x if x is not None else i32 if cached else _dummy(device, torch.int32, False)

    return [q, k, v, bias if bias is not None else _dummy(device, q.dtype, cached),
            int32(q_seg), int32(kv_seg), int32(cu_q), int32(cu_k), int32(seed)]


def _forward(spec: fa.FlashSpec, arrays, fwd_params: Optional[list[int]]) -> tuple[Tensor, Tensor]:
    """(out, lse) for the op's nine arrays: the body of ``flash_attention_fwd``, which the public
    functions also call directly in plain eager mode (``_call_forward``)."""
    device = arrays[0].device
    plan = fa.forward_plan(spec, device_facts(device),
                           _tuning.resolve(FLASH_FWD, spec, device, decode_params(FwdParams, fwd_params)))
    out, lse = launch_traceable(plan, *_features(*arrays))
    return out, lse


class _Resolved(NamedTuple):
    """What a plain eager call's kernels need beyond its tensors (see ``_resolved``)."""
    facts: DeviceFacts
    forward: LaunchPlan
    bwd_params: Optional[BwdParams]  # resolved when the forward records a gradient, else None


def _resolved(spec: fa.FlashSpec, device: torch.device, params: tuple, backward: bool) -> _Resolved:
    """The forward plan (and the backward's params with ``backward``) that the op bodies would
    resolve, memoized with ``tuning.memoized``: a repeated eager call, forward and backward,
    checks the config cache once instead of per ``_tuning.resolve``, and rebuilds nothing until
    the cache changes. The backward's params are resolved here, with the forward's, when a
    gradient is recorded (as ``_autotune`` tunes them). ``spec`` comes from ``dense_spec`` or
    ``varlen_spec``, whose fields have one type each (floats stay floats): equal specs are one
    problem, as ``tuning.resolve`` keys them. ``device`` is a tensor's (CUDA ones carry an index)."""
    encoded = tuple(None if p is None else tuple(p) for p in params)  # lists: not hashable
    return tuning.memoized(("torch flash_attention eager", spec, device, encoded, backward), _resolve_eager,
                           spec, device, params, backward)


def _resolve_eager(spec: fa.FlashSpec, device: torch.device, params: tuple, backward: bool) -> _Resolved:
    facts = device_facts(device)
    fwd = _tuning.resolve(FLASH_FWD, spec, device, decode_params(FwdParams, params[0]))
    bwd = _tuning.resolve(FLASH_BWD, spec, device, decode_params(BwdParams, params[1])) if backward else None
    return _Resolved(facts, fa.forward_plan(spec, facts, fwd), bwd)


def _eager_forward(spec: fa.FlashSpec, arrays, resolved: _Resolved) -> tuple[Tensor, Tensor]:
    """``_forward`` in plain eager mode: the memoized plan, launched as ``launch_traceable``
    would launch it there. Without the launcher's input checks: the public functions made every
    array contiguous on q's device in the spec's dtypes, ``plain_eager`` refused lazy ones, and
    the stand-ins are the plan's own (about 5 us of host time a call)."""
    out, lse = launch_prechecked(resolved.forward, *_features(*arrays, cached=True))
    return out, lse


@torch.library.triton_op("ejkernel::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], q_segment_ids: Optional[Tensor],
                        kv_segment_ids: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                        cu_seqlens_k: Optional[Tensor], dropout_seed: Optional[Tensor], max_seqlen_q: int,
                        max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                        softcap: float, dropout_p: float, fwd_params: Optional[list[int]] = None,
                        bwd_params: Optional[list[int]] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of flash attention; lse is float32 natural log, [b, hq, sq] or [hq, total_q].
    ``fwd_params``/``bwd_params``: ``encode_params`` of the overrides (``bwd_params`` is for autograd)."""
    spec = _spec_of(q, k, bias, q_segment_ids, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale,
                    window_left, window_right, softcap, dropout_p)
    return _forward(spec, (q, k, v, bias, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, dropout_seed),
                    fwd_params)


def _backward_kernels(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                      lse: Tensor, bias: Optional[Tensor], q_segment_ids: Optional[Tensor],
                      kv_segment_ids: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                      cu_seqlens_k: Optional[Tensor], dropout_seed: Optional[Tensor], max_seqlen_q: int,
                      max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                      softcap: float, dropout_p: float, bias_grad: bool,
                      params: Optional[list[int]] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, ds): ds is the float32 gradient of the logits [b, hq, sq, sk] when
    ``bias_grad``, else a one-element placeholder."""
    spec = _spec_of(q, k, bias, q_segment_ids, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale,
                    window_left, window_right, softcap, dropout_p)
    plans = fa.backward_plans(spec, device_facts(q.device), bias_grad, dlse is not None,
                              _tuning.resolve(FLASH_BWD, spec, q.device, decode_params(BwdParams, params)))
    arrays = (q, k, v, bias, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, dropout_seed)
    return _launch_backward(plans, launch_traceable, plain_eager(q), dout, dlse, out, lse, arrays)


def _launch_backward(plans, run, cached: bool, dout, dlse, out, lse, arrays) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward's launches of ``plans`` (``fa.BackwardPlans``), each with ``run``
    (``launch_traceable``, or ``launch_prechecked`` in plain eager mode); ``cached``: see ``_features``."""
    dlse_arg = dlse if dlse is not None else _dummy(arrays[0].device, torch.float32, cached)
    return plans.gradients(run, _features(*arrays, cached=cached), out, dout, lse, dlse_arg)


# Registered from a named function so that ``_backward`` can also call the body directly.
flash_attention_bwd = torch.library.triton_op("ejkernel::flash_attention_bwd", _backward_kernels, mutates_args=())
declare_kernels("ejkernel::flash_attention_fwd", fa.plan.FORWARD_KERNELS)
declare_kernels("ejkernel::flash_attention_bwd", fa.plan.BACKWARD_KERNELS)


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_N_ARRAYS = 9  # q, k, v, bias, q_seg, kv_seg, cu_q, cu_k, seed
_N_SCALARS = 7  # max_seqlen_q .. dropout_p; then fwd_params, bwd_params


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_N_ARRAYS], *output)
    ctx.scalars = inputs[_N_ARRAYS:_N_ARRAYS + _N_SCALARS]
    tail = inputs[_N_ARRAYS + _N_SCALARS:]
    ctx.bwd_params = tail[1] if len(tail) > 1 else None
    ctx.n_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # an unused lse gives dlse=None: no dlse work in the kernels


def _backward(ctx, dout, dlse):
    q, k, v, bias, q_seg, kv_seg, cu_q, cu_k, seed, out, lse = saved_tensors(ctx)
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dout = torch.zeros_like(out) if dout is None else dout.to(q.dtype).contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    args = (dout, dlse, q, k, v, out, lse, bias, q_seg, kv_seg, cu_q, cu_k, seed, *ctx.scalars, bias_grad,
            ctx.bwd_params)
    tensors = (dout, dlse, q, k, v, out, lse, bias, q_seg, kv_seg, cu_q, cu_k, seed)
    spec, resolved = getattr(ctx, "eager", (None, None))
    # A _FlashAttentionFn forward saved plain tensors (autograd refuses them changed since): only
    # the mode and the incoming gradients remain to check.
    plain = plain_eager(dout, dlse) if resolved is not None else plain_eager(*tensors)
    if plain and not _needs_grad(tensors):  # as in _call_forward: skip the dispatcher
        if resolved is not None:  # a _FlashAttentionFn forward: its spec and resolved params serve
            plans = fa.backward_plans(spec, resolved.facts, bias_grad, dlse is not None, resolved.bwd_params)
            dq, dk, dv, ds = _launch_backward(plans, launch_prechecked, True, dout, dlse, out, lse,
                                                  (q, k, v, bias, q_seg, kv_seg, cu_q, cu_k, seed))
        else:
            dq, dk, dv, ds = _backward_kernels(*args)
    else:
        dq, dk, dv, ds = no_grad_op(torch.ops.ejkernel.flash_attention_bwd, *args)
    dbias = _sum_to(ds, bias.shape).to(bias.dtype) if bias_grad else None
    grads = (dq, dk, dv, dbias) + (None,) * (ctx.n_inputs - 4)
    # Recorded backward (create_graph=True, torch.func.grad): a second derivative must raise by name.
    return first_order("flash_attention", grads, (q, k, v, bias, out, dout, dlse))


def _sum_to(ds: Tensor, shape) -> Tensor:
    dims = [d for d in (0, 1) if shape[d] == 1 and ds.shape[d] != 1]
    return ds.sum(dim=dims, keepdim=True) if dims else ds


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# torch.func.vmap: the mapped axis folded into the batch, one launch for every sample (the
# kernels treat each (batch row, head) on its own). Not with dropout (the mask is drawn by
# batch-row index: a folded sample would draw another row's mask) nor varlen (cu_seqlens index
# packed tokens): those run once per sample, as torch's fallback for ops without a rule does.


@functools.cache
def _arg_index(op) -> dict[str, int]:
    """The op's argument positions by name (vmap rules get them positionally)."""
    return {a.name: i for i, a in enumerate(op.default._schema.arguments)}


def _folded_call(op, info, in_dims: tuple, args: tuple, batched: tuple[str, ...], shared: tuple[int, ...] = ()):
    """(``op``'s outputs, the samples' batch size) with the arguments named in ``batched``
    ([batch, ...] arrays) folded, or None where folding does not apply (dropout, varlen). A bias
    the same for every batch row and sample (``[1, ...]``, unmapped) stays so: the kernels
    broadcast it. The folded batch is a grid axis: past its limit the samples go to several
    launches (``fa.fold_chunks``), whose outputs are concatenated, except ``shared`` ones (the
    same for every sample), taken from the first."""
    at = _arg_index(op)
    if args[at["cu_seqlens_q"]] is not None or args[at["dropout_p"]] != 0.0:
        return None
    q_dim = in_dims[at["q"]]
    batch = args[at["q"]].shape[1 if q_dim == 0 else 0]

    def launch(size, chunk):
        folded = list(chunk)
        for name in batched:
            i = at[name]
            x, dim = chunk[i], in_dims[i]
            if not (name == "bias" and x is not None and dim is None and x.shape[0] == 1):  # shared bias
                folded[i] = fold(x, dim, size, batch)
        return op(*folded)

    n = info.batch_size
    return in_chunks(fa.fold_chunks(n, batch), n, args, in_dims, launch, shared), batch


def _per_sample(op, info, in_dims: tuple, args: tuple, out_dims: tuple):
    """``op`` once per sample, outputs stacked (where folding does not apply)."""
    results = []
    for i in range(info.batch_size):
        sample = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
        results.append(op(*sample))
    return tuple(torch.stack(r) if d == 0 else r[0] for r, d in zip(zip(*results), out_dims)), out_dims


@flash_attention_fwd.register_vmap
def _fwd_vmap(info, in_dims, *args):
    op = torch.ops.ejkernel.flash_attention_fwd
    folded = _folded_call(op, info, in_dims, args, ("q", "k", "v", "bias", "q_segment_ids", "kv_segment_ids"))
    if folded is None:
        return _per_sample(op, info, in_dims, args, (0, 0))
    outputs, batch = folded
    return tuple(unfold(o, info.batch_size, batch) for o in outputs), (0, 0)


@flash_attention_bwd.register_vmap
def _bwd_vmap(info, in_dims, *args):
    op = torch.ops.ejkernel.flash_attention_bwd
    bias_grad = args[_arg_index(op)["bias_grad"]]
    out_dims = (0, 0, 0, 0 if bias_grad else None)  # ds: else a one-element placeholder, shared
    folded = _folded_call(op, info, in_dims, args, ("dout", "dlse", "q", "k", "v", "out", "lse", "bias",
                                                    "q_segment_ids", "kv_segment_ids"), () if bias_grad else (3,))
    if folded is None:
        return _per_sample(op, info, in_dims, args, out_dims)
    outputs, batch = folded
    return tuple(o if d is None else unfold(o, info.batch_size, batch) for o, d in zip(outputs, out_dims)), out_dims


class _FlashAttentionFn(torch.autograd.Function):
    """The registered forward op's autograd (same ``_setup_context`` and ``_backward``) for plain
    eager calls that need a gradient. The op's own autograd wrapper costs much more than this
    (it rebuilds the schema's argument list per call, quadratically). Arguments: the op's nine
    arrays (first, so ``needs_input_grad`` indices match the op's), the spec they were made from
    and the op's (fwd_params, bwd_params); the op's scalars are the spec's (``_op_scalars``),
    not passed: each argument of ``apply`` costs host time."""

    @staticmethod
    def forward(ctx, *inputs):
        arrays, spec, params = inputs[:_N_ARRAYS], inputs[-2], inputs[-1]
        resolved = _resolved(spec, arrays[0].device, params, backward=True)
        output = _eager_forward(spec, arrays, resolved)
        _setup_context(ctx, (*arrays, *_op_scalars(spec), *params), output)
        ctx.n_inputs = len(inputs)  # gradients for this function's inputs, not the op's
        ctx.eager = spec, resolved  # for a plain eager backward
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


# The same for calls under torch.func transforms (grad, vjp, jacrev, vmap), which the op's own
# autograd refuses: the setup_context form with a generated vmap rule, running the registered op
# (on vmap's batched tensors: the op's batching).
_FlashAttentionTransformsFn = autograd_function("_FlashAttentionTransformsFn", torch.ops.ejkernel.flash_attention_fwd,
                                                _setup_context, _backward, transforms=True)


# --------------------------------------------------------------------------------------------
# public functions


def _optional_tensor(name, x, device) -> Tensor | None:
    if x is None:
        return None
    x = tensor_arg(name, x)
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x


def _seed(dropout_seed, dropout_p: float, device) -> Tensor | None:
    if dropout_p == 0.0:
        if dropout_seed is not None:  # unused, but a bad one is still an error
            _seed_tensor(dropout_seed, device)
        return None
    return _seed_tensor(dropout_seed, device)


def _seed_tensor(dropout_seed, device, where: str = "q is on") -> Tensor:
    """int32 [1] seed on ``device``; None draws one from torch's generator (torch.manual_seed
    reproduces it). ``where`` names ``device``'s source in the device error."""
    if dropout_seed is None:
        return torch.randint(-(2**31), 2**31 - 1, (1,), dtype=torch.int32, device=device)
    if isinstance(dropout_seed, Tensor):
        tensor_arg("dropout_seed", dropout_seed)  # dense: a sparse seed failed in reshape
        fa.seed_array(tuple(dropout_seed.shape), name_of(dropout_seed))
        if dropout_seed.device != device:
            raise ValueError(f"dropout_seed is on {dropout_seed.device} but {where} {device}")
        seed = dropout_seed.reshape(1)
        return seed.view(torch.int32) if seed.dtype == torch.uint32 else seed.to(torch.int32)  # uint32: same bits
    return torch.full((1,), fa.seed_value(dropout_seed), dtype=torch.int32, device=device)


def _qkv(q, k, v):
    q, k, v = autocast(tensor_arg("q", q), tensor_arg("k", k), tensor_arg("v", v))
    device = same_device(q=q, k=k, v=v)
    return q, k, v, device


def _shape_dtype(x):
    return (None, None) if x is None else (tuple(x.shape), name_of(x))


def _shapes_and_dtypes(*tensors):
    return tuple(tuple(t.shape) for t in tensors), tuple(name_of(t) for t in tensors)


def _params(spec, fwd_params, bwd_params, device) -> tuple:
    """The op's encoded (fwd_params, bwd_params), checked against the plans before any kernel runs."""
    if fwd_params is None and bwd_params is None:  # the usual call: nothing to coerce or check
        return None, None
    fwd, bwd = op_params(FwdParams, fwd_params, "fwd_params"), op_params(BwdParams, bwd_params, "bwd_params")
    if (fwd is not None or bwd is not None) and not torch.compiler.is_compiling():
        fa.forward_plan(spec, device_facts(device), fwd)
        fa.backward_plans(spec, device_facts(device), False, False, bwd)
    return encode_params(fwd), encode_params(bwd)


def _call_forward(spec: fa.FlashSpec, arrays: tuple, params: tuple) -> tuple[Tensor, Tensor]:
    """The registered forward op on the public functions' arrays (``spec`` is what they were
    checked into; the op would rebuild the same one from its scalars).

    In plain eager mode (``plain_eager``) the op's body runs without the dispatcher, which
    would run exactly that body after tens of microseconds of Python (custom-op, autograd and
    triton_op wrappers, dynamo's disable guard): directly when no gradient is recorded, else
    through ``_FlashAttentionFn``, the op's own autograd functions. Anything else (torch.compile,
    fake or functional tensors, modes) calls the registered op; torch.func transforms, which its
    autograd refuses, call it through ``_FlashAttentionTransformsFn``."""
    if not plain_eager(*arrays):
        reject_forward_ad(*arrays)
        if functorch_active() and not vmap_only(*arrays):
            return _FlashAttentionTransformsFn.apply(*arrays, *_op_scalars(spec), *params)
        return torch.ops.ejkernel.flash_attention_fwd(*arrays, *_op_scalars(spec), *params)  # vmap: its rule
    return _plain_forward(spec, arrays, params)


def _plain_forward(spec: fa.FlashSpec, arrays: tuple, params: tuple) -> tuple[Tensor, Tensor]:
    """``_call_forward`` in plain eager mode."""
    if _needs_grad(arrays[:4]):
        return _FlashAttentionFn.apply(*arrays, spec, params)
    return _eager_forward(spec, arrays, _resolved(spec, arrays[0].device, params, backward=False))


# -- known calls ------------------------------------------------------------------------------
#
# A model calls attention with the same shapes and options at every layer and step. A call
# with only q, k, v and scalar options (dropout too, seeded from torch's generator) whose key
# (``_call_key``) equals that of a call that passed the full checks is a known call: it takes
# that call's spec and goes straight to ``_plain_forward``. What the checks derive from the
# arguments is all in the key; what is not (the mode and the tensors' types: ``plain_eager``;
# gradients; autotuning) is still asked per call. Skipping the checks and the spec took a
# forward's host time from 71 to 47 us on the dev machine (scripts/profile_op_overhead.py,
# kernels stubbed).

_known_specs: dict[tuple, fa.FlashSpec] = {}
_KNOWN_LIMIT = 1024
_NO_PARAMS = (None, None)
_NO_FEATURES = (None,) * (_N_ARRAYS - 4)  # bias, segment ids, cu_seqlens
_KEY_FLOATS = (float, type(None))  # exact types: 1 == 1.0 == True as keys


def _call_key(q, k, v, causal, softmax_scale, sliding_window, logits_soft_cap, dropout_p,
              return_lse) -> tuple | None:
    """The call's key, or None where the call must take the full path: a tensor that is not a
    plain strided one, an option of another type than the usual ones, autocast on (it may
    change dtypes), or tracing. Strides are not in it: both paths make the arrays contiguous."""
    if torch.compiler.is_compiling():
        return None
    for t in (q, k, v):
        if type(t) not in _PLAIN_TYPES or t.layout is not torch.strided or t.is_nested:
            return None
    if (type(causal) is not bool or type(return_lse) is not bool or type(softmax_scale) not in _KEY_FLOATS
            or type(logits_soft_cap) not in _KEY_FLOATS or type(dropout_p) is not float
            or not _key_window(sliding_window)):
        return None
    if autocasting(q.device.type):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal,
            softmax_scale, sliding_window, logits_soft_cap, dropout_p)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _key_window(window) -> bool:
    if window is None or type(window) is int:
        return True
    return type(window) is tuple and len(window) == 2 and all(w is None or type(w) is int for w in window)


def _known_forward(spec: fa.FlashSpec, q: Tensor, k: Tensor, v: Tensor, autotune, return_lse: bool):
    # as the checked path: contiguous arrays, and a seed drawn from torch's generator for dropout
    arrays = (q.contiguous(), k.contiguous(), v.contiguous(), *_NO_FEATURES, _seed(None, spec.dropout_p, q.device))
    _autotune(spec, arrays, _NO_PARAMS, autotune, q.device)
    out, lse = _plain_forward(spec, arrays, _NO_PARAMS)
    return (out, lse) if return_lse else out


def _remember_call(key: tuple, spec: fa.FlashSpec) -> None:
    if len(_known_specs) >= _KNOWN_LIMIT:
        _known_specs.clear()
    _known_specs[key] = spec


def _autotune(spec, arrays, params, autotune, device) -> None:
    """On a cache miss with autotuning enabled, tune the forward, and the backward when a
    gradient will be taken (``arrays``: the op's nine array arguments)."""
    check_autotune(autotune)  # also while compiling, where it is not read
    if not autotune_enabled(autotune) or not values_readable():  # no timing while tracing or capturing
        return
    features = _features(*arrays)
    _tuning.autotune(FLASH_FWD, spec, device, features, autotune, params[0])
    if _needs_grad(arrays[:4]):
        _tuning.autotune(FLASH_BWD, spec, device, features, autotune, params[1])


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: float | None = None,
                    sliding_window: int | tuple[int | None, int | None] | None = None,
                    logits_soft_cap: float | None = None, bias: Tensor | None = None,
                    q_segment_ids: Tensor | None = None, kv_segment_ids: Tensor | None = None,
                    dropout_p: float = 0.0, dropout_seed: int | Tensor | None = None, return_lse: bool = False,
                    fwd_params: FwdParams | dict | None = None, bwd_params: BwdParams | dict | None = None,
                    autotune: bool | None = None):
    """Attention softmax(q k^T * scale [soft cap] + bias, masked) v with flash-attention kernels.

    q ``[batch, seq_q, heads_q, head_dim]``, k/v ``[batch, seq_k, heads_kv, head_dim]``, with
    ``heads_q % heads_kv == 0`` (GQA/MQA without repeating k/v). float16/bfloat16/float32,
    head_dim 1..256 (padded inside the kernels).

    * ``causal``: query i sees keys j <= i + seq_k - seq_q (bottom-right aligned, as flash-attn >= 2.1).
    * ``softmax_scale``: multiplies q k^T; None (the default) means ``head_dim ** -0.5``.
    * ``sliding_window``: int w (w keys left of the diagonal, and w right unless causal) or
      (left, right), None for an unbounded side.
    * ``logits_soft_cap``: logits become cap * tanh(logits / cap), then the bias is added and the
      masks applied.
    * ``bias``: additive, ``[batch|1, heads_q|1, seq_q, seq_k]``; gets a gradient if it requires one
      (float32 scratch of [batch, heads_q, seq_q, seq_k] in the backward).
    * ``q_segment_ids``/``kv_segment_ids`` ``[batch, seq]``: tokens attend only within equal ids;
      ids <= 0 are padding. int8/16/32/64 or uint8; int64 ids are compared as int64, the rest as int32.
      Padding is masked but still read: keep its q/k/v finite (a NaN there reaches every row).
    * ``dropout_p``/``dropout_seed``: dropout on the probabilities, drawn in-kernel from
      (seed, element offset) (see ``flash_attention_dropout_mask``); the seed defaults to a draw
      from torch's generator.
    * ``return_lse``: also return the float32 log-sum-exp ``[batch, heads_q, seq_q]``.
    * ``fwd_params``/``bwd_params`` (FwdParams/BwdParams or dicts: ``blocksize_m``/``q_blocksize``,
      ``blocksize_n``/``kv_blocksize``, ``num_warps``, ``num_stages``): override the forward /
      backward plans; checked (shared memory included) before any kernel runs. Without them the
      plans use the config cache's entry for this call's shapes and device, else their heuristic.
    * ``autotune`` (default: ``EJKERNEL_AUTOTUNE``): on a cache miss, time candidate configs and
      store the fastest (the backward's too when an input requires grad); eager only, never while
      ``torch.compile`` traces. See ``triton_kernels.tuning``.

    Rows that attend nothing give 0, lse -inf and zero gradients.
    """
    key = None
    if (bias is None and q_segment_ids is None and kv_segment_ids is None and dropout_seed is None
            and fwd_params is None and bwd_params is None):
        key = _call_key(q, k, v, causal, softmax_scale, sliding_window, logits_soft_cap, dropout_p, return_lse)
        spec = _known_specs.get(key) if key is not None else None
        if spec is not None and plain_eager(q, k, v):
            return _known_forward(spec, q, k, v, autotune, return_lse)
    q, k, v, device = _qkv(q, k, v)
    bias = _optional_tensor("bias", bias, device)
    q_seg = _optional_tensor("q_segment_ids", q_segment_ids, device)
    kv_seg = _optional_tensor("kv_segment_ids", kv_segment_ids, device)
    shapes, dtypes = _shapes_and_dtypes(q, k, v)
    (bias_shape, bias_dtype), (qs_shape, qs_dtype), (ks_shape, ks_dtype) = map(_shape_dtype, (bias, q_seg, kv_seg))
    spec = uncached_while_compiling(fa.dense_spec)(
        *shapes, dtypes, causal=causal, softmax_scale=softmax_scale, sliding_window=fa.window_arg(sliding_window),
        logits_soft_cap=logits_soft_cap, bias_shape=bias_shape, bias_dtype=bias_dtype, q_segment_shape=qs_shape,
        q_segment_dtype=qs_dtype, kv_segment_shape=ks_shape, kv_segment_dtype=ks_dtype, dropout_p=dropout_p)
    return_lse = checks.flag("return_lse", return_lse)  # "no" is truthy
    params = _params(spec, fwd_params, bwd_params, device)
    seed = _seed(dropout_seed, spec.dropout_p, device)
    arrays = (q.contiguous(), k.contiguous(), v.contiguous(), None if bias is None else bias.contiguous(),
              *(None if s is None else s.to(torch_dtype(spec.segment_dtype)).contiguous() for s in (q_seg, kv_seg)),
              None, None, seed)
    _autotune(spec, arrays, params, autotune, device)
    out, lse = _call_forward(spec, arrays, params)
    if key is not None:
        _remember_call(key, spec)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                           softmax_scale: float | None = None,
                           sliding_window: int | tuple[int | None, int | None] | None = None,
                           logits_soft_cap: float | None = None, bias: Tensor | None = None,
                           q_segment_ids: Tensor | None = None, kv_segment_ids: Tensor | None = None,
                           dropout_p: float = 0.0, dropout_seed: int | Tensor | None = None,
                           return_lse: bool = False, fwd_params: FwdParams | dict | None = None,
                           bwd_params: BwdParams | dict | None = None, autotune: bool | None = None):
    """``flash_attention`` over packed sequences: q ``[total_q, heads_q, head_dim]``, k/v
    ``[total_k, heads_kv, head_dim]``; sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``
    (int32, ``[n_seq + 1]``, starting at 0, non-decreasing; checked on the host, a sync on
    CUDA once per tensor object and version: the layers of a model given the same unwritten
    tensor check the values read by the first; not checked under torch.compile or CUDA graph
    capture, where the kernels clamp them as under jax.jit). ``max_seqlen_*`` bound the lengths. lse is ``[heads_q, total_q]``; tokens past
    ``cu_seqlens[-1]`` give 0. Dropout offsets are those of the padded ``[n_seq, heads_q,
    max_seqlen_q, max_seqlen_k]`` problem. Bias and segment ids are not supported here.
    ``fwd_params``/``bwd_params``/``autotune`` as in ``flash_attention`` (cache keys count the
    token totals by power of two).
    """
    q, k, v, device = _qkv(q, k, v)
    if bias is not None or q_segment_ids is not None or kv_segment_ids is not None:
        raise ValueError("flash_attention_varlen takes no bias or segment ids (sequences are given by cu_seqlens)")
    cu_q = _optional_tensor("cu_seqlens_q", cu_seqlens_q, device)
    cu_k = _optional_tensor("cu_seqlens_k", cu_seqlens_k, device)
    shapes, dtypes = _shapes_and_dtypes(q, k, v)
    spec = uncached_while_compiling(fa.varlen_spec)(
        *shapes, dtypes, tuple(cu_q.shape), name_of(cu_q), tuple(cu_k.shape), name_of(cu_k), max_seqlen_q,
        max_seqlen_k, causal=causal, softmax_scale=softmax_scale, sliding_window=fa.window_arg(sliding_window),
        logits_soft_cap=logits_soft_cap, dropout_p=dropout_p)
    if values_readable(cu_q, cu_k):  # one host sync for both (none for tensors read before: read_later)
        values_q, values_k = read_later(cu_q, cu_k)()
        fa.cu_seqlens_values("cu_seqlens_q", values_q, spec.total_q, max_seqlen_q)
        fa.cu_seqlens_values("cu_seqlens_k", values_k, spec.total_k, max_seqlen_k)
    return_lse = checks.flag("return_lse", return_lse)  # "no" is truthy
    params = _params(spec, fwd_params, bwd_params, device)
    seed = _seed(dropout_seed, spec.dropout_p, device)
    arrays = (q.contiguous(), k.contiguous(), v.contiguous(), None, None, None, cu_q.contiguous(), cu_k.contiguous(),
              seed)
    _autotune(spec, arrays, params, autotune, device)
    out, lse = _call_forward(spec, arrays, params)
    return (out, lse) if return_lse else out


def flash_attention_dropout_mask(dropout_seed: int | Tensor, batch: int, heads: int, seq_q: int, seq_k: int,
                                 dropout_p: float, *, device: str | torch.device = "cpu") -> Tensor:
    """The bool keep-mask ``[batch, heads, seq_q, seq_k]`` flash attention draws for this seed
    (element offset ((b * heads + h) * seq_q + i) * seq_k + j); the same in torch and jax.
    ``dropout_seed`` is required (an int or an integer tensor), as in jax."""
    if dropout_seed is None:  # flash_attention's default draw would give the mask of no known call
        fa.seed_value(dropout_seed)  # raises jax's TypeError for None
    # No q here: the seed's device is checked against device= (a CUDA seed with the default "cpu").
    seed = _seed_tensor(dropout_seed, torch.device(device), where="device= is")
    return _dropout_mask(seed, *dropout_mask_sizes(batch, heads, seq_q, seq_k), check_dropout(dropout_p)).bool()


def _dropout_mask_body(seed: Tensor, batch: int, heads: int, seq_q: int, seq_k: int, dropout_p: float) -> Tensor:
    # int(): under torch.compile the sizes may be SymInts; the plan specializes on them
    plan = fa.dropout_mask_plan(int(batch), int(heads), int(seq_q), int(seq_k), float(dropout_p),
                                device_facts(seed.device))
    return launch_traceable(plan, seed)[0]


# A registered op, as the attention ops: torch.compile cannot trace the plan code nor the interpreter.
_dropout_mask = KernelOp("flash_attention_dropout_mask", _dropout_mask_body,
                         kernels=(fa.plan.dropout_mask_kernel,))
