"""Flax linen layers over the shared kernels, mirroring ``ejkernel_torch.nn`` parameter for
parameter (torch layouts: ``weight [out, in]``), so weights move across with ``params_from_torch``
and back with ``params_to_torch``."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_jax.ops._common import array_arg, name_of
from ejkernel_jax.ops.flash_attention import flash_attention
from triton_kernels import checks, flash_attention as fa


def _torch_uniform(fan_in: int):
    # torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
    bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class TorchLinear(nn.Module):
    """``x @ weight.T + bias`` with torch's parameter names, layout, init and rounding: the
    product is accumulated in float32, the bias added there, and the sum rounded once to
    ``dtype`` (as torch's addmm does; rounding the product first differs in bf16/fp16).
    ``precision`` as in ``flax.linen.Dense``: a GPU's default for float32 is TF32, where torch
    multiplies in full float32, so ``"highest"`` matches torch there."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x):
        fan_in = x.shape[-1]
        dtype = self.dtype or x.dtype
        if not jnp.issubdtype(dtype, jnp.inexact):  # the weights cast to it: int x gave all zeros
            raise TypeError(f"dtype must be a floating-point dtype, got {jnp.dtype(dtype).name}" if self.dtype
                            else f"x must be a floating-point array (or set dtype), got {x.dtype}")
        weight = self.param("weight", _torch_uniform(fan_in), (self.features, fan_in), self.param_dtype)
        y = jax.lax.dot_general(x.astype(dtype), weight.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                precision=self.precision, preferred_element_type=jnp.float32)
        if checks.flag("use_bias", self.use_bias):  # use_bias="no" built a bias
            y = y + self.param("bias", _torch_uniform(fan_in), (self.features,), self.param_dtype).astype(dtype)
        return y.astype(dtype)


def _static_flag(name: str, value) -> bool:
    """``checks.flag`` (a string such as "no" was truthy and ran without dropout), with a traced
    value told how to keep it static: nn.remat/nn.jit trace call arguments not in static_argnums."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is traced ({value!r}): it must be a static Python bool. Under nn.remat / "
            f"nn.checkpoint / nn.jit, give it positionally and list it in static_argnums "
            f"(nn.remat(MultiHeadAttention, static_argnums=(3,)): 0 is the module, then x, "
            f"segment_ids, {name}); nn.remat traces keyword arguments")
    return checks.flag(name, value)


class MultiHeadAttention(nn.Module):
    """Self-attention for GPT-style models, the Flax twin of ``ejkernel_torch.nn.MultiHeadAttention``.

    ``x [batch, seq, embed_dim] -> [batch, seq, embed_dim]``. Dropout applies when
    ``deterministic=False``, with the seed drawn from the ``"dropout"`` rng stream.
    ``attention_fn`` swaps the attention itself (same signature as ``flash_attention``); with the
    default one, ``head_dim`` (given, or ``embed_dim // num_heads``) must be 1..256.

    ``deterministic`` picks the kernel (with or without dropout), so it must be a Python bool,
    also under lifted transforms that trace call arguments: give it positionally and mark it
    static, ``nn.remat(MultiHeadAttention, static_argnums=(3,))(...)(x, segment_ids, False)``
    (argument 0 is the module), or pass it to the enclosing module's constructor.
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = True
    dropout: float = 0.0
    use_bias: bool = True
    sliding_window: Any = None
    logits_soft_cap: float | None = None
    softmax_scale: float | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None  # of the projections, see TorchLinear
    attention_fn: Callable = flash_attention

    @nn.compact
    def __call__(self, x, segment_ids=None, deterministic: bool = True):
        kv_heads, head_dim = checks.attention_layer(self.embed_dim, self.num_heads, self.num_kv_heads,
                                                    self.head_dim, self.dropout)
        checks.attention_layer_input(tuple(x.shape), self.embed_dim)
        checks.flag("use_bias", self.use_bias), checks.flag("causal", self.causal)  # before any weight
        fa.layer_options(head_dim, self.causal, self.sliding_window, self.logits_soft_cap, self.softmax_scale)
        if not jnp.issubdtype(x.dtype, jnp.floating):  # it would cast the weights to int32 first
            raise TypeError(f"x must be a floating-point array, got {x.dtype}")
        if self.attention_fn is flash_attention:  # another attention_fn (a reference run) may take wider heads
            fa.layer_head_dim(self.embed_dim, self.num_heads, self.head_dim, head_dim)
            compute = self.dtype if self.dtype is not None else x.dtype  # as TorchLinear's
            # jax computes float64 in float32 without x64 (a numpy x, dtype=float): not refused
            compute = jax.dtypes.canonicalize_dtype(compute)
            fa.layer_dtype(jnp.dtype(compute).name, "dtype" if self.dtype is not None else "x's dtype, dtype=None")
        if segment_ids is not None:  # checked here: flash_attention named them q_segment_ids, not an argument here
            segment_ids = array_arg("segment_ids", segment_ids)
            checks.attention_layer_segment_ids(tuple(segment_ids.shape), name_of(segment_ids), tuple(x.shape))
        deterministic = _static_flag("deterministic", deterministic)
        batch, seq, _ = x.shape
        linear = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        qkv = TorchLinear((self.num_heads + 2 * kv_heads) * head_dim, name="qkv", **linear)(x)
        qkv = qkv.reshape(batch, seq, self.num_heads + 2 * kv_heads, head_dim)
        q, k, v = jnp.split(qkv, [self.num_heads, self.num_heads + kv_heads], axis=2)
        dropout_p, seed = 0.0, None
        if not deterministic and self.dropout > 0.0:
            dropout_p = self.dropout
            seed = jax.random.randint(self.make_rng("dropout"), (), -(2**31), 2**31 - 1, jnp.int32)
        out = self.attention_fn(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                                sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                                q_segment_ids=segment_ids, kv_segment_ids=segment_ids, dropout_p=dropout_p,
                                dropout_seed=seed)
        return TorchLinear(self.embed_dim, name="out", **linear)(out.reshape(batch, seq, self.num_heads * head_dim))


def _numpy_of_tensor(tensor) -> np.ndarray:
    """A torch tensor's values in its own dtype (params keep the torch layer's dtype, as the
    Flax layer's ``param_dtype`` would give them). bf16 and float8 have no numpy twin in torch:
    they go through float32, which holds their values exactly, and back."""
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.float().numpy().astype(jnp.dtype(str(tensor.dtype).removeprefix("torch.")))


def params_from_torch(state_dict: Mapping[str, Any]) -> dict:
    """A torch ``state_dict`` ("a.b.weight" -> tensor) as nested Flax params ({"a": {"b": {"weight": ...}}})."""
    params: dict = {}
    for name, value in state_dict.items():
        if hasattr(value, "detach"):  # a torch tensor
            value = _numpy_of_tensor(value)
        *path, leaf = name.split(".")
        node = params
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(np.asarray(value))
    return params


def params_to_torch(params: Mapping[str, Any]) -> dict:
    """Nested Flax params (``variables["params"]``) as a torch ``state_dict``: the inverse of
    ``params_from_torch``, for ``load_state_dict`` of the torch twin. Values keep their dtype
    (bf16 crosses through float32, which holds it exactly); tensors are on the CPU."""
    import torch  # only this direction needs torch

    state: dict = {}
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(str(getattr(key, "key", key)) for key in path)
        array = np.asarray(value)
        dtype = getattr(torch, array.dtype.name, None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"params_to_torch: {name} has dtype {array.dtype}, which torch does not have")
        if array.dtype.kind == "V":  # bf16/fp8 (numpy's ml_dtypes): torch cannot take them from numpy
            state[name] = torch.from_numpy(array.astype(np.float32)).to(dtype)
        else:
            state[name] = torch.from_numpy(np.array(array))  # a copy: jax's buffer is read-only
    return state
