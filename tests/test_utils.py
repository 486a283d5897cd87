"""Kernel utilities: params and their rules (triton_kernels), and each front's utils."""
from __future__ import annotations

import collections
import enum
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.frameworks import TOLERANCE, rel_error, x64
from triton_kernels.config_cache import cpu_fingerprint
from triton_kernels.params import (
    BwdParams,
    FwdParams,
    attention_smem_bytes,
    check_params,
    check_shared_memory,
    dtype_name,
    select_num_stages,
    select_num_warps,
    shared_memory_limit,
    short_hash,
    stable_json,
)
from triton_kernels.plan import HOPPER, DeviceFacts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURING = DeviceFacts.cuda((7, 5), 40)


def utils(fw):
    if fw.name == "torch":
        from ejkernel_torch import utils as u
    else:
        from ejkernel_jax import utils as u
    return u


def run_python(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT, **env}, cwd=ROOT)
    return out.stdout.strip()


# -- FwdParams / BwdParams ----------------------------------------------------------------------


def test_params_dict_merge_and_validation():
    base = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4)
    assert base.to_dict() == {"q_blocksize": 128, "kv_blocksize": 64, "num_warps": 4}
    merged = FwdParams.merge(base, {"kv_blocksize": 32, "num_stages": 3})
    assert merged == FwdParams(q_blocksize=128, kv_blocksize=32, num_warps=4, num_stages=3)
    assert FwdParams.merge(None, base) == base and FwdParams.merge(base, None) == base
    assert FwdParams.coerce(None) == FwdParams() and FwdParams.coerce({"num_warps": 8}).num_warps == 8
    assert FwdParams.from_dict(base.to_dict()) == base
    with pytest.raises(ValueError, match="power of two"):
        FwdParams(q_blocksize=96)
    with pytest.raises(ValueError, match="num_warps"):
        BwdParams(num_warps=3)
    with pytest.raises(ValueError, match="positive"):
        FwdParams(num_stages=0)
    with pytest.raises(TypeError, match="num_stages"):
        FwdParams(num_stages=True)
    for bad in (np.bool_(True), 2.0, "2"):
        with pytest.raises(TypeError, match="FwdParams.num_stages must be an int or None"):
            FwdParams(num_stages=bad)
    # numpy ints, as the ops' other int options take them (they were refused); stored as Python ints
    numpy_made = FwdParams(q_blocksize=np.int64(128), num_warps=np.int32(4))
    assert numpy_made == FwdParams(q_blocksize=128, num_warps=4) and type(numpy_made.num_warps) is int
    with pytest.raises(ValueError, match="blocksize_q"):
        FwdParams.from_dict({"blocksize_q": 64})
    with pytest.raises(TypeError, match="FwdParams"):
        FwdParams.coerce(64)
    assert {FwdParams(num_warps=4): 1}[FwdParams(num_warps=4)] == 1  # usable as a plan-cache key


def test_bwd_from_fwd():
    fwd = FwdParams(q_blocksize=128, kv_blocksize=16, blocksize_m=64, num_warps=8, num_stages=3)
    assert BwdParams.from_fwd_params(fwd) == BwdParams(q_blocksize=64, kv_blocksize=16, blocksize_m=32,
                                                       num_warps=8, num_stages=3)
    assert BwdParams.from_fwd_params(fwd, scale=1.0).q_blocksize == 128
    assert BwdParams.from_fwd_params(None) == BwdParams()


def test_stable_hash_is_the_same_in_other_processes():
    params = FwdParams(q_blocksize=64, num_warps=4)
    assert params.stable_hash() == FwdParams(num_warps=4, q_blocksize=64).stable_hash()
    assert params.stable_hash() != FwdParams(q_blocksize=64, num_warps=8).stable_hash()
    code = ("from triton_kernels.params import FwdParams, short_hash; "
            "print(FwdParams(q_blocksize=64, num_warps=4).stable_hash(), "
            "short_hash({'b': {3, 1, 2}, 'a': (1.5, None, 'x')}))")
    seen = {run_python(code, PYTHONHASHSEED=str(seed)) for seed in (1, 2)}
    assert seen == {f"{params.stable_hash()} {short_hash({'a': [1.5, None, 'x'], 'b': {2, 3, 1}})}"}


# -- stable_json / short_hash ----------------------------------------------------------------------


def test_stable_json_is_canonical():
    assert stable_json({"b": (1, 2), "a": {"z": None, "y": 1.5}}) == '{"a":{"y":1.5,"z":null},"b":[1,2]}'
    assert short_hash({"x": 1}) == hashlib.sha256(b'{"x":1}').hexdigest()[:16]
    assert stable_json({2, 10, 1}) == "[1,2,10]"
    assert stable_json({"b", 1}) == stable_json({1, "b"})  # mixed types still have one order
    with pytest.raises(TypeError, match="stable"):
        stable_json(object())
    with pytest.raises(TypeError, match="mapping keys must be str"):  # JSON would write 1 as "1"
        stable_json({1: "a"})
    with pytest.raises(TypeError, match="collide"):
        stable_json({enum.Enum("Color", {"RED": "red"}).RED: "a", "red": "b"})


def test_stable_json_same_for_torch_and_jax_arrays(torch_fw, jax_fw):
    a = np.zeros((2, 3), np.float32)
    for name in ("float32", "bfloat16", "int32", "bool"):
        t, j = torch_fw.asarray(a, name), jax_fw.asarray(a, name)
        expected = f'{{"dtype":"{name}","shape":[2,3]}}'
        assert stable_json(t) == stable_json(j) == expected
        assert stable_json(torch_fw.dtype(name)) == stable_json(jax_fw.dtype(name)) == f'"{name}"'
    assert stable_json(np.float32(2.5)) == "2.5"


def test_dtype_names_of_ml_dtypes_instances():
    """ml_dtypes >= 0.7 gives each of its dtypes a DType class of its own, in module ml_dtypes
    (a subclass of numpy.dtype): still a dtype, named as numpy names it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        assert dtype_name(np.dtype(getattr(ml_dtypes, name))) == name
        assert dtype_name(getattr(ml_dtypes, name)) == name  # the scalar type
    assert dtype_name(np.dtype("float16")) == "float16"


def test_triton_kernels_modules_import_no_framework():
    code = ("import sys, triton_kernels.params, triton_kernels.config_cache; "
            "print(sorted(m for m in ('torch', 'jax', 'numpy') if m in sys.modules))")
    assert run_python(code) == "[]"


# -- warps, stages, shared memory ------------------------------------------------------------------


def test_select_num_warps():
    assert select_num_warps(16, 16) == 1
    assert select_num_warps(64, 64) == 4
    assert select_num_warps(128, 64) == 8
    assert select_num_warps(128, 128, head_dim=256) == 8
    assert select_num_warps(32, 32, head_dim=128) == 4
    assert all(w in (1, 2, 4, 8) for w in (select_num_warps(m, n) for m in (16, 64, 256) for n in (16, 128)))


def test_select_num_stages_and_shared_memory(monkeypatch):
    per_stage = attention_smem_bytes(0, 64, 128, "bfloat16", num_stages=1)  # K+V tiles: 32 KiB
    assert per_stage == 2 * 64 * 128 * 2
    assert select_num_stages(per_stage, HOPPER) == 4  # capped
    assert select_num_stages(per_stage, TURING) == 2  # 64 KiB fits two, and pre-Ampere caps at 2
    assert select_num_stages(per_stage, DeviceFacts.cpu()) == 1
    assert select_num_stages(per_stage, HOPPER, fixed_smem=160_000) == 2
    with pytest.raises(ValueError, match="shared memory"):
        select_num_stages(per_stage, TURING, fixed_smem=40_000)
    assert shared_memory_limit(HOPPER) == 232_448
    monkeypatch.setenv("EJKERNEL_TRITON_SMEM_LIMIT", "50000")
    assert shared_memory_limit(HOPPER) == 50_000
    assert select_num_stages(per_stage, HOPPER) == 1
    monkeypatch.setenv("EJKERNEL_TRITON_SMEM_LIMIT", "lots")
    with pytest.raises(ValueError, match="EJKERNEL_TRITON_SMEM_LIMIT"):
        shared_memory_limit(HOPPER)


def test_oversized_config_is_rejected_clearly():
    params = FwdParams(q_blocksize=256, kv_blocksize=256, num_stages=4)
    smem = attention_smem_bytes(256, 256, 256, "float32", num_stages=4)
    with pytest.raises(ValueError, match=r"flash_attention fwd .*q_blocksize.*sm90 allows 232448"):
        check_params(params, HOPPER, smem, "flash_attention fwd")
    check_params(FwdParams(q_blocksize=64, kv_blocksize=64, num_stages=2), HOPPER,
                 attention_smem_bytes(64, 64, 64, "float16", 2))
    check_shared_memory(10**8, DeviceFacts.cpu())  # the interpreter has no limit


# -- per-front utilities -----------------------------------------------------------------------------


def test_fingerprint_and_keys_agree_across_fronts(torch_fw, jax_fw):
    t, j = utils(torch_fw), utils(jax_fw)
    assert t.device_fingerprint() == j.device_fingerprint()
    assert t.device_fingerprint().split("|")[0] in ("cpu", "cuda", "rocm")
    assert t.get_device_platform() == j.get_device_platform() in ("cpu", "gpu")
    q = np.zeros((1, 8, 2, 16), np.float32)
    tk = t.config_key("attn", 1, q=torch_fw.asarray(q, "bfloat16"), causal=True)
    jk = j.config_key("attn", 1, q=jax_fw.asarray(q, "bfloat16"), causal=True)
    assert tk == jk and tk.text == jk.text
    assert '{"dtype":"bfloat16","shape":[1,8,2,16]}' in tk.text


def test_generate_attention_inputs_identical_across_fronts(torch_fw, jax_fw):
    t = utils(torch_fw).generate_attention_inputs(2, 5, 4, 8, "float32", seed=3, kv_seq_len=7, num_kv_heads=2)
    j = utils(jax_fw).generate_attention_inputs(2, 5, 4, 8, "float32", seed=3, kv_seq_len=7, num_kv_heads=2)
    assert t.keys() == j.keys() == {"query", "key", "value"}
    assert torch_fw.to_numpy(t["query"]).shape == (2, 5, 4, 8)
    assert torch_fw.to_numpy(t["key"]).shape == (2, 7, 2, 8)
    for name in t:
        assert np.array_equal(torch_fw.to_numpy(t[name]), jax_fw.to_numpy(j[name]))
    other = utils(jax_fw).generate_attention_inputs(2, 5, 4, 8, "float32", seed=4)
    assert not np.array_equal(jax_fw.to_numpy(other["query"]), jax_fw.to_numpy(j["query"]))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(scale=True), TypeError, "scale must be a float, got True"),  # was scale 1.0
    (dict(scale="2"), TypeError, "scale must be a float"),  # was parsed as 2.0
    (dict(scale=1e40), ValueError, "scale must be finite in float32"),  # was inf inputs
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(seq_len=True), TypeError, "seq_len must be an int, got a bool"),
    (dict(head_dim=2.0), TypeError, "head_dim must be an int"),
    (dict(num_kv_heads=-1), ValueError, "num_kv_heads must be >= 0"),
    (dict(seed=True), TypeError, "seed must be an int, got a bool"),  # was seed 1
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(dtype="float33"), TypeError, "dtype must be a dtype, got 'float33'"),  # jax: numpy's unnamed error
])
def test_generate_attention_inputs_arguments_are_checked(fw, kwargs, error, match):
    sizes = dict(batch_size=1, seq_len=2, num_heads=1, head_dim=2)
    with pytest.raises(error, match=match):
        utils(fw).generate_attention_inputs(**{**sizes, **kwargs})


def test_generate_attention_inputs_default_dtype(fw):
    # dtype=None: the framework's default float dtype (torch refused None, jax took float32).
    got = utils(fw).generate_attention_inputs(1, 2, 1, 2, None)
    want = utils(fw).generate_attention_inputs(1, 2, 1, 2, "float32")
    assert all(np.array_equal(fw.to_numpy(got[n]), fw.to_numpy(want[n])) and got[n].dtype == fw.dtype("float32")
               for n in want)


def test_generate_attention_inputs_numpy_scalars(fw):
    got = utils(fw).generate_attention_inputs(np.int64(1), 2, 1, 2, seed=np.int32(3), scale=np.float32(2))
    want = utils(fw).generate_attention_inputs(1, 2, 1, 2, seed=3, scale=2.0)
    assert all(np.array_equal(fw.to_numpy(got[n]), fw.to_numpy(want[n])) for n in want)


def test_abstractify(fw):
    u = utils(fw)
    tree = {"q": fw.asarray(np.ones((2, 3)), "bfloat16"), "rest": [fw.asarray(np.arange(4)), 5, "x"]}
    abstract = u.abstractify(tree)
    assert abstract["rest"][1:] == [5, "x"]
    assert tuple(abstract["q"].shape) == (2, 3) and str(abstract["q"].dtype).endswith("bfloat16")
    assert stable_json(abstract) == stable_json(tree)
    if fw.name == "torch":
        assert abstract["q"].device.type == "meta"
    else:
        import jax

        assert isinstance(abstract["q"], jax.ShapeDtypeStruct)


@pytest.mark.parametrize("length,chunk,axis", [(10, 4, 0), (8, 4, 1), (3, 5, -1)])
def test_chunk_round_trip(fw, length, chunk, axis):
    u = utils(fw)
    shape = [2, 2]
    shape[axis] = length
    x = np.arange(np.prod(shape)).reshape(shape) + 1
    chunked = fw.to_numpy(u.chunk_array(fw.asarray(x), chunk, axis=axis, pad_value=-7))
    num = -(-length // chunk)
    ax = axis % 2
    assert chunked.shape[ax:ax + 2] == (num, chunk)
    flat = chunked.reshape(shape[:ax] + [num * chunk] + shape[ax + 1:])
    assert (np.take(flat, range(length, num * chunk), axis=ax) == -7).all()
    back = u.unchunk_array(u.chunk_array(fw.asarray(x), chunk, axis=axis), length, axis=axis)
    assert np.array_equal(fw.to_numpy(back), x)


def test_chunk_array_bad_input(fw):
    """Out-of-range axes wrapped (axis=2 of a 2-D array chunked axis 0), a scalar or a 1-D
    unchunk input divided by zero, and a bad original_length dropped data or failed inside."""
    u = utils(fw)
    x = fw.asarray(np.arange(6.0).reshape(2, 3))
    for axis in (2, -3):
        with pytest.raises(ValueError, match=f"axis={axis} is out of range"):
            u.chunk_array(x, 2, axis=axis)
    with pytest.raises(ValueError, match="x must have at least one axis"):
        u.chunk_array(fw.asarray(np.float32(1.0)), 2)
    for flag in (True, fw.asarray(np.bool_(True))):  # a bool scalar tensor/array read as 1 before
        with pytest.raises(TypeError, match="chunk_size must be an int, got a bool"):
            u.chunk_array(x, flag)
    with pytest.raises(TypeError, match="axis must be an int"):
        u.chunk_array(x, 2, axis=1.0)
    chunked = u.chunk_array(x, 2, axis=1)  # (2, 2, 2): 3 columns padded to 4
    with pytest.raises(ValueError, match="x must have the two axes"):
        u.unchunk_array(fw.asarray(np.zeros(4)), 2)
    for axis in (2, -3):
        with pytest.raises(ValueError, match=f"axis={axis} is out of range"):
            u.unchunk_array(chunked, 3, axis=axis)
    for length in (-1, 5):
        with pytest.raises(ValueError, match=r"original_length must lie in \[0, 4\]"):
            u.unchunk_array(chunked, length, axis=1)
    with pytest.raises(TypeError, match="original_length must be an int"):
        u.unchunk_array(chunked, 3.0, axis=1)
    assert np.array_equal(fw.to_numpy(u.unchunk_array(chunked, 3, axis=-1)), fw.to_numpy(x))


def test_numpy_inputs(fw):
    """Both fronts take numpy arrays (torch crashed inside on them, and on reversed strides,
    bfloat16 numpy arrays, numpy dtypes and defaultdicts)."""
    import ml_dtypes

    u = utils(fw)
    x = np.arange(5.0, dtype=np.float32)[::-1]
    chunked = u.chunk_array(x, 2, pad_value=-1)
    assert fw.to_numpy(chunked).tolist() == [[4, 3], [2, 1], [0, -1]]
    assert fw.to_numpy(u.unchunk_array(np.asarray(fw.to_numpy(chunked), np.float32), 5)).tolist() == x.tolist()
    assert fw.to_numpy(u.chunk_array(x.astype(ml_dtypes.bfloat16), 5)).tolist() == [x.tolist()]
    np.testing.assert_allclose(fw.to_numpy(u.log_sum_exp(x, axis=0)), np.log(np.exp(x).sum()), rtol=1e-6)
    np.testing.assert_allclose(fw.to_numpy(u.safe_divide(np.ones(2, np.float32), x[:2])), [0.25, 1 / 3], rtol=1e-6)
    tree = collections.defaultdict(list, r=np.arange(5)[::-1], b=np.zeros((2, 3), ml_dtypes.bfloat16))
    abstract = u.abstractify(tree)
    assert type(abstract) is collections.defaultdict and abstract.default_factory is list
    assert tuple(abstract["r"].shape) == (5,) and str(abstract["r"].dtype).endswith("int64")
    assert tuple(abstract["b"].shape) == (2, 3) and str(abstract["b"].dtype).endswith("bfloat16")
    inputs = u.generate_attention_inputs(1, 4, 2, 8, dtype=np.float16)
    assert str(inputs["query"].dtype).endswith("float16")


def test_chunk_array_pad_value_is_checked(fw):
    """A string pad_value failed deep inside torch's new_full / jax's pad (and passed in torch when
    nothing was padded); for an integer array jax padded with 0 for NaN where torch raised, and a
    value past the dtype failed differently in each."""
    u = utils(fw)
    x, ints = fw.asarray(np.arange(3.0)), fw.asarray(np.arange(3, dtype=np.int32))
    for bad in ("1", None, [1], 1 + 2j, True):
        for size in (2, 3):  # padded or not
            with pytest.raises(TypeError, match="pad_value must be a"):
                u.chunk_array(x, size, pad_value=bad)
    for bad in (float("nan"), 1.5, 2**40):
        with pytest.raises(ValueError, match=r"pad_value must be an integer in \[-2147483648, 2147483647\]"):
            u.chunk_array(ints, 2, pad_value=bad)
    assert fw.to_numpy(u.chunk_array(ints, 2, pad_value=np.float32(-2.0))).ravel().tolist() == [0, 1, 2, -2]
    assert fw.to_numpy(u.chunk_array(x, 2, pad_value=fw.asarray(np.float32(7)))).ravel().tolist() == [0, 1, 2, 7]
    flags = u.chunk_array(fw.asarray(np.ones(3, bool)), 2, pad_value=False)
    assert fw.to_numpy(flags).ravel().tolist() == [True, True, True, False]
    assert fw.to_numpy(u.chunk_array(fw.asarray(np.zeros(3, bool)), 2, pad_value=1)).ravel().tolist()[-1]
    for bad in (2, 0.5):  # became True silently
        with pytest.raises(ValueError, match="pad_value must be a bool, 0 or 1 for bool arrays"):
            u.chunk_array(fw.asarray(np.ones(3, bool)), 2, pad_value=bad)


def test_chunk_array_big_int_pad_value_on_floats(fw):
    """An int pad_value past int32 for a float array raised OverflowError in jax (its pad parsed
    the int as an int32) where torch padded with its float value, and one past int64 failed in
    torch too. Both pad with the float now; an int past float64 is a ValueError."""
    u = utils(fw)
    for value in (2**40, -(2**40), 2**70):
        for dtype in ("float32", "bfloat16"):
            padded = fw.to_numpy(u.chunk_array(fw.asarray(np.arange(3.0), dtype), 2, pad_value=value))
            assert padded.ravel()[-1] == np.float32(value)
    half = fw.to_numpy(u.chunk_array(fw.asarray(np.arange(3.0), "float16"), 2, pad_value=2**40))
    assert half.ravel()[-1] == np.inf  # as a float past float16's range pads
    with pytest.raises(ValueError, match="pad_value must fit in a float64 for float32 arrays"):
        u.chunk_array(fw.asarray(np.arange(3.0)), 2, pad_value=10**400)


def test_chunk_array_numpy_pad_value(fw):
    """A numpy scalar or 0-d numpy array pad_value skipped the checks (it has a shape): for uint8
    np.int64(300) padded 44 in jax and failed inside torch's new_full, NaN and 2**40 padded 0 in
    jax, np.float32(1.5) padded 1 where 1.5 is refused, and torch's new_full took no np.array(7).
    Each is now taken as the Python number it holds."""
    u = utils(fw)
    ints, small = fw.asarray(np.arange(3, dtype=np.int32)), fw.asarray(np.arange(3, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"pad_value must be an integer in \[0, 255\] for uint8 arrays, got 300$"):
        u.chunk_array(small, 2, pad_value=np.int64(300))
    for bad in (np.float64("nan"), np.float32(1.5), np.int64(2**40), np.array(1.5)):
        with pytest.raises(ValueError, match=r"pad_value must be an integer in \[-2147483648, 2147483647\]"):
            u.chunk_array(ints, 2, pad_value=bad)
    for bad in (np.array("1"), np.complex64(1), np.bool_(True), np.array(True)):  # a bool only for bool arrays
        with pytest.raises(TypeError, match="pad_value must be a"):
            u.chunk_array(ints, 2, pad_value=bad)
    for good in (np.array(7), np.uint8(7), np.float64(7.0), np.array(7.0, np.float32)):
        assert fw.to_numpy(u.chunk_array(ints, 2, pad_value=good)).ravel().tolist() == [0, 1, 2, 7]
    assert fw.to_numpy(u.chunk_array(fw.asarray(np.arange(3.0)), 2, pad_value=np.array(-0.5))).ravel()[-1] == -0.5
    flags = u.chunk_array(fw.asarray(np.ones(3, bool)), 2, pad_value=np.array(False))
    assert fw.to_numpy(flags).ravel().tolist() == [True, True, True, False]


def test_log_sum_exp(fw):
    u = utils(fw)
    x = np.array([[1000.0, 1001.0, 1002.0], [-np.inf, -np.inf, -np.inf], [0.5, -np.inf, 2.0]])
    got = fw.to_numpy(u.log_sum_exp(fw.asarray(x), axis=1))
    ref = np.array([1002 + np.log1p(np.exp(-1) + np.exp(-2)), -np.inf, np.log(np.exp(0.5) + np.exp(2.0))])
    rtol = 1e-6  # fw.asarray feeds float32 (jax has no x64 here)
    np.testing.assert_allclose(got, ref, rtol=rtol)
    assert fw.to_numpy(u.log_sum_exp(fw.asarray(x), axis=1, keepdims=True)).shape == (3, 1)
    whole = fw.to_numpy(u.log_sum_exp(fw.asarray(x[::2])))
    assert whole.shape == () and np.isclose(whole, np.log(np.exp(x[::2] - 1002).sum()) + 1002, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_log_sum_exp_of_a_long_half_precision_row(fw, dtype):
    """The exponentials are summed in float32: 70,000 fp16 ones summed to inf (fp16 tops out at
    65,504), so a row of zeros gave inf for log(70,000) = 11.16. The result keeps x's dtype."""
    x = np.zeros((2, 70000))
    x[1, ::7] = -3.0
    got = utils(fw).log_sum_exp(fw.asarray(x, dtype), axis=1)
    assert str(got.dtype).endswith(dtype)
    want = np.log(np.exp(x).sum(axis=1))
    assert rel_error(fw.to_numpy(got).astype(np.float64), want) < TOLERANCE[dtype]


def test_log_sum_exp_keepdims_must_be_a_bool(fw):
    x = fw.asarray(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="keepdims must be a bool, got 'no'"):  # "no" kept the dims
        utils(fw).log_sum_exp(x, axis=1, keepdims="no")
    assert fw.to_numpy(utils(fw).log_sum_exp(x, axis=1, keepdims=np.True_)).shape == (2, 1)


def test_log_sum_exp_axis_is_checked(fw):
    """torch raised IndexError for an out-of-range axis and jax ValueError; jax read axis=True as
    1; torch read axis=() as every axis (jax: none). Both fronts now check axes alike."""
    u, x = utils(fw), np.array([[0.0, 1.0, 2.0], [-np.inf, 3.0, 4.0]], np.float32)
    for bad in (2, -3, (0, 2)):
        with pytest.raises(ValueError, match="axis=.* is out of range for an array of rank 2"):
            u.log_sum_exp(fw.asarray(x), axis=bad)
    with pytest.raises(ValueError, match="axis must name distinct axes"):
        u.log_sum_exp(fw.asarray(x), axis=(1, -1))
    for bad in (True, 1.0, "0"):
        with pytest.raises(TypeError, match="axis must be an int"):
            u.log_sum_exp(fw.asarray(x), axis=bad)
    np.testing.assert_array_equal(fw.to_numpy(u.log_sum_exp(fw.asarray(x), axis=())), x)
    both = fw.to_numpy(u.log_sum_exp(fw.asarray(x), axis=[0, -1], keepdims=True))
    assert both.shape == (1, 1) and np.isclose(both, np.log(np.exp(x).sum()), rtol=1e-6)


def test_safe_divide(fw):
    u = utils(fw)
    den = np.array([0.0, -1e-12, 1e-12, 2.0, -4.0])
    got = fw.to_numpy(u.safe_divide(fw.asarray(np.ones(5)), fw.asarray(den)))
    np.testing.assert_allclose(got, [1e10, -1e10, 1e10, 0.5, -0.25])


def test_safe_divide_floor_never_rounds_to_zero(fw):
    """The floor was cast to the denominator's dtype: 0 for integers and float16 (so 1 / 0 gave
    inf), and torch rounded it through float32 for float64."""
    u = utils(fw)
    got = u.safe_divide(1.0, 0)
    assert str(got.dtype).endswith("float32") and fw.to_numpy(got) == np.float32(1 / 1e-10)
    got = u.safe_divide(fw.asarray(np.array([0, 1, 2])), fw.asarray(np.array([0, -1, 4])))
    assert str(got.dtype).endswith("float32") and fw.to_numpy(got).tolist() == [0.0, -1.0, 0.5]
    half = u.safe_divide(fw.asarray(np.ones(2, np.float16)), fw.asarray(np.array([0, -1e-6], np.float16)))
    tiny = float(np.finfo(np.float16).tiny)  # 1e-10 is 0 in float16: the floor is its smallest normal
    assert str(half.dtype).endswith("float16") and fw.to_numpy(half).tolist() == [1 / tiny, -1 / tiny]
    with x64(fw):
        one, zero = fw.asarray(np.ones(1), "float64"), fw.asarray(np.zeros(1), "float64")
        assert fw.to_numpy(u.safe_divide(one, zero)).tolist() == [1.0 / 1e-10]
    with pytest.raises(ValueError, match="min_denominator must be positive"):
        u.safe_divide(1.0, 0, min_denominator=0)
    with pytest.raises(TypeError, match="min_denominator must be a real number"):
        u.safe_divide(1.0, 0, min_denominator="small")


def test_device_strings(fw):
    """Both fronts take a device as a string ("cpu"); jax failed with an AttributeError."""
    u = utils(fw)
    assert u.get_device_platform("cpu") == "cpu"
    assert u.device_fingerprint("cpu") == cpu_fingerprint()
    assert set(u.get_memory_usage("cpu")) == {"allocated", "reserved", "limit"}
    assert u.config_key("op", 1, device="cpu").device == cpu_fingerprint()


def test_assert_allclose(fw):
    u = utils(fw)
    a = fw.asarray(np.array([1.0, 2.0, np.nan]), "bfloat16")
    u.assert_allclose(a, fw.asarray(np.array([1.0, 2.0, np.nan]), "float32"))
    with pytest.raises(AssertionError, match="Mismatch"):
        u.assert_allclose(a, fw.asarray(np.array([1.0, 2.5, np.nan])))
    with pytest.raises(AssertionError, match="shape"):
        u.assert_allclose(a, fw.asarray(np.ones(2)))


def test_timer_and_memory(fw, capsys):
    u = utils(fw)
    with u.timer("nap") as t:
        time.sleep(0.02)
    assert 0.015 < t.seconds < 5 and "nap took" in capsys.readouterr().out
    with u.timer(verbose=False):
        pass
    assert capsys.readouterr().out == ""
    mem = u.get_memory_usage()
    assert set(mem) == {"allocated", "reserved", "limit"} and mem["limit"] > mem["allocated"] >= 0
    json.dumps(mem)  # plain ints


def test_log_sum_exp_over_an_empty_axis_is_minus_inf(fw):
    # The empty sum is 0, its log -inf, as torch.logsumexp and jax.nn.logsumexp give; torch raised
    # IndexError (amax of nothing), jax ValueError (max of nothing).
    u = utils(fw)
    x = fw.asarray(np.zeros((2, 0, 3), np.float32))
    for axis, shape in [(1, (2, 3)), (-2, (2, 3)), ((0, 1), (3,)), (None, ())]:
        got = fw.to_numpy(u.log_sum_exp(x, axis=axis))
        assert got.shape == shape and (got == -np.inf).all(), (axis, got)
    assert fw.to_numpy(u.log_sum_exp(x, axis=1, keepdims=True)).shape == (2, 1, 3)
    assert fw.to_numpy(u.log_sum_exp(x, axis=2)).shape == (2, 0)  # no rows: nothing to reduce


def test_log_sum_exp_of_integers_is_a_float(fw):
    # The result was cast back to the input's dtype: log(e + e^2 + e^3) = 3.41 came back as 3 (and
    # bools failed inside the subtraction); torch.logsumexp and jax.nn.logsumexp give floats.
    u = utils(fw)
    for dtype, x in [("int32", [[1, 2, 3], [0, 0, 0]]), ("int64", [[1, 2, 3], [0, 0, 0]]), ("bool", [[1, 0, 1]])]:
        got = u.log_sum_exp(fw.asarray(np.array(x, dtype)), axis=1)
        assert str(got.dtype).endswith("float32"), (dtype, got.dtype)
        want = np.log(np.exp(np.array(x, np.float64)).sum(axis=1))
        np.testing.assert_allclose(fw.to_numpy(got), want, rtol=1e-6)


def test_bad_device_arguments_are_named(fw):
    # torch raised RuntimeError ("Expected one of cpu, cuda, ...") for a misspelt device, an
    # AssertionError ("Torch not compiled with CUDA enabled") for "cuda" without CUDA, and a
    # TypeError naming device() for a float; jax names the device in a ValueError / TypeError.
    u = utils(fw)
    with pytest.raises(ValueError, match="device 'nonsense' names no"):
        u.get_device_platform("nonsense")
    with pytest.raises(TypeError, match="device must be None, .*got float"):
        u.device_fingerprint(1.5)
    if u.get_device_platform() == "cpu":  # no GPU seen by this front
        with pytest.raises(ValueError, match="device 'cuda' names no device"):
            u.device_fingerprint("cuda")


def test_safe_divide_floor_must_be_finite_in_the_dtype(fw):
    # An infinite floor (inf, or 1e6 rounded to float16) replaced every finite denominator, 2.0
    # included, and returned 0 everywhere.
    u = utils(fw)
    half = fw.asarray(np.array([1.0, 2.0], np.float16))
    with pytest.raises(ValueError, match=r"min_denominator must be at most 65504 .*got 1000000.0"):
        u.safe_divide(half, half, min_denominator=1e6)
    with pytest.raises(ValueError, match="min_denominator must be at most .*got inf"):
        u.safe_divide(1.0, fw.asarray(np.array([0.0, 2.0], np.float32)), min_denominator=float("inf"))
    got = u.safe_divide(half, half, min_denominator=1.5)
    assert fw.to_numpy(got).tolist() == [float(np.float16(1) / np.float16(1.5)), 1.0]
