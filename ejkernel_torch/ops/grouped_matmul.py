"""grouped_matmul (gmm) and transposed_grouped_matmul (tgmm) on torch tensors.

Both are registered ops (``torch.ops.ejkernel.grouped_matmul`` / ``transposed_grouped_matmul``) made
with ``torch.library.triton_op``: on CUDA their bodies launch the shared Triton kernels through
``wrap_triton``, so ``torch.compile(fullgraph=True)`` traces them without a graph break; on CPU they
run the Triton interpreter inside an opaque op. Autograd is ``register_autograd`` (under
``torch.func`` transforms, which that refuses, the same setup and backward in an autograd
function); the backward of each op is made of the two ops, so higher-order gradients run on the
kernels too (``torch.func.grad`` of ``grad`` included). Plans are built
from concrete sizes: under ``torch.compile``/``torch.export`` every size is specialized, as
``flash_attention``'s module docstring details (new shapes recompile; ``mark_dynamic`` raises).

Value checks on ``group_sizes`` (negative sizes, ``sum > m``) and on a tensor ``group_offset``
read the values, a host sync on CUDA. They run eagerly, and are skipped while ``torch.compile``
traces, while a CUDA graph is captured, or when the caller passes ``check_values=False`` (values
known valid, e.g. a router's ``bincount``: the sync stalls the launch queue; the copy it waits
for is queued before the rest of the argument handling, which then overlaps it, yet on an H200 the
checked forward still ran at 0.77x the unchecked one's speed at 128 experts of 128 rows, 0.96-0.98x
at 8-16 experts of 2-8k rows). A tensor is read once: later calls given the same tensor object,
not written since (its version counter unchanged: an MoE layer's gate, up and down projections
on one router's counts), check the values read then, with no sync; a write through torch is
seen, one torch does not count (a raw kernel's, through ``.data`` or a numpy view) is not. Unchecked bad values are clamped by the kernels (no
out-of-bounds access, meaningless result); a tensor ``group_offset`` is clamped before it is
narrowed to int32, so an int64 offset past int32 is not wrapped into a valid-looking one.

``group_sizes`` counted from a router's choices, ``torch.bincount(expert_ids, minlength=g)``, have a
length that depends on the values, unknown while torch.compile traces; the kernels read only
groups ``[0, group_offset + num_selected)``, so with an int ``group_offset`` the front cuts
``group_sizes`` to those (see ``_compile_time_groups``) and the graph asserts the length when it runs.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true, has_free_unbacked_symbols

from ejkernel_torch.launch import (device_facts, dtype_name, functorch_active, launch_traceable, plain_eager,
                                   reject_forward_ad, vmap_only)
from ejkernel_torch.ops import _tuning
from ejkernel_torch.ops._common import (autocast, autograd_function, clamp_to_int32, declare_kernels, name_of,
                                        read_later, same_device, saved_tensors, tensor_arg, values_readable)
from triton_kernels import checks, tuning
from triton_kernels import gluon_grouped_matmul as ggm
from triton_kernels import grouped_matmul as gm
from triton_kernels.config_cache import check_autotune
from triton_kernels.params import FwdParams, op_params
from triton_kernels.plan import LaunchPlan
from triton_kernels.tuning import GMM, TGMM, autotune_enabled


def _encode(params: FwdParams | None) -> Optional[list[int]]:
    """FwdParams as a list of ints (0 = plan default): what a custom-op schema can carry."""
    if params is None:
        return None
    return [getattr(params, f) or 0 for f in gm.PARAM_FIELDS]


def _decode(encoded: Optional[list[int]]) -> FwdParams | None:
    if encoded is None:
        return None
    return FwdParams(**{f: v for f, v in zip(gm.PARAM_FIELDS, encoded) if v})


# --------------------------------------------------------------------------------------------
# registered ops: inputs are already checked; group_offset is an int32 [1] tensor


def _static(shape) -> tuple[int, ...]:
    # Plans need concrete sizes: under dynamic-shape tracing this specializes (guards) on them.
    return tuple(int(d) for d in shape)


def _static_groups(group_sizes: torch.Tensor) -> int:
    """The number of groups, which plans need. A length that depends on values (torch.bincount's)
    reaches an op body under torch.compile only with a tensor ``group_offset``
    (``_compile_time_groups`` cuts it otherwise): refused by name, where torch's own error said
    "Could not extract specialized integer"."""
    length = group_sizes.shape[-1]
    if isinstance(length, torch.SymInt) and has_free_unbacked_symbols(length):
        raise ValueError("group_sizes has a length that depends on values (torch.bincount's, say): under "
                         "torch.compile pass group_offset as an int, or cut group_sizes to the number of groups "
                         "(torch._check(group_sizes.shape[0] >= g); group_sizes = group_sizes[:g])")
    return int(length)


def _sizes_shape(group_sizes: torch.Tensor) -> tuple[int, ...]:
    """``group_sizes``'s shape for ``gm.gmm_problem``: ``[groups]``, or ``[batch, groups]`` in the
    vmap rules' folded calls (``_gmm_vmap``)."""
    return (*_static(group_sizes.shape[:-1]), _static_groups(group_sizes))


def _gmm_problem(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, group_offset: torch.Tensor,
                 transpose_rhs: bool, out_dtype: torch.dtype, params: Optional[list[int]] = None) -> tuple:
    """The GMM problem (plan arguments, cache key) of a ``_gmm_body`` call: takes its arguments."""
    return gm.gmm_problem(_static(lhs.shape), _static(rhs.shape), _sizes_shape(group_sizes), transpose_rhs,
                          dtype_name(lhs.dtype), dtype_name(out_dtype))


def _tgmm_problem(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, group_offset: torch.Tensor,
                  num_selected: int, lhs_mk: bool, out_dtype: torch.dtype, params: Optional[list[int]] = None) -> tuple:
    """The TGMM problem of a ``_tgmm_body`` call: takes its arguments."""
    return gm.tgmm_problem(_static(lhs.shape), _static(rhs.shape), _sizes_shape(group_sizes), int(num_selected),
                           lhs_mk, dtype_name(lhs.dtype), dtype_name(out_dtype))


def _gmm_body(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, group_offset: torch.Tensor,
              transpose_rhs: bool, out_dtype: torch.dtype, params: Optional[list[int]]) -> torch.Tensor:
    """One problem, or a batch of them (a 2-D ``group_sizes``: see ``_gmm_vmap``)."""
    plan = _plan(_gmm_plan, lhs, rhs, group_sizes, transpose_rhs, out_dtype, params)
    return launch_traceable(plan, lhs.contiguous(), rhs.contiguous(), group_sizes, group_offset)[0]


def _tgmm_body(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, group_offset: torch.Tensor,
               num_selected: int, lhs_mk: bool, out_dtype: torch.dtype, params: Optional[list[int]]) -> torch.Tensor:
    """``lhs`` is [k, m], or [m, k] when ``lhs_mk`` (the gmm backward's layout: no transpose copy)."""
    plan = _plan(_tgmm_plan, lhs, rhs, group_sizes, (num_selected, lhs_mk), out_dtype, params)
    return launch_traceable(plan, lhs.contiguous(), rhs.contiguous(), group_sizes, group_offset)[0]


def _gmm_plan(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, transpose_rhs: bool,
              out_dtype: torch.dtype, params: Optional[list[int]]) -> LaunchPlan:
    problem = _gmm_problem(lhs, rhs, group_sizes, None, transpose_rhs, out_dtype)
    batch, shared = gm.problem_batch(group_sizes.shape), rhs.dim() == 3
    tuned = _tuning.resolve(GMM, gm.tuning_problem(problem, batch, shared), lhs.device, _decode(params))
    return gm.gmm_plan(*problem, device_facts(lhs.device), tuned, batch=batch, shared_rhs=shared)


def _tgmm_plan(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, options: tuple,
               out_dtype: torch.dtype, params: Optional[list[int]]) -> LaunchPlan:
    problem = _tgmm_problem(lhs, rhs, group_sizes, None, *options, out_dtype)
    return gm.tgmm_plan(*problem, device_facts(lhs.device), _tuning.resolve(TGMM, problem, lhs.device, _decode(params)),
                        batch=gm.problem_batch(group_sizes.shape))


def _plan(build: Callable[..., LaunchPlan], lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
          options, out_dtype: torch.dtype, params: Optional[list[int]]) -> LaunchPlan:
    """``build(...)``: an op body's plan. In plain eager mode it is memoized on what ``build``
    reads (sizes, dtypes, options, device) while the config cache keeps its generation, as
    flash attention's ``_resolved``: one cache check instead of a problem, a lookup and a plan
    per launch, three launches a training step (on an H200 host a small step's host time went
    from 890 to 755 us with it; scripts/profile_gmm_host.py)."""
    if not plain_eager():  # traced sizes may be symbols: no key of them
        return build(lhs, rhs, group_sizes, options, out_dtype, params)
    key = (build.__name__, lhs.shape, rhs.shape, group_sizes.shape, lhs.dtype, options, out_dtype,
           None if params is None else tuple(params), lhs.device)
    return tuning.memoized(key, build, lhs, rhs, group_sizes, options, out_dtype, params)


# Registered from named functions so that the eager fast path (``_call``) can run the bodies directly.
_gmm = torch.library.triton_op("ejkernel::grouped_matmul", _gmm_body, mutates_args=())
_tgmm = torch.library.triton_op("ejkernel::transposed_grouped_matmul", _tgmm_body, mutates_args=())
declare_kernels("ejkernel::grouped_matmul", (gm.gmm_kernel,))
declare_kernels("ejkernel::transposed_grouped_matmul", (gm.tgmm_kernel, getattr(ggm, "tgmm_gluon_kernel", None)))


def _gmm_setup(ctx, inputs, output):
    lhs, rhs, group_sizes, group_offset, transpose_rhs, _, _ = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes, group_offset)
    ctx.transpose_rhs = transpose_rhs


def _gmm_grad_calls(lhs, rhs, group_sizes, group_offset, transpose_rhs: bool, grad, needs) -> tuple:
    """The gmm backward's launches as (tunable, op arguments), for d_lhs and d_rhs (None where
    ``needs`` asks for no gradient): the backward runs these, and autotuning tunes their problems."""
    d_lhs = d_rhs = None
    if needs[0]:  # d_lhs[rows_g] = grad[rows_g] @ rhs[g]^T
        d_lhs = (GMM, (grad, rhs, group_sizes, group_offset, not transpose_rhs, lhs.dtype, None))
    if needs[1]:  # d_rhs[g] = lhs[rows_g]^T @ grad[rows_g] (or its transpose)
        a, b = (grad, lhs) if transpose_rhs else (lhs, grad)
        d_rhs = (TGMM, (a, b, group_sizes, group_offset, rhs.shape[-3], True, rhs.dtype, None))
    return d_lhs, d_rhs


def _gmm_backward(ctx, grad):
    lhs, rhs, group_sizes, group_offset = saved_tensors(ctx)
    grad = grad.to(lhs.dtype).contiguous()  # a bf16 model keeps a bf16 backward
    calls = _gmm_grad_calls(lhs, rhs, group_sizes, group_offset, ctx.transpose_rhs, grad, ctx.needs_input_grad)
    d_lhs, d_rhs = map(_run, calls)
    if d_rhs is not None and group_sizes.dim() == 2:  # a batch: [batch * selected, ...] per problem
        d_rhs = d_rhs.unflatten(0, (group_sizes.shape[0], -1))
        if rhs.dim() == 3:  # one rhs shared by the problems
            d_rhs = d_rhs.sum(0)
    return d_lhs, d_rhs, None, None, None, None, None


_gmm.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def _tgmm_setup(ctx, inputs, output):
    lhs, rhs, group_sizes, group_offset, num_selected, lhs_mk, _, _ = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes, group_offset)
    ctx.lhs_mk = lhs_mk


def _tgmm_grad_calls(lhs, rhs, group_sizes, group_offset, lhs_mk: bool, grad, needs) -> tuple:
    """The tgmm backward's launches, as ``_gmm_grad_calls``; d_lhs is built as [m, k]."""
    d_lhs = d_rhs = None
    if group_sizes.dim() == 2:  # a batch (see _tgmm_problem): grad [batch * selected, k, n] per problem
        grad = grad.unflatten(0, (group_sizes.shape[0], -1))
    if needs[0]:  # d_lhs[:, rows_g] = grad[g] @ rhs[rows_g]^T
        d_lhs = (GMM, (rhs, grad, group_sizes, group_offset, True, lhs.dtype, None))
    if needs[1]:  # d_rhs[rows_g] = lhs[:, rows_g]^T @ grad[g]
        # a view: the op body makes it contiguous, so asking for the problem copies nothing
        d_rhs = (GMM, (lhs if lhs_mk else _rows_first(lhs), grad, group_sizes, group_offset, False, rhs.dtype, None))
    return d_lhs, d_rhs


def _rows_first(lhs: torch.Tensor) -> torch.Tensor:
    """tgmm's [k, m] lhs as [m, k]; a batch's [batch, k, m] as [batch * m, k]."""
    return lhs.t() if lhs.dim() == 2 else lhs.transpose(1, 2).flatten(0, 1)


def _tgmm_backward(ctx, grad):
    lhs, rhs, group_sizes, group_offset = saved_tensors(ctx)
    grad = grad.to(lhs.dtype).contiguous()  # [groups, k, n]
    calls = _tgmm_grad_calls(lhs, rhs, group_sizes, group_offset, ctx.lhs_mk, grad, ctx.needs_input_grad)
    d_lhs, d_rhs = map(_run, calls)
    if d_lhs is not None and not ctx.lhs_mk:  # built as [m, k] (a batch's as [batch * m, k])
        d_lhs = d_lhs.t() if lhs.dim() == 2 else d_lhs.unflatten(0, (lhs.shape[0], -1)).transpose(1, 2)
    return d_lhs, d_rhs, None, None, None, None, None, None


_tgmm.register_autograd(_tgmm_backward, setup_context=_tgmm_setup)


# --------------------------------------------------------------------------------------------
# torch.func.vmap: the samples become one launch's batch of problems (a 2-D group_sizes, one
# row per problem; see gmm_plan). Without these rules torch ran one launch per sample, with its
# "performance drop" warning, and a mapped axis of size 0 raised. A nested vmap folds again:
# the inner rule's problems are each sample's.


def _sample_shape(x: torch.Tensor, dim: Optional[int]) -> tuple:
    return tuple(x.shape) if dim is None else tuple(x.shape[:dim] + x.shape[dim + 1:])


def _stacked(x: torch.Tensor, dim: Optional[int], n: int) -> torch.Tensor:
    """``x`` as ``[n, ...]``: mapped over ``dim``, or the same for every sample."""
    return x.expand(n, *x.shape) if dim is None else x.movedim(dim, 0)


def _problems(group_sizes, group_offset, in_dims, n: int) -> tuple:
    """(group_sizes ``[n * batch, groups]``, group_offset ``[n * batch]``, batch): the samples'
    group arguments as one batch of problems, ``batch`` per sample (1, or an inner vmap's)."""
    sizes = _stacked(group_sizes, in_dims[2], n)
    batch = sizes.shape[1] if sizes.dim() == 3 else 1
    offset = _stacked(group_offset, in_dims[3], n).expand(n, batch)
    return sizes.reshape(n * batch, sizes.shape[-1]).contiguous(), offset.reshape(n * batch).contiguous(), batch


def _batched_call(op, body, *args) -> torch.Tensor:
    """A vmap rule's call: the op body itself on plain tensors with nothing to differentiate
    (the dispatcher's layers cost host time), else the op (an outer vmap's rule, or under
    torch.compile the op's own derivative, where vmap's batched tensors hid requires_grad)."""
    tensors = args[:4]
    if plain_eager(*tensors) and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return body(*args)
    return op(*args)


@_gmm.register_vmap
def _gmm_vmap(info, in_dims, lhs, rhs, group_sizes, group_offset, transpose_rhs, out_dtype, params):
    n = info.batch_size
    rows, k = _sample_shape(lhs, in_dims[0])
    rhs_shape = _sample_shape(rhs, in_dims[1])
    if n == 0:
        return lhs.new_empty((0, rows, rhs_shape[-2 if transpose_rhs else -1]), dtype=out_dtype), 0
    sizes, offset, batch = _problems(group_sizes, group_offset, in_dims, n)
    if in_dims[1] is None and len(rhs_shape) == 3:  # one rhs for every problem: read in place, not copied
        rhs_b = rhs
    else:
        rhs_b = _stacked(rhs, in_dims[1], n)
        if len(rhs_shape) == 3:  # each sample's own rhs, shared by its inner problems
            rhs_b = rhs_b.unsqueeze(1).expand(n, batch, *rhs_shape)
        rhs_b = rhs_b.reshape(n * batch, *rhs_shape[-3:])
    lhs_b = _stacked(lhs, in_dims[0], n).reshape(n * rows, k)
    out = _batched_call(_gmm, _gmm_body, lhs_b, rhs_b, sizes, offset, transpose_rhs, out_dtype, params)
    return out.unflatten(0, (n, rows)), 0


@_tgmm.register_vmap
def _tgmm_vmap(info, in_dims, lhs, rhs, group_sizes, group_offset, num_selected, lhs_mk, out_dtype, params):
    n = info.batch_size
    lhs_shape, rhs_shape = _sample_shape(lhs, in_dims[0]), _sample_shape(rhs, in_dims[1])
    sizes, offset, batch = _problems(group_sizes, group_offset, in_dims, n)
    k = lhs_shape[-1] if lhs_mk else lhs_shape[-2]
    if n == 0:
        return lhs.new_empty((0, batch * num_selected, k, rhs_shape[-1]), dtype=out_dtype), 0
    lhs_b = _stacked(lhs, in_dims[0], n)
    # [n * rows, k] for lhs_mk, else [n * batch, k, m]: each problem's [k, m] block in place
    lhs_b = lhs_b.flatten(0, 1) if lhs_mk else lhs_b.reshape(n * batch, *lhs_shape[-2:])
    rhs_b = _stacked(rhs, in_dims[1], n).flatten(0, 1)
    out = _batched_call(_tgmm, _tgmm_body, lhs_b, rhs_b, sizes, offset, num_selected, lhs_mk, out_dtype, params)
    return out.unflatten(0, (n, batch * num_selected)), 0


# --------------------------------------------------------------------------------------------
# eager fast path
#
# In plain eager mode (``plain_eager``) the registered ops' dispatcher layers (custom-op,
# autograd and triton_op wrappers) only add host time before the same body runs: up to about a
# millisecond per training step of one grouped matmul on an H100 host
# (scripts/profile_gmm_step.py), which leaves the GPU idle when nothing else is queued. There the
# bodies run directly, through these autograd functions (the ops' own setup and backward) when a
# gradient is recorded. Under torch.func transforms (grad, vjp, jacrev, vmap), which the registered
# ops' autograd refuses, their setup_context-form twins run the registered ops (see
# ``autograd_function``). Anything else calls those ops.


_GmmFn = autograd_function("_GmmFn", _gmm_body, _gmm_setup, _gmm_backward, transforms=False)
_TgmmFn = autograd_function("_TgmmFn", _tgmm_body, _tgmm_setup, _tgmm_backward, transforms=False)
_GmmTransformsFn = autograd_function("_GmmTransformsFn", _gmm, _gmm_setup, _gmm_backward, transforms=True)
_TgmmTransformsFn = autograd_function("_TgmmTransformsFn", _tgmm, _tgmm_setup, _tgmm_backward, transforms=True)


def _call(op, body, fn, transforms_fn, args):
    """``op(*args)``, or the same work without the dispatcher in plain eager mode, or through
    ``transforms_fn`` under torch.func transforms."""
    lhs, rhs, group_sizes, group_offset = args[:4]
    if not plain_eager(lhs, rhs, group_sizes, group_offset):
        reject_forward_ad(lhs, rhs)
        if functorch_active() and not vmap_only(lhs, rhs):  # vmap alone: the ops' vmap rules serve
            return transforms_fn.apply(*args)
        return op(*args)
    if torch.is_grad_enabled() and (lhs.requires_grad or rhs.requires_grad):
        return fn.apply(*args)
    return body(*args)


def _call_gmm(*args) -> torch.Tensor:
    return _call(_gmm, _gmm_body, _GmmFn, _GmmTransformsFn, args)


def _call_tgmm(*args) -> torch.Tensor:
    return _call(_tgmm, _tgmm_body, _TgmmFn, _TgmmTransformsFn, args)


_CALLS = {GMM: (_call_gmm, _gmm_problem), TGMM: (_call_tgmm, _tgmm_problem)}


def _run(call) -> Optional[torch.Tensor]:
    """Runs one of a backward's launches (``_gmm_grad_calls``); None stays None."""
    if call is None:
        return None
    tunable, args = call
    return _CALLS[tunable][0](*args)


def _problem(call) -> tuple:
    """(tunable, problem) of one of a backward's launches: what its plan resolves."""
    tunable, args = call
    return tunable, _CALLS[tunable][1](*args)


def _autotune_grads(grad_calls, arrays, out_shape, autotune, device) -> None:
    """With autotuning enabled and a gradient to be taken, tune the problems of the backward's
    launches, ``grad_calls(grad, needs)``, on a cache miss. ``arrays``: the forward's (lhs, rhs,
    group_sizes, offset), gated as its own tuning is (eager only, no torch.func wrappers)."""
    needs = [torch.is_grad_enabled() and t.requires_grad for t in arrays[:2]]
    if not any(needs) or not autotune_enabled(autotune) or not values_readable(*arrays):
        return
    with torch.no_grad():
        grad = torch.empty(out_shape, dtype=arrays[0].dtype, device=device)  # the dtype the backward casts to
        calls = [c for c in grad_calls(grad, needs) if c is not None]
        if all(_tuning.resolve(*_problem(c), device) is not None for c in calls):
            return  # tuned before: no timing, no random draw
        # The gradient does not exist yet: random values (zeros would time a degenerate case),
        # from a private generator that leaves the caller's random stream alone.
        grad.normal_(generator=torch.Generator(device).manual_seed(0))
        for call in calls:  # timed on contiguous arrays, as the plans launch them
            _tuning.autotune(*_problem(call), device, [a.contiguous() for a in call[1][:4]], autotune)


# --------------------------------------------------------------------------------------------
# argument handling


def _group_args(group_sizes, group_offset, m: int, num_groups: int, num_selected: int,
                device: torch.device, check_values: bool):
    """group_sizes as given (int32, checked), group_offset as an int32 [1] tensor on ``device``, and
    the value checks: a function to call before any kernel runs. With ``check_values`` and
    ``values_readable()`` it reads the values, a host sync on CUDA; the read starts here, so the
    host work done before that call overlaps it (``read_later``)."""
    if group_sizes.device != device:
        raise ValueError(f"group_sizes is on {group_sizes.device} but lhs is on {device}")
    if group_offset is None:
        group_offset = 0
    if isinstance(group_offset, torch.Tensor):
        gm.check_group_offset_shape(tuple(group_offset.shape), name_of(group_offset))
        if group_offset.device != device:  # was moved silently (a meta one failed inside the copy)
            raise ValueError(f"group_offset is on {group_offset.device} but lhs is on {device}")
        # Clamped before the int32 cast (see group_offset_bounds).
        offset = clamp_to_int32(group_offset.reshape(1), *gm.group_offset_bounds(num_groups, num_selected))
        unread = [group_offset.reshape(())]  # values the checks still need
    elif isinstance(group_offset, (int, np.integer)) and not isinstance(group_offset, bool):
        group_offset = int(group_offset)  # numpy integers too, as in the jax front
        gm.check_group_offset_value(group_offset, num_groups, num_selected)
        # torch.full fills on the device; torch.tensor([...], device="cuda") would sync the stream.
        offset = torch.full((1,), group_offset, dtype=torch.int32, device=device)
        unread = []
    else:
        raise TypeError(f"group_offset must be an int or an integer scalar tensor, got {group_offset!r}")
    if check_values and (num_groups or unread) and values_readable(group_sizes, *unread):
        check = functools.partial(_check_values, read_later(group_sizes, *unread), m, num_groups, num_selected)
        return group_sizes.contiguous(), offset, check
    return group_sizes.contiguous(), offset, _no_check


def _no_check() -> None:
    pass


def _check_values(read, m: int, num_groups: int, num_selected: int) -> None:
    """The value checks on what ``read`` (``read_later``) waits for: group_sizes, and a tensor
    group_offset if one was given."""
    sizes, *offset = read()
    if num_groups:
        gm.check_group_values(min(sizes), sum(sizes), m)
    if offset:
        gm.check_group_offset_value(offset[0], num_groups, num_selected)


def _compile_time_groups(group_sizes: torch.Tensor, group_offset, num_selected) -> torch.Tensor:
    """``group_sizes`` with a length known while torch.compile traces.

    A length computed from values, as ``torch.bincount(expert_ids, minlength=g)``'s (the usual
    count of a router's tokens per expert: ``max(g, max(expert_ids) + 1)``), is an unbacked
    symbol there, and plans need concrete sizes: tracing failed with "Could not extract
    specialized integer from data-dependent expression u0". The kernels read only groups
    ``[0, group_offset + num_selected)``, so with an int ``group_offset`` the rest is cut off:
    the same result, from a length the plan knows; that the length reaches it is asserted when
    the graph runs. Every length is cut while compiling: dynamo shows a symbolic length as an
    int, and torch 2.11's refuses to trace ``has_free_unbacked_symbols``, so a known length
    cannot be told apart (cutting it changes no result). A tensor ``group_offset`` keeps the
    length, and the op body refuses an unbacked one by name (``_static_groups``); tgmm without
    ``num_actual_groups`` has one output per group, and torch's data-dependent error names
    ``num_actual_groups`` (where ``check_tgmm`` takes it).
    """
    if not torch.compiler.is_compiling() or group_sizes.dim() != 1:  # other ranks: refused by the checks
        return group_sizes
    if num_selected is None or isinstance(group_offset, torch.Tensor):
        return group_sizes
    length = group_sizes.shape[0]
    # Bad values count as 0 here: the checks after this refuse them by name.
    used = sum(max(int(v), 0) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else 0
               for v in (group_offset, num_selected))
    if not guard_or_true(length >= used):  # known short (a static length): the checks name it
        return group_sizes
    # No message function: strict torch.export (torch 2.13) took it for a tensor constant and
    # failed with "AttributeError: 'function' object has no attribute 'is_quantized'".
    torch._check(length >= used)
    return group_sizes[:used]


def _out_dtype(preferred_element_type, default: torch.dtype) -> torch.dtype:
    if preferred_element_type is None:
        return default
    if not isinstance(preferred_element_type, torch.dtype):
        raise TypeError(f"preferred_element_type must be a torch.dtype or None, got {preferred_element_type!r}")
    gm.check_out_dtype(str(preferred_element_type).removeprefix("torch."))
    return preferred_element_type


class _Args(NamedTuple):
    """The checked arguments of ``grouped_matmul`` or ``transposed_grouped_matmul`` (``_args``)."""
    arrays: tuple  # (lhs, rhs, group_sizes, offset): contiguous; offset an int32 [1] tensor
    m: int
    k: int
    n: int
    num_selected: int
    device: torch.device
    out_dtype: torch.dtype
    params: FwdParams | None
    check_group_values: Callable[[], None]  # the value checks, to call before any kernel runs (_group_args)


def _args(check_shapes: Callable, option, groups_read: Callable, lhs, rhs, group_sizes, group_offset,
          preferred_element_type, fwd_params, autotune, check_values) -> _Args:
    """The argument handling both ops share, in their order of checks. ``check_shapes`` is
    ``gm.check_gmm`` or ``gm.check_tgmm``, ``option`` its last argument (``transpose_rhs`` or
    ``num_actual_groups``); ``groups_read(rhs)`` is the number of selected groups that
    ``_compile_time_groups`` takes."""
    lhs, rhs, group_sizes = (tensor_arg(n, t) for n, t in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)))
    lhs, rhs = autocast(lhs, rhs)
    group_sizes = _compile_time_groups(group_sizes, group_offset, groups_read(rhs))
    m, k, n, num_groups, num_selected = check_shapes(
        tuple(lhs.shape), name_of(lhs), tuple(rhs.shape), name_of(rhs),
        tuple(group_sizes.shape), name_of(group_sizes), option)
    device = same_device(lhs=lhs, rhs=rhs)
    group_sizes, offset, check_group_values = _group_args(group_sizes, group_offset, m, num_groups, num_selected,
                                                          device, checks.flag("check_values", check_values))
    out_dtype = _out_dtype(preferred_element_type, lhs.dtype)
    params = op_params(FwdParams, fwd_params, "fwd_params", gm.PARAM_FIELDS)  # {}: None, as if not given
    check_autotune(autotune)
    lhs, rhs = lhs.contiguous(), rhs.contiguous()
    return _Args((lhs, rhs, group_sizes, offset), m, k, n, num_selected, device, out_dtype, params, check_group_values)


def _gmm_groups_read(rhs: torch.Tensor) -> int:
    """grouped_matmul's ``groups_read`` (``_args``): rhs's groups (0 for a bad rank: the checks refuse it)."""
    return rhs.shape[0] if rhs.dim() == 3 else 0


def grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
                   preferred_element_type: torch.dtype | None = None, transpose_rhs: bool = False,
                   group_offset: int | torch.Tensor | None = None,
                   fwd_params: FwdParams | dict | None = None, autotune: bool | None = None,
                   check_values: bool = True) -> torch.Tensor:
    """Grouped matmul for MoE: ``out[rows_g] = lhs[rows_g] @ rhs[g - group_offset]``.

    ``lhs`` is ``[m, k]``; ``rhs`` is ``[num_selected, k, n]`` (``[num_selected, n, k]`` if
    ``transpose_rhs``), same float dtype; ``group_sizes`` is int32 ``[num_groups]``
    (``num_groups >= num_selected``) and splits the rows of ``lhs`` into consecutive groups.
    ``group_offset`` (int or integer scalar tensor, default 0) selects groups
    ``[group_offset, group_offset + num_selected)``. Rows of other groups and rows past
    ``sum(group_sizes)`` are zeros. Accumulates in float32; the output dtype is
    ``preferred_element_type`` (default: the input dtype). ``fwd_params`` overrides the forward
    (Triton) kernel's ``blocksize_m/n/k`` (each at least 16), ``num_warps``, ``num_stages``;
    unset fields come from the heuristic, and the gradients' launches ignore it (as on
    ``ejkernel_jax``'s Triton path; its Pallas path and ``ejkernel_torch.tpu`` take a tiling).
    Without it (or with no field set, e.g. ``{}``) every launch (the gradients' too) uses the
    config cache's entry for its shapes and device, else the heuristic. ``autotune`` (True, False or None, the default:
    ``EJKERNEL_AUTOTUNE``) times candidates on a cache miss and stores the fastest, for the
    gradients' launches too when an input requires grad (eager only; see
    ``triton_kernels.tuning``). ``check_values=False`` skips reading ``group_sizes`` (and a
    tensor ``group_offset``) for the value checks, a host sync on CUDA (once per tensor and
    version, see the module docstring): for values known valid.
    Under ``torch.compile``, ``group_sizes`` may have a length that depends on values
    (``torch.bincount(expert_ids, minlength=g)``) when ``group_offset`` is an int.
    Differentiable in lhs and rhs.
    """
    a = _args(gm.check_gmm, transpose_rhs, _gmm_groups_read, lhs, rhs, group_sizes, group_offset,
              preferred_element_type, fwd_params, autotune, check_values)
    arrays = a.arrays
    compiling = torch.compiler.is_compiling()
    if not compiling:  # bad fwd_params fail here (dynamo cannot trace plans)
        problem = _gmm_problem(*arrays, bool(transpose_rhs), a.out_dtype)  # the op body's
        gm.gmm_plan(*problem, device_facts(a.device), a.params)
    a.check_group_values()  # before any kernel runs (autotuning's too)
    if not compiling:
        _tuning.autotune(GMM, problem, a.device, arrays, autotune, a.params)
        _autotune_grads(functools.partial(_gmm_grad_calls, *arrays, bool(transpose_rhs)),
                        arrays, (a.m, a.n), autotune, a.device)
    return _call_gmm(*arrays, bool(transpose_rhs), a.out_dtype, _encode(a.params))


def transposed_grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
                              preferred_element_type: torch.dtype | None = None,
                              group_offset: int | torch.Tensor | None = None,
                              num_actual_groups: int | None = None,
                              fwd_params: FwdParams | dict | None = None,
                              autotune: bool | None = None, check_values: bool = True) -> torch.Tensor:
    """Transposed grouped matmul: ``out[i] = lhs[:, rows_g] @ rhs[rows_g]`` with ``g = group_offset + i``.

    ``lhs`` is ``[k, m]``, ``rhs`` ``[m, n]``; returns ``[num_actual_groups, k, n]`` (default: all
    groups); an empty group gives zeros. This is the weight gradient of ``grouped_matmul``.
    ``fwd_params``: ``blocksize_k`` x ``blocksize_n`` is the output tile, ``blocksize_m`` the rows
    summed per step. ``fwd_params``/``autotune``/``check_values``: as in ``grouped_matmul``.
    Under ``torch.compile``, ``group_sizes`` may have a length that depends on values
    (``torch.bincount``) when ``group_offset`` is an int and ``num_actual_groups`` is given.
    Differentiable in lhs and rhs.
    """
    a = _args(gm.check_tgmm, num_actual_groups, lambda rhs: num_actual_groups, lhs, rhs, group_sizes,
              group_offset, preferred_element_type, fwd_params, autotune, check_values)
    arrays = a.arrays
    compiling = torch.compiler.is_compiling()
    if not compiling:
        problem = _tgmm_problem(*arrays, a.num_selected, False, a.out_dtype)  # the op body's
        gm.tgmm_plan(*problem, device_facts(a.device), a.params)
    a.check_group_values()
    if not compiling:
        _tuning.autotune(TGMM, problem, a.device, arrays, autotune, a.params)
        _autotune_grads(functools.partial(_tgmm_grad_calls, *arrays, False),
                        arrays, (a.num_selected, a.k, a.n), autotune, a.device)
    return _call_tgmm(*arrays, a.num_selected, False, a.out_dtype, _encode(a.params))
