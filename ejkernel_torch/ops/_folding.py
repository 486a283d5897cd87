"""torch.func.vmap by folding: the mapped axis joins an op's leading (batch or row) axis, one
launch for all samples. Without a rule torch runs an op once per sample (its fallback, with a
"performance drop" warning); kernels that treat every leading index on its own give the same
values folded, in one launch."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ejkernel_torch.launch import requires_grad_beneath
from triton_kernels.plan import fold_chunks


def fold(x: Optional[Tensor], dim: Optional[int], n: int, batch: Optional[int] = None) -> Optional[Tensor]:
    """``x`` as ``[n * batch, ...]``: mapped over ``dim`` with ``[batch|1, ...]`` samples, or the
    same ``[batch|1, ...]`` for every sample (``dim`` None). ``batch`` defaults to the samples'
    own leading size."""
    if x is None:
        return None
    x = x.expand(n, *x.shape) if dim is None else x.movedim(dim, 0)
    batch = x.shape[1] if batch is None else batch
    return x.expand(n, batch, *x.shape[2:]).reshape(n * batch, *x.shape[2:]).contiguous()


def unfold(x: Tensor, n: int, batch: int) -> Tensor:
    """A folded ``[n * batch, ...]`` result as ``[n, batch, ...]`` (batch given: n may be 0)."""
    return x.unflatten(0, (n, batch))


def in_chunks(chunks, n: int, args, in_dims, call, shared: tuple = ()):
    """``call(size, args)`` on each chunk of the ``n`` mapped samples (``(start, size)`` pairs: the
    mapped tensors narrowed, the rest whole), the outputs (a tensor or a tuple) concatenated along
    their folded axis, except ``shared`` ones (the same for every sample: the first chunk's)."""
    pieces = []
    for start, size in chunks:
        chunk = [a.narrow(d, start, size) if isinstance(a, Tensor) and d is not None and size != n else a
                 for a, d in zip(args, in_dims)]
        pieces.append(call(size, chunk))
    if len(pieces) == 1:
        return pieces[0]
    if isinstance(pieces[0], Tensor):
        return torch.cat(pieces)
    return tuple(p[0] if i in shared else torch.cat(p) for i, p in enumerate(zip(*pieces)))


def register_folding(kernel_op) -> None:
    """A vmap rule for ``kernel_op`` (a ``KernelOp``), whose tensor arguments and outputs all
    share one leading axis that its kernels treat index by index: every tensor argument is
    folded, the op runs once and each output is unfolded. Where the folded axis would pass
    ``kernel_op.fold_limit`` (a grid axis, an int32 row count) the samples go to several
    launches (``fold_chunks``), whose outputs are concatenated."""
    op = kernel_op.op

    @op.register_vmap
    def _rule(info, in_dims, *args):
        n = info.batch_size
        at = next(i for i, a in enumerate(args) if isinstance(a, Tensor))
        batch = args[at].shape[1 if in_dims[at] == 0 else 0]
        chunks = [(0, n)]
        if kernel_op.fold_limit is not None:
            first, dim = args[at], in_dims[at]
            sample = tuple(first.shape) if dim is None else tuple(first.shape[:dim] + first.shape[dim + 1:])
            chunks = fold_chunks(n, batch, kernel_op.fold_limit(sample))
        outputs = in_chunks(chunks, n, args, in_dims,
                            lambda size, chunk: _folded_call(kernel_op, op, chunk, in_dims, size))
        if isinstance(outputs, Tensor):
            return unfold(outputs, n, batch), 0
        return tuple(unfold(o, n, batch) for o in outputs), (0,) * len(outputs)


def _folded_call(kernel_op, op, args, in_dims, n: int):
    """``kernel_op`` on ``args`` (``n`` samples each, mapped over ``in_dims``) folded."""
    folded = [fold(a, d, n) if isinstance(a, Tensor) else a for a, d in zip(args, in_dims)]
    if torch.is_grad_enabled() and any(requires_grad_beneath(a) for a in folded):
        # Reached so under torch.compile, where vmap's batched tensors hide requires_grad and
        # the op is called outside its autograd function: its own derivative records it (in
        # the innermost vmap's rule: until then the folded tensors are batched ones).
        if not kernel_op.differentiable:
            raise NotImplementedError(f"{op._name} under torch.func.vmap with inputs that require grad: it "
                                      "has no derivative, and the gradient would be lost")
        return op(*folded)
    return kernel_op(*folded)
