"""grouped_matmul (gmm) and transposed_grouped_matmul (tgmm) on jax arrays, with custom VJPs.

``grouped_matmul`` dispatches by platform: on TPU the Pallas kernel
(``ejkernel_jax.pallas.tpu.grouped_matmul``), elsewhere the shared Triton kernels (compiled
through jax-triton on GPU, the Triton interpreter on CPU). ``platform=`` overrides the choice;
``platform="tpu"`` off a TPU runs Pallas in interpret mode.

Value checks on ``group_sizes`` (negative sizes, ``sum > m``) and ``group_offset`` run when the
values are concrete (reading them is a device-to-host copy on GPU) unless ``check_values=False``.
Under ``jax.jit`` they are traced and cannot be checked: the kernels then clamp them (no
out-of-bounds access, meaningless result). An unchecked ``group_offset`` is clamped into range
in its own dtype before it is narrowed to int32, so an int64 offset past int32 is not wrapped
into a valid-looking one.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_jax._vma import vary_together
from ejkernel_jax.launch import any_traced, backend, device_facts, launch
from ejkernel_jax.ops import _tuning
from ejkernel_jax.ops._common import array_arg, is_concrete, name_of, same_device
from triton_kernels import checks
from triton_kernels import grouped_matmul as gm
from triton_kernels.config_cache import check_autotune
from triton_kernels.params import FwdParams, op_params
from triton_kernels.tuning import GMM, TGMM, autotune_enabled

PLATFORMS = ("tpu", "gpu", "cuda", "cpu")

# --------------------------------------------------------------------------------------------
# Triton path: inputs checked; group_offset is an int32 [1] array; out_dtype a dtype name


def _gmm_problem(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params=None) -> tuple:
    """The GMM problem (plan arguments, cache key) of a ``_gmm_launch`` call: takes its arguments."""
    return gm.gmm_problem(lhs.shape, rhs.shape, group_sizes.shape, transpose_rhs, name_of(lhs), out_dtype)


def _tgmm_problem(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params=None) -> tuple:
    """The TGMM problem of a ``_tgmm_launch`` call: takes its arguments."""
    return gm.tgmm_problem(lhs.shape, rhs.shape, group_sizes.shape, num_selected, lhs_mk, name_of(lhs), out_dtype)


def _gmm_launch(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params):
    if not any_traced(lhs, rhs, group_sizes, offset):  # concrete: no vmap can be batching the call
        return _gmm_kernels(transpose_rhs, out_dtype, params, lhs, rhs, group_sizes, offset)
    return _gmm_batching(transpose_rhs, out_dtype, params)(lhs, rhs, group_sizes, offset)


def _tgmm_launch(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params):
    if not any_traced(lhs, rhs, group_sizes, offset):
        return _tgmm_kernels(num_selected, lhs_mk, out_dtype, params, lhs, rhs, group_sizes, offset)
    return _tgmm_batching(num_selected, lhs_mk, out_dtype, params)(lhs, rhs, group_sizes, offset)


def _gmm_kernels(transpose_rhs, out_dtype, params, lhs, rhs, group_sizes, offset):
    """One problem, or a batch of them (see ``gm.gmm_plan``): lhs [batch * m, k], rhs [batch,
    selected, ..] or shared, group_sizes [batch, groups], offset [batch]."""
    problem = _gmm_problem(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype)
    batch, shared = gm.problem_batch(group_sizes.shape), rhs.ndim == 3
    tuned = _tuning.resolve(GMM, gm.tuning_problem(problem, batch, shared), params)
    plan = gm.gmm_plan(*problem, device_facts(), tuned, batch=batch, shared_rhs=shared)
    return launch(plan, lhs, rhs, group_sizes, offset)[0]


def _tgmm_kernels(num_selected, lhs_mk, out_dtype, params, lhs, rhs, group_sizes, offset):
    """One problem, or a batch: lhs [batch * m, k] (lhs_mk) or [batch, k, m], rhs [batch * m, n]."""
    problem = _tgmm_problem(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype)
    plan = gm.tgmm_plan(*problem, device_facts(), _tuning.resolve(TGMM, problem, params),
                        batch=gm.problem_batch(group_sizes.shape))
    return launch(plan, lhs, rhs, group_sizes, offset)[0]


# -- vmap: the samples become one launch's batch of problems ---------------------------------
# The launches' own vmap rule runs one launch per sample, in sequence (lax.map). A nested vmap
# folds again: the inner rule's problems are each sample's.


def _stacked(x, batched: bool, n: int):
    return x if batched else jnp.broadcast_to(x, (n,) + x.shape)


def _problems(group_sizes, offset, in_batched, n: int):
    """(group_sizes [n * batch, groups], offset [n * batch], batch per sample)."""
    sizes = _stacked(group_sizes, in_batched[2], n)
    batch = sizes.shape[1] if sizes.ndim == 3 else 1
    offset = jnp.broadcast_to(_stacked(offset, in_batched[3], n), (n, batch))
    return sizes.reshape(n * batch, sizes.shape[-1]), offset.reshape(n * batch), batch


@functools.lru_cache(maxsize=256)
def _gmm_batching(transpose_rhs, out_dtype, params):
    @jax.custom_batching.custom_vmap
    def run(lhs, rhs, group_sizes, offset):
        return _gmm_kernels(transpose_rhs, out_dtype, params, lhs, rhs, group_sizes, offset)

    @run.def_vmap
    def _rule(n, in_batched, lhs, rhs, group_sizes, offset):
        rows, k = lhs.shape[-2:]
        rhs_shape = rhs.shape[1:] if in_batched[1] else rhs.shape
        if n == 0:
            return jnp.zeros((0, rows, rhs_shape[-2 if transpose_rhs else -1]), out_dtype), True
        sizes, offsets, batch = _problems(group_sizes, offset, in_batched, n)
        if not in_batched[1] and rhs.ndim == 3:  # one rhs for every problem: read in place
            rhs_b = rhs
        else:
            rhs_b = _stacked(rhs, in_batched[1], n)
            if len(rhs_shape) == 3:  # each sample's own rhs, shared by its inner problems
                rhs_b = jnp.broadcast_to(rhs_b[:, None], (n, batch) + rhs_shape)
            rhs_b = rhs_b.reshape((n * batch,) + rhs_shape[-3:])
        lhs_b = _stacked(lhs, in_batched[0], n).reshape(n * rows, k)
        return run(lhs_b, rhs_b, sizes, offsets).reshape(n, rows, -1), True  # an outer vmap folds again

    return run


@functools.lru_cache(maxsize=256)
def _tgmm_batching(num_selected, lhs_mk, out_dtype, params):
    @jax.custom_batching.custom_vmap
    def run(lhs, rhs, group_sizes, offset):
        return _tgmm_kernels(num_selected, lhs_mk, out_dtype, params, lhs, rhs, group_sizes, offset)

    @run.def_vmap
    def _rule(n, in_batched, lhs, rhs, group_sizes, offset):
        lhs_shape = lhs.shape[1:] if in_batched[0] else lhs.shape
        sizes, offsets, batch = _problems(group_sizes, offset, in_batched, n)
        k, width = (lhs_shape[-1] if lhs_mk else lhs_shape[-2]), rhs.shape[-1]
        if n == 0:
            return jnp.zeros((0, batch * num_selected, k, width), out_dtype), True
        lhs_b = _stacked(lhs, in_batched[0], n)
        # [n * rows, k] for lhs_mk, else [n * batch, k, m]: each problem's [k, m] block in place
        lhs_b = lhs_b.reshape((-1, k) if lhs_mk else (n * batch,) + lhs_shape[-2:])
        rhs_b = _stacked(rhs, in_batched[1], n).reshape(-1, width)
        return run(lhs_b, rhs_b, sizes, offsets).reshape(n, batch * num_selected, k, width), True

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gmm(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params):
    return _gmm_launch(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params)


def _gmm_fwd(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params):
    # The op itself, not the raw launch: gradients of gradients differentiate this too.
    out = _gmm(lhs, rhs, group_sizes, offset, transpose_rhs, out_dtype, params)
    return out, (lhs, rhs, group_sizes, offset)


def _gmm_grad_calls(lhs, rhs, group_sizes, offset, transpose_rhs, grad) -> tuple:
    """The gmm backward's launches as (tunable, op arguments), for d_lhs and d_rhs: the backward
    runs these, and autotuning tunes their problems."""
    # d_lhs[rows_g] = grad[rows_g] @ rhs[g]^T
    d_lhs = (GMM, (grad, rhs, group_sizes, offset, not transpose_rhs, name_of(lhs), None))
    # d_rhs[g] = lhs[rows_g]^T @ grad[rows_g] (or its transpose), lhs read as [m, k]: no transpose
    a, b = (grad, lhs) if transpose_rhs else (lhs, grad)
    d_rhs = (TGMM, (a, b, group_sizes, offset, rhs.shape[0], True, name_of(rhs), None))
    return d_lhs, d_rhs


def _gmm_bwd(transpose_rhs, out_dtype, params, residuals, grad):
    lhs, rhs, group_sizes, offset = residuals
    grad = grad.astype(lhs.dtype)  # a bf16 model keeps a bf16 backward
    d_lhs, d_rhs = map(_run, _gmm_grad_calls(lhs, rhs, group_sizes, offset, transpose_rhs, grad))
    return d_lhs, d_rhs, None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _tgmm(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params):
    return _tgmm_launch(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params)


def _tgmm_fwd(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params):
    out = _tgmm(lhs, rhs, group_sizes, offset, num_selected, lhs_mk, out_dtype, params)
    return out, (lhs, rhs, group_sizes, offset)


def _tgmm_grad_calls(lhs, rhs, group_sizes, offset, lhs_mk, grad) -> tuple:
    """The tgmm backward's launches, as ``_gmm_grad_calls``; d_lhs is built as [m, k]."""
    # d_lhs[:, rows_g] = grad[g] @ rhs[rows_g]^T
    d_lhs = (GMM, (rhs, grad, group_sizes, offset, True, name_of(lhs), None))
    # d_rhs[rows_g] = lhs[:, rows_g]^T @ grad[g]
    d_rhs = (GMM, (lhs if lhs_mk else lhs.T, grad, group_sizes, offset, False, name_of(rhs), None))
    return d_lhs, d_rhs


def _tgmm_bwd(num_selected, lhs_mk, out_dtype, params, residuals, grad):
    lhs, rhs, group_sizes, offset = residuals
    grad = grad.astype(lhs.dtype)  # [groups, k, n]
    d_lhs, d_rhs = map(_run, _tgmm_grad_calls(lhs, rhs, group_sizes, offset, lhs_mk, grad))
    return (d_lhs if lhs_mk else d_lhs.T), d_rhs, None, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)

_CALLS = {GMM: (_gmm, _gmm_problem), TGMM: (_tgmm, _tgmm_problem)}


def _run(call):
    """Runs one of a backward's launches (``_gmm_grad_calls``)."""
    tunable, args = call
    return _CALLS[tunable][0](*args)


def _problem(call) -> tuple:
    """(tunable, problem) of one of a backward's launches: what its plan resolves."""
    tunable, args = call
    return tunable, _CALLS[tunable][1](*args)


def _autotune_grads(grad_calls, arrays, out_shape, autotune) -> None:
    """With autotuning enabled, tune the problems of the backward's launches, ``grad_calls(grad)``,
    on a cache miss, as flash_attention tunes its backward: whether a gradient follows is not
    known here. ``arrays``: the forward's (lhs, rhs, group_sizes, offset); on tracers (under
    ``grad``/``jit``/``vmap``) nothing is timed, as for the forward."""
    if not autotune_enabled(autotune) or not all(map(is_concrete, arrays)):
        return
    dtype = arrays[0].dtype  # the backward casts the gradient to lhs's dtype
    if all(_tuning.resolve(*_problem(c)) is not None for c in grad_calls(jax.ShapeDtypeStruct(out_shape, dtype))):
        return  # tuned before: no random draw
    # The gradient does not exist yet: random values (zeros would time a degenerate case).
    grad = jax.random.normal(jax.random.key(0), out_shape, dtype)
    for call in grad_calls(grad):
        _tuning.autotune(*_problem(call), call[1][:4], autotune)


# --------------------------------------------------------------------------------------------
# argument handling


def _group_sizes_arg(group_sizes, m: int, check_values: bool):
    group_sizes = array_arg("group_sizes", group_sizes)
    num_groups = gm.check_group_sizes(tuple(group_sizes.shape), name_of(group_sizes))
    if check_values and num_groups and is_concrete(group_sizes):
        sizes = np.asarray(group_sizes).astype(np.int64)
        gm.check_group_values(int(sizes.min()), int(sizes.sum()), m)
    return group_sizes


def _group_offset_arg(group_offset, num_groups: int, num_selected: int, check_values: bool) -> jax.Array:
    """group_offset as an int32 [1] array; its value is checked when concrete (an array's only if
    ``check_values``)."""
    if group_offset is None:
        group_offset = 0
    if isinstance(group_offset, (bool, np.bool_)):
        raise TypeError(f"group_offset must be an int or an integer scalar array, got {group_offset!r}")
    if isinstance(group_offset, (int, np.integer)):
        gm.check_group_offset_value(int(group_offset), num_groups, num_selected)
        return jnp.full((1,), int(group_offset), jnp.int32)
    if not isinstance(group_offset, (jax.Array, np.ndarray)):
        raise TypeError(f"group_offset must be an int or an integer scalar array, got {group_offset!r}")
    gm.check_group_offset_shape(tuple(group_offset.shape), name_of(group_offset))
    if check_values and is_concrete(group_offset):
        gm.check_group_offset_value(int(np.asarray(group_offset).reshape(())), num_groups, num_selected)
    # Unread values (traced, or check_values=False) clamped in their own dtype, then narrowed.
    lo, hi = gm.group_offset_bounds(num_groups, num_selected)
    clip = np.clip if isinstance(group_offset, np.ndarray) else jnp.clip  # numpy int64 without x64 too
    return jnp.asarray(clip(group_offset, lo, min(hi, np.iinfo(group_offset.dtype).max))).reshape(1).astype(jnp.int32)


def _out_dtype(preferred_element_type, default: str) -> str:
    if preferred_element_type is None:
        return default
    try:
        name = jnp.dtype(preferred_element_type).name
    except TypeError:
        raise TypeError(f"preferred_element_type must be a dtype or None, got {preferred_element_type!r}") from None
    gm.check_out_dtype(name)
    return name


def _platform(platform) -> str:
    if platform is None:
        return backend()  # jax.default_device(...) counts
    if not isinstance(platform, str):  # True was a ValueError, a wrong type a TypeError as elsewhere
        raise TypeError(f"platform must be a str or None, got {platform!r}")
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
    return platform


# The Pallas kernel's fwd_params: its tiling (tm, tk, tn). It has no warps or stages, and
# num_warps / num_stages given for it were dropped silently.
PALLAS_PARAM_FIELDS = ("blocksize_m", "blocksize_n", "blocksize_k")


def _fwd_params(fwd_params, pallas: bool) -> FwdParams | None:
    """fwd_params for the path taken (None: nothing overridden); fields only the Triton kernel
    has are refused on the Pallas path."""
    params = op_params(FwdParams, fwd_params, "fwd_params", gm.PARAM_FIELDS)  # {}: None, as if not given
    triton_only = sorted(set(params.to_dict()) - set(PALLAS_PARAM_FIELDS)) if pallas and params else []
    if triton_only:
        raise ValueError(f"fwd_params: {triton_only} apply to the Triton kernel only; platform='tpu' runs the "
                         f"Pallas kernel, whose fwd_params are its tiling: {sorted(PALLAS_PARAM_FIELDS)}")
    return params


def _pallas_tiling(params: FwdParams | None):
    """fwd_params' block sizes as a Pallas tiling (tm, tk, tn); unset sizes keep Pallas' 128."""
    if params is None:
        return (128, 128, 128)
    return tuple(getattr(params, f) or 128 for f in ("blocksize_m", "blocksize_k", "blocksize_n"))


class _Args(NamedTuple):
    """The checked arguments of ``grouped_matmul`` or ``transposed_grouped_matmul`` (``_args``)."""
    arrays: tuple  # (lhs, rhs, group_sizes, offset): the launch's arrays; offset an int32 [1] array
    m: int
    k: int
    n: int
    num_selected: int
    out_dtype: str
    pallas: bool
    params: FwdParams | None


def _args(check_shapes: Callable, option, lhs, rhs, group_sizes, group_offset, preferred_element_type,
          fwd_params, platform, autotune, check_values) -> _Args:
    """The argument handling both ops share, in their order of checks. ``check_shapes`` is
    ``gm.check_gmm`` or ``gm.check_tgmm``, ``option`` its last argument (``transpose_rhs`` or
    ``num_actual_groups``)."""
    lhs, rhs = array_arg("lhs", lhs), array_arg("rhs", rhs)
    group_sizes = array_arg("group_sizes", group_sizes)
    same_device(lhs=lhs, rhs=rhs, group_sizes=group_sizes, group_offset=group_offset)
    m, k, n, num_groups, num_selected = check_shapes(
        tuple(lhs.shape), name_of(lhs), tuple(rhs.shape), name_of(rhs),
        tuple(group_sizes.shape), name_of(group_sizes), option)
    out_dtype = _out_dtype(preferred_element_type, name_of(lhs))
    pallas = _platform(platform) == "tpu"
    params = _fwd_params(fwd_params, pallas)
    check_autotune(autotune)
    check_values = checks.flag("check_values", check_values)
    group_sizes = _group_sizes_arg(group_sizes, m, check_values)
    offset = _group_offset_arg(group_offset, num_groups, num_selected, check_values)
    return _Args((lhs, rhs, group_sizes, offset), m, k, n, num_selected, out_dtype, pallas, params)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type=None, transpose_rhs: bool = False,
                   group_offset: int | jax.Array | None = None,
                   fwd_params: FwdParams | dict | None = None, platform: str | None = None,
                   autotune: bool | None = None, check_values: bool = True) -> jax.Array:
    """Grouped matmul for MoE: ``out[rows_g] = lhs[rows_g] @ rhs[g - group_offset]``.

    ``lhs`` is ``[m, k]``; ``rhs`` is ``[num_selected, k, n]`` (``[num_selected, n, k]`` if
    ``transpose_rhs``), same float dtype; ``group_sizes`` is int32 ``[num_groups]``
    (``num_groups >= num_selected``) and splits the rows of ``lhs`` into consecutive groups.
    ``group_offset`` (int or integer scalar array, may be traced; default 0) selects groups
    ``[group_offset, group_offset + num_selected)``. Rows of other groups and rows past
    ``sum(group_sizes)`` are zeros. Accumulates in float32; the output dtype is
    ``preferred_element_type`` (default: the input dtype).
    ``platform``: None (the default backend), "tpu" (Pallas), "gpu"/"cuda"/"cpu" (Triton).
    ``fwd_params`` (``FwdParams`` or dict; block sizes are powers of two) means, per path:

    * Triton: the forward kernel's ``blocksize_m/n/k`` (each at least 16), ``num_warps`` and
      ``num_stages``; unset fields come from the plan's heuristic. The gradients' launches
      ignore it. Without ``fwd_params`` (or with no field set, e.g. ``{}``) every launch (the
      gradients' too) uses the config cache's entry for its shapes and device, else the
      heuristic; ``autotune`` (True, False or None, the default: ``EJKERNEL_AUTOTUNE``) times
      candidates on a cache miss, the gradients' launches' too, on concrete arrays only (under
      ``jit`` the cache is only read, at trace time).
    * Pallas: ``blocksize_m/k/n`` are its tiling ``(tm, tk, tn)``, for the forward and the
      gradients' kernels; unset ones are 128; any size from 1, shrunk to the problem (on a TPU,
      Mosaic's block rules apply). ``num_warps``/``num_stages`` raise ValueError: that kernel
      has neither. No config cache, no ``autotune``.
    ``check_values=False`` skips reading concrete ``group_sizes``/``group_offset`` arrays for
    the value checks (a device-to-host copy on GPU): for values known valid.
    Differentiable in lhs and rhs.
    """
    a = _args(gm.check_gmm, transpose_rhs, lhs, rhs, group_sizes, group_offset, preferred_element_type,
              fwd_params, platform, autotune, check_values)
    lhs, rhs, group_sizes, offset = arrays = a.arrays
    if a.pallas:
        from ejkernel_jax.pallas.tpu import grouped_matmul as pallas_gm

        # check_values=False: the values were checked above if asked; read again there, they were
        # checked even with check_values=False (raising, and a device-to-host copy on TPU).
        return pallas_gm.grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.dtype(a.out_dtype),
                                        tiling=_pallas_tiling(a.params), group_offset=offset[0],
                                        transpose_rhs=bool(transpose_rhs), check_values=False)
    problem = _gmm_problem(*arrays, bool(transpose_rhs), a.out_dtype)  # the launch's
    gm.gmm_plan(*problem, device_facts(), a.params)  # bad fwd_params fail here, before tracing the op
    _tuning.autotune(GMM, problem, arrays, autotune, a.params)
    _autotune_grads(functools.partial(_gmm_grad_calls, *arrays, bool(transpose_rhs)), arrays, (a.m, a.n), autotune)
    return _gmm(*vary_together(arrays), bool(transpose_rhs), a.out_dtype, a.params)


def transposed_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                              preferred_element_type=None, group_offset: int | jax.Array | None = None,
                              num_actual_groups: int | None = None,
                              fwd_params: FwdParams | dict | None = None, platform: str | None = None,
                              autotune: bool | None = None, check_values: bool = True) -> jax.Array:
    """Transposed grouped matmul: ``out[i] = lhs[:, rows_g] @ rhs[rows_g]`` with ``g = group_offset + i``.

    ``lhs`` is ``[k, m]``, ``rhs`` ``[m, n]``; returns ``[num_actual_groups, k, n]`` (default: all
    groups, static); an empty group gives zeros. The weight gradient of ``grouped_matmul``.
    ``fwd_params``: ``blocksize_k`` x ``blocksize_n`` is the output tile, ``blocksize_m`` the rows
    summed per step (both paths). ``platform``, ``fwd_params``, ``autotune`` and ``check_values``
    as in ``grouped_matmul``.
    Differentiable in lhs and rhs.
    """
    a = _args(gm.check_tgmm, num_actual_groups, lhs, rhs, group_sizes, group_offset, preferred_element_type,
              fwd_params, platform, autotune, check_values)
    lhs, rhs, group_sizes, offset = arrays = a.arrays
    if a.pallas:
        from ejkernel_jax.pallas.tpu import grouped_matmul as pallas_gm

        return pallas_gm.transposed_grouped_matmul(
            lhs, rhs, group_sizes, preferred_element_type=jnp.dtype(a.out_dtype), tiling=_pallas_tiling(a.params),
            group_offset=offset[0], num_actual_groups=a.num_selected, check_values=False)  # as in grouped_matmul
    problem = _tgmm_problem(*arrays, a.num_selected, False, a.out_dtype)  # the launch's
    gm.tgmm_plan(*problem, device_facts(), a.params)
    _tuning.autotune(TGMM, problem, arrays, autotune, a.params)
    _autotune_grads(functools.partial(_tgmm_grad_calls, *arrays, False), arrays, (a.num_selected, a.k, a.n), autotune)
    return _tgmm(*vary_together(arrays), a.num_selected, False, a.out_dtype, a.params)
