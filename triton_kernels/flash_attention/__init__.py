"""Flash attention (forward + backward) as shared Triton kernels, with their plans and checks.

Layout: q ``[batch, seq_q, heads_q, head_dim]``, k/v ``[batch, seq_k, heads_kv, head_dim]``
(varlen: tokens packed as ``[total, heads, head_dim]`` with int32 ``cu_seqlens``). Supports GQA,
head_dim 1..256 (padded inside the kernels), bottom-right causal masks and sliding windows, a
logits soft cap, additive bias (with its gradient), segment ids and in-kernel dropout.
"""
from .plan import (FEATURE_INPUTS, BackwardPlans, backward_inputs, backward_plans, dropout_mask_plan, feature_dtypes,
                   fold_chunks, forward_plan)
from .spec import (FlashSpec, cu_seqlens_values, dense_spec, layer_dtype, layer_head_dim, layer_options, seed_array,
                   seed_value, varlen_spec, window_arg)

__all__ = [
    "BackwardPlans", "FEATURE_INPUTS", "FlashSpec", "backward_inputs", "backward_plans", "cu_seqlens_values",
    "dense_spec", "dropout_mask_plan", "feature_dtypes", "fold_chunks", "forward_plan", "layer_dtype",
    "layer_head_dim", "layer_options", "seed_array", "seed_value", "varlen_spec", "window_arg",
]
