"""ejkernel_torch.interop: DLPack exchange (zero-copy proofs, dtypes, layouts, fp8, devices,
streams) and jax_to_torch (autograd vs the same function in torch, trace counting, pytrees,
torch.compile, bad input).

Zero-copy is proved by pointer equality (torch ``data_ptr()`` vs jax
``unsafe_buffer_pointer()``); bit-exactness by comparing raw bytes. GPU tests are marked
``gpu`` (skipped without CUDA); on a CUDA machine the ``device`` parametrization also runs the
CPU tests' CUDA twins.
"""
from __future__ import annotations

import collections
import contextlib
import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ejkernel_torch import interop
from ejkernel_torch._interop import _bridge, _convert
from ejkernel_torch.interop import jax_to_torch, to_jax, to_torch
from tests import frameworks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# torch dtype name -> jax dtype name; every one must cross zero-copy, bit-exact.
DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
]
FP8 = ["float8_e4m3fn", "float8_e5m2"]
WIDE = {"int64", "uint64", "float64", "complex128"}


def _random_tensor(name: str, shape=(3, 5), device="cpu", seed=0) -> torch.Tensor:
    """Random *bit patterns* (NaNs, infs, denormals included) of the given dtype."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, name)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=g) == 1).to(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return bits.view(dtype).to(device)


def _tbytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


def _jbytes(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).reshape(-1)


def _ptr(a) -> int:
    return a.unsafe_buffer_pointer()


def _x64(enabled: bool):
    return jax.enable_x64(True) if enabled else _Null()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _jax_device(device: str):
    return jax.devices("cpu")[0] if device == "cpu" else jax.devices("gpu")[0]


# =====================================================================================
# to_jax / to_torch
# =====================================================================================


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DTYPES)
def test_to_jax_is_zero_copy_and_bit_exact(name, device):
    t = _random_tensor(name, device=device)
    a = to_jax(t)
    assert a.dtype == jnp.dtype(name)  # 64-bit kept even with jax_enable_x64 off
    assert a.shape == tuple(t.shape)
    assert a.devices() == {_jax_device(device)}
    assert _ptr(a) == t.data_ptr()
    assert np.array_equal(_jbytes(a), _tbytes(t))
    back = to_torch(a)
    assert back.dtype == t.dtype and back.device == t.device
    assert back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DTYPES)
def test_to_torch_is_zero_copy_and_bit_exact(name, device):
    bits = _tbytes(_random_tensor(name, seed=1))
    np_val = bits.view(jnp.dtype(name)).reshape(3, 5)
    with _x64(name in WIDE):
        a = jax.device_put(np_val, _jax_device(device))
    assert a.dtype == jnp.dtype(name)
    t = to_torch(a)
    assert t.dtype == getattr(torch, name)
    assert t.device.type == device
    assert t.data_ptr() == _ptr(a)
    assert np.array_equal(_tbytes(t), bits)


@pytest.mark.parametrize("name", ["float64", "int64", "bool", "bfloat16"])
def test_public_import_path_is_equivalent(name, monkeypatch):
    """The jax.dlpack.from_dlpack fallback: same dtype (64-bit preserved), zero-copy, bits."""
    monkeypatch.setattr(_convert, "_import_impl", _convert._public_import)
    t = _random_tensor(name)
    a = to_jax(t)
    assert _convert._import_impl is _convert._public_import
    assert a.dtype == jnp.dtype(name)
    assert _ptr(a) == t.data_ptr()
    assert np.array_equal(_jbytes(a), _tbytes(t))


@pytest.mark.parametrize("route", ["native", "bitcast"])
@pytest.mark.parametrize("name", FP8)
def test_fp8_round_trip_every_bit_pattern(name, route, monkeypatch):
    monkeypatch.setattr(_convert, "_fp8_native", route == "native")
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(getattr(torch, name))
    a = to_jax(t)
    assert a.dtype == jnp.dtype(name)
    assert np.array_equal(np.asarray(a).view(np.uint8), np.arange(256, dtype=np.uint8))
    back = to_torch(a)
    assert back.dtype == t.dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    # jax reads the same numbers torch meant (same format on both sides, not just same bits)
    vals = torch.linspace(-8, 8, 33).to(getattr(torch, name))
    np.testing.assert_array_equal(np.asarray(to_jax(vals).astype(jnp.float32)), vals.float().numpy())
    if route == "native":
        assert _ptr(a) == t.data_ptr() and back.data_ptr() == t.data_ptr()
    else:
        with pytest.raises(ValueError, match="bit-cast"):
            to_jax(t, copy=False)
        with pytest.raises(ValueError, match="bit-cast"):
            to_torch(a, copy=False)


def test_fp8_native_probe_agrees_with_this_pair():
    """The probe's verdict is the route taken: native (zero-copy) or bit-cast (a copy)."""
    _convert.set_fp8_native(None)
    assert _convert.fp8_native() in (True, False)
    t = torch.ones(3, dtype=torch.float8_e4m3fn)
    a = to_jax(t)
    assert (_ptr(a) == t.data_ptr()) == _convert.fp8_native()


# -- layouts ------------------------------------------------------------------------------

_base = torch.arange(2 * 3 * 4 * 8, dtype=torch.float32).reshape(2, 3, 4, 8)
COMPACT_VIEWS = {
    "contiguous": lambda: _base,
    "transpose": lambda: _base.transpose(0, 3),
    "permute": lambda: _base.permute(2, 0, 3, 1),
    "mT": lambda: _base.mT,
    "leading-slice": lambda: _base[1:],  # offset 96 floats = 384 bytes, still 64-byte aligned
    "unsqueeze": lambda: _base.unsqueeze(2),
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 4),
}
NON_COMPACT_VIEWS = {
    "inner-slice": lambda: _base[:, :, :2],
    "step": lambda: _base[:, ::2],
    "column": lambda: _base[..., :1],
    "expand": lambda: torch.arange(3.0).reshape(3, 1).expand(3, 4),
    "broadcast-0d": lambda: torch.tensor(2.0).expand(2, 3),
    "diagonal": lambda: _base[0, 0].diagonal(),
    "permuted-slice": lambda: _base.permute(3, 1, 0, 2)[:, 1:],
}


@pytest.mark.parametrize("view", COMPACT_VIEWS)
def test_permuted_compact_layouts_are_zero_copy(view):
    t = COMPACT_VIEWS[view]()
    a = to_jax(t, copy=False)
    assert t.numel() == 0 or _ptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    # jax computes correctly on the foreign layout, and the way back keeps values.
    if t.ndim:
        np.testing.assert_array_equal(np.asarray(jnp.sum(a, axis=0)), t.sum(0).numpy())
    back = to_torch(a)
    assert torch.equal(back, t)


@pytest.mark.parametrize("view", NON_COMPACT_VIEWS)
def test_non_compact_layouts_copy_by_default_and_refuse_with_copy_false(view):
    t = NON_COMPACT_VIEWS[view]()
    a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert _ptr(a) != t.data_ptr()
    with pytest.raises(ValueError, match=r"to_jax: argument 'tensor'.*strides.*copy=False"):
        to_jax(t, copy=False)


def test_unaligned_offset_copies_or_refuses():
    t = torch.arange(10.0)[1:5]  # 4-byte offset: jax (CPU) only aliases 64-byte aligned data
    np.testing.assert_array_equal(np.asarray(to_jax(t)), t.numpy())
    with pytest.raises(ValueError, match="to_jax: argument 'tensor'.*aligned"):
        to_jax(t, copy=False)


@st.composite
def _strided_views(draw):
    """A permutation of a contiguous tensor, maybe sliced along one dim: (view, compact?)."""
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    t = t.permute(draw(st.permutations(list(range(ndim)))))
    if not draw(st.booleans()):
        return t, True
    d = draw(st.integers(0, ndim - 1))
    n = t.shape[d]
    start, step = draw(st.integers(0, n - 1)), draw(st.integers(1, 2))
    t = t[(slice(None),) * d + (slice(start, None, step),)]
    # Keeping the whole dim (start 0, full length) keeps a compact layout at offset 0.
    return t, t.shape[d] == n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_strided_views())
def test_any_strided_view_crosses_with_right_values(case):
    """Permutations of compact tensors alias; every view converts to the right values."""
    t, compact = case
    a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    if compact and t.storage_offset() == 0:
        assert _ptr(a) == t.data_ptr()
    assert torch.equal(to_torch(a), t)


# -- copy semantics, grad, async ----------------------------------------------------------


def test_copy_true_gives_independent_arrays():
    t = torch.arange(6.0)
    a = to_jax(t, copy=True)
    assert _ptr(a) != t.data_ptr()
    t.add_(100)
    np.testing.assert_array_equal(np.asarray(a), np.arange(6.0, dtype=np.float32))

    x = jnp.arange(6.0)
    u = to_torch(x, copy=True)
    assert u.data_ptr() != _ptr(x)
    u.add_(1)
    np.testing.assert_array_equal(np.asarray(x), np.arange(6.0, dtype=np.float32))


def test_zero_copy_shares_memory_both_ways():
    t = torch.zeros(4)
    a = to_jax(t)
    t[1] = 5.0
    assert float(a[1]) == 5.0  # same memory (which is why in-place writes need care)
    x = jnp.arange(4.0) * 2
    u = to_torch(x)
    assert u.data_ptr() == _ptr(x)


def test_requires_grad_tensor_is_exported_detached_without_copy():
    w = torch.randn(4, 3, requires_grad=True)
    a = to_jax(w)
    assert _ptr(a) == w.data_ptr()
    assert w.requires_grad  # the tensor itself is untouched
    y = (w * 2).sum()
    y.backward()
    assert torch.equal(w.grad, torch.full((4, 3), 2.0))


def test_conjugate_view_is_resolved():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    a = to_jax(z.conj())
    np.testing.assert_array_equal(np.asarray(a), np.array([1 - 2j, 3 + 4j], np.complex64))
    np.testing.assert_array_equal(np.asarray(to_jax(torch.tensor([1.0, -2.0])._neg_view())), [-1.0, 2.0])


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_lazy_views_refuse_copy_false(view):
    # Materialising a lazy conjugate / negation is a copy, which copy=False forbids.
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    lazy = z.conj() if view == "conj" else z._neg_view()
    with pytest.raises(ValueError, match=r"to_jax: argument 'tensor'.*lazy conjugate or negated view.*copy=False"):
        to_jax(lazy, copy=False)
    assert to_jax(lazy.resolve_conj().resolve_neg(), copy=False) is not None  # materialised: shares memory


def test_zero_tensors_cross_as_zeros():
    """torch's efficient ZeroTensor has no memory (data_ptr 0) and DLPack exported the null pointer:
    to_jax returned garbage values and a jax_to_torch call on one segfaulted. Now materialised
    (a copy, so copy=False refuses), also as an incoming gradient."""
    z = torch._efficientzerotensor(2, 3)
    for copy in (None, True):
        np.testing.assert_array_equal(np.asarray(to_jax(z, copy=copy)), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"to_jax: argument 'tensor'.*ZeroTensor.*copy=False"):
        to_jax(z, copy=False)
    x = torch.ones(2, 3, requires_grad=True)
    plus = jax_to_torch(lambda a, b: a * 2 + b)
    assert torch.equal(plus(x.detach(), z), torch.full((2, 3), 2.0))
    (g,) = torch.autograd.grad(plus(x, torch.ones(2, 3)), x, grad_outputs=z)
    assert torch.equal(g, torch.zeros(2, 3))


def test_functional_tensors_are_refused_by_name():
    """Under torch.func.functionalize a tensor has no memory of its own (data_ptr 0), and DLPack
    exported the null pointer: to_jax returned garbage and a jax_to_torch call segfaulted. Now a
    TypeError naming the argument."""

    def convert(t):
        with pytest.raises(TypeError, match=r"to_jax: argument 'tensor': the tensor is a functional tensor"):
            to_jax(t)
        with pytest.raises(TypeError, match=r"argument 'x': the tensor is a functional tensor.*functionalize"):
            jax_to_torch(lambda x: x + 1)(t)
        return t * 2

    torch.func.functionalize(convert)(torch.ones(3))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused_by_name():
    """A nested tensor failed in DLPack export with torch's "Internal error: NestedTensorImpl
    doesn't support sizes. Please file an issue.": now a TypeError naming the argument."""
    ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"to_jax: argument 'tensor': the tensor is a nested tensor"):
        to_jax(ragged)
    with pytest.raises(TypeError, match=r"argument 'b': the tensor is a nested tensor.*to_padded_tensor"):
        jax_to_torch(lambda a, b: a)(torch.ones(2), ragged)
    # The jagged layout was refused as any other layout: "call .to_dense() first", which it lacks.
    jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"to_jax: argument 'tensor': the tensor is a nested tensor.*to_padded_tensor"):
        to_jax(jagged)


def test_deleted_jax_array_arguments_are_named():
    # jax.jit's "Array has been deleted with shape=float32[3]" (a RuntimeError) named no argument.
    x = jnp.arange(3.0)
    x.delete()
    with pytest.raises(ValueError, match=r"argument 'b' is a deleted jax.Array"):
        jax_to_torch(lambda a, b: a * b)(torch.ones(3), x)


def test_float0_outputs_say_why():
    # jax.grad(allow_int=True) gives an integer input's gradient as float0: "expected a jax.Array,
    # got TypedNdArray" named the leaf but not the reason.
    f = jax_to_torch(lambda x, i: jax.grad(lambda x, i: (x * i).sum(), argnums=(0, 1), allow_int=True)(x, i))
    with pytest.raises(TypeError, match=r"output leaf 1: got a float0 array .*no torch dtype"):
        f(torch.ones(3), torch.arange(3))


def test_to_torch_waits_for_async_jax_work():
    x = jax.device_put(jnp.full((512, 512), 1.0 / 512, jnp.float32), jax.devices("cpu")[0])
    y = x
    for _ in range(8):
        y = y @ x  # queued asynchronously on jax's CPU runtime
    t = to_torch(y)
    assert t.device.type == "cpu" and t.data_ptr() == _ptr(y)
    np.testing.assert_allclose(t.numpy(), np.full((512, 512), 1.0 / 512, np.float32), rtol=1e-5)


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_bad_input_errors_name_the_argument():
    with pytest.raises(TypeError, match="to_jax: argument 'tensor'.*complex32"):
        to_jax(torch.zeros(3, dtype=torch.complex64).to(torch.complex32))
    with pytest.raises(TypeError, match="to_jax: argument 'tensor' must be a torch.Tensor"):
        to_jax(np.zeros(3))
    with pytest.raises(ValueError, match="to_jax: argument 'tensor'.*meta.*cpu, cuda"):
        to_jax(torch.zeros(3, device="meta"))
    with pytest.raises(TypeError, match="to_jax: argument 'tensor'.*layout"):
        to_jax(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match="copy must be None, True or False"):
        to_jax(torch.zeros(3), copy="yes")
    for not_a_bool in (1, 0):  # equal to True / False, but not what the argument takes
        with pytest.raises(TypeError, match="copy must be None, True or False"):
            to_jax(torch.zeros(3), copy=not_a_bool)
        with pytest.raises(TypeError, match="copy must be None, True or False"):
            to_torch(jnp.zeros(3), copy=not_a_bool)
    with pytest.raises(TypeError, match="to_torch: argument 'array'.*expected a jax.Array"):
        to_torch(np.zeros(3))
    with pytest.raises(TypeError, match="to_torch: argument 'array'.*expected a jax.Array, got list"):
        to_torch([1.0, 2.0])
    with pytest.raises(TypeError, match="to_torch: argument 'array'.*int4"):
        to_torch(jnp.zeros(4, jnp.int4))
    # An extended dtype has no numpy dtype: numpy's "Cannot interpret 'key<fry>'" named nothing.
    with pytest.raises(TypeError, match="to_torch: argument 'array': dtype key<fry> has no torch equivalent"):
        to_torch(jax.random.key(0))
    with pytest.raises(TypeError, match="output leaf 1: dtype key<fry> has no torch equivalent"):
        jax_to_torch(lambda x: (x + 1, jax.random.key(0)))(torch.ones(2))


def test_to_torch_of_a_deleted_array_is_a_clear_error():
    # was "TypeError: object of type 'NoneType' has no len()" from inside jax
    a = jnp.ones(3) + 1
    a.delete()
    with pytest.raises(ValueError, match=r"to_torch: argument 'array': the array has been deleted"):
        to_torch(a)


def test_to_torch_inside_jit_is_a_clear_error():
    @jax.jit
    def f(x):
        to_torch(x)
        return x

    with pytest.raises(TypeError, match="to_torch: argument 'array'.*traced value"):
        f(jnp.ones(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_gpu_jax_is_a_clear_error():
    # A CPU-only torch cannot make CUDA tensors; check the device mapping the converters use.
    with pytest.raises(_convert.ConversionError, match="jax has no GPU backend|no GPU with that index") as info:
        _convert.jax_device_for(torch.device("cuda", 0))
    assert info.value.exc_type is ValueError


# =====================================================================================
# jax_to_torch
# =====================================================================================


def _f64(*shape, seed=0, requires_grad=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device).requires_grad_(requires_grad)


def _grads(loss_fn, tensors):
    for t in tensors:
        t.grad = None
    loss_fn().backward()
    return [None if t.grad is None else t.grad.clone() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_the_same_function_in_torch(device):
    """A nontrivial function (matmul, broadcasting, reductions, gather by int64 index, two
    outputs, a non-differentiable input), float64, vs torch autograd of its twin."""

    def jfn(params, x, idx, *, scale):
        h = jnp.tanh(x @ params["w"] + params["b"]) * scale
        picked = jnp.take(h, idx, axis=0)
        return {"y": jnp.exp(-picked) * jnp.sin(x[idx, :1]), "norm": jnp.sum(h * h, axis=-1)}

    def tfn(params, x, idx, *, scale):
        h = torch.tanh(x @ params["w"] + params["b"]) * scale
        picked = h.index_select(0, idx)
        return {"y": torch.exp(-picked) * torch.sin(x[idx, :1]), "norm": torch.sum(h * h, dim=-1)}

    bridged = jax_to_torch(jfn)
    params = {"w": _f64(6, 4, seed=1, device=device), "b": _f64(4, seed=2, device=device)}
    x = _f64(5, 6, seed=3, device=device)
    x_const = x.detach()  # a non-differentiable tensor input
    idx = torch.tensor([4, 0, 2, 2], device=device)
    cy, cn = _f64(4, 4, seed=4, requires_grad=False, device=device), _f64(5, seed=5, requires_grad=False, device=device)
    leaves = [params["w"], params["b"], x]

    for inp in (x, x_const):
        out_b = bridged(params, inp, idx, scale=1.5)
        out_t = tfn(params, inp, idx, scale=1.5)
        assert out_b["y"].device == x.device and out_b["y"].dtype == torch.float64
        torch.testing.assert_close(out_b["y"], out_t["y"])
        torch.testing.assert_close(out_b["norm"], out_t["norm"])
        g_b = _grads(lambda: (bridged(params, inp, idx, scale=1.5)["y"] * cy).sum()
                     + (bridged(params, inp, idx, scale=1.5)["norm"] * cn).sum(), leaves)
        g_t = _grads(lambda: (tfn(params, inp, idx, scale=1.5)["y"] * cy).sum()
                     + (tfn(params, inp, idx, scale=1.5)["norm"] * cn).sum(), leaves)
        for gb, gt in zip(g_b, g_t):
            if gt is None:
                assert gb is None
            else:
                torch.testing.assert_close(gb, gt)
        if inp is x_const:
            assert g_b[2] is None


def test_complex_gradients_follow_torch_convention():
    def jfn(z, w):
        return jnp.sum(jnp.abs(z * w + 1j) ** 2).real, z * jnp.conj(w)

    def tfn(z, w):
        return torch.sum(torch.abs(z * w + 1j) ** 2).real, z * torch.conj(w)

    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, dtype=torch.complex128, generator=g).requires_grad_(True)
    w = torch.randn(6, dtype=torch.complex128, generator=g).requires_grad_(True)
    ct = torch.randn(6, dtype=torch.complex128, generator=g)
    bridged = jax_to_torch(jfn)

    def loss(f):
        s, p = f(z, w)
        return s + (p * ct).real.sum()

    gb = _grads(lambda: loss(bridged), [z, w])
    gt = _grads(lambda: loss(tfn), [z, w])
    for a, b in zip(gb, gt):
        torch.testing.assert_close(a, b)


def test_float32_and_bfloat16_gradients_match_torch():
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(11)
        x = torch.randn(8, 16, generator=g).to(dtype).requires_grad_(True)
        w = torch.randn(16, 4, generator=g).to(dtype).requires_grad_(True)
        bridged = jax_to_torch(lambda x, w: jnp.sin(x) @ w)
        gb = _grads(lambda: bridged(x, w).float().square().sum(), [x, w])
        gt = _grads(lambda: (torch.sin(x) @ w).float().square().sum(), [x, w])
        assert bridged(x, w).dtype == dtype
        for a, b in zip(gb, gt):
            assert a.dtype == dtype
            # same math in a different order (XLA vs ATen): dtype-default tolerances
            torch.testing.assert_close(a, b)


def test_one_trace_per_shape_dtype_and_static_args():
    count = collections.Counter()

    def fn(x, y, *, mode, power=2):
        count["trace"] += 1
        out = x * y if mode == "mul" else x + y
        return out**power

    b = jax_to_torch(fn, static_argnames=("mode", "power"))
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for _ in range(5):
        b(x, y, mode="mul")
    assert count["trace"] == 1
    b(torch.randn(4, 3), torch.randn(4, 3), mode="mul")  # new values, same signature
    assert count["trace"] == 1
    b(torch.randn(5, 3), torch.randn(5, 3), mode="mul")  # new shape
    assert count["trace"] == 2
    b(x.double(), y.double(), mode="mul")  # new dtype
    assert count["trace"] == 3
    b(x, y, mode="add")  # new static value
    assert count["trace"] == 4
    b(x, y, mode="add", power=3)
    assert count["trace"] == 5
    for _ in range(3):
        b(x, y, mode="add", power=3)
        b(x, y, mode="mul")
    assert count["trace"] == 5
    torch.testing.assert_close(b(x, y, mode="add", power=3), (x + y) ** 3)
    assert b.cache_info()["traces"] == 5
    assert b.cache_info()["calls"] == 17


def test_static_args_equal_in_value_but_not_type_trace_apart():
    # As in jax.jit: 1 == True and 2 == 2.0 share a hash, but a function may branch on the type.
    def fn(x, n):
        return x + n + (100 if isinstance(n, bool) else 0) + (0.5 if isinstance(n, float) else 0)

    b = jax_to_torch(fn, static_argnames="n")
    x = torch.zeros(2)
    for n in (1, True, 2, 2.0):
        torch.testing.assert_close(b(x, n=n), torch.from_numpy(np.asarray(jax.jit(fn, static_argnames="n")(
            jnp.zeros(2), n=n))))
    assert b.cache_info()["traces"] == 4


def test_static_value_cache_is_bounded(monkeypatch):
    # A new static value on each call (a fresh object as `self`) grew the cache, and kept the
    # objects alive, without end; now the oldest entry goes, and comes back by tracing again.
    from ejkernel_torch._interop import _bridge

    monkeypatch.setattr(_bridge, "MAX_CACHE_ENTRIES", 3)
    b = jax_to_torch(lambda x, n: x * n, static_argnames="n")
    x = torch.arange(4.0)
    for n in range(1, 8):
        torch.testing.assert_close(b(x, n=n), x * n)
        assert b.cache_info()["entries"] == min(n, 3)
    traces = b.cache_info()["traces"]
    torch.testing.assert_close(b(x, n=7), x * 7)  # kept: no new trace
    torch.testing.assert_close(b(x, n=1), x * 1)  # evicted: traced again, same answer
    assert b.cache_info()["traces"] == traces + 1


def test_grad_path_traces_once_and_backward_is_cached():
    count = collections.Counter()

    def fn(x, w):
        count["trace"] += 1
        return jnp.tanh(x @ w)

    b = jax_to_torch(fn)
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    for _ in range(4):
        b(x, w).sum().backward()
    assert count["trace"] == 1  # the jitted jax.vjp traced fn once
    assert b.cache_info()["backward_traces"] == 1
    with torch.no_grad():
        b(x, w)
    assert count["trace"] == 2  # the no-grad path is its own (VJP-free) compilation
    for _ in range(3):
        b(x, w)
        with torch.no_grad():
            b(x, w)
    assert count["trace"] == 2


def test_python_numbers_are_traced_not_baked_in():
    count = collections.Counter()

    def fn(x, s):
        count["trace"] += 1
        return x * s

    b = jax_to_torch(fn)
    x = torch.ones(3)
    assert torch.equal(b(x, 2.0), torch.full((3,), 2.0))
    assert torch.equal(b(x, 3.0), torch.full((3,), 3.0))
    assert count["trace"] == 1


def test_no_grad_fast_path_skips_the_vjp():
    b = jax_to_torch(lambda x, y: x * y)
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = b(x, y)
    assert not out.requires_grad and out.grad_fn is None
    out = b(x.detach(), y.detach())
    assert not out.requires_grad
    entry = next(iter(b._cache.values()))
    assert entry.vjp_fwd == {} and entry.plain is not None
    out = b(x, y)
    assert out.requires_grad and entry.vjp_fwd


def test_pytrees_keywords_namedtuples_and_integer_outputs():
    Pair = collections.namedtuple("Pair", "first second")

    def fn(pair, rest, *, bias):
        s = pair.first + pair.second + rest[0] * rest[1]["k"] + bias
        return Pair(first=s, second=[jnp.argmax(s, axis=-1), s > 0, None])

    b = jax_to_torch(fn)
    g = torch.Generator().manual_seed(3)
    a, c, d, e = (torch.randn(2, 5, generator=g, requires_grad=True) for _ in range(4))
    out = b(Pair(a, c), (d, {"k": e}), bias=0.5)
    assert isinstance(out, Pair) and isinstance(out.second, list) and out.second[2] is None
    ref = a + c + d * e + 0.5
    torch.testing.assert_close(out.first, ref)
    assert out.second[0].dtype == torch.int32 and torch.equal(out.second[0], ref.argmax(-1).int())
    assert out.second[1].dtype == torch.bool and torch.equal(out.second[1], ref > 0)
    assert out.first.requires_grad
    assert not out.second[0].requires_grad and not out.second[1].requires_grad
    out.first.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(2, 5))
    torch.testing.assert_close(d.grad, e.detach())


def test_unused_float_outputs_get_zero_cotangents():
    b = jax_to_torch(lambda x: (jnp.sin(x), jnp.cos(x) * 3))
    x = _f64(7)
    s, _ = b(x)
    s.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_retain_graph_and_double_backward():
    b = jax_to_torch(lambda x: jnp.sum(x**3))
    x = _f64(4)
    y = b(x)
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    torch.testing.assert_close(first, 3 * x.detach() ** 2)
    # Double backward is not supported: it must fail, not silently drop second-order terms.
    y = b(x)
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.testing.assert_close(g, 3 * x.detach() ** 2)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g**2).sum() + x.sum(), x)


def test_double_backward_through_the_incoming_grads_fails_loudly():
    """A Hessian-vector-product style second derivative w.r.t. the grad_outputs ``v``: the
    gradient is linear in ``v``, so differentiating it w.r.t. ``v`` alone must not see a
    graph-less (None / zero) result."""
    b = jax_to_torch(jnp.sin)
    x, v = _f64(4), _f64(4, seed=1)
    (g,) = torch.autograd.grad(b(x), x, grad_outputs=v, create_graph=True)
    torch.testing.assert_close(g, torch.cos(x.detach()) * v.detach())
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), v, allow_unused=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward(inputs=[v])


def _fake_call_jax(fn, args, use_x64):
    """torch_xla's call_jax stood in by an eager run on CPU tensors (no torch_xla here)."""
    assert not use_x64
    leaves, tree = jax.tree_util.tree_flatten(args)
    jleaves = [to_jax(t) if isinstance(t, torch.Tensor) else t for t in leaves]
    return jax.tree_util.tree_map(to_torch, fn(*jax.tree_util.tree_unflatten(tree, jleaves)))


def test_xla_graph_route_refuses_double_backward(monkeypatch):
    """The call_jax route (TPU tensors) had no double-backward guard: its gradients carry no
    graph, so with create_graph=True the second-order term of (g**2).sum() vanished silently.
    Run here on CPU tensors, with call_jax faked."""
    from ejkernel_torch._interop import _xla

    monkeypatch.setattr(_xla, "_call_jax", _fake_call_jax)
    b = jax_to_torch(jnp.sin)
    x, v = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    treedef = jax.tree_util.tree_structure(((x,), {}))
    y = _xla.graph_call(b, _bridge._Entry(), treedef, (), [x], [0], [x], False, True)
    (g,) = torch.autograd.grad(y, x, grad_outputs=v, create_graph=True)
    torch.testing.assert_close(g, torch.cos(x.detach()) * v.detach())
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g**2).sum() + x.sum(), x)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), v, allow_unused=True)
    y = _xla.graph_call(b, _bridge._Entry(), treedef, (), [x], [0], [x], False, True)
    (g,) = torch.autograd.grad(y.sum(), x)  # a plain backward is unaffected
    torch.testing.assert_close(g, torch.cos(x.detach()))


def test_in_place_write_after_forward_fails_loudly():
    """Residuals live on the jax side and may alias torch memory: torch's check must fire."""
    b = jax_to_torch(lambda x, y: x * y)
    x, y = _f64(3), _f64(3, seed=1)
    y_data = y.detach()
    out = b(x, y_data)
    y_data.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("hooks", [False, True])
def test_outputs_the_backward_does_not_read_may_be_modified_in_place(hooks):
    """Every output was saved for backward, so any in-place op on one failed at backward
    ("modified by an inplace operation"), where torch's own ops allow it: relu_ after a bridged
    matmul, an update of x * y. Only outputs whose memory a residual shares are saved now."""
    x, w = _f64(2, 3), _f64(3, 4, seed=1)
    lin = jax_to_torch(lambda x, w: x @ w)
    ref = [t.detach().clone().requires_grad_() for t in (x, w)]
    with torch.autograd.graph.save_on_cpu() if hooks else contextlib.nullcontext():
        torch.relu_(lin(x, w)).sum().backward()
        torch.relu_(ref[0] @ ref[1]).sum().backward()
        out = jax_to_torch(jnp.exp)(x)  # the residual is exp(x) too, in a buffer of its own
        with torch.no_grad():
            out.add_(1)
        out.sum().backward()
    assert torch.allclose(w.grad, ref[1].grad)
    assert torch.allclose(x.grad, ref[0].grad + x.detach().exp())


def test_an_output_sharing_a_residual_buffer_is_saved():
    """Where jax hands back one buffer as an output and a residual, that output is saved, so an
    in-place write to it fails loudly instead of corrupting the gradient."""
    from ejkernel_torch._interop._bridge import _outputs_sharing

    residual = jnp.arange(4.0) + 1
    shared, other = to_torch(residual), torch.ones(4)
    assert _outputs_sharing([residual], [other, shared], None) == [shared]
    assert _outputs_sharing([], [other, shared], None) == []


def test_tensors_converted_inside_the_jax_function_are_refused():
    """to_jax inside a bridged function ran at trace time, so the tensor became a constant of the
    compiled function: w.grad stayed None, and after w.mul_(10) the grad path's cached trace kept
    the old w while the no-grad path, traced after the update, used the new one."""
    w = torch.full((3,), 2.0, requires_grad=True)
    b = jax_to_torch(lambda x: x * to_jax(w.detach()))
    x = torch.ones(3, requires_grad=True)
    msg = r"to_jax: argument 'tensor' is converted inside jax_to_torch\('.*<lambda>'\).*as an argument"
    with pytest.raises(TypeError, match=msg):
        b(x)
    with pytest.raises(TypeError, match=msg):
        b(x.detach())
    # Passed as an argument, the same tensor gets its gradient; to_jax works again outside.
    (jax_to_torch(lambda x, w: x * w)(x, w)).sum().backward()
    assert torch.equal(w.grad, torch.ones(3)) and torch.equal(x.grad, torch.full((3,), 2.0))
    assert np.array_equal(np.asarray(to_jax(w.detach())), np.full(3, 2.0, np.float32))


def test_inference_tensors_run_without_grad_and_are_named_with_grad():
    """Without grad nothing is saved, so inference tensors work. With grad, torch refused to save
    them only after the jax forward had run, naming no argument."""
    f = jax_to_torch(lambda x, w: jnp.tanh(x @ w))
    with torch.inference_mode():
        x = torch.randn(3, 4)
    w = torch.randn(4, 2, requires_grad=True)
    want = torch.tanh(x @ w.detach())
    with torch.no_grad():
        torch.testing.assert_close(f(x, w), want)
    with torch.inference_mode():
        y = f(x, w)
    assert y.is_inference() and not y.requires_grad
    torch.testing.assert_close(y, want)
    traces = f.cache_info()["traces"]
    with pytest.raises(TypeError, match=r"argument 'x' is an inference tensor .*\.clone\(\)"):
        f(x, w)
    assert f.cache_info()["traces"] == traces  # refused before any jax work
    f(x.clone(), w).sum().backward()
    torch.testing.assert_close(w.grad, x.T @ (1 - want**2))


def test_residuals_that_are_inputs_are_not_copied():
    b = jax_to_torch(lambda x, y: x * y)
    x, y = _f64(64), _f64(64, seed=1)
    out = b(x, y)
    leaves = jax.tree_util.tree_leaves(out.grad_fn.kept.pullback)
    ptrs = {_ptr(leaf) for leaf in leaves if isinstance(leaf, jax.Array)}
    assert {x.data_ptr(), y.data_ptr()} <= ptrs  # d(x*y) keeps x and y: the torch buffers
    out.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())


def test_recompute_fallback_gives_the_same_gradients(monkeypatch):
    monkeypatch.setattr(_bridge, "_residual_mode", False)
    b = jax_to_torch(lambda x, w: jnp.tanh(x @ w).sum(axis=0))
    x, w = _f64(4, 3), _f64(3, 2, seed=1)
    gb = _grads(lambda: (b(x, w) ** 2).sum(), [x, w])
    gt = _grads(lambda: (torch.tanh(x @ w).sum(0) ** 2).sum(), [x, w])
    for a, c in zip(gb, gt):
        torch.testing.assert_close(a, c)


def test_outputs_never_alias_inputs():
    b = jax_to_torch(lambda x, y: (x, y * 1))
    x, y = torch.arange(4.0), torch.arange(4.0)
    ox, oy = b(x, y)
    assert ox.data_ptr() != x.data_ptr() and oy.data_ptr() != y.data_ptr()
    ox.add_(1)
    assert torch.equal(x, torch.arange(4.0))


def test_x64_policy():
    b = jax_to_torch(lambda i, x: (i * 2, x.astype(jnp.float64) + jnp.float64(1e-10)))
    i, x = torch.tensor([2**40, 3]), torch.ones(2, dtype=torch.float64)
    oi, ox = b(i, x)
    assert oi.dtype == torch.int64 and oi.tolist() == [2**41, 6]
    assert ox.dtype == torch.float64 and ox[0].item() == 1 + 1e-10
    assert not jax.config.jax_enable_x64  # enabled for the call only
    narrow = jax_to_torch(lambda i: i * 2, x64=False)
    assert narrow(torch.tensor([3])).dtype == torch.int32  # jax's canonicalization


def test_x64_mode_is_scoped_to_the_call_and_its_thread():
    """Pins the documented scope: an int64 input turns 64-bit mode on for the whole of fn (its
    defaults widen, so a float32 result combined with one becomes float64), for this thread's
    call only: another thread running jax meanwhile keeps 32-bit defaults."""
    import threading

    started, seen = threading.Event(), []

    def fn(i, x):
        started.set()
        worker.join()  # the other thread runs jax while this call is in 64-bit mode
        return x[i] + jnp.linspace(0.0, 1.0, 2)

    def other():
        started.wait()
        seen.append((jax.config.jax_enable_x64, jnp.zeros(1).dtype))

    b, x = jax_to_torch(fn), torch.ones(4)
    worker = threading.Thread(target=other)
    worker.start()
    assert b(torch.tensor([0, 1]), x).dtype == torch.float64
    assert seen == [(False, jnp.float32)]
    assert not jax.config.jax_enable_x64
    assert b(torch.tensor([0, 1], dtype=torch.int32), x).dtype == torch.float32
    assert jax_to_torch(fn, x64=False)(torch.tensor([0, 1]), x).dtype == torch.float32


def test_x64_false_keeps_jax_global_64_bit_mode():
    """The docstring said x64=False canonicalizes 64-bit inputs to 32 bits, which holds only with
    jax's 64-bit mode off: x64 never turns a global jax_enable_x64 off (documented now)."""
    narrow = jax_to_torch(lambda i, x: (i * 2, x * 2, jnp.zeros(2)), x64=False)
    i, x = torch.tensor([3]), torch.ones(2, dtype=torch.float64)
    assert [t.dtype for t in narrow(i, x)] == [torch.int32, torch.float32, torch.float32]
    with jax.enable_x64(True):
        assert [t.dtype for t in narrow(i, x)] == [torch.int64, torch.float64, torch.float64]
    assert "with ``jax_enable_x64`` set globally" in jax_to_torch.__doc__


def test_x64_false_canonicalizes_64_bit_inputs_with_gradients():
    """x64=False used to hand jax 64-bit arrays with x64 off: x * y came back float64 and the
    backward of x[i] failed ('lax.scatter requires arguments to have the same dtypes')."""
    b = jax_to_torch(lambda x, y, i: (x * y, x[i], i + 1), x64=False)
    x, y = _f64(4), _f64(4, seed=1)
    i = torch.tensor([1, 1, 3], device=x.device)
    prod, picked, shifted = b(x, y, i)
    assert (prod.dtype, picked.dtype, shifted.dtype) == (torch.float32, torch.float32, torch.int32)
    torch.testing.assert_close(prod, (x * y).float())
    assert torch.equal(shifted, (i + 1).int())
    (prod.sum() + picked.sum()).backward()
    assert x.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad, y.detach().float().double() + torch.tensor([0.0, 2, 0, 1], dtype=torch.float64))
    torch.testing.assert_close(y.grad, x.detach().float().double())
    z = torch.ones(2, dtype=torch.complex128, device=x.device)
    assert b(z, z, i)[0].dtype == torch.complex64


def test_decorator_forms_and_metadata():
    @jax_to_torch
    def plain(x):
        """Doc."""
        return x + 1

    @jax_to_torch(static_argnames="n")
    def rep(x, n):
        return jnp.tile(x, n)

    assert plain.__doc__ == "Doc." and plain.__name__ == "plain"
    assert torch.equal(plain(torch.zeros(2)), torch.ones(2))
    assert rep(torch.ones(2), 3).shape == (6,)
    assert rep(torch.ones(2), n=2).shape == (4,)
    assert isinstance(rep, interop.BridgedFunction)


def test_decorated_methods_bind_self_like_functions():
    # Without __get__ the instance was never passed: m.scale(x) called fn(x) and failed inside jax.
    class Scaler:
        def __init__(self, factor):
            self.factor = factor

        @jax_to_torch(static_argnames="self")
        def scale(self, x):
            return x * self.factor

        @jax_to_torch
        def traced_self(self, x):
            return x

    x = _f64(4)
    assert torch.equal(Scaler(3.0).scale(x), 3 * x)
    assert torch.equal(Scaler(2.0).scale(x=x), 2 * x)
    assert isinstance(Scaler.scale, interop.BridgedFunction)  # looked up on the class: unbound
    assert torch.equal(Scaler.scale(Scaler(5.0), x), 5 * x)
    with pytest.raises(TypeError, match=r"argument 'self' is a Scaler.*static_argnames"):
        Scaler(1.0).traced_self(x)


def test_modules_holding_a_bridged_function_can_be_deep_copied():
    # copy.deepcopy (EMA weights, model clones) failed: "cannot pickle '_thread.lock' object".
    import copy

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(_f64(3, requires_grad=False))
            self.f = jax_to_torch(lambda x, w: jnp.sin(x) * w)

        def forward(self, x):
            return self.f(x, self.w)

    model = Scale()
    twin = copy.deepcopy(model)
    assert twin.w is not model.w and twin.f is model.f
    with torch.no_grad():
        twin.w.mul_(2)
    x = _f64(3, seed=1, requires_grad=False)
    torch.testing.assert_close(twin(x), 2 * model(x))
    twin(x).sum().backward()
    torch.testing.assert_close(twin.w.grad, torch.sin(x))


@jax_to_torch
def _sin_twice(x):
    return jnp.sin(x) * 2


def _scaled_sum(x, scale):
    return jnp.sum(x) * scale


class _HoldsBridged(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x, scale=2.0)


def test_bridged_functions_pickle_like_functions():
    """pickle.dumps (so torch.save of a module holding one, and multiprocessing) failed with
    "cannot pickle '_thread.lock' object"."""
    import io
    import pickle

    assert pickle.loads(pickle.dumps(_sin_twice)) is _sin_twice  # by reference, as functions
    x = torch.arange(3.0)
    b = jax_to_torch(_scaled_sum, static_argnames="scale", x64=False)
    b(x, scale=2.0)
    c = pickle.loads(pickle.dumps(b))  # rebuilt from the wrapped function, caches fresh
    assert c is not b and c.fn is _scaled_sum
    assert (c.static_argnames, c.x64, c.cache_info()["calls"]) == (("scale",), False, 0)
    buf = io.BytesIO()
    torch.save(_HoldsBridged(b), buf)
    buf.seek(0)
    m = torch.load(buf, weights_only=False)
    assert torch.equal(m(x), b(x, scale=2.0))
    with pytest.raises((pickle.PicklingError, AttributeError), match="<lambda>"):  # names fn
        pickle.dumps(jax_to_torch(lambda x: x))


def test_torch_func_transforms_fail_loudly():
    b = jax_to_torch(lambda x: jnp.sin(x) * 2)
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match=r"argument 'x': the tensor is a torch.func .*jax.vmap"):
        torch.func.vmap(b)(x)
    # torch's own error here said to override setup_context on our autograd.Function
    match = r"argument 'x' requires grad under a torch.func transform.*jax.grad / jax.vmap"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(lambda x: b(x).sum())(x)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.vjp(b, x)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jacrev(b)(x)
    w = torch.randn(3, requires_grad=True)  # unbatched, but autograd records under vmap
    with pytest.raises(NotImplementedError, match=r"argument 'x' requires grad under a torch.func transform"):
        torch.func.vmap(lambda r: b(w) * r)(x)
    # constants inside a transform still work
    c = x[0].clone()  # made outside: ops inside a transform return wrapped tensors
    torch.testing.assert_close(torch.func.grad(lambda r: (r * b(c)).sum())(x[1]), torch.sin(c) * 2)
    torch.testing.assert_close(torch.func.vmap(lambda r: b(c) * r)(x), torch.sin(c) * 2 * x)


def test_batched_gradients_fail_loudly():
    """torch.autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) hand the backward
    legacy-vmap batched gradients: it failed with "Cannot access data pointer of Tensor that
    doesn't have storage". The unbatched jacobian works."""
    b = jax_to_torch(lambda x: jnp.sin(x) * x[::-1])
    x = _f64(3)
    want = torch.autograd.functional.jacobian(lambda x: torch.sin(x) * x.flip(0), x)
    torch.testing.assert_close(torch.autograd.functional.jacobian(b, x), want)
    match = r"gradient of output leaf 0: the tensor is batched by torch's legacy vmap.*vectorize=False"
    with pytest.raises(TypeError, match=match):
        torch.autograd.grad(b(x), x, torch.eye(3, dtype=torch.float64), is_grads_batched=True)
    with pytest.raises(TypeError, match=match):
        torch.autograd.functional.jacobian(b, x, vectorize=True)


def test_forward_mode_dual_tensors_fail_loudly():
    """A dual tensor's tangent used to vanish (None) without requires_grad; with it torch's
    generic 'implement the jvp function' error came. Constants under a dual level still work."""
    import torch.autograd.forward_ad as fwd

    b = jax_to_torch(lambda c, x: jnp.sin(x) * c)
    c, x = _f64(3, requires_grad=False), _f64(3, seed=1, requires_grad=False)
    for requires_grad in (False, True):
        with fwd.dual_level(), pytest.raises(NotImplementedError, match=r"argument 'x' is a forward-mode"):
            b(c, fwd.make_dual(x.clone().requires_grad_(requires_grad), torch.ones_like(x)))
    with fwd.dual_level():
        torch.testing.assert_close(b(c, x), torch.sin(x) * c)


# -- torch.compile --------------------------------------------------------------------------


def test_autocast_is_not_applied_and_mixed_dtypes_promote_as_in_jax():
    """Pins the documented behaviour: under autocast the JAX function computes in the dtypes it
    is given (float32 stays float32, bfloat16 x float32 promotes to float32), with gradients."""
    f = jax_to_torch(lambda x, w: jnp.tanh(x @ w))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ torch.eye(4)  # autocast makes this matmul bfloat16
        mixed, plain = f(h, w), f(x, w)
    assert h.dtype == torch.bfloat16 and (mixed.dtype, plain.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(plain, torch.tanh(x @ w))
    torch.testing.assert_close(mixed, torch.tanh(h.float() @ w))
    (mixed.sum() + plain.sum()).backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32


def test_torch_compile_graph_breaks_and_stays_correct():
    bridged = jax_to_torch(lambda h, y: jnp.sin(h) * y)

    def model(x, y, f):
        h = torch.tanh(x) * 2
        return (f(h, y) + h).square().sum()

    x, y = _f64(5), _f64(5, seed=1)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    g_c = _grads(lambda: compiled(x, y, bridged), [x, y])
    g_t = _grads(lambda: model(x, y, lambda h, y: torch.sin(h) * y), [x, y])
    torch.testing.assert_close(compiled(x, y, bridged), model(x, y, lambda h, y: torch.sin(h) * y))
    for a, b in zip(g_c, g_t):
        torch.testing.assert_close(a, b)
    explained = torch._dynamo.explain(model)(x, y, bridged)
    assert explained.graph_break_count >= 1
    assert any("jax_to_torch" in str(r.reason) or "disable" in str(r.reason) for r in explained.break_reasons)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x, y, bridged)
    torch._dynamo.reset()


def test_compiled_autograd_graph_breaks_in_the_backward():
    """With compiled autograd, dynamo traces custom backwards: it stepped into the JAX pullback
    and failed inside jax with "flatten(): incompatible function arguments"."""
    bridged = jax_to_torch(lambda h, w: jnp.sin(h) * w)
    # config.patch, not monkeypatch: pytest's undo deletes the attribute, and a deleted torch
    # config is hidden ("compiled_autograd does not exist" in every later torch.compile).
    patch = torch._dynamo.config.patch(compiled_autograd=True)
    patch.__enter__()
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager")
    def step(x, w):
        loss = (bridged(torch.tanh(x), w) * 2).square().sum()
        loss.backward()
        return loss

    try:
        for seed in range(2):
            x, w = _f64(5, seed=seed), _f64(5, seed=seed + 10)
            want = torch.autograd.grad((torch.sin(torch.tanh(x)) * w * 2).square().sum(), [x, w])
            loss = step(x, w)
            torch.testing.assert_close(loss, (torch.sin(torch.tanh(x)) * w * 2).square().sum())
            torch.testing.assert_close(x.grad, want[0])
            torch.testing.assert_close(w.grad, want[1])
    finally:
        patch.__exit__(None, None, None)
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_jit_trace_is_refused_not_baked_in():
    # The trace used to hold the JAX call's outputs as constants: sin(0) for any input.
    bridged = jax_to_torch(jnp.sin)
    x = _f64(3, requires_grad=False)
    with pytest.raises(RuntimeError, match="cannot be recorded by torch.jit.trace"):
        torch.jit.trace(lambda x: bridged(x) * 2, torch.zeros_like(x))
    torch.testing.assert_close(bridged(x), torch.sin(x))


def test_fx_symbolic_trace_and_torch_export_errors_say_what_to_do():
    """symbolic_trace said "argument 'x' is a Proxy; ... or list the argument in static_argnames"
    and torch.export "the tensor is a FakeTensor (a subclass without exportable storage)"."""
    bridged = jax_to_torch(jnp.sin)

    class Model(torch.nn.Module):
        def forward(self, x):
            return bridged(x) * 2

    with pytest.raises(TypeError, match=r"argument 'x' is a torch.fx Proxy.*torch.fx.wrap") as err:
        torch.fx.symbolic_trace(Model())
    assert "static_argnames" not in str(err.value)
    with pytest.raises(TypeError, match=r"argument 'x': the tensor is a FakeTensor \(torch.export.*torch.compile"):
        torch.export.export(Model(), (torch.zeros(3),))


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_make_fx_is_refused_not_baked_in(tracing_mode):
    """make_fx(tracing_mode='real') recorded no DLPack exchange: its graph held the JAX call's
    outputs as a constant (sin(0) * 2 = 0 for any input), silently; 'fake' failed unclearly."""
    from torch.fx.experimental.proxy_tensor import make_fx

    bridged = jax_to_torch(jnp.sin)
    with pytest.raises(RuntimeError, match="cannot be recorded by make_fx"):
        make_fx(lambda x: bridged(x) * 2, tracing_mode=tracing_mode)(torch.zeros(3))
    x = _f64(3, requires_grad=False)
    torch.testing.assert_close(bridged(x), torch.sin(x))


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_bridge_bad_input_names_the_argument():
    def fn(x, y, opts=None):
        return x + y

    b = jax_to_torch(fn)
    x = torch.ones(3)
    with pytest.raises(ValueError, match=r"argument 'y' is on meta but argument 'x' is on cpu"):
        b(x, torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match=r"argument 'y'.*complex32"):
        b(x, torch.zeros(3, dtype=torch.complex64).to(torch.complex32))
    with pytest.raises(TypeError, match=r"argument 'opts'\['mode'\] is a str.*static_argnames"):
        b(x, x, opts={"mode": "fast"})
    with pytest.raises(ValueError, match=r"argument 'x'.*meta"):
        b(torch.ones(3, device="meta"), torch.ones(3, device="meta"))
    s = jax_to_torch(fn, static_argnames=("opts",))
    with pytest.raises(TypeError, match=r"static argument 'opts' must be hashable"):
        s(x, x, opts={"mode": "fast"})
    assert torch.equal(s(x, x, opts=("mode", "fast")), 2 * x)
    # was "argument 'opts' is a str ... list the argument in static_argnames" (it is listed)
    with pytest.raises(TypeError, match=r"multiple values for argument 'opts'"):
        s(x, x, "slow", opts="fast")
    with pytest.raises(ValueError, match="static_argnames names 'nope'"):
        jax_to_torch(fn, static_argnames=("nope",))
    # was accepted, then every call said "list the argument in static_argnames" (it is listed)
    with pytest.raises(ValueError, match=r"static_argnames names 'opts', the \*opts parameter"):
        jax_to_torch(lambda x, *opts: x, static_argnames="opts")
    # [0] was accepted for a function taking **kwargs (and ignored), 3 was "'int' object is not iterable"
    for names in ([0], 3):
        with pytest.raises(TypeError, match="static_argnames must be a string or strings"):
            jax_to_torch(lambda x, **kw: x, static_argnames=names)
    assert jax_to_torch(fn, static_argnames=None).static_argnames == ()
    with pytest.raises(TypeError, match="must be callable"):
        jax_to_torch(3)
    for x64 in ("no", 0, 1):  # read by truthiness, "no" turned 64-bit mode on
        with pytest.raises(TypeError, match="x64 must be None, True or False"):
            jax_to_torch(fn, x64=x64)
    assert jax_to_torch(fn, x64=np.False_).x64 is False


def test_static_torch_tensors_are_refused_not_baked_in():
    """A torch tensor hashes by identity, so one listed in static_argnames was accepted and baked
    into the trace: after an in-place update the call returned the old values, and a tensor
    requiring grad got no gradient (None), silently."""
    b = jax_to_torch(lambda x, m: x * jnp.asarray(m), static_argnames="m")
    x = torch.ones(3)
    for m in (torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, requires_grad=True), (1, torch.ones(3))):
        with pytest.raises(TypeError, match=r"static argument 'm' is or holds a torch.Tensor.*static_argnames"):
            b(x, m)
        with pytest.raises(TypeError, match=r"static argument 'm' is or holds a torch.Tensor"):
            b(x, m=m)
    assert b.cache_info()["traces"] == 0  # refused before anything is traced
    traced = jax_to_torch(lambda x, m: x * m)
    m = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    traced(x, m).sum().backward()
    torch.testing.assert_close(m.grad, x)


def test_traced_jax_values_get_a_clear_error():
    """A bridged function called from JAX code (inside jax.jit, or another jax_to_torch function)
    got "is a DynamicJaxprTracer; ... or list the argument in static_argnames", which would not help."""
    inner = jax_to_torch(jnp.sin)
    outer = jax_to_torch(lambda x: inner(x) * 2)
    for call in (lambda: outer(torch.ones(2)), lambda: jax.jit(inner)(jnp.ones(2))):
        with pytest.raises(TypeError, match=r"argument 'x' is a traced jax value .*call the JAX function directly") as err:
            call()
        assert "static_argnames" not in str(err.value)
    torch.testing.assert_close(jax_to_torch(lambda x: inner.fn(x) * 2)(torch.ones(2)), 2 * torch.sin(torch.ones(2)))


@pytest.mark.parametrize("grad", [False, True])
def test_outputs_that_are_not_arrays_are_named(grad):
    """A torch tensor or a string returned by the JAX function failed, with grad, in the bridge's
    inexact-output filter ("Cannot interpret 'torch.float32' as a data type", "data type 's' not
    understood"), and without grad as jax's "function plain at .../_bridge.py returned a value of
    type ...". Now a TypeError naming the bridged function and the output leaf."""
    x = torch.ones(2, requires_grad=grad)
    with pytest.raises(TypeError, match=r"<lambda>'\): output leaf 1 is a Tensor; .*jax arrays"):
        jax_to_torch(lambda a: (a, torch.ones(2)))(x)
    with pytest.raises(TypeError, match=r"output leaf 1 is a str"):
        jax_to_torch(lambda a: {"a": a * 2, "b": ["s"]})(x)
    out = jax_to_torch(lambda a: (a * 2, np.ones(2, np.float32), 3, 2.5, True))(x)  # numbers and numpy are fine
    assert [t.dtype for t in out] == [torch.float32, torch.float32, torch.int32, torch.float32, torch.bool]


def test_concretization_errors_name_the_argument():
    """jax's error for a traced value used as a Python one named the bridge's internals ("the
    function plain at .../_bridge.py ... depends on the value of the argument leaves[1]", "try using
    static_argnums"): a note now names the caller's argument and static_argnames."""

    def pad(x, cfg):
        return jnp.concatenate([x, jnp.zeros(cfg["n"])])

    for x in (torch.ones(3), torch.ones(3, requires_grad=True)):
        with pytest.raises(TypeError, match=r"argument leaves\[1\]") as info:
            jax_to_torch(pad)(x, {"n": 2})
        notes = getattr(info.value, "__notes__", [])
        assert any("argument 'cfg'['n']" in n and "static_argnames" in n for n in notes), notes
    padded = jax_to_torch(lambda x, n: jnp.concatenate([x, jnp.zeros(n)]), static_argnames="n")
    assert torch.equal(padded(torch.ones(3), 2), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))  # as the note says


def test_an_inner_jits_static_argument_is_named():
    """A jitted function with its own static argument, bridged without listing it, failed with
    jax's "Non-hashable static arguments are not supported ... DynamicJaxprTracer", naming nothing."""
    scaled = jax.jit(lambda x, n: x * n, static_argnames="n")
    for x in (torch.ones(3), torch.ones(3, requires_grad=True)):
        with pytest.raises(ValueError, match="Non-hashable static arguments") as info:
            jax_to_torch(lambda x, n: scaled(x, n=n))(x, 3)
        notes = getattr(info.value, "__notes__", [])
        assert any("static_argnames" in n and "argument 'n'" in n for n in notes), notes
    bridged = jax_to_torch(lambda x, n: scaled(x, n=n), static_argnames="n")
    assert torch.equal(bridged(torch.ones(3), 3), torch.full((3,), 3.0))  # as the note says


def test_python_ints_out_of_range_name_the_argument():
    """jax.jit's OverflowError named the bridge's internals ("argument path is leaves[1]")."""
    b = jax_to_torch(lambda x, n: x * n)
    x = torch.ones(2)
    for n in (2**31, -(2**31) - 1, 2**40):
        with pytest.raises(ValueError, match=rf"argument 'n' is the Python int {n}, which does not fit in int32.*x64=True"):
            b(x, n)
    with pytest.raises(ValueError, match=r"argument 'n' is the Python int .* does not fit in int64"):
        b(x.double(), 2**63)  # a float64 input turns 64-bit mode on for the call
    assert b(x, -(2**31)).tolist() == [-(2**31)] * 2
    assert b(x.double(), 2**40).tolist() == [2.0**40] * 2
    assert jax_to_torch(lambda x, n: x * n, x64=True)(x, 2**40).tolist() == [2.0**40] * 2
    assert b(x, True).tolist() == [1.0, 1.0]


def test_int_subclasses_out_of_range_name_the_argument():
    """An IntEnum (an int subclass) skipped the range check and got jax's OverflowError naming
    'leaves[1]'; within range it computes as its int value."""
    class Size(enum.IntEnum):
        BIG = 2**40
        SMALL = 3

    b = jax_to_torch(lambda x, n: x * n)
    x = torch.ones(2)
    with pytest.raises(ValueError, match=rf"argument 'n' is the Python int {2**40}, which does not fit in int32"):
        b(x, Size.BIG)
    assert b(x, Size.SMALL).tolist() == [3.0, 3.0]



_EXPECT_NAMED = """
def expect_named(cases, banned):
    # Each call must raise a ValueError naming its argument and device_put, none of ``banned``.
    for call, name in cases:
        try:
            call()
        except ValueError as e:
            message = str(e)
            assert f"argument '{name}'" in message and "device_put" in message, message
            assert not any(word in message for word in banned), message
        else:
            raise AssertionError(f"no error: {name}")
"""


_MULTI_DEVICE_SCRIPT = _EXPECT_NAMED + """
import jax, jax.numpy as jnp, numpy as np, torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ejkernel_torch.interop import jax_to_torch, to_torch

mesh = Mesh(np.array(jax.devices()), ("x",))
mul = jax_to_torch(lambda a, b: a * b)
for spec in (P("x"), P()):  # sharded, replicated
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, spec))
    cases = [(lambda: mul(torch.ones(8), x), "b"), (lambda: mul(torch.ones(8, requires_grad=True), b=x), "b"),
             (lambda: mul(x, x), "a"), (lambda: to_torch(x), "array")]
    expect_named(cases, ("leaves", "_make_", "output leaf"))
one = jax.device_put(jnp.arange(8.0), jax.devices()[0])
assert torch.equal(mul(torch.ones(8), one), torch.arange(8.0))
"""


def test_multi_device_jax_arrays_are_refused_by_name():
    """A jax.Array on several devices passed to a jax_to_torch function beside a tensor failed in
    jax.jit with "Received incompatible devices ... argument leaves[0] of BridgedFunction.
    _make_plain.<locals>.plain" (the bridge's internals); alone it ran, then failed on "output
    leaf 0". Now a ValueError naming the argument: single-device arrays only, device_put it.
    Two host CPU devices need a flag set before jax is imported: a subprocess."""
    frameworks.run_on_two_host_devices(_MULTI_DEVICE_SCRIPT)


_OTHER_DEVICE_SCRIPT = _EXPECT_NAMED + """
import jax, jax.numpy as jnp, torch
from ejkernel_torch.interop import jax_to_torch

d0, d1 = jax.devices()
mul = jax_to_torch(lambda a, b: a * b)
on1 = jax.device_put(jnp.arange(8.0), d1)
cases = [(lambda: mul(torch.ones(8), on1), "b"), (lambda: mul(torch.ones(8, requires_grad=True), b=on1), "b"),
         (lambda: mul(jax.device_put(jnp.ones(8), d0), on1), "b")]
expect_named(cases, ("leaves", "_make_"))
with jax.default_device(d1):
    uncommitted = jnp.arange(8.0)  # jax.jit moves it, as it does without the bridge
assert torch.equal(mul(torch.ones(8), uncommitted), torch.arange(8.0))
assert torch.equal(mul(on1, on1), torch.arange(8.0) ** 2)
"""


def test_jax_arrays_on_another_device_are_refused_by_name():
    """A single-device jax.Array committed to another device than the call's tensors (or another
    committed array) failed in jax.jit with "Received incompatible devices ... argument leaves[0]
    of BridgedFunction._make_plain.<locals>.plain" (the bridge's internals). Now a ValueError
    naming the argument and the device to device_put it onto."""
    frameworks.run_on_two_host_devices(_OTHER_DEVICE_SCRIPT)

# =====================================================================================
# CUDA: stream ordering, device mapping (run by the lead on a GPU machine)
# =====================================================================================


def _slow_then_fill(t: torch.Tensor, value: float):
    """On torch's current stream: spin the GPU ~50 ms, then write ``value`` everywhere."""
    torch.cuda._sleep(100_000_000)
    t.fill_(value)


@pytest.mark.gpu
def test_cuda_torch_side_stream_work_is_visible_to_jax():
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _slow_then_fill(x, 7.0)
        a = to_jax(x)  # jax's stream waits on an event recorded on `side`
    assert _ptr(a) == x.data_ptr()
    assert float(jnp.min(a)) == 7.0 and float(jnp.max(a)) == 7.0


@pytest.mark.gpu
def test_cuda_jax_results_are_visible_to_torch_side_stream():
    x = jax.device_put(jnp.full((2048, 2048), 1.0 / 2048, jnp.float32), jax.devices("gpu")[0])
    y = x
    for _ in range(20):
        y = y @ x  # long jax queue
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = to_torch(y)  # `side` waits on y's definition event
        s = t.sum()
    side.synchronize()
    assert t.data_ptr() == _ptr(y)
    assert abs(s.item() - 2048.0) < 1e-2


@pytest.mark.gpu
def test_cuda_bridge_runs_on_the_inputs_device_and_orders_streams():
    b = jax_to_torch(lambda x, y: jnp.sin(x) * y)
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 16, device="cuda", dtype=torch.float64, requires_grad=True)
    y = torch.zeros(1 << 16, device="cuda", dtype=torch.float64)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        with torch.no_grad():
            _slow_then_fill(x, 0.5)
        _slow_then_fill(y, 3.0)
        out = b(x, y)
        out.sum().backward()
    side.synchronize()
    assert out.device == x.device
    torch.testing.assert_close(out, torch.sin(x.detach()) * 3.0)
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) * 3.0)


@pytest.mark.gpu
def test_cuda_device_mapping_and_mixed_devices():
    for i in range(torch.cuda.device_count()):
        t = torch.ones(3, device=f"cuda:{i}")
        a = to_jax(t)
        (dev,) = a.devices()
        assert dev.platform == "gpu" and dev.local_hardware_id == i
        assert to_torch(a).device == t.device
    b = jax_to_torch(lambda x, y: x + y)
    with pytest.raises(ValueError, match=r"argument 'y' is on cuda:0 but argument 'x' is on cpu"):
        b(torch.ones(3), torch.ones(3, device="cuda:0"))


def test_interop_benchmark_runs_and_meets_its_copy_and_cache_goals(tmp_path):
    """benchmarks/interop.py end to end on CPU (few samples): every variant is timed, compact
    tensors cross with 0 bytes copied both ways, and warm calls never retrace."""
    from benchmarks import interop as bench

    out = tmp_path / "interop.json"
    result = bench.main(["--rounds", "1", "--per-round", "3", "--warmup", "2", "--out", str(out)])
    assert out.exists()
    assert all(t["median_us"] > 0 for t in result["timings"].values())
    assert {"bridge_grad_chain", "raw_dlpack_grad_chain"} <= set(result["timings"])
    for run in result["copies"].values():
        assert run["conversions"] > 0 and run["bytes_moved"] > 0 and run["bytes_copied"] == 0
    assert result["jit_cache"]["new_traces"] == 0 and result["jit_cache"]["hit_rate"] == 1.0


def _residual_count(shape) -> int:
    """Live jax float16 arrays of ``shape``: the residuals of ``_half_sin_sum`` below (its input,
    gradient and output are float32)."""
    import gc

    gc.collect()
    # The torch tensors here are on the CPU, so jax runs there: count that backend, not the default.
    return sum(1 for a in jax.live_arrays("cpu") if a.shape == shape and a.dtype == jnp.float16)


def _half_sin_sum(x):
    return jnp.sum(jnp.sin(x.astype(jnp.float16)).astype(jnp.float32))


def test_residuals_are_freed_by_backward_not_by_the_outputs():
    """Torch frees saved tensors at backward; the jax residuals lived until the outputs died (in
    a training loop, through the next step's forward). retain_graph keeps them for a second
    backward, and a third backward gets torch's own error."""
    shape = (37, 53)
    f = jax_to_torch(_half_sin_sum)
    x = torch.randn(shape, requires_grad=True)
    before = _residual_count(shape)
    y = f(x)
    assert _residual_count(shape) > before
    y.backward(retain_graph=True)
    first = x.grad.clone()
    assert _residual_count(shape) > before  # kept for the second backward
    x.grad = None
    y.backward()
    assert torch.equal(x.grad, first)
    assert _residual_count(shape) == before  # while y is still alive
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


@pytest.mark.parametrize("wrap", ["checkpoint", "checkpoint-reentrant", "save_on_cpu"])
def test_saved_tensor_hooks_keep_the_backward_working(wrap):
    """Activation checkpointing and save_on_cpu replace saved tensors as they are saved: the
    state the backward needs must not be tied to them."""
    import torch.utils.checkpoint as ckpt

    f = jax_to_torch(lambda x, w: jnp.tanh(x @ w) * 2.0)
    x, w = torch.randn(6, 5, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    want = torch.autograd.grad(f(x, w).square().sum(), [x, w])
    if wrap == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            loss = f(x, w).square().sum()
    else:
        loss = ckpt.checkpoint(lambda a, b: f(a, b).square().sum(), x, w, use_reentrant=wrap.endswith("reentrant"))
    loss.backward()  # reentrant checkpointing refuses torch.autograd.grad
    for g, e in zip((x.grad, w.grad), want):
        assert torch.equal(g, e)


@pytest.mark.parametrize("residuals", ["saved", "jax-fallback", "recompute"])
def test_checkpointing_frees_residuals_and_intermediates(residuals, monkeypatch):
    """Under non-reentrant checkpointing the jax residuals (and, through the call, its input
    tensors) stayed on ctx, outside the saved-tensor hooks: after the checkpointed forward the
    float16 residual and the region's intermediate ``h`` were alive, so it freed nothing."""
    import gc
    import weakref

    import torch.utils.checkpoint as ckpt

    if residuals == "jax-fallback":  # residual dtypes torch lacks: kept as jax arrays
        monkeypatch.setattr(_bridge, "_residual_tensors", lambda kept, device: None)
    if residuals == "recompute":
        monkeypatch.setattr(_bridge, "_residual_mode", False)
    shape = (37, 53)
    f = jax_to_torch(_half_sin_sum)
    refs = []

    def region(x):
        h = x * 2
        refs.append(weakref.ref(h))
        return f(h)

    x = torch.randn(shape, requires_grad=True)
    (want,) = torch.autograd.grad(f(x * 2), x)
    before = _residual_count(shape)
    y = ckpt.checkpoint(region, x, use_reentrant=False)
    gc.collect()
    assert refs[0]() is None
    assert _residual_count(shape) == before + (residuals == "jax-fallback")
    y.backward()
    assert torch.equal(x.grad, want)


def test_residuals_go_through_saved_tensor_hooks():
    packed = []
    f = jax_to_torch(_half_sin_sum)
    x = torch.randn(37, 53, requires_grad=True)
    (want,) = torch.autograd.grad(f(x), x)
    before = _residual_count((37, 53))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.dtype) or t.clone(), lambda t: t):
        y = f(x)
    assert packed.count(torch.float16) == 1  # the residual, which the hook replaced by a copy
    assert _residual_count((37, 53)) == before
    y.backward()
    assert torch.equal(x.grad, want)


def test_nested_static_values_equal_in_value_but_not_type_trace_apart():
    """An entry's functions keep its first call's static values, and the cache compared nested
    ones by ==: after a refused (True, 8), the valid (1, 8) was refused too; (1.0, 8) ran as (1, 8)."""
    def fn(x, window):
        if any(isinstance(w, bool) for w in window):
            raise TypeError(f"window sides must be ints, got {window!r}")
        return x + sum(window) + (0.5 if any(isinstance(w, float) for w in window) else 0)

    b = jax_to_torch(fn, static_argnames="window")
    x = torch.zeros(2)
    with pytest.raises(TypeError, match="must be ints"):
        b(x, window=(True, 8))
    assert torch.equal(b(x, window=(1, 8)), torch.full((2,), 9.0))
    assert torch.equal(b(x, window=(1.0, 8)), torch.full((2,), 9.5))
