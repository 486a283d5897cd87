"""torch.func.vmap by folding: the mapped axis joins an op's leading (batch or row) axis, one
launch for all samples. Without a rule torch runs an op once per sample (its fallback, with a
"performance drop" warning); kernels that treat every leading index on its own give the same
values folded, in one launch."""
from __future__ import annotations

from typing import Optional

from torch import Tensor


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
