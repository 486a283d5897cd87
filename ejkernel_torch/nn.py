"""torch.nn layers over the shared kernels."""
from __future__ import annotations

import torch
from torch import nn

from ejkernel_torch.ops._common import autocasting, name_of
from ejkernel_torch.ops.flash_attention import flash_attention
from triton_kernels import checks, flash_attention as fa


_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what flash_attention takes


class MultiHeadAttention(nn.Module):
    """Self-attention for GPT-style models: fused qkv projection, flash attention, output projection.

    ``x [batch, seq, embed_dim] -> [batch, seq, embed_dim]``. ``num_kv_heads`` < ``num_heads`` gives
    GQA (MQA at 1). Dropout on the attention probabilities applies in training mode only, with
    seeds drawn from torch's generator. Parameters: ``qkv.weight [(heads + 2 * kv_heads) *
    head_dim, embed_dim]``, ``out.weight [embed_dim, heads * head_dim]`` (and biases), the same
    names and shapes as ``ejkernel_jax.nn.MultiHeadAttention``. ``attention_fn`` swaps the
    attention itself (same signature as ``flash_attention``), e.g. for a reference run; with the
    default one, ``head_dim`` (given, or ``embed_dim // num_heads``) must be 1..256.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
                 head_dim: int | None = None, causal: bool = True, dropout: float = 0.0, bias: bool = True,
                 sliding_window=None, logits_soft_cap: float | None = None, softmax_scale: float | None = None,
                 attention_fn=flash_attention, device=None, dtype=None):
        super().__init__()
        self.num_kv_heads, self.head_dim = checks.attention_layer(embed_dim, num_heads, num_kv_heads, head_dim, dropout)
        # checked here, not read by truthiness: bias="no" built biased projections
        bias, causal = checks.flag("bias", bias), checks.flag("causal", causal)
        fa.layer_options(self.head_dim, causal, sliding_window, logits_soft_cap, softmax_scale)  # not at forward
        if attention_fn is flash_attention:  # another attention_fn (a reference run) may take wider heads
            fa.layer_head_dim(embed_dim, num_heads, head_dim, self.head_dim)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.causal, self.dropout, self.attention_fn = causal, dropout, attention_fn
        self.options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_scale=softmax_scale)
        factory = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias, **factory)
        self.out = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **factory)

    def forward(self, x: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``segment_ids [batch, seq]``: attend within equal ids only; ids <= 0 are padding."""
        if not isinstance(x, torch.Tensor):  # x.device of a numpy array is a str: an AttributeError followed
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        checks.attention_layer_input(tuple(x.shape), self.embed_dim)
        if x.dtype != self.qkv.weight.dtype and not autocasting(x.device.type):  # autocast casts both
            raise TypeError(f"x must have the layer's dtype {self.qkv.weight.dtype}, got {x.dtype}")
        if self.attention_fn is flash_attention and self.qkv.weight.dtype not in _FLASH_DTYPES:
            # (a float64 layer may still be built: to hold or convert weights)
            fa.layer_dtype(name_of(self.qkv.weight), "the layer's dtype")
        if segment_ids is not None:  # checked here: flash_attention named them q_segment_ids, not an argument here
            if not isinstance(segment_ids, torch.Tensor):
                raise TypeError(f"segment_ids must be a torch.Tensor, got {type(segment_ids).__name__}")
            checks.attention_layer_segment_ids(tuple(segment_ids.shape), name_of(segment_ids), tuple(x.shape))
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        out = self.attention_fn(q, k, v, causal=self.causal, dropout_p=self.dropout if self.training else 0.0,
                                q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **self.options)
        return self.out(out.reshape(batch, seq, self.num_heads * self.head_dim))
