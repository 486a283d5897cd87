"""fwd_params / bwd_params on padded_attention and flash_attention(_varlen): they change the plans,
results stay correct (and equal across fronts), and bad or oversized configs fail before any kernel."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error
from triton_kernels import flash_attention as fa
from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan
from triton_kernels.params import SMEM_LIMIT_ENV, BwdParams, FwdParams
from triton_kernels.plan import HOPPER, DeviceFacts

CPU = DeviceFacts.cpu()
FWD = dict(blocksize_m=16, kv_blocksize=32, num_warps=2)  # differs from every default plan
BWD = BwdParams(blocksize_m=32, blocksize_n=16, num_warps=2)


def _blocks(plan):
    return plan.constexpr_dict["BLOCK_M"], plan.constexpr_dict["BLOCK_N"], plan.num_warps, plan.num_stages


@pytest.mark.parametrize("facts", [CPU, HOPPER], ids=["cpu", "hopper"])
def test_overrides_change_only_what_they_name(facts):
    key = ((2, 40, 32), "float16", 0.25, facts)
    default = attention_fwd_plan(*key)
    assert attention_fwd_plan(*key, None) == default  # no override: the default plan
    assert _blocks(attention_fwd_plan(*key, FwdParams(**FWD))) == (16, 32, 2, default.num_stages)
    assert _blocks(attention_fwd_plan(*key, FwdParams(num_stages=1)))[:3] == _blocks(default)[:3]
    _, dkdv, dq = attention_bwd_plans(*key, BWD)
    assert _blocks(dkdv)[:3] == _blocks(dq)[:3] == (32, 16, 2)
    assert dkdv.grid[0] == 3 and dq.grid[0] == 2  # grids follow the overridden tiles

    spec = fa.dense_spec((1, 20, 2, 16), (1, 24, 2, 16), (1, 24, 2, 16), ("float32",) * 3)
    assert _blocks(fa.forward_plan(spec, facts, FwdParams(**FWD)))[:3] == (16, 32, 2)
    assert fa.forward_plan(spec, facts, FwdParams(**FWD)) == fa.forward_plan(spec, facts, FwdParams(**FWD))
    plans = fa.backward_plans(spec, facts, False, False, BWD)
    dkdv, dq = plans.dkdv, plans.dq
    assert _blocks(dkdv)[:3] == (32, 16, 2)
    assert _blocks(dq)[:3] == (16, 32, 2)  # dq holds blocksize_n queries and steps over blocksize_m keys


def _padded_inputs(fw, rng, dtype="float32"):
    qkv = [rng.standard_normal((2, 37, 24)) for _ in range(3)]
    n_pad = np.array([0, 5], np.int32)
    arrays = [fw.asarray(a, dtype) for a in qkv]
    return arrays, [fw.to_numpy(a) for a in arrays], fw.asarray(n_pad), n_pad


def test_padded_attention_with_overrides_matches_float64(fw, rng):
    arrays, values, n_pad, n_pad_np = _padded_inputs(fw, rng)
    op = lambda q, k, v: fw.ops.padded_attention(q, k, v, n_pad, fwd_params=FWD, bwd_params=BWD)  # noqa: E731
    assert rel_error(fw.to_numpy(op(*arrays)), ref.forward(ref.padded_attention, *values, n_pad_np)) < 1e-5
    dout = rng.standard_normal((2, 37, 24))
    grads = fw.vjp(op, arrays, fw.asarray(dout, "float32"))
    expected = ref.vjp(ref.padded_attention, [*values, n_pad_np], dout, n_diff=3)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < 2e-5, name


def test_flash_attention_with_overrides_matches_float64(fw, rng):
    shapes = [(2, 21, 4, 16), (2, 30, 2, 16), (2, 30, 2, 16)]
    arrays = [fw.asarray(rng.standard_normal(s), "float32") for s in shapes]
    values = [fw.to_numpy(a) for a in arrays]
    opts = dict(causal=True, logits_soft_cap=5.0)
    op = lambda q, k, v: fw.ops.flash_attention(q, k, v, fwd_params=FWD, bwd_params=BWD, **opts)  # noqa: E731
    want = ref.flash_attention(*(ref._t(a) for a in values), **opts).numpy()
    assert rel_error(fw.to_numpy(op(*arrays)), want) < TOLERANCE["float32"]
    dout = rng.standard_normal(shapes[0])
    grads = fw.vjp(op, arrays, fw.asarray(dout, "float32"))
    expected = ref.vjp(lambda q, k, v: ref.flash_attention(q, k, v, **opts), values, dout, n_diff=3)
    for name, got, want in zip("qkv", grads, expected):
        assert rel_error(got, want) < 2e-5, name


def test_flash_attention_varlen_with_overrides(fw, rng):
    cu = [0, 7, 25]
    arrays = [fw.asarray(rng.standard_normal((25, 2, 16)), "float32") for _ in range(3)]
    cu_arr = fw.asarray(np.array(cu, np.int32))
    out = fw.ops.flash_attention_varlen(*arrays, cu_arr, cu_arr, 18, 18, causal=True,
                                        fwd_params=FwdParams(blocksize_m=16, blocksize_n=16))
    want = ref.flash_attention_varlen(*(ref._t(fw.to_numpy(a)) for a in arrays), ref._t(np.array(cu)),
                                      ref._t(np.array(cu)), 18, 18, causal=True).numpy()
    assert rel_error(fw.to_numpy(out), want) < TOLERANCE["float32"]


def test_torch_and_jax_agree_with_overrides(torch_fw, jax_fw, rng):
    qkv = [rng.standard_normal((2, 37, 24)).astype(np.float32) for _ in range(3)]
    dout = rng.standard_normal((2, 37, 24)).astype(np.float32)
    results = []
    for f in (torch_fw, jax_fw):
        args, n_pad = [f.asarray(a) for a in qkv], f.asarray(np.array([0, 5], np.int32))
        op = lambda q, k, v: f.ops.padded_attention(q, k, v, n_pad, fwd_params=FWD, bwd_params=BWD)  # noqa: E731
        results.append([f.to_numpy(op(*args)), *f.vjp(op, args, f.asarray(dout))])
    for a, b in zip(*results):
        assert np.max(np.abs(a - b)) <= 1e-6


def test_torch_compile_with_params_dicts(torch_fw, rng):
    # Dicts failed to trace (dynamo cannot take dataclasses.fields() of a class): only
    # FwdParams/BwdParams instances compiled.
    import torch

    import ejkernel_torch as ejk

    q = torch.from_numpy(rng.standard_normal((1, 20, 2, 16)).astype(np.float32))
    fn = torch.compile(lambda x: ejk.flash_attention(x, x, x, fwd_params=FWD, bwd_params={"blocksize_m": 32}),
                       backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(q), ejk.flash_attention(q, q, q, fwd_params=FWD))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fwd_params={"blocksize_q": 32}), ValueError, "fwd_params.*unknown field"),
    (dict(fwd_params={"blocksize_m": 24}), ValueError, "fwd_params.*power of two"),
    (dict(fwd_params={"num_warps": "4"}), TypeError, "fwd_params.*int"),
    (dict(fwd_params=[64]), TypeError, "fwd_params"),
    (dict(fwd_params=BwdParams()), TypeError, "fwd_params"),
    (dict(bwd_params={"num_stages": 0}), ValueError, "bwd_params.*positive"),
    (dict(fwd_params={"blocksize_m": 8}), ValueError, "fwd_params.*at least 16"),
    (dict(bwd_params={"num_key_splits": 2}), ValueError, "bwd_params.*unknown field"),
    (dict(fwd_params={"blocksize_k": 32}), ValueError, "fwd_params.*do not apply"),
    (dict(fwd_params={"blocksize_m": 32, "q_blocksize": 64}), ValueError, "fwd_params.*disagree"),
    # past Triton's 2**20 elements a tile: it crashed inside the kernel (an InterpreterError)
    (dict(fwd_params={"blocksize_m": 2048, "blocksize_n": 1024}), ValueError, "fwd_params.*2048x1024 tile"),
    (dict(autotune="no"), TypeError, "autotune must be True, False or None"),
    (dict(autotune=1, fwd_params=FWD, bwd_params=BWD), TypeError, "autotune must be"),  # even when not read
])
@pytest.mark.parametrize("op", ["padded_attention", "flash_attention"])
def test_bad_params_raise(fw, op, kwargs, error, match):
    x = fw.asarray(np.zeros((1, 8, 2, 16) if op == "flash_attention" else (1, 8, 16)), "float32")
    args = (x, x, x) if op == "flash_attention" else (x, x, x, fw.asarray(np.zeros(1, np.int32)))
    with pytest.raises(error, match=match):
        getattr(fw.ops, op)(*args, **kwargs)


def test_tiles_past_tritons_element_limit_raise(fw, rng):
    # gmm's tiles too (it crashed inside the kernel); on a GPU plan the shared memory check passed them.
    lhs, rhs = fw.asarray(np.zeros((4, 16)), "float32"), fw.asarray(np.zeros((2, 16, 16)), "float32")
    sizes = fw.asarray(np.array([2, 2], np.int32))
    with pytest.raises(ValueError, match="a 1024x2048 tile has 2097152 elements"):
        fw.ops.grouped_matmul(lhs, rhs, sizes, fwd_params=dict(blocksize_m=1024, blocksize_n=1024, blocksize_k=2048))
    with pytest.raises(ValueError, match="a 2048x1024 tile"):
        attention_fwd_plan((1, 512, 16), "float16", 0.1, HOPPER, FwdParams(blocksize_m=2048, blocksize_n=1024,
                                                                             num_stages=1))


def test_too_big_config_raises(fw, monkeypatch):
    # On a GPU: Hopper's 227 KiB cannot hold 256x256 fp32 tiles with 4 stages.
    with pytest.raises(ValueError, match="fwd_params.*shared memory.*sm90"):
        attention_fwd_plan((1, 512, 128), "float32", 0.1, HOPPER, FwdParams(blocksize_m=256, blocksize_n=256,
                                                                             num_stages=4))
    # Through the ops, with the limit lowered (the interpreter has none of its own).
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(16 * 1024))
    x = fw.asarray(np.zeros((1, 64, 64)), "float32")
    big = dict(blocksize_m=64, blocksize_n=64, num_stages=2)
    with pytest.raises(ValueError, match="padded_attention fwd_params.*shared memory"):
        fw.ops.padded_attention(x, x, x, fw.asarray(np.zeros(1, np.int32)), fwd_params=big)
    with pytest.raises(ValueError, match="flash_attention bwd_params.*shared memory"):
        y = fw.asarray(np.zeros((1, 64, 1, 64)), "float32")
        fw.ops.flash_attention(y, y, y, bwd_params=big)
    fw.ops.padded_attention(x, x, x, fw.asarray(np.zeros(1, np.int32)))  # defaults are never checked


def test_backward_uses_bwd_params(fw, rng, monkeypatch):
    seen = []
    real = fa.backward_plans

    def spy(spec, facts, write_ds=False, use_dlse=False, params=None):
        seen.append(params)
        return real(spec, facts, write_ds, use_dlse, params)

    monkeypatch.setattr(fa, "backward_plans", spy)
    arrays = [fw.asarray(rng.standard_normal((1, 9, 2, 16)), "float32") for _ in range(3)]
    fw.vjp(lambda q, k, v: fw.ops.flash_attention(q, k, v, bwd_params=BWD), arrays, arrays[0])
    assert seen and seen[-1] == BWD  # the gradient's own plans, not just the up-front check
