"""``jax_to_torch``: a JAX function as a torch function with autograd, jit-cached.

Per call (hot path): flatten ``(args, kwargs)`` with ``jax.tree_util`` (torch tensors are
leaves), look the structure up in a small dict, import every tensor zero-copy, call a cached
``jax.jit`` (jax's C++ dispatch keys on shapes/dtypes, so there is one trace per (structure,
static args, shapes, dtypes)), export the outputs zero-copy.

With grad: a ``torch.autograd.Function`` whose forward runs a jitted ``jax.vjp`` that returns
the outputs *and* the VJP object (a pytree whose leaves are the residuals, still jax arrays
on the device), and whose backward runs one shared jitted ``vjp(cotangents)``. The residuals
are dropped when torch frees the call's saved tensors (after a backward without
``retain_graph``), not when the outputs die. Under saved-tensor hooks (activation
checkpointing, ``save_on_cpu``) they are saved as torch tensors, so the hooks drop or offload
them as they do torch's own.
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

from . import _convert as cv
from ._convert import ConversionError

_tree_flatten = jax.tree_util.tree_flatten
_tree_unflatten = jax.tree_util.tree_unflatten

# Non-tensor leaves handed to jax as they are (traced like jax.jit would, never differentiated).
_PASSTHROUGH = (bool, int, float, complex, np.ndarray, np.generic, jax.Array)

# The bridged functions whose JAX function is being traced on this thread (innermost last).
_tracing = threading.local()


def tracing_function() -> "BridgedFunction | None":
    """The bridged function being traced on this thread, if any (to_jax refuses to run then)."""
    stack = getattr(_tracing, "stack", None)
    return stack[-1] if stack else None

# -- residual strategy ------------------------------------------------------------------------

_residual_mode: bool | None = None


def residuals_on_device() -> bool:
    """Can a jitted function return jax.vjp's pullback (residuals as its pytree leaves)?

    True on every jax this was written against; if a future jax makes the pullback opaque,
    the bridge falls back to re-running the forward under ``jax.vjp`` in backward (inputs are
    kept alive by torch's ``save_for_backward``).
    """
    global _residual_mode
    if _residual_mode is None:
        try:
            fwd = jax.jit(lambda x: jax.vjp(jnp.sin, x))
            _, pullback = fwd(jnp.float32(0.5))
            (g,) = jax.jit(lambda p, c: p(c))(pullback, jnp.float32(2.0))
            _residual_mode = bool(abs(float(g) - 2.0 * float(np.cos(np.float32(0.5)))) < 1e-6)
        except Exception:
            _residual_mode = False
    return _residual_mode


def set_residual_mode(value: bool | None) -> None:
    """Force the residual strategy (True: residuals on device, False: recompute). For tests."""
    global _residual_mode
    _residual_mode = value


def _conj_complex(xs):
    return [jnp.conj(x) if jnp.iscomplexobj(x) else x for x in xs]


# -- the wrapper ----------------------------------------------------------------------------


class _Static:
    """A pytree node without children: its payload travels in the treedef (static)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda aux, _: _Static(aux))


def _rebuild_pullback(jleaves, kept, static: _Static):
    res_tree, src = static.value
    it = iter(kept)
    return _tree_unflatten(res_tree, [jleaves[p] if p >= 0 else next(it) for p in src])


# Entries one bridged function keeps (input structures x static values). Past it the oldest goes:
# a new static value on every call (a fresh object as `self`) grew the cache, and kept those
# objects alive, forever. An evicted entry is traced again if it comes back.
MAX_CACHE_ENTRIES = 512


class _Entry:
    """Jitted callables for one (input structure, static args, x64) combination."""

    __slots__ = ("plain", "vjp_fwd", "vjp_bwd", "xla")

    def __init__(self):
        self.xla = None  # the torch_xla call_jax route's callables (see _xla.graph_call)
        self.plain = None
        self.vjp_fwd: dict[tuple[int, ...], Callable] = {}
        self.vjp_bwd: dict[tuple[int, ...], Callable] = {}


def _holds_tensor(value) -> bool:
    """Is a static value a torch tensor, or a (nested) tuple/frozenset holding one?"""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, frozenset)):  # the hashable containers; namedtuples too
        return any(_holds_tensor(v) for v in value)
    return False


def _argnames(static_argnames) -> tuple[str, ...]:
    """static_argnames as a tuple of names (a lone string or None as jax.jit takes them)."""
    if static_argnames is None:
        return ()
    if isinstance(static_argnames, str):
        return (static_argnames,)
    try:
        names = tuple(static_argnames)
    except TypeError:
        names = None
    # a non-string name never matches a keyword: it would be ignored, its argument traced
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"jax_to_torch: static_argnames must be a string or strings, got {static_argnames!r}")
    return names


def _global_named(obj):
    """What obj's module holds under obj's qualified name (None if nothing)."""
    value = sys.modules.get(getattr(obj, "__module__", None) or "")
    for part in str(getattr(obj, "__qualname__", "<locals>")).split("."):
        if part == "<locals>":
            return None
        value = getattr(value, part, None)
    return value


def _rebuild(fn, static_argnames, x64) -> "BridgedFunction":
    """Unpickle a bridged function that is not reachable by name."""
    return BridgedFunction(fn, static_argnames=static_argnames, x64=x64)


class BridgedFunction:
    """A torch-callable wrapping a JAX function; see :func:`jax_to_torch`."""

    def __init__(self, fn: Callable, *, static_argnames: Iterable[str] = (), x64: bool | None = None):
        if not callable(fn):
            raise TypeError(f"jax_to_torch: fn must be callable, got {type(fn).__name__}")
        # not `in`: 1 == True and 0 == False; a string such as "no" would read as True
        if not (x64 is None or isinstance(x64, (bool, np.bool_))):
            raise TypeError(f"jax_to_torch: x64 must be None, True or False, got {x64!r}")
        self.fn = fn
        self.static_argnames = _argnames(static_argnames)
        self.x64 = None if x64 is None else bool(x64)
        functools.update_wrapper(self, fn, updated=())
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        self._param_names = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        names = {p.name for p in params}
        has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
        var_pos = [p.name for p in params if p.kind == p.VAR_POSITIONAL]
        specs = []
        for name in self.static_argnames:
            if params and name not in names and not has_var_kw:
                raise ValueError(f"jax_to_torch: static_argnames names {name!r}, which {fn!r} does not take")
            if name in var_pos:  # no keyword reaches *name: it was accepted, then never static
                raise ValueError(
                    f"jax_to_torch: static_argnames names {name!r}, the *{name} parameter of {fn!r}; "
                    "arguments gathered by *args cannot be static by name (as in jax.jit): make them "
                    "named parameters"
                )
            pos = self._param_names.index(name) if name in self._param_names else None
            specs.append((name, pos))
        self._static_specs = tuple(specs)
        self._cache: dict[Any, _Entry] = {}
        self._lock = threading.Lock()
        # Counters (trace-time side effects, so they count compilations, not calls).
        self.calls = 0
        self.traces = 0
        self.backward_traces = 0
        self._bwd = jax.jit(self._bwd_residual)

    def __repr__(self) -> str:
        return f"jax_to_torch({getattr(self.fn, '__qualname__', self.fn)!r})"

    def __call__(self, *args, **kwargs):
        return _bridge_call(self, args, kwargs)

    def __get__(self, instance, owner=None):
        # A decorated method binds its instance as a plain function does; `self` is then an
        # argument like any other (list it in static_argnames unless it is a pytree of tensors).
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __deepcopy__(self, memo):
        # Like a Python function or a jax.jit: nothing to copy (the lock could not be copied, so
        # copy.deepcopy of a torch module holding a bridged function failed).
        return self

    def __reduce__(self):
        # pickle.dumps failed on the lock ("cannot pickle '_thread.lock' object"), so torch.save
        # of a module holding a bridged function did too. Pickled as functions and jax.jit are:
        # by reference when the module exposes this very object under its name (a decorated
        # function or method); else rebuilt from fn, which the pickler must handle (lambdas
        # need cloudpickle). Caches and counters start fresh either way.
        if _global_named(self) is self:
            return self.__qualname__
        return _rebuild, (self.fn, self.static_argnames, self.x64)

    def cache_info(self) -> dict[str, int]:
        """Calls so far, forward traces (compilations) and backward traces."""
        return {
            "calls": self.calls,
            "traces": self.traces,
            "backward_traces": self.backward_traces,
            "entries": len(self._cache),
        }

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
        self._bwd = jax.jit(self._bwd_residual)

    # -- argument handling ------------------------------------------------------------------

    def _split_static(self, args, kwargs):
        statics = []
        args_l = None
        kwargs = dict(kwargs)
        for name, pos in self._static_specs:
            if pos is not None and pos < len(args):
                if name in kwargs:  # else the keyword is refused as a non-static leaf
                    raise TypeError(f"{self!r}: got multiple values for argument {name!r}")
                if args_l is None:
                    args_l = list(args)
                statics.append((name, pos, args_l[pos]))
                args_l[pos] = None  # an empty pytree node in the slot; refilled when tracing
            elif name in kwargs:
                statics.append((name, None, kwargs.pop(name)))
        statics = tuple(statics)
        for name, _, value in statics:
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{self!r}: static argument {name!r} must be hashable, got {type(value).__name__}"
                ) from None
            # A tensor hashes by identity: it would be baked into the trace, so an in-place update
            # (or any later value) and its gradient would be ignored, silently.
            if _holds_tensor(value):
                raise TypeError(
                    f"{self!r}: static argument {name!r} is or holds a torch.Tensor; static values "
                    "are baked into the compiled function (later values and gradients would be "
                    "ignored) -- pass tensors as traced arguments, not in static_argnames"
                )
        return (tuple(args_l) if args_l is not None else args), kwargs, statics

    def _argname(self, args, kwargs, index: int) -> str:
        """"argument 'x'[0]" for the index-th flattened leaf of (args, kwargs)."""
        paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
        path = paths[index][0]
        head, rest = path[1], path[2:]
        if path[0].idx == 0:  # positional
            i = head.idx
            base = self._param_names[i] if i < len(self._param_names) else f"args[{i}]"
        else:
            base = head.key
        return f"argument {base!r}{jax.tree_util.keystr(tuple(rest))}"

    def _describe(self, args, kwargs, index: int) -> str:
        return f"{self!r}: {self._argname(args, kwargs, index)}"

    # -- traced functions -------------------------------------------------------------------

    def _call_fn(self, treedef, statics, leaves):
        args, kwargs = _tree_unflatten(treedef, leaves)
        if statics:
            args = list(args)
            for name, pos, value in statics:
                if pos is not None:
                    args[pos] = value
                else:
                    kwargs[name] = value
        # Runs only while jax traces: a tensor converted in here would become a constant of the
        # compiled function (to_jax checks this stack and refuses).
        stack = getattr(_tracing, "stack", None)
        if stack is None:
            stack = _tracing.stack = []
        stack.append(self)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            stack.pop()
        self._check_outputs(out)
        return out

    def _check_outputs(self, out) -> None:
        """Output leaves must be arrays or numbers. A torch tensor or a string among them failed, with
        grad, in the inexact-output filter ("Cannot interpret 'torch.float32' as a data type", "data
        type 's' not understood"), naming no output; without, as jax's "function plain at ..."."""
        for j, leaf in enumerate(jax.tree_util.tree_leaves(out)):
            if not isinstance(leaf, _PASSTHROUGH):
                raise TypeError(
                    f"{self!r}: output leaf {j} is a {type(leaf).__name__}; the JAX function must return "
                    "jax arrays or numbers (any pytree of them)"
                )

    def _make_plain(self, treedef, statics):
        def plain(*leaves):
            self.traces += 1
            return self._call_fn(treedef, statics, leaves)

        return jax.jit(plain)

    def _vjp_parts(self, treedef, statics, diff_pos, leaves):
        """(outputs pytree, pullback over the inexact output leaves) at ``leaves``."""

        def g(*diff):
            ls = list(leaves)
            for p, d in zip(diff_pos, diff):
                ls[p] = d
            out = self._call_fn(treedef, statics, ls)
            flat = jax.tree_util.tree_leaves(out)
            inexact = [x for x in flat if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
            return inexact, out

        _, pullback, out = jax.vjp(g, *[leaves[p] for p in diff_pos], has_aux=True)
        return out, pullback

    def _make_vjp_fwd(self, treedef, statics, diff_pos, tensor_pos):
        """jit(leaves -> (outputs, residuals not forwarded, _Static(rebuild recipe))).

        Residuals that *are* input tensors (jax often keeps primals, e.g. ``y`` for ``x * y``)
        are not returned from the jit -- XLA would copy them -- but refilled outside from the
        zero-copy input arrays; ``_Static`` rides in the output treedef, so the recipe comes
        back with every call at no cost.
        """

        def fwd(*leaves):
            self.traces += 1
            out, pullback = self._vjp_parts(treedef, statics, diff_pos, leaves)
            res, res_tree = _tree_flatten(pullback)
            ids = {id(leaves[p]): p for p in tensor_pos}
            src = tuple(ids.get(id(r), -1) for r in res)
            kept = [r for r, p in zip(res, src) if p < 0]
            return out, kept, _Static((res_tree, src))

        return jax.jit(fwd)

    def _make_vjp_bwd_recompute(self, treedef, statics, diff_pos):
        def bwd(leaves, cts):
            self.backward_traces += 1
            _, pullback = self._vjp_parts(treedef, statics, diff_pos, leaves)
            return _conj_complex(pullback(_conj_complex(cts)))

        return jax.jit(bwd)

    def _bwd_residual(self, pullback, cts):
        # torch's complex convention is the conjugate of jax's: g_torch = conj(vjp(conj(ct))).
        self.backward_traces += 1
        return _conj_complex(pullback(_conj_complex(cts)))

    def _entry(self, key) -> _Entry:
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    if len(self._cache) >= MAX_CACHE_ENTRIES:  # dicts keep insertion order: oldest first
                        del self._cache[next(iter(self._cache))]
                    entry = self._cache[key] = _Entry()
        return entry


def _export_outputs(bridged, out, input_ptrs, device=None):
    flat, out_tree = _tree_flatten(out)
    touts = []
    for j, o in enumerate(flat):
        try:
            t = cv.array_to_torch(o, None, device=device)
        except ConversionError as err:
            err.reraise(f"{bridged!r}: output leaf {j}")
        # jax.jit returns fresh buffers, but never hand torch two tensors over one buffer.
        if input_ptrs and t.numel() and t.data_ptr() in input_ptrs:
            t = t.clone()
        touts.append(t)
    return flat, out_tree, touts


def _import_leaves(bridged, args, kwargs, leaves, tpos, tensors):
    jleaves = list(leaves)
    k = 0
    try:
        for k, i in enumerate(tpos):
            jleaves[i] = cv.tensor_to_jax(tensors[k], None)
    except ConversionError as err:
        err.reraise(bridged._describe(args, kwargs, tpos[k]))
    return jleaves


def _xla_device(tensors):
    """The XLA device of a call's tensors (outputs go back onto it), else None."""
    if tensors and tensors[0].is_xla:
        return tensors[0].device
    return None


def _data_ptrs(tensors):
    # XLA tensors report data_ptr() 0 and are values (an in-place op rebinds, never writes
    # into an exported buffer), so they need no alias check.
    if not tensors or tensors[0].is_xla:
        return None
    return {t.data_ptr() for t in tensors}


class _Call:
    """Per-call state shared by the autograd Function's forward and backward."""

    __slots__ = ("bridged", "entry", "treedef", "statics", "args", "kwargs", "leaves", "tpos",
                 "diff_k", "diff_pos", "use_x64", "out_tree", "ct_idx")


class _Kept:
    """What a backward needs besides torch's saved tensors: the call (it holds the inputs) and
    the pullback (the jax residuals). Cleared when torch frees the saved tensors after a
    backward without ``retain_graph``: on ctx alone they lived as long as the outputs (in a
    training loop, into the next step's forward)."""

    __slots__ = ("call", "pullback", "recipe")

    def __init__(self, call, pullback, recipe=None):
        # recipe: set instead of pullback when the residuals are saved tensors (see _save_hooked)
        self.call, self.pullback, self.recipe = call, pullback, recipe

    def clear(self):
        self.call = self.pullback = self.recipe = None

    def tie_to(self) -> torch.Tensor:
        """An empty tensor to save for backward: torch drops it with the other saved tensors,
        and that clears this."""
        token = torch.empty(0)
        weakref.finalize(token, self.clear)
        return token


def _typed(value):
    """A static value keyed with the types of its parts, nested ones too: an entry's functions
    keep the first call's values, so with (True, 8) == (1, 8) == (1.0, 8) a later call ran the
    first one's (and a refused first call poisoned every equal value after it)."""
    if isinstance(value, tuple):  # namedtuples too (their type is kept)
        return type(value), tuple(_typed(v) for v in value)
    return type(value), value


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _BridgeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        b = call.bridged
        jleaves = _import_leaves(b, call.args, call.kwargs, call.leaves, call.tpos, tensors)
        if residuals_on_device():
            fwd = call.entry.vjp_fwd.get(call.diff_pos)
            if fwd is None:
                fwd = call.entry.vjp_fwd.setdefault(
                    call.diff_pos,
                    b._make_vjp_fwd(call.treedef, call.statics, call.diff_pos, call.tpos),
                )
            out, kept, recipe = _run(call.use_x64, fwd, jleaves)
        else:
            if call.entry.plain is None:
                call.entry.plain = b._make_plain(call.treedef, call.statics)
            out, kept, recipe = _run(call.use_x64, call.entry.plain, jleaves), None, None
        flat, call.out_tree, touts = _export_outputs(b, out, _data_ptrs(tensors), _xla_device(tensors))
        inexact = cv.INEXACT_JAX_DTYPES
        call.ct_idx = ct_idx = [j for j, o in enumerate(flat) if o.dtype in inexact]
        if len(ct_idx) != len(touts):
            keep = set(ct_idx)
            ctx.mark_non_differentiable(*[t for j, t in enumerate(touts) if j not in keep])
        # Saving inputs, and the outputs whose memory a residual shares, arms torch's
        # in-place-modification check: the backward reads them (zero-copy), so a later in-place
        # write must fail. Other outputs may be modified, as torch's own ops allow (relu_ after
        # a bridged matmul); the backward needs only their shapes.
        ctx.out_meta = [(t.shape, t.dtype, t.device) for t in touts]
        touts_read = _outputs_sharing(kept, touts, _xla_device(tensors))
        ctx.n_outs_read = len(touts_read)
        if _saved_tensor_hooks_active():
            _save_hooked(ctx, call, jleaves, kept, recipe, tensors, touts_read)
        else:
            pullback = None if recipe is None else _rebuild_pullback(jleaves, kept, recipe)
            ctx.kept = _Kept(call, pullback)
            ctx.save_for_backward(*tensors, *touts_read, ctx.kept.tie_to())
        return tuple(touts)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual case: the engine runs backward without grad
            return (None, *_backward(ctx, grads))
        # create_graph=True: compute without recording, then make any second use fail loudly.
        with torch.no_grad():
            result = _backward(ctx, grads)
        saved = ctx.saved_tensors
        # The gradients depend on the inputs *and* on the incoming grads (a Hessian-vector
        # product differentiates w.r.t. the latter): wire both to the error node.
        anchors = [saved[k] for k in ctx.kept.call.diff_k] + [g for g in grads if g is not None]
        return (None, *_poison_for_double_backward(result, anchors))


def _outputs_sharing(kept, touts, xla_device) -> list:
    """The outputs whose memory a kept residual (a jax array the backward reads) shares; all of
    them where that cannot be told (torch_xla, arrays without one buffer pointer)."""
    if not kept:  # no residuals (or recomputed from the inputs in backward)
        return []
    if xla_device is not None:
        return list(touts)
    try:
        shared = {r.unsafe_buffer_pointer() for r in kept if r.size}
    except Exception:  # noqa: BLE001 (sharded or deleted arrays: keep the safe choice)
        return list(touts)
    return [t for t in touts if t.numel() and t.data_ptr() in shared]


def _save_hooked(ctx, call, jleaves, kept, recipe, tensors, touts):
    """Save for backward under saved-tensor hooks (activation checkpointing, save_on_cpu), which
    pack what is saved: drop it to recompute it, or offload it. Kept on ctx as jax arrays, the
    residuals (and the inputs, through the call) escaped them: checkpointing freed nothing.
    So the residuals are saved as torch tensors, and the call lets go of its tensors; ctx then
    keeps no tensor and needs no tied token (the hooks would replace it at once)."""
    res = [] if recipe is None else _residual_tensors(kept, _xla_device(tensors))
    if res is None:  # a residual dtype torch lacks: it stays on ctx as a jax array
        ctx.kept, res = _Kept(call, _rebuild_pullback(jleaves, kept, recipe)), []
    else:
        ctx.kept = _Kept(call, None, recipe)
    _release_tensors(call)
    ctx.save_for_backward(*tensors, *touts, *res)


def _residual_tensors(kept, device):
    """The residual jax arrays as torch tensors (zero-copy), or None if a dtype has none."""
    if any(r.dtype not in cv.JAX_TO_TORCH_DTYPE for r in kept):
        return None
    return [cv.array_to_torch(r, None, device=device) for r in kept]


def _release_tensors(call) -> None:
    """Drop the call's references to its input tensors; the backward gets them back from the
    saved tensors, and argument names come from the structure alone."""
    tset = set(call.tpos)
    call.leaves = [None if i in tset else leaf for i, leaf in enumerate(call.leaves)]
    call.args, call.kwargs = _tree_unflatten(
        call.treedef, ["<tensor>" if i in tset else leaf for i, leaf in enumerate(call.leaves)]
    )


def _run(use_x64: bool, fn, leaves):
    if use_x64:
        with cv.x64_context():
            return fn(*leaves)
    return fn(*leaves)


def _backward(ctx, grads):
    saved = ctx.saved_tensors  # raises if an input/output was modified in place, or freed (a 2nd backward)
    call: _Call = ctx.kept.call
    b = call.bridged
    n_in = len(call.tpos)
    cts = []
    for j in call.ct_idx:
        g = grads[j]
        if g is None:
            shape, dtype, device = ctx.out_meta[j]
            g = torch.zeros(shape, dtype=dtype, device=device)
        elif not g.is_contiguous():
            g = g.contiguous()  # e.g. the expanded ones of sum().backward()
        try:
            cts.append(cv.tensor_to_jax(g, None))
        except ConversionError as err:
            err.reraise(f"{b!r}: gradient of output leaf {j}")
    if ctx.kept.pullback is not None:
        grads_in = _run(call.use_x64, b._bwd, (ctx.kept.pullback, cts))
    elif ctx.kept.recipe is not None:  # residuals saved through saved-tensor hooks
        jleaves = _import_leaves(b, call.args, call.kwargs, call.leaves, call.tpos, saved[:n_in])
        kept = [cv.tensor_to_jax(t, None) for t in saved[n_in + ctx.n_outs_read:]]
        pullback = _rebuild_pullback(jleaves, kept, ctx.kept.recipe)
        grads_in = _run(call.use_x64, b._bwd, (pullback, cts))
    else:
        jleaves = _import_leaves(b, call.args, call.kwargs, call.leaves, call.tpos, saved[:n_in])
        bwd = call.entry.vjp_bwd.get(call.diff_pos)
        if bwd is None:
            bwd = call.entry.vjp_bwd.setdefault(
                call.diff_pos, b._make_vjp_bwd_recompute(call.treedef, call.statics, call.diff_pos)
            )
        grads_in = _run(call.use_x64, bwd, (jleaves, cts))
    result: list[torch.Tensor | None] = [None] * n_in
    device = _xla_device(saved[:n_in])
    for k, g in zip(call.diff_k, grads_in):
        result[k] = cv.array_to_torch(g, None, device=device)
    return result


_DOUBLE_BACKWARD = (
    "jax_to_torch: differentiating a gradient that went through a JAX function (double "
    "backward / create_graph=True) is not supported"
)


def _poison_for_double_backward(result, anchors):
    """Like torch's @once_differentiable, but the error node is also wired to the function's
    inputs and incoming grads (``anchors``): once_differentiable returns graph-less gradients
    when the incoming grads are constants (the usual create_graph=True case), and even its
    error node is pruned by ``torch.autograd.grad(..., inputs=x)`` -- second-order terms would
    silently vanish. Here any differentiation of these gradients back to the inputs or to the
    incoming grads raises."""
    present = [i for i, g in enumerate(result) if g is not None]
    anchors = [a for a in anchors if a.requires_grad]
    if not present:
        return result
    err = torch._C._functions.DelayedError(_DOUBLE_BACKWARD, len(present) + len(anchors))
    poisoned = err(*[result[i].detach().requires_grad_(True) for i in present], *anchors)
    if isinstance(poisoned, torch.Tensor):
        poisoned = (poisoned,)
    poisoned = poisoned[: len(present)]
    out = list(result)
    for i, g in zip(present, poisoned):
        out[i] = g
    return out


_GRAPH_BREAK_REASON = (
    "ejkernel_torch.interop.jax_to_torch runs a JAX computation (DLPack exchange + jax.jit); "
    "dynamo cannot trace it, so it graph-breaks here by design and runs it eagerly"
)


def _compiler_disable(fn, reason: str):
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch without the reason= keyword
        return torch.compiler.disable(fn)


def _reject_tangents(b, args, kwargs, tpos, tensors) -> None:
    """A forward-AD dual tensor would lose its tangent silently (DLPack carries the primal),
    and with requires_grad torch's own error does not say what to do instead."""
    for k, t in enumerate(tensors):
        if _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{b._describe(args, kwargs, tpos[k])} is a forward-mode AD dual tensor "
                "(torch.autograd.forward_ad); jax_to_torch differentiates in reverse mode only -- "
                "use backward / torch.autograd.grad, or jax.jvp inside the JAX function"
            )


def _proxy_mode(_get=torch._C._get_dispatch_mode, _key=torch._C._TorchDispatchModeKey.PROXY):
    """The active make_fx tracing mode (a ProxyTorchDispatchMode), if any."""
    return _get(_key)


_functorch_level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)


def _reject_functorch(b, args, kwargs, tpos, tensors) -> None:
    """torch.func transforms (grad, vjp, jacrev, vmap) refuse our autograd.Function with torch's
    generic "must override the setup_context staticmethod", which points at the wrong fix."""
    k = next(k for k, t in enumerate(tensors) if t.requires_grad)
    raise NotImplementedError(
        f"{b._describe(args, kwargs, tpos[k])} requires grad under a torch.func transform (grad / vjp / "
        "jacrev / vmap ...); jax_to_torch functions are differentiated by torch autograd only -- use "
        "backward / torch.autograd.grad outside torch.func, or jax.grad / jax.vmap inside the JAX function"
    )


def _reject_inference(b, args, kwargs, tpos, tensors) -> None:
    """A call that records gradients saves all its inputs (jax residuals may alias them), and
    torch refuses to save inference tensors -- after the jax forward had run, naming no argument."""
    for k, t in enumerate(tensors):
        if t.is_inference():
            raise TypeError(
                f"{b._describe(args, kwargs, tpos[k])} is an inference tensor (made under "
                "torch.inference_mode()), and a call that records gradients saves its inputs for "
                "backward, which inference tensors cannot be; pass a .clone() made outside "
                "inference_mode, or make the tensor under torch.no_grad() instead"
            )


def _check_single_device(b, args, kwargs, index: int, array: jax.Array) -> None:
    """A jax.Array argument spanning several devices made jax.jit fail beside a tensor with
    "Received incompatible devices ... argument leaves[0] of BridgedFunction._make_plain.<locals>
    .plain", and alone it ran and then failed on its output: the results cross through DLPack,
    which carries one device's buffer, so such arrays are refused up front, by name."""
    n = len(array.sharding.device_set)
    if n > 1:
        raise ValueError(
            f"{b._describe(args, kwargs, index)} is a jax.Array on {n} devices (sharded or replicated); "
            "jax_to_torch takes single-device arrays (DLPack exchanges one device's buffer): gather it "
            "onto one device first, e.g. jax.device_put(x, jax.devices()[0])"
        )


def _check_jax_array_devices(b, args, kwargs, leaves, committed, tpos, tensors) -> None:
    """A jax.Array committed to one device other than the tensors' (or another such array's)
    made jax.jit fail with "Received incompatible devices ... argument leaves[0] of
    BridgedFunction._make_plain.<locals>.plain" (the bridge's internals): refused by name here.
    Uncommitted arrays are moved by jax.jit, as it moves them."""
    if tensors:
        if tensors[0].device.type not in ("cpu", "cuda"):
            return  # XLA tensors take other routes
        try:
            want = cv.jax_device_for(tensors[0].device)
        except ConversionError:
            return  # the tensor's import names it
        ref = f"{b._argname(args, kwargs, tpos[0])} is on {tensors[0].device} (jax {want})"
    else:
        first = committed[0]
        want = next(iter(leaves[first].devices()))
        ref = f"{b._argname(args, kwargs, first)} is on {want}"
    for i in committed:
        got = next(iter(leaves[i].devices()))
        if got != want:
            raise ValueError(
                f"{b._describe(args, kwargs, i)} is a jax.Array on {got} but {ref}; the arrays and "
                f"tensors of one call must share a device: jax.device_put it onto {want} first"
            )


# Only where the traced function is one of ours (a jit inside fn may have its own `leaves`).
_TRACED_LEAF = re.compile(rf"function \w+ at {re.escape(__file__)}:\d+ .*?the argument leaves\[(\d+)\]", re.S)


def _name_traced_leaf(b, args, kwargs, leaves, err: Exception) -> None:
    """jax's concretization errors (``if n > 0``, ``jnp.zeros(n)`` on a traced value) named our jitted
    function's flat parameter ("depends on the value of the argument leaves[1]", "try using
    static_argnums"): a note names the caller's argument and what to do instead."""
    if _INNER_STATIC in str(err) and "Tracer" in str(err):
        _name_inner_static(b, args, kwargs, leaves, err)
        return
    m = _TRACED_LEAF.search(str(err))
    if m is None or int(m.group(1)) >= len(leaves):
        return
    err.add_note(
        f"{b!r}: leaves[{m.group(1)}] is {b._argname(args, kwargs, int(m.group(1)))}, whose value is traced "
        "as under jax.jit: a Python number used as a shape or in an `if` must be listed in static_argnames "
        "(for a tensor, use jnp.where / lax.cond)"
    )


_INNER_STATIC = "Non-hashable static arguments are not supported"


def _name_inner_static(b, args, kwargs, leaves, err: Exception) -> None:
    """A jax.jit inside fn got one of our traced leaves as a static argument: jax's error named
    only the tracer's type. Which leaf jax does not say; the Python numbers are the candidates."""
    numbers = [b._argname(args, kwargs, i) for i, leaf in enumerate(leaves)
               if isinstance(leaf, (int, float, np.generic))]
    err.add_note(
        f"{b!r}: a jax.jit inside the function got a traced value as a static argument; the bridge traces "
        "Python numbers as jax.jit does, so list that argument in jax_to_torch's static_argnames too"
        + (f" (Python numbers in this call: {', '.join(numbers)})" if numbers else "")
    )


def _refuse_graph_recorders(b: BridgedFunction) -> None:
    """Tracers that record torch ops (torch.jit.trace, make_fx) would bake the JAX call in as a constant."""
    if torch._C._get_tracing_state() is not None:
        # torch.jit.trace records no DLPack exchange: the outputs would be baked into the
        # trace as constants, and the traced function would return them for any input.
        raise RuntimeError(
            f"{b!r} cannot be recorded by torch.jit.trace (or a tracing exporter): the JAX call "
            "would become a constant; use torch.compile, which runs it eagerly between graphs"
        )
    if _proxy_mode() is not None:
        # make_fx / torch.export / AOT tracing record aten ops: the DLPack exchange is none, so
        # the outputs became graph constants (make_fx's graph returned sin(0) for any input).
        raise RuntimeError(
            f"{b!r} cannot be recorded by make_fx, torch.export or another graph tracer: the JAX "
            "call would become a constant; use torch.compile, which runs it eagerly between graphs"
        )


def _classify_leaves(b, args, kwargs, leaves):
    """Returns ``(tpos, tensors, ints)``: the tensor leaves' positions, the tensors, and the
    positions of the Python ints. Refuses the leaves jax.jit cannot take (or would take with an
    error naming our internals), and checks the jax.Array leaves' devices."""
    tpos: list[int] = []
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    committed: list[int] = []  # jax.Array leaves placed on a device explicitly
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tpos.append(i)
            tensors.append(leaf)
        elif isinstance(leaf, int) and not isinstance(leaf, bool):  # an IntEnum too
            ints.append(i)
        elif isinstance(leaf, jax.core.Tracer):
            # Called from JAX code (jax.jit, another bridged function): static_argnames would
            # not help, the JAX function itself is what belongs there.
            raise TypeError(
                f"{b._describe(args, kwargs, i)} is a traced jax value (this torch function was called "
                "inside a jax transformation or another jax_to_torch function); in JAX code, call the "
                "JAX function directly (it is this wrapper's .fn)"
            )
        elif isinstance(leaf, torch.fx.Proxy):  # static_argnames would not help here either
            raise TypeError(
                f"{b._describe(args, kwargs, i)} is a torch.fx Proxy: torch.fx.symbolic_trace cannot "
                "record a JAX call; keep the call out of the graph with torch.fx.wrap (or a leaf module), "
                "or use torch.compile, which runs it eagerly between graphs"
            )
        elif not isinstance(leaf, _PASSTHROUGH):
            raise TypeError(
                f"{b._describe(args, kwargs, i)} is a {type(leaf).__name__}; pass tensors or numbers, "
                "or list the argument in static_argnames"
            )
        elif isinstance(leaf, jax.Array):
            if leaf.is_deleted():  # jax.jit's "Array has been deleted with shape=float32[3]" named no argument
                raise ValueError(f"{b._describe(args, kwargs, i)} is a deleted jax.Array (array.delete(), or "
                                 "donated to a jitted call)")
            _check_single_device(b, args, kwargs, i, leaf)
            if leaf.committed:
                committed.append(i)

    if committed:
        _check_jax_array_devices(b, args, kwargs, leaves, committed, tpos, tensors)
    return tpos, tensors, ints


_NO_TENSORS = (None, False, False)


def _scan_tensors(b, args, kwargs, tpos, tensors):
    """Returns ``(device, need_grad, wide)`` of a call's tensors (``_NO_TENSORS`` without any):
    their one device, whether the call records gradients, whether one is 64-bit. Refuses
    forward-AD duals, tensors on several devices, and (recording gradients) torch.func
    transforms and inference tensors."""
    if not tensors:
        return _NO_TENSORS
    need_grad = False
    wide = False
    if _forward_ad._current_level >= 0:
        _reject_tangents(b, args, kwargs, tpos, tensors)
    device = tensors[0].device
    grad_on = torch.is_grad_enabled()
    for k, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(
                f"{b._describe(args, kwargs, tpos[k])} is on {t.device} but "
                f"{b._argname(args, kwargs, tpos[0])} is on {device}; "
                "all tensors of one call must share a device"
            )
        if grad_on and t.requires_grad:
            need_grad = True
        if t.dtype in cv.WIDE_TORCH_DTYPES:
            wide = True
    if need_grad:
        if _functorch_level() is not None:
            _reject_functorch(b, args, kwargs, tpos, tensors)
        _reject_inference(b, args, kwargs, tpos, tensors)
    return device, need_grad, wide


def _check_int_leaves(b, args, kwargs, leaves, ints, use_x64: bool) -> None:
    # jax.jit would raise an OverflowError naming our internals ("argument path is leaves[1]").
    bits = 64 if use_x64 or cv.x64_enabled() else 32
    for i in ints:
        if not -(1 << (bits - 1)) <= leaves[i] < 1 << (bits - 1):
            raise ValueError(
                f"{b._describe(args, kwargs, i)} is the Python int {int(leaves[i])}, which does not fit "
                f"in int{bits}, jax's integer type for this call"
                + ("" if bits == 64 else " (64-bit mode is off: pass x64=True to jax_to_torch)")
            )


def _narrowed(tensors):
    # x64=False: canonicalize as jax does for numpy inputs. The import keeps 64-bit dtypes,
    # and jax mishandles 64-bit arrays with x64 off (a * b stays float64, a[i]'s backward
    # fails in scatter). A torch cast, so autograd carries gradients back to the input.
    return [t.to(cv.NARROW_TORCH_DTYPE[t.dtype]) if t.dtype in cv.WIDE_TORCH_DTYPES else t
            for t in tensors]


def _cache_entry(b, treedef, statics, use_x64: bool, tpos) -> _Entry:
    # tpos is in the key: whether a leaf is a tensor or a number changes what is traced. Static
    # values carry their types, as in jax.jit: 1 == True and 2 == 2.0, but they may trace apart.
    if statics:
        statics_key = tuple((name, pos, _typed(value)) for name, pos, value in statics)
    else:
        statics_key = statics
    key = (treedef, statics_key, use_x64, tuple(tpos))
    entry = b._cache.get(key)
    if entry is None:
        entry = b._entry(key)
    return entry


def _call_without_grad(b, args, kwargs, entry, treedef, statics, leaves, tpos, tensors, use_x64: bool):
    """Nothing records gradients: the entry's plain jitted function, no VJP."""
    jleaves = _import_leaves(b, args, kwargs, leaves, tpos, tensors)
    fn = entry.plain
    if fn is None:
        fn = entry.plain = b._make_plain(treedef, statics)
    try:
        out = _run(use_x64, fn, jleaves)
    except Exception as err:
        _name_traced_leaf(b, args, kwargs, leaves, err)
        raise
    _, out_tree, touts = _export_outputs(b, out, _data_ptrs(tensors), _xla_device(tensors))
    return _tree_unflatten(out_tree, touts)


def _call_with_grad(b, args, kwargs, entry, treedef, statics, leaves, tpos, tensors, use_x64: bool):
    """Through _BridgeFunction (torch autograd), its per-call state in a _Call."""
    call = _Call()
    call.bridged = b
    call.entry = entry
    call.treedef = treedef
    call.statics = statics
    call.args = args
    call.kwargs = kwargs
    call.leaves = leaves
    call.tpos = tpos
    call.use_x64 = use_x64
    diff_k = [k for k, t in enumerate(tensors) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    call.diff_k = diff_k
    call.diff_pos = tuple(tpos[k] for k in diff_k)
    try:
        touts = _BridgeFunction.apply(call, *tensors)
    except Exception as err:
        _name_traced_leaf(b, args, kwargs, leaves, err)
        raise
    return _tree_unflatten(call.out_tree, list(touts))


def _bridge_call(b: BridgedFunction, args: tuple, kwargs: dict):
    """The hot path. torch.compile graph-breaks here (documented; never traced by dynamo)."""
    _refuse_graph_recorders(b)
    b.calls += 1
    statics = ()
    if b._static_specs:
        args, kwargs, statics = b._split_static(args, kwargs)
    leaves, treedef = _tree_flatten((args, kwargs))
    tpos, tensors, ints = _classify_leaves(b, args, kwargs, leaves)
    device, need_grad, wide = _scan_tensors(b, args, kwargs, tpos, tensors)

    if b.x64 is None:
        use_x64 = wide and not cv.x64_enabled()
    else:
        use_x64 = b.x64 and not cv.x64_enabled()
    if ints:
        _check_int_leaves(b, args, kwargs, leaves, ints, use_x64)
    if wide and not use_x64 and not cv.x64_enabled():
        tensors = _narrowed(tensors)
    entry = _cache_entry(b, treedef, statics, use_x64, tpos)

    if tensors and device.type == "xla":
        from . import _xla

        if _xla.graph_route(device):  # TPU: no DLPack; run inside torch_xla's graph
            return _xla.graph_call(b, entry, treedef, statics, leaves, tpos, tensors, use_x64, need_grad)
    if need_grad:
        return _call_with_grad(b, args, kwargs, entry, treedef, statics, leaves, tpos, tensors, use_x64)
    return _call_without_grad(b, args, kwargs, entry, treedef, statics, leaves, tpos, tensors, use_x64)


_bridge_call = _compiler_disable(_bridge_call, _GRAPH_BREAK_REASON)
# Compiled autograd (torch._dynamo.config.compiled_autograd) traces custom backwards with dynamo,
# which then stepped into jax and failed there ("flatten(): incompatible function arguments").
_backward = _compiler_disable(
    _backward, "ejkernel_torch.interop.jax_to_torch's backward runs a jitted JAX pullback; it graph-breaks by design"
)


def jax_to_torch(
    fn: Callable | None = None,
    *,
    static_argnames: Iterable[str] = (),
    x64: bool | None = None,
):
    """Wrap a JAX function so torch code can call it, with autograd.

    ``fn`` receives jax arrays wherever the caller passes torch tensors (any pytree of them:
    tuples, lists, dicts, namedtuples, in positional or keyword arguments) and may return any
    pytree of arrays; the caller gets the same pytree of torch tensors, on the inputs' device.

    * **Zero-copy** both ways through DLPack (see :func:`to_jax`); tensors of one call must
      share a device (cpu or cuda:i).
    * **Compiled once** per (argument structure, static arguments, shapes, dtypes): the call
      goes through a cached ``jax.jit``. ``static_argnames`` are passed to ``fn`` unchanged and
      must be hashable; numbers and numpy/jax arrays are traced like ``jax.jit`` would (a jax
      array on several devices is refused: the results cross through DLPack, one device's
      buffer); other objects must be static. ``cache_info()`` reports calls and traces; the
      newest ``MAX_CACHE_ENTRIES`` (512) structure and static-value combinations stay cached.
    * **Closed-over values are constants**: what ``fn`` closes over instead of receiving is
      baked into each compiled entry when it is traced (as under ``jax.jit``), so later
      in-place updates of a tensor it came from are not seen and it gets no gradient. Pass
      tensors as arguments; ``to_jax`` inside ``fn`` raises TypeError.
    * **Autograd**: when grad is enabled and a floating/complex input requires grad, the forward
      runs a jitted ``jax.vjp`` and keeps its residuals as jax arrays; ``backward`` runs a jitted
      pullback (double backward is not supported). Integer/bool outputs are marked
      non-differentiable. When nothing requires grad the VJP is skipped entirely. Complex
      gradients follow torch's convention (the conjugate of jax's). A call that records
      gradients saves all its input tensors, so inference tensors (``torch.inference_mode``)
      are refused there (TypeError); without grad, and inside inference_mode, they work.
      ``torch.utils.checkpoint`` (either ``use_reentrant``) and ``save_on_cpu`` work: under
      saved-tensor hooks the jax residuals are saved as torch tensors, so the hooks drop or
      offload them as they do torch's own.
    * **x64**: ``None`` (default) turns jax's 64-bit mode on for the call when an input tensor
      is 64-bit (float64/int64/complex128/uint64), so dtypes are what torch passed; ``True``
      always, ``False`` never (jax then canonicalizes 64-bit inputs to 32 bits). None of them
      turns it off: with ``jax_enable_x64`` set globally, every call runs in 64-bit mode and
      64-bit inputs stay 64-bit, ``x64=False`` too.
      The mode is jax's thread-local ``jax.enable_x64`` context around the call's trace,
      forward and backward only (other threads and the global flag are untouched), but it
      covers all of ``fn``: its defaults widen too (``jnp.zeros``/``arange``/``linspace``
      without a dtype give float64/int64), so a float32 input combined with one comes back
      float64. torch index tensors are int64 by default: pass ``idx.int()``, or ``x64=False``,
      to keep ``fn`` in 32 bits.
    * **Autocast**: not applied. ``torch.autocast`` changes the dtypes of torch's own ops only;
      ``fn`` receives the tensors' dtypes as passed and computes in jax's (mixed inputs promote
      as in jax: a bfloat16 activation times a float32 weight gives float32). Cast inside
      ``fn`` (or before the call) for reduced precision.
    * **torch.compile**: the wrapper is ``torch.compiler.disable``-d, so dynamo graph-breaks
      around it and runs it eagerly (values and gradients are right; ``fullgraph=True`` raises).
      Under compiled autograd the backward graph-breaks the same way.
    * **torch.func**: reverse mode through torch autograd only. ``grad``/``vjp``/``jacrev`` (and
      ``vmap`` of tensors that require grad, or are batched) raise, as forward-mode AD does; use
      ``jax.grad``/``jax.vmap`` inside the JAX function instead.
    * **Small CUDA calls with grad**: torch runs CUDA backward functions on its own device
      thread, and waking it (then jax, then the caller again) costs about 0.4 ms a step on an
      H200 (``scripts/probe_grad_overhead.py``). When that matters, call ``backward`` inside
      ``with torch.autograd.set_multithreading_enabled(False):`` (only ever as a ``with``:
      calling it plainly switches the engine to one thread for good).

    Usable as a decorator, with or without arguments, also on methods: the instance is then
    the first argument, so list ``"self"`` in ``static_argnames`` (it must be hashable).

    Picklable (``torch.save`` of a module holding one, multiprocessing) as functions are: by
    reference when its module exposes it under its name (decorated functions and methods),
    else rebuilt from ``fn``, which the pickler must handle (a lambda needs cloudpickle).
    """
    if fn is None:
        return functools.partial(jax_to_torch, static_argnames=static_argnames, x64=x64)
    return BridgedFunction(fn, static_argnames=static_argnames, x64=x64)
