"""PyTorch/XLA tensors <-> jax arrays through ``torch_xla.utils.dlpack`` (zero-copy on XLA:CPU).

An XLA tensor is lazy: until its graph runs there is no device buffer, and exporting such a
tensor through DLPack aborts the whole process (a C++ check, not an exception). So every export
first materializes the tensor (``_xla_sync_multi`` of just that tensor, waiting for it). jax can
import the buffer when it lives on a device jax also has (XLA:CPU -> jax cpu, checked by
scripts/test_torch_xla.sh; XLA:CUDA -> jax gpu, untested). TPU buffers have no DLPack device
type jax can import: ``jax_to_torch`` runs those calls inside torch_xla's graph instead
(``graph_call`` below) and ``to_jax`` raises a clear error.

torch_xla is imported lazily: nothing here runs unless a tensor is on an ``xla`` device.
"""
from __future__ import annotations

import jax
import torch

from . import _convert as cv
from ._convert import ConversionError

_kDLCPU, _kDLCUDA = 1, 2


def _hardware(device: torch.device) -> str:
    import torch_xla.core.xla_model as xm

    return xm.xla_device_hw(device)  # "CPU", "CUDA", "TPU", ...


class _Exported:
    """A DLPack producer for one capsule, with the device that jax needs to place it."""

    __slots__ = ("capsule", "device")

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, stream=None, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def sync(tensor: torch.Tensor) -> None:
    """Run the pending graph of ``tensor`` so that it has a buffer (waits for it)."""
    import torch_xla

    torch_xla._XLAC._xla_sync_multi([tensor], devices=[], wait=True)


def tensor_to_jax(tensor: torch.Tensor, copy: bool | None):
    """XLA tensor -> jax.Array; raises ConversionError (no argument name) on bad input."""
    cv.check_tensor(tensor)
    hw = _hardware(tensor.device)
    if hw == "CPU":
        dl_device = (_kDLCPU, 0)
    elif hw in ("CUDA", "GPU"):
        dl_device = (_kDLCUDA, tensor.device.index or 0)
    else:
        raise ConversionError(
            ValueError,
            f"tensor is on {tensor.device} ({hw}); jax cannot import {hw} buffers through DLPack "
            "(supported: XLA:CPU and XLA:CUDA devices); move it with .cpu() first",
        )
    if tensor.requires_grad:
        tensor = tensor.detach()
    if copy:  # copy on the torch side (lazy; materialized by the sync below), then share it
        tensor, copy = tensor.clone(), None
    sync(tensor)
    import torch_xla.utils.dlpack as xdl

    producer = _Exported(xdl.to_dlpack(tensor), dl_device)
    # Same dtype rule as the public import path: no silent 64 -> 32-bit cast.
    if tensor.dtype in cv.WIDE_TORCH_DTYPES and not cv.x64_enabled():
        with cv.x64_context():
            return jax.dlpack.from_dlpack(producer, copy=copy)
    return jax.dlpack.from_dlpack(producer, copy=copy)


def array_to_torch(array, copy: bool | None, device: torch.device) -> torch.Tensor:
    """jax.Array -> XLA tensor on ``device`` (torch_xla imports it from jax's buffer)."""
    cv.check_array(array)
    import torch_xla.utils.dlpack as xdl

    try:
        out = xdl.from_dlpack(array)
    except Exception as err:
        raise ConversionError(ValueError, f"torch_xla cannot import this array ({err})") from None
    if out.device != device:
        out = out.to(device)
    return out.clone() if copy else out


# -- TPU: run the jax function inside torch_xla's graph (torch_xla.core.xla_builder.call_jax) --------
#
# DLPack cannot carry TPU buffers, but torch_xla can lower a jax function to HLO and run it as part
# of its own lazy graph, on the tensors' device, with no exchange at all. jax_to_torch takes this
# route for XLA tensors on hardware outside _DLPACK_HARDWARE; the forward is one call_jax, the
# backward another one that recomputes the forward under jax.vjp (residuals cannot leave the
# graph). call_jax needs torchax (shipped with torch_xla; it imports flax).

_DLPACK_HARDWARE = ("CPU", "CUDA", "GPU")
_route: str | None = None


def set_route(route: str | None) -> None:
    """Force XLA tensors through "dlpack" or "graph" (call_jax); None: by hardware. For tests."""
    global _route
    if route not in (None, "dlpack", "graph"):
        raise ValueError(f"route must be None, 'dlpack' or 'graph', got {route!r}")
    _route = route


def graph_route(device: torch.device) -> bool:
    if _route is not None:
        return _route == "graph"
    return _hardware(device) not in _DLPACK_HARDWARE


def _inexact(x) -> bool:
    import jax.numpy as jnp

    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class _GraphFns:
    """Stable jax callables (call_jax caches compilations by function identity) for one
    (bridged function, argument structure, static arguments)."""

    def __init__(self, b, treedef, statics):
        self.b, self.treedef, self.statics = b, treedef, statics
        self._bwd: dict[tuple[int, ...], object] = {}
        # call_jax keys its cache on id(fn): keep one bound-method object (each attribute
        # access would make a new one, and a retrace).
        self.forward = self._forward

    def _outputs(self, leaves):
        return self.b._call_fn(self.treedef, self.statics, leaves)

    def _forward(self, *leaves):
        self.b.traces += 1  # runs only while call_jax traces
        return self._outputs(list(leaves))

    def backward(self, diff_pos: tuple[int, ...]):
        fn = self._bwd.get(diff_pos)
        if fn is None:
            from ._bridge import _conj_complex

            def fn(leaves, cts):
                self.b.backward_traces += 1

                def g(*diff):
                    ls = list(leaves)
                    for p, d in zip(diff_pos, diff):
                        ls[p] = d
                    return [x for x in jax.tree_util.tree_leaves(self._outputs(ls)) if _inexact(x)]

                _, pullback = jax.vjp(g, *[leaves[p] for p in diff_pos])
                # torch's complex convention is the conjugate of jax's (as in the DLPack route)
                return list(_conj_complex(pullback(_conj_complex(list(cts)))))

            self._bwd[diff_pos] = fn
        return fn


def _call_jax(fn, args, use_x64: bool):
    import torch_xla.core.xla_builder as xb

    if use_x64:
        with cv.x64_context():
            return xb.call_jax(fn, args)
    return xb.call_jax(fn, args)


def _forward(fns, leaves, use_x64):
    """(flat output tensors, output treedef); torch tensors are pytree leaves."""
    return jax.tree_util.tree_flatten(_call_jax(fns.forward, tuple(leaves), use_x64))


class _GraphFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fns, skeleton, tpos, diff_k, use_x64, tree_box, *tensors):
        leaves = list(skeleton)
        for p, t in zip(tpos, tensors):
            leaves[p] = t
        outs, tree_box[0] = _forward(fns, leaves, use_x64)
        ct_idx = [j for j, o in enumerate(outs) if o.is_floating_point() or o.is_complex()]
        ctx.mark_non_differentiable(*[o for j, o in enumerate(outs) if j not in ct_idx])
        ctx.save_for_backward(*tensors, *outs)
        ctx.fns, ctx.skeleton, ctx.tpos, ctx.diff_k, ctx.use_x64, ctx.ct_idx = (
            fns, skeleton, tpos, diff_k, use_x64, ct_idx)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual case: the engine runs backward without grad
            return (None,) * 6 + tuple(_graph_backward(ctx, grads))
        # create_graph=True: call_jax's results carry no graph, so second-order terms vanished
        # silently; as on the DLPack route, compute without recording and poison any second use.
        from ._bridge import _poison_for_double_backward

        with torch.no_grad():
            result = _graph_backward(ctx, grads)
        saved = ctx.saved_tensors
        anchors = [saved[k] for k in ctx.diff_k] + [g for g in grads if g is not None]
        return (None,) * 6 + tuple(_poison_for_double_backward(result, anchors))


def _graph_backward(ctx, grads):
    saved = ctx.saved_tensors
    n_in = len(ctx.tpos)
    leaves = list(ctx.skeleton)
    for p, t in zip(ctx.tpos, saved[:n_in]):
        leaves[p] = t
    cts = tuple(grads[j] if grads[j] is not None else torch.zeros_like(saved[n_in + j]) for j in ctx.ct_idx)
    diff_pos = tuple(ctx.tpos[k] for k in ctx.diff_k)
    got = _call_jax(ctx.fns.backward(diff_pos), (tuple(leaves), cts), ctx.use_x64)
    result = [None] * n_in
    for k, g in zip(ctx.diff_k, got):
        result[k] = g
    return result


def graph_call(b, entry, treedef, statics, leaves, tpos, tensors, use_x64: bool, need_grad: bool):
    """jax_to_torch's call on XLA tensors that DLPack cannot carry; returns the output pytree.

    Non-tensor leaves become static here (call_jax keys its cache on them), so only hashable
    Python numbers are accepted besides tensors."""
    tset = set(tpos)
    for i, leaf in enumerate(leaves):
        if i not in tset and not isinstance(leaf, (bool, int, float, complex)):
            raise TypeError(
                f"{b._describe(*jax.tree_util.tree_unflatten(treedef, leaves), i)} is a "
                f"{type(leaf).__name__}; on this XLA device only tensors and Python numbers can be passed"
            )
    fns = entry.xla
    if fns is None:  # one per bridge cache entry (argument structure, statics, x64)
        fns = entry.xla = _GraphFns(b, treedef, statics)
    skeleton = [None if i in tset else leaf for i, leaf in enumerate(leaves)]
    diff_k = [k for k, t in enumerate(tensors)
              if need_grad and t.requires_grad and (t.is_floating_point() or t.is_complex())]
    if not diff_k:
        for p, t in zip(tpos, tensors):
            skeleton[p] = t
        outs, out_tree = _forward(fns, skeleton, use_x64)
    else:
        box = [None]
        outs = _GraphFunction.apply(fns, skeleton, tpos, diff_k, use_x64, box, *tensors)
        out_tree = box[0]
    return jax.tree_util.tree_unflatten(out_tree, list(outs))
