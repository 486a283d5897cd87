"""Pallas blocksparse attention vs a dense float64 reference (interpret mode off TPU),
plus lowering of every kernel for TPU on this machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel_jax.pallas.tpu.blocksparse_attention import (
    BlockSizes,
    CausalMask,
    LocalMask,
    MultiHeadMask,
    NumpyMask,
    blocksparse_attention,
    make_causal_mask,
    make_random_mask,
    process_dynamic_mask,
    process_mask,
)
from tests.pallas_precision import hlo_dot_precisions, kernel_dots, mosaic_matmuls

# Relative Frobenius error bounds (float32 / bfloat16 inputs).
TOL = {"float32": {"out": 5e-6, "grad": 2e-5}, "bfloat16": {"out": 8e-3, "grad": 1.2e-2}}
# The float32 lse, for inputs of any dtype (absolute and relative parts).
LSE_ATOL, LSE_RTOL = 1e-5, 1e-6


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def reference(q, k, v, allowed, do, dlse, *, scale, cap=None):
    """Dense float64 attention.  ``allowed``: bool [B|1, H|1, Sq, Skv].

    Returns out, lse, dq, dk, dv; fully masked rows give 0 / -inf / zero gradients."""
    q, k, v, do, dlse = (np.asarray(x, np.float64) for x in (q, k, v, do, dlse))
    B, Sq, H, D = q.shape
    g = H // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    allowed = np.broadcast_to(allowed, (B, H, Sq, k.shape[1]))
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    z = cap * np.tanh(s / cap) if cap else s
    zmax = np.where(allowed, z, -np.inf).max(-1, keepdims=True)
    e = np.where(allowed, np.exp(z - np.where(np.isfinite(zmax), zmax, 0.0)), 0.0)
    l = e.sum(-1, keepdims=True)
    p = e / np.where(l == 0, 1.0, l)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] == 0, -np.inf, np.log(l[..., 0]) + zmax[..., 0])
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    di = np.einsum("bqhd,bqhd->bhq", do, out)
    ds = p * (dp - di[..., None] + dlse[..., None])
    if cap:
        ds = ds * (1.0 - np.tanh(s / cap) ** 2)
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kk)
    group_sum = lambda x: x.reshape(*x.shape[:2], -1, g, x.shape[-1]).sum(3)
    dk = group_sum(scale * np.einsum("bhqk,bqhd->bkhd", ds, q))
    dv = group_sum(np.einsum("bhqk,bqhd->bkhd", p, do))
    return out, lse, dq, dk, dv


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    assert np.isfinite(x).all(), "non-finite values"  # NaN never passes
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def make_inputs(rng, B, Sq, Skv, H, Hkv, D, Dv=None, dtype="float32"):
    Dv = Dv or D
    cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
    q = cast(rng.standard_normal((B, Sq, H, D)))
    k = cast(rng.standard_normal((B, Skv, Hkv, D)))
    v = cast(rng.standard_normal((B, Skv, Hkv, Dv)))
    do = cast(rng.standard_normal((B, Sq, H, Dv)))
    dlse = jnp.asarray(rng.standard_normal((B, H, Sq)), jnp.float32)
    return q, k, v, do, dlse


def check(q, k, v, do, dlse, allowed, *, cap=None, scale=None, use_dlse=True, **kwargs):
    """Run forward + VJP and compare with the reference; returns the kernel results."""
    scale_ = q.shape[-1] ** -0.5 if scale is None else scale

    def f(q, k, v):
        return blocksparse_attention(
            q, k, v, logits_soft_cap=cap, softmax_scale=scale, return_lse=True, **kwargs
        )

    (out, lse), vjp = jax.vjp(f, q, k, v)
    dlse = dlse if use_dlse else jnp.zeros_like(dlse)
    dq, dk, dv = vjp((do, dlse))
    ref = reference(q, k, v, allowed, do, dlse, scale=scale_, cap=cap)
    tol = TOL[jnp.dtype(q.dtype).name]
    assert out.shape == q.shape[:3] + v.shape[3:] and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    assert rel_err(out, ref[0]) < tol["out"]
    lse, ref_lse = np.asarray(lse), ref[1]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    # lse is float32 whatever the inputs' dtype, and the reference sees the same (rounded) inputs:
    # its error is float32's (5e-7 measured, bf16 and f32). The bound was the output's relative one,
    # atol 10x it: 8e-2 for bf16 inputs, where an lse off by 1e-2 passed (and with use_dlse=False
    # no gradient saw it).
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=LSE_ATOL, rtol=LSE_RTOL)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        assert rel_err(got, want) < tol["grad"], name
    return out, lse, (dq, dk, dv)


def bottom_right(Sq, Skv, fn):
    """Dense convenience mask: query i sits at key position i + Skv - Sq."""
    q = np.arange(Sq)[:, None] + Skv - Sq
    kv = np.arange(Skv)[None, :]
    return fn(q, kv)


# --------------------------------------------------------------------------------------
# Numerics (interpret mode)
# --------------------------------------------------------------------------------------
S = 64
CASES = {
    # name: (H, Hkv, kwargs, dense mask fn of (q position, kv), block sizes)
    "causal-mha": (2, 2, dict(causal=True), lambda q, kv: q >= kv, BlockSizes(16, 32, 32, 16, 16, 16)),
    "window-gqa": (
        4,
        2,
        dict(sliding_window=(8, 4)),
        lambda q, kv: (q - 8 <= kv) & (kv <= q + 4),
        BlockSizes(16, 16),
    ),
    "causal-window-gqa": (
        4,
        2,
        dict(causal=True, sliding_window=10),
        lambda q, kv: (q - 10 <= kv) & (kv <= q),
        BlockSizes(8, 16, 16, 8, 32, 8),
    ),
    "chunked-mqa": (
        4,
        1,
        dict(chunk_size=24),
        lambda q, kv: (q // 24 == kv // 24) & (q >= kv),
        BlockSizes(16, 16),
    ),
    # Beyond every position, a window side or chunk is unbounded (was numpy's OverflowError).
    "huge-window-chunk": (
        2,
        1,
        dict(causal=True, sliding_window=2**40, chunk_size=2**40),
        lambda q, kv: q >= kv,
        BlockSizes(32, 32),
    ),
    "full-mqa": (2, 1, dict(), lambda q, kv: np.ones(np.broadcast(q, kv).shape, bool), BlockSizes(32, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_convenience_masks(name, rng):
    H, Hkv, kwargs, fn, bs = CASES[name]
    q, k, v, do, dlse = make_inputs(rng, 2, S, S, H, Hkv, 32)
    check(q, k, v, do, dlse, bottom_right(S, S, fn), block_sizes=bs, **kwargs)


def test_per_head_masks_mqa(rng):
    """Different static masks per head: schedule rows per head, mask blocks loaded."""
    H = 3
    dense = [make_random_mask((S, S), 0.7, 1), make_causal_mask((S, S)), make_random_mask((S, S), 0.3, 2)]
    for d in dense:
        d[:, 0] = True
    dense[0][:, 16:32] = False  # whole empty blocks
    mask = MultiHeadMask([NumpyMask(d) for d in dense])
    q, k, v, do, dlse = make_inputs(rng, 1, S, S, H, 1, 16)
    check(q, k, v, do, dlse, np.stack(dense)[None], mask=mask, block_sizes=BlockSizes(16, 16, 8, 32, 32, 8))


@pytest.mark.parametrize("kind", ["dynamic", "numpy2d"])
def test_array_masks(kind, rng):
    dense = make_random_mask((S, S), 0.5, 4)
    if kind == "dynamic":
        dense = np.stack([dense, make_random_mask((S, S), 0.5, 5)])
    dense[..., 40:, :] |= make_causal_mask((S, S))[40:]  # some full blocks
    dense[..., :16, 32:] = False  # and empty ones
    mask = jnp.asarray(dense) if kind == "dynamic" else dense
    q, k, v, do, dlse = make_inputs(rng, 1, S, S, 2, 2, 32)
    allowed = dense[None] if kind == "dynamic" else dense
    check(q, k, v, do, dlse, allowed, mask=mask, block_sizes=BlockSizes(16, 16))
    # A dynamic mask is traced (a jit argument); a 2-D one is shared by all heads.
    if kind == "dynamic":
        f = jax.jit(lambda m, q, k, v: blocksparse_attention(q, k, v, mask=m, block_sizes=BlockSizes(16, 16)))
        shared = ~dense[0]
        shared[:, 0] = True
        out = f(jnp.asarray(shared), q, k, v)
        ref = reference(q, k, v, shared, do, dlse, scale=32**-0.5)[0]
        assert rel_err(out, ref) < TOL["float32"]["out"]


@pytest.mark.parametrize("Sq,Skv", [(40, 72), (64, 40)])
def test_cross_attention_odd_sizes(Sq, Skv, rng):
    """q_len != kv_len, causal aligned bottom-right; with Sq > Skv the first rows see
    no key at all (output 0, lse -inf, zero gradients).  Odd head dims."""
    q, k, v, do, dlse = make_inputs(rng, 1, Sq, Skv, 2, 1, 24, Dv=40)
    out, lse, (dq, _, _) = check(
        q,
        k,
        v,
        do,
        dlse,
        bottom_right(Sq, Skv, lambda q, kv: q >= kv),
        causal=True,
        block_sizes=BlockSizes(8, 8),
    )
    empty = max(Sq - Skv, 0)
    assert not np.asarray(out[:, :empty]).any() and np.isneginf(lse[:, :, :empty]).all()
    assert not np.asarray(dq[:, :empty]).any()


def test_segment_ids(rng):
    """Equal ids attend; rows whose id has no key are fully masked but stay finite."""
    q, k, v, do, dlse = make_inputs(rng, 2, S, S, 4, 2, 32)
    q_seg = np.sort(rng.integers(0, 4, (2, S)), axis=1)
    kv_seg = np.sort(rng.integers(0, 3, (2, S)), axis=1)  # id 3 never appears in kv
    q_seg[1, -5:] = -7  # negative ids are ordinary ids
    kv_seg[1, -3:] = -7
    allowed = make_causal_mask((S, S))[None, None] & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    out, lse, (dq, _, _) = check(
        q,
        k,
        v,
        do,
        dlse,
        allowed,
        causal=True,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
        block_sizes=BlockSizes(16, 16, 32, 16, 16, 32),
    )
    empty = ~allowed.any(-1)[:, 0]  # [B, Sq]
    assert empty.any()
    assert not np.asarray(out)[empty].any() and not np.asarray(dq)[empty].any()


def test_traced_64_bit_segment_ids_are_not_wrapped(rng):
    """Under jit, int64/uint64 ids (unread, so not range-checked) were narrowed to int32: 0 and
    2**32 (or 3 and 2**63 + 3) became one segment, silently. They are renumbered jointly instead:
    the same bits as the equal pattern of int32 ids, for q and kv ids that differ too."""
    q = jnp.asarray(rng.standard_normal((1, 16, 1, 8)), jnp.float32)
    attend = jax.jit(lambda qs, ks: blocksparse_attention(q, q, q, q_segment_ids=qs, kv_segment_ids=ks))
    halves = np.array([[0] * 8 + [1] * 8], np.int32)
    shifted = np.array([[1] * 8 + [0] * 8], np.int32)  # kv: the halves swapped
    want = attend(halves, halves), attend(halves, shifted)
    assert not np.array_equal(want[0], attend(halves * 0, halves * 0))  # the segments matter
    with jax.enable_x64(True):
        for lo, hi, dtype in ((0, 2**32, np.int64), (3, 2**63 + 3, np.uint64), (-5, 2**40 - 5, np.int64)):
            lo, hi = np.array(lo, dtype), np.array(hi, dtype)  # older numpy: 2**63 + 3 is no C long
            qs, ks = np.where(halves == 0, lo, hi), np.where(shifted == 0, lo, hi)
            assert np.array_equal(attend(qs, qs), want[0]), (lo, hi)
            assert np.array_equal(attend(qs, ks), want[1]), (lo, hi)


def test_soft_cap_scale_and_lse_gradient(rng):
    q, k, v, do, dlse = make_inputs(rng, 1, S, S, 2, 2, 32)
    q = q * 4  # large logits, so the cap matters
    mask = LocalMask((S, S), (20, 3))
    allowed = mask[:, :]
    check(q, k, v, do, dlse, allowed, mask=mask, cap=3.0, scale=0.3, block_sizes=BlockSizes(16, 32))


def test_bfloat16_gqa(rng):
    q, k, v, do, dlse = make_inputs(rng, 2, S, S, 4, 2, 64, dtype="bfloat16")
    check(
        q,
        k,
        v,
        do,
        dlse,
        make_causal_mask((S, S)),
        causal=True,
        block_sizes=BlockSizes(32, 32),
    )


def test_lane_tiling_with_128_blocks(rng):
    """Blocks of 128 and head dims of 64 / 256: the TPU-shaped code paths."""
    q, k, v, do, dlse = make_inputs(rng, 1, 256, 256, 2, 1, 64, Dv=256)
    mask = CausalMask((256, 256)) & LocalMask((256, 256), (150, None))
    check(q, k, v, do, dlse, mask[:, :], mask=mask, block_sizes=BlockSizes(128, 128))


def test_empty_blocks_are_never_loaded(rng):
    """NaNs in keys/values that only empty blocks would cover cannot leak: those blocks
    are skipped, not masked after the fact."""
    q, k, v, do, dlse = make_inputs(rng, 1, S, S, 2, 2, 16)
    dense = make_causal_mask((S, S))
    dense[:, 16:32] = False
    dense[:, 0] = True
    k = k.at[:, 16:32].set(jnp.nan)
    v = v.at[:, 16:32].set(jnp.nan)
    f = lambda q, k, v: blocksparse_attention(q, k, v, mask=NumpyMask(dense), block_sizes=BlockSizes(16, 16))
    out, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(do)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dq)).all()
    assert not np.asarray(dk[:, 16:32]).any() and not np.asarray(dv[:, 16:32]).any()


@pytest.mark.slow
def test_larger_shapes(rng):
    """TPU-sized tiles over a longer sequence: per-head masks, GQA, segment ids."""
    Sx, H, Hkv = 512, 4, 2
    q, k, v, do, dlse = make_inputs(rng, 2, Sx, Sx, H, Hkv, 128)
    heads = [
        CausalMask((Sx, Sx)),
        LocalMask((Sx, Sx), (200, 0)),
        CausalMask((Sx, Sx)),
        LocalMask((Sx, Sx), (64, 64)),
    ]
    seg = np.repeat(rng.integers(0, 3, (2, 4)), Sx // 4, axis=1)
    allowed = np.stack([m[:, :] for m in heads])[None] & (seg[:, None, :, None] == seg[:, None, None, :])
    check(
        q,
        k,
        v,
        do,
        dlse,
        allowed,
        mask=MultiHeadMask(heads),
        q_segment_ids=jnp.asarray(seg),
        block_sizes=BlockSizes(128, 256, 256, 128, 128, 256),
    )


def test_jit_grad_and_default_interpret(rng):
    q, k, v, do, _ = make_inputs(rng, 1, S, S, 2, 2, 32)
    loss = lambda q, k, v: jnp.sum(
        blocksparse_attention(q, k, v, causal=True) * do
    )  # default blocks, interpret
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = reference(q, k, v, make_causal_mask((S, S)), do, jnp.zeros((1, 2, S)), scale=32**-0.5)
    for got, want in zip(g, ref[2:]):
        assert rel_err(got, want) < TOL["float32"]["grad"]


def test_second_derivative_names_the_op(rng):
    """grad of grad raised Pallas's bare NotImplementedError from inside the backward kernels."""
    q, k, v, _, _ = make_inputs(rng, 1, 16, 16, 2, 2, 8)
    blocks = BlockSizes(8, 8)
    loss = lambda q: jnp.sum(blocksparse_attention(q, k, v, causal=True, block_sizes=blocks) ** 2)  # noqa: E731
    jax.grad(loss)(q)
    with pytest.raises(NotImplementedError, match="blocksparse_attention has no second derivative"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)


def test_matches_splash_attention(rng):
    """Extra oracle: JAX's own splash attention kernel (interpret mode)."""
    splash = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    Sx, H, D = 256, 2, 64
    q, k, v, do, _ = make_inputs(rng, 1, Sx, Sx, H, H, D)
    block = splash.BlockSizes(128, 128, 128, 128, 128, 128, 128, 128)
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([splash.CausalMask((Sx, Sx))] * H),
        block_sizes=block,
        head_shards=1,
        q_seq_shards=1,
        interpret=True,
    )
    theirs = lambda q, k, v: kernel(
        q[0].swapaxes(0, 1) * D**-0.5, k[0].swapaxes(0, 1), v[0].swapaxes(0, 1)
    ).swapaxes(0, 1)[None]
    ours = lambda q, k, v: blocksparse_attention(q, k, v, causal=True, block_sizes=BlockSizes(128, 128))
    a, vjp_a = jax.vjp(ours, q, k, v)
    # Splash's dots leave precision unset: make them float32 too (XLA:GPU would use TF32).
    with jax.default_matmul_precision("highest"):
        b, vjp_b = jax.vjp(theirs, q, k, v)
        theirs_grads = vjp_b(do)
    assert rel_err(a, np.asarray(b, np.float64)) < 1e-5
    for x, y in zip(vjp_a(do), theirs_grads):
        assert rel_err(x, np.asarray(y, np.float64)) < 1e-4


# --------------------------------------------------------------------------------------
# TPU lowering on this (CPU) machine: Mosaic's block-shape rules are enforced
# --------------------------------------------------------------------------------------
def lower_for_tpu(B, Sq, Skv, H, Hkv, D=128, *, seg=False, dtype=jnp.bfloat16, **kwargs):
    """Lowers forward and forward + backward for TPU; returns the two StableHLO texts."""
    q = jax.ShapeDtypeStruct((B, Sq, H, D), dtype)
    kv = jax.ShapeDtypeStruct((B, Skv, Hkv, D), dtype)
    ids = (
        (jax.ShapeDtypeStruct((B, Sq), jnp.int32), jax.ShapeDtypeStruct((B, Skv), jnp.int32))
        if seg
        else (None, None)
    )

    def fwd(q, k, v, qs, ks):
        return blocksparse_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, interpret=False, **kwargs)

    def bwd(q, k, v, qs, ks):
        return jax.grad(lambda *a: fwd(*a, qs, ks).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    texts = [jax.jit(fn).trace(q, kv, kv, *ids).lower(lowering_platforms=("tpu",)).as_text() for fn in (fwd, bwd)]
    assert [t.count("tpu_custom_call") for t in texts] == [1, 3]  # forward; forward + dq + dkv
    return texts


TPU_CASES = {
    "causal-gqa-2k": dict(B=1, Sq=2048, Skv=2048, H=8, Hkv=2, causal=True),
    "causal-seg-softcap-4k": dict(
        B=2,
        Sq=4096,
        Skv=4096,
        H=4,
        Hkv=4,
        causal=True,
        seg=True,
        logits_soft_cap=30.0,
        block_sizes=BlockSizes(512, 1024, 256, 512, 512, 256),
    ),
    "window-8k": dict(
        B=1,
        Sq=8192,
        Skv=8192,
        H=2,
        Hkv=1,
        sliding_window=1024,
        causal=True,
        block_sizes=BlockSizes(256, 512, 128, 256, 256, 128),
    ),
    "chunked-mqa-4k": dict(
        B=1, Sq=4096, Skv=4096, H=4, Hkv=1, chunk_size=1024, block_sizes=BlockSizes(128, 128)
    ),
    "numpy-mask-cross-2k": dict(
        B=1,
        Sq=2048,
        Skv=4096,
        H=2,
        Hkv=2,
        D=64,
        mask=NumpyMask(make_random_mask((2048, 4096), 0.9, 0) | make_causal_mask((2048, 4096), 2048)),
    ),
    "per-head-2k": dict(
        B=1,
        Sq=2048,
        Skv=2048,
        H=2,
        Hkv=1,
        mask=MultiHeadMask([CausalMask((2048, 2048)), LocalMask((2048, 2048), (256, 256))]),
    ),
    "dynamic-2k": dict(
        B=1, Sq=2048, Skv=2048, H=2, Hkv=2, mask=jnp.asarray(make_causal_mask((2048, 2048)))[None]
    ),
    # float32 operands: every tpu.matmul carries contract_precision<fp32> (Precision.HIGHEST).
    "causal-seg-softcap-2k-f32": dict(
        B=1,
        Sq=2048,
        Skv=2048,
        H=4,
        Hkv=2,
        causal=True,
        seg=True,
        logits_soft_cap=30.0,
        dtype=jnp.float32,
        block_sizes=BlockSizes(256, 512, 128, 256, 256, 128),
    ),
}


@pytest.mark.parametrize("name", list(TPU_CASES))
def test_lowers_for_tpu(name):
    lower_for_tpu(**TPU_CASES[name])


# --------------------------------------------------------------------------------------
# Matmul precision: float32 dots are HIGHEST (true float32 on CPU, GPU and TPU), bf16 / f16
# dots DEFAULT (native path).  Interpret mode on an NVIDIA GPU would otherwise run float32 dots
# as TF32 (~1e-3), which no GPU-less run can see, so the precision itself is checked.
# --------------------------------------------------------------------------------------
_EXPECTED_PRECISION = {"float32": "HIGHEST", "bfloat16": "DEFAULT", "float16": "DEFAULT"}
# Dots per kernel body (each traced once per full / partial block path, hence "at least").
_MIN_DOTS = {"blocksparse_attention_fwd": 2, "blocksparse_attention_dq": 3, "blocksparse_attention_dkv": 4}


def _fwd_bwd(**kwargs):
    def f(q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: blocksparse_attention(q, k, v, **kwargs), q, k, v)
        return out, pullback(do)

    return f


@pytest.mark.parametrize("dtype", list(_EXPECTED_PRECISION))
def test_kernel_dots_state_precision(dtype):
    """Every dot_general in the forward, dQ and dK/dV kernel bodies, in the jaxpr."""
    q = jnp.zeros((1, 32, 2, 16), dtype)
    kv = jnp.zeros((1, 32, 1, 16), dtype)
    fn = _fwd_bwd(causal=True, logits_soft_cap=5.0, block_sizes=BlockSizes(16, 16))
    kernels = kernel_dots(fn, q, kv, kv, q)
    assert set(kernels) == set(_MIN_DOTS), kernels.keys()
    want = _EXPECTED_PRECISION[dtype]
    for name, calls in kernels.items():
        for dots in calls:
            assert len(dots) >= _MIN_DOTS[name], (name, dots)
            for precision, operands in dots:
                assert precision == (want, want), f"{name}: {dtype} dot with precision {precision} {operands}"
                assert operands == (dtype, dtype), f"{name}: dot operands {operands}, inputs {dtype}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpret_hlo_dots_state_precision(dtype):
    """What XLA runs in interpret mode (on CPU here, on GPU elsewhere) keeps the precision."""
    q = jnp.zeros((1, 32, 2, 16), dtype)
    fn = _fwd_bwd(causal=True, block_sizes=BlockSizes(16, 16), interpret=True)
    dots = hlo_dot_precisions(jax.jit(fn).lower(q, q, q, q).as_text())
    want = _EXPECTED_PRECISION[dtype]
    assert len(dots) >= sum(_MIN_DOTS.values())
    assert set(dots) == {(f"{want},{want}", {"float32": "f32", "bfloat16": "bf16"}[dtype])}, dots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_matmuls_state_precision(dtype):
    """In the Mosaic kernels: contract_precision<fp32> on every float32 matmul, none on bf16."""
    texts = lower_for_tpu(1, 1024, 1024, 2, 1, seg=True, causal=True, logits_soft_cap=20.0, dtype=dtype)
    matmuls = mosaic_matmuls(texts[1])
    if matmuls is None:
        pytest.skip("cannot decode Mosaic payloads with this jax version")
    assert len(matmuls) >= sum(_MIN_DOTS.values()), matmuls
    for line in matmuls:
        assert ("#tpu.contract_precision<fp32>" in line) == (dtype == jnp.float32), line


def test_odd_lengths_lower_for_tpu_with_default_blocks():
    """No block_sizes: the defaults must obey Mosaic's rules for lengths that 512..8 divide
    only through blocks below 128 (96, 200, 320), or not at all (100)."""
    lower_for_tpu(1, 96, 96, 2, 1, D=64, causal=True)
    lower_for_tpu(1, 320, 200, 2, 2, D=64, seg=True, sliding_window=64)
    lower_for_tpu(1, 100, 384, 2, 1, D=64, causal=True)


def test_tpu_block_rules_are_checked():
    with pytest.raises(ValueError, match="block_kv"):
        lower_for_tpu(1, 2048, 2048, 2, 2, causal=True, block_sizes=BlockSizes(128, 64))
    with pytest.raises(ValueError, match="block_q_dq"):
        lower_for_tpu(1, 2048, 2048, 2, 2, causal=True, block_sizes=BlockSizes(128, 128, block_q_dq=64))


# --------------------------------------------------------------------------------------
# Argument checking
# --------------------------------------------------------------------------------------
def test_block_size_defaults():
    bs = BlockSizes().resolve(1024, 96, tpu=False)
    assert (bs.block_q, bs.block_kv, bs.block_q_dq, bs.block_kv_dkv) == (512, 32, 512, 32)
    bs = BlockSizes(block_q=128, block_kv_dkv=16).resolve(256, 48, tpu=False)
    assert (bs.block_q, bs.block_kv, bs.block_q_dkv, bs.block_kv_dkv) == (128, 16, 128, 16)
    assert BlockSizes().resolve(100, 100, tpu=True).block_kv == 100  # whole sequence


_TPU_RULES = {  # field -> (which length, multiple it needs on TPU unless it is the whole length)
    "block_q": ("q", 8),
    "block_kv": ("kv", 128),
    "block_q_dq": ("q", 128),
    "block_kv_dq": ("kv", 128),
    "block_q_dkv": ("q", 128),
    "block_kv_dkv": ("kv", 8),
}
_LENGTHS = (8, 96, 100, 128, 200, 256, 320, 384, 640, 1000, 1024, 1152, 4096)


@pytest.mark.parametrize("given", [{}, {"block_q": 32}, {"block_q": 8, "block_kv_dkv": 8}])
def test_tpu_default_block_sizes_obey_the_tpu_rule(given):
    """Every default resolve() picks on TPU is valid for its pass, for every length pair;
    a backward size inherits a forward one only where that is valid for it."""
    for q_len in _LENGTHS:
        for kv_len in _LENGTHS:
            length_of = lambda name: {"q": q_len, "kv": kv_len}[_TPU_RULES[name][0]]
            if any(length_of(name) % b for name, b in given.items()):
                continue
            bs = BlockSizes(**given).resolve(q_len, kv_len, tpu=True)
            for name, (_, multiple) in _TPU_RULES.items():
                length, b = length_of(name), getattr(bs, name)
                assert length % b == 0 and (b == length or b % multiple == 0), (q_len, kv_len, name, b)
            for name, b in given.items():
                assert getattr(bs, name) == b  # what the user gave is kept


def test_tpu_default_block_sizes_prefer_lane_wide_blocks():
    bs = BlockSizes().resolve(96, 320, tpu=True)  # was (32, 64, ...): invalid on TPU
    assert (bs.block_q, bs.block_kv, bs.block_q_dq, bs.block_kv_dq, bs.block_q_dkv, bs.block_kv_dkv) == (
        96, 320, 96, 320, 96, 320
    )
    bs = BlockSizes().resolve(1000, 640, tpu=True)
    assert (bs.block_q, bs.block_kv, bs.block_q_dq, bs.block_kv_dkv) == (1000, 128, 1000, 128)
    bs = BlockSizes(block_q=64).resolve(1024, 96, tpu=True)  # 64 is valid for block_q only
    assert (bs.block_q, bs.block_q_dq, bs.block_q_dkv) == (64, 512, 512)
    # Off TPU the defaults are unchanged: the largest of 512..8 dividing the length.
    bs = BlockSizes().resolve(96, 320, tpu=False)
    assert (bs.block_q, bs.block_kv, bs.block_q_dq, bs.block_kv_dkv) == (32, 64, 32, 64)


def test_tpu_default_block_sizes_reject_unsupported_lengths():
    """A length that no multiple of 128 divides is one block only up to 1024; past that
    the error says which lengths have defaults and that block_sizes can be passed."""
    with pytest.raises(ValueError, match=r"block_sizes.block_kv for sequence length 1096 .*multiples of 128"):
        BlockSizes().resolve(1024, 1096, tpu=True)
    with pytest.raises(ValueError, match=r"block_sizes.block_q for sequence length 1100 .*pass block_sizes"):
        BlockSizes().resolve(1100, 1024, tpu=True)
    explicit = BlockSizes(1096, 1096, 1096, 1096, 1096, 1096)  # the whole sequence, chosen by the user
    assert explicit.resolve(1096, 1096, tpu=True) == explicit
    with pytest.raises(ValueError, match="block_sizes.block_q must be a positive int"):
        BlockSizes(block_q=0).resolve(256, 256, tpu=True)  # not inherited by the backward sizes


@pytest.mark.parametrize("value", [True, 2.5, "8", 8.0])
def test_block_sizes_must_be_ints(value):
    with pytest.raises(TypeError, match="block_sizes.block_kv must be an int"):
        BlockSizes(8, value)
    assert BlockSizes(np.int64(8)) == BlockSizes(8)  # numpy ints are ints


def test_invalid_arguments(rng):
    q, k, v, _, _ = make_inputs(rng, 1, 32, 32, 4, 2, 16)
    call = lambda **kw: blocksparse_attention(**{"q": q, "k": k, "v": v, **kw})
    with pytest.raises(ValueError, match="4-D"):
        call(q=q[0])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(k=k[:, :, :1].repeat(3, 2), v=v[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="head_dim"):
        call(k=k[..., :8])
    with pytest.raises(ValueError, match="dtype"):
        call(v=v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="block_sizes.block_q="):
        call(block_sizes=BlockSizes(block_q=12))
    with pytest.raises(ValueError, match="block_sizes.block_kv_dkv"):
        call(block_sizes={"block_kv_dkv": 24})
    with pytest.raises(ValueError, match="mask shape"):
        call(mask=CausalMask((32, 16)))
    with pytest.raises(ValueError, match="mask shape"):
        call(mask=MultiHeadMask([CausalMask((32, 32))] * 3))
    with pytest.raises(ValueError, match="either mask"):
        call(mask=CausalMask((32, 32)), causal=True)
    with pytest.raises(TypeError, match="mask"):  # wrong types are TypeErrors, as in the torch front
        call(mask=[[True]])
    with pytest.raises(TypeError, match="boolean"):
        call(mask=jnp.ones((32, 32), jnp.int32))
    # float64 ran at float32 precision (float8 rounded the output) where the torch front refuses them.
    with pytest.raises(TypeError, match="q must be bfloat16, float16 or float32, got float8_e4m3fn"):
        call(q=q.astype(jnp.float8_e4m3fn), k=k.astype(jnp.float8_e4m3fn), v=v.astype(jnp.float8_e4m3fn))
    with jax.enable_x64(True), pytest.raises(TypeError, match="q must be bfloat16, float16 or float32, got float64"):
        call(q=q.astype(jnp.float64), k=k.astype(jnp.float64), v=v.astype(jnp.float64))
    with pytest.raises(TypeError, match="q must be bfloat16, float16 or float32, got int32"):
        call(q=q.astype(jnp.int32), k=k.astype(jnp.int32), v=v.astype(jnp.int32))
    with pytest.raises(ValueError, match="q_segment_ids"):
        call(q_segment_ids=jnp.zeros((1, 31), jnp.int32))
    with pytest.raises(TypeError, match="kv_segment_ids"):
        call(q_segment_ids=jnp.zeros((1, 32), jnp.int32), kv_segment_ids=jnp.zeros((1, 32), jnp.float32))
    wide = np.zeros((1, 32), np.int64)
    wide[0, -1] = 2**32  # would wrap to segment 0
    with pytest.raises(ValueError, match="q_segment_ids holds values in \\[0, 4294967296\\]"):
        call(q_segment_ids=wide)
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=-1)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        call(logits_soft_cap=0.0)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 8, 1, 0), (1, 8, 1, 0), (1, 8, 1, 0)), r"q must have head_dim >= 1"),  # was ZeroDivisionError
        (((1, 8, 2, 4), (1, 8, 0, 4), (1, 8, 0, 4)), r"k must have heads >= 1"),  # was ZeroDivisionError
        (((1, 8, 0, 4), (1, 8, 1, 4), (1, 8, 1, 4)), r"q must have heads >= 1"),
        (((0, 8, 2, 4), (0, 8, 2, 4), (0, 8, 2, 4)), r"q must have batch >= 1"),
        (((1, 0, 2, 4), (1, 8, 2, 4), (1, 8, 2, 4)), r"q must have seq >= 1"),
        (((1, 8, 2, 4), (1, 0, 2, 4), (1, 0, 2, 4)), r"k must have seq >= 1"),
        (((1, 8, 2, 4), (1, 8, 2, 4), (1, 8, 2, 0)), r"v must have head_dim >= 1"),
    ],
)
def test_empty_dimensions_raise(shapes, match):
    q, k, v = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        blocksparse_attention(q, k, v)


def test_argument_types_are_checked(rng):
    q, k, v, _, _ = make_inputs(rng, 1, 32, 32, 4, 2, 16)
    call = lambda **kw: blocksparse_attention(**{"q": q, "k": k, "v": v, **kw})
    with pytest.raises(TypeError, match="sliding_window must be an int or a"):
        call(sliding_window="ab")  # once unpacked into sides "a" and "b"
    with pytest.raises(TypeError, match="sliding_window must be an int"):
        call(sliding_window=2.5)
    with pytest.raises(TypeError, match="sliding_window must be an int"):
        call(sliding_window=(4, 1.5))
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=(1, 2, 3))
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        call(chunk_size=2.5)  # once chunks of 2
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        call(chunk_size="4")
    with pytest.raises(TypeError, match="q_segment_ids must be a jax or numpy"):
        call(q_segment_ids=[[0] * 32])  # once an AttributeError
    with pytest.raises(TypeError, match="kv_segment_ids must be a jax or numpy"):
        call(q_segment_ids=jnp.zeros((1, 32), jnp.int32), kv_segment_ids=[[0] * 32])
    with pytest.raises(TypeError, match="k must be a jax or numpy array"):
        call(k=k.tolist())
    with pytest.raises(TypeError, match="block_sizes must be a BlockSizes"):
        call(block_sizes=(16, 16))  # once an AttributeError
    with pytest.raises(TypeError, match="mask must be boolean, got dtype int32"):
        call(mask=np.ones((32, 32), np.int32))  # was NumpyMask's ValueError "array must be boolean"
    with pytest.raises(TypeError, match="mask must be boolean, got dtype float32"):
        call(mask=jnp.ones((32, 32)))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(causal="no"), TypeError, "causal must be a bool, got 'no'"),  # was causal
    (dict(causal=1), TypeError, "causal must be a bool, got 1"),
    (dict(return_lse="no"), TypeError, "return_lse must be a bool, got 'no'"),  # returned the lse
    (dict(softmax_scale="1"), TypeError, "softmax_scale must be a float or None, got '1'"),  # float("1")
    (dict(softmax_scale=True), TypeError, "softmax_scale must be a float or None, got True"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap must be a float or None, got True"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite, got nan"),  # all-NaN output
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be finite"),
    (dict(interpret="no"), TypeError, "interpret must be None, a bool or a pltpu.InterpretParams, got 'no'"),  # ran
    (dict(interpret=0), TypeError, "interpret must be None, a bool or a pltpu.InterpretParams, got 0"),
])
def test_scalar_options_are_checked(rng, kwargs, error, match):
    q, k, v, _, _ = make_inputs(rng, 1, 32, 32, 4, 2, 16)
    with pytest.raises(error, match=match):
        blocksparse_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("process", ["static", "dynamic"])
@pytest.mark.parametrize("flag", ["is_dkv", "downcast_smem_data", "shrink_grid"])
def test_process_mask_flags_must_be_bools(process, flag):
    # bool() of them: is_dkv="no" gave the dK/dV schedule
    causal = np.tril(np.ones((8, 8), bool))
    if process == "static":
        call = lambda **kw: process_mask(MultiHeadMask([NumpyMask(causal)]), (4, 4), **kw)
    else:
        call = lambda **kw: process_dynamic_mask(jnp.asarray(causal)[None], (4, 4), **kw)
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'no'"):
        call(**{flag: "no"})
    call(**{flag: np.False_})


def test_numpy_scalar_options(rng):
    q, k, v, _, _ = make_inputs(rng, 1, 32, 32, 4, 2, 16)
    expected = blocksparse_attention(q, k, v, causal=True, softmax_scale=0.5, return_lse=True)
    out = blocksparse_attention(q, k, v, causal=np.True_, softmax_scale=np.float32(0.5), return_lse=np.True_)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(expected[0]))
