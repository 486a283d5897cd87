"""torch.Tensor <-> jax.Array through DLPack: zero-copy, stream-ordered, dtype-exact.

The low-level converters used by :func:`ejkernel_torch.interop.to_jax`,
:func:`ejkernel_torch.interop.to_torch` and the ``jax_to_torch`` bridge.

Stream ordering (CUDA) follows the DLPack protocol, never a device sync:

* torch -> jax: ``S`` is the stream jax orders external buffers on
  (``Device.get_stream_for_external_ready_events``); an event recorded on torch's *current*
  stream is waited on by ``S`` (what ``tensor.__dlpack__(stream=S)`` does, done in
  :func:`cuda_capsule` without its per-call Python), and jax's buffer is defined on ``S``.
* jax -> torch: we ask for ``array.__dlpack__(stream=T)`` with ``T`` torch's *current* stream;
  jax makes ``T`` wait on the event that marks the buffer as defined.

Import uses jaxlib's ``dlpack_managed_tensor_to_buffer`` directly when it is there and passes
a self-check (it is what ``jax.dlpack.from_dlpack`` calls, minus ~15 us of Python and the
silent 64->32-bit cast); otherwise the public ``jax.dlpack.from_dlpack``.
"""
from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

# DLPack device types (dlpack.h).
_kDLCPU = 1
_kDLCUDA = 2

# -- dtypes ------------------------------------------------------------------------------

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)
_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _build_dtype_tables():
    t2j: dict[torch.dtype, np.dtype] = {}
    fp8: set[torch.dtype] = set()
    for name in _DTYPE_NAMES + _FP8_NAMES:
        td = getattr(torch, name, None)
        jd = getattr(jnp, name, None)
        if td is None or jd is None:
            continue
        t2j[td] = np.dtype(jd)
        if name in _FP8_NAMES:
            fp8.add(td)
    j2t = {v: k for k, v in t2j.items()}
    return t2j, j2t, frozenset(fp8)


TORCH_TO_JAX_DTYPE, JAX_TO_TORCH_DTYPE, _FP8_TORCH = _build_dtype_tables()
_FP8_JAX = frozenset(TORCH_TO_JAX_DTYPE[d] for d in _FP8_TORCH)
WIDE_TORCH_DTYPES = frozenset(
    d for d in (torch.int64, torch.float64, torch.complex128, getattr(torch, "uint64", None)) if d is not None
)
# What jax's 64-bit canonicalization makes of each wide dtype when x64 is off.
NARROW_TORCH_DTYPE = {
    d: n for d, n in ((torch.int64, torch.int32), (torch.float64, torch.float32),
                      (torch.complex128, torch.complex64), (getattr(torch, "uint64", None), getattr(torch, "uint32", None)))
    if d is not None and n is not None
}
INEXACT_JAX_DTYPES = frozenset(d for d in JAX_TO_TORCH_DTYPE if jnp.issubdtype(d, jnp.inexact))


class ConversionError(Exception):
    """Internal: carries (exception type, message) so callers can name the argument."""

    def __init__(self, exc_type: type[Exception], message: str):
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message

    def reraise(self, name: str):
        raise self.exc_type(f"{name}: {self.message}") from None


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def x64_context():
    """A context enabling jax 64-bit types for its duration (thread-local in jax)."""
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # older / newer spellings
        from jax.experimental import enable_x64 as ctx  # type: ignore[no-redef]
    return ctx(True)


# -- devices -------------------------------------------------------------------------------

_device_cache: dict[tuple[str, int | None], Any] = {}
_lock = threading.Lock()


_cpu_device = None


def _init_cpu_device():
    global _cpu_device
    _cpu_device = jax.devices("cpu")[0]
    return _cpu_device


def jax_device_for(device: torch.device):
    """The jax device holding the memory of a torch tensor on ``device`` (cpu or cuda:i)."""
    key = (device.type, device.index)
    dev = _device_cache.get(key)
    if dev is not None:
        return dev
    if device.type == "cpu":
        dev = jax.devices("cpu")[0]
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            gpus = jax.local_devices(backend="gpu")
        except RuntimeError:
            raise ConversionError(
                ValueError,
                f"tensor is on {device} but jax has no GPU backend "
                f"(jax devices: {jax.devices()}); install a CUDA build of jax or move the tensor to cpu",
            ) from None
        matches = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == index]
        if not matches:
            raise ConversionError(
                ValueError, f"tensor is on {device} but jax sees no GPU with that index (jax GPUs: {gpus})"
            )
        dev = matches[0]
    else:
        raise ConversionError(
            ValueError,
            f"tensor is on device {device!s}, which jax cannot address through DLPack "
            "(supported: cpu, cuda:i; move it with .cpu() / .cuda() first)",
        )
    with _lock:
        _device_cache[key] = dev
    return dev


_external_streams: dict[tuple[int, int], Any] = {}


def cuda_capsule(tensor: torch.Tensor, stream: int | None):
    """``tensor.__dlpack__(stream=stream)`` for a CUDA tensor, minus its per-call Python.

    Same protocol: work queued on torch's *current* stream is ordered before ``stream`` (the
    consumer's) by an event recorded on the former and waited on by the latter -- no host
    sync. The ExternalStream wrapper is cached per (device, stream); the event is fresh per
    call (re-recording a shared event from two threads could order the wrong work).
    """
    index = tensor.device.index
    if stream is None:  # the consumer names no stream to order on: settle torch's side first
        torch.cuda.current_stream(index).synchronize()
    else:
        current = torch.cuda.current_stream(index)
        ptr = current.cuda_stream
        if stream != ptr and not (stream == 1 and ptr == 0):
            key = (index, stream)
            ext = _external_streams.get(key)
            if ext is None:
                ext = torch.cuda.ExternalStream(stream, device=tensor.device)
                with _lock:
                    _external_streams[key] = ext
            event = torch.cuda.Event()
            event.record(current)
            ext.wait_event(event)
    return _to_dlpack(tensor)


def _torch_stream_ptr(index: int) -> int:
    """torch's current CUDA stream on device ``index`` as a DLPack stream integer."""
    ptr = torch.cuda.current_stream(index).cuda_stream
    # DLPack: 1 names the legacy default stream on CUDA; 0 is ambiguous and disallowed.
    return 1 if ptr == 0 else ptr


# -- jax import primitive (fast private path, public fallback) -------------------------------

def _public_import(tensor: torch.Tensor, jdev, copy: bool | None):
    if tensor.requires_grad:
        tensor = tensor.detach()
    # jax.dlpack.from_dlpack canonicalizes 64-bit dtypes when x64 is off (a silent
    # down-cast and a copy); run it with x64 on so dtypes are preserved bit-exactly.
    if tensor.dtype in WIDE_TORCH_DTYPES and not x64_enabled():
        with x64_context():
            return jax.dlpack.from_dlpack(tensor, copy=copy)
    return jax.dlpack.from_dlpack(tensor, copy=copy)


def _make_private_import():
    try:
        from jax._src.lib import _jax as _jaxlib  # type: ignore[attr-defined]
        from jax._src.lib import jaxlib_extension_version  # type: ignore[attr-defined]

        raw = _jaxlib.dlpack_managed_tensor_to_buffer
    except Exception:  # pragma: no cover - depends on the jaxlib build
        return None
    new_signature = jaxlib_extension_version >= 467

    def private_import(tensor: torch.Tensor, jdev, copy: bool | None):
        if tensor.is_cuda:
            dl_type = _kDLCUDA
            try:
                stream = jdev.get_stream_for_external_ready_events()
            except Exception:  # UNIMPLEMENTED on some runtimes: no ordering stream
                stream = None
            capsule = cuda_capsule(tensor, stream)
        else:
            # CPU: no stream to order, so the legacy exporter (no Python-level checks; 0.4 us
            # instead of 3.6 us for __dlpack__) hands over the same DLManagedTensor.
            dl_type, stream = _kDLCPU, None
            capsule = _to_dlpack(tensor)
        if new_signature:
            return raw(capsule, jdev, stream, copy, dl_type)
        return raw(capsule, jdev, stream, copy)

    return private_import


_import_impl = None


def _select_import():
    """Use the private primitive only if it behaves exactly like the public path."""
    global _import_impl
    private = _make_private_import()
    if private is not None:
        try:
            probe = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            cpu = jax.devices("cpu")[0]
            got = private(probe, cpu, None)
            ok = (
                isinstance(got, jax.Array)
                and got.dtype == np.float32
                and got.shape == (2, 3)
                and got.unsafe_buffer_pointer() == probe.data_ptr()
                and np.array_equal(np.asarray(got), probe.numpy())
                and got.devices() == {cpu}
            )
            if ok:
                _import_impl = private
                return private
        except Exception:
            pass
    _import_impl = _public_import
    return _public_import


def use_public_import(enabled: bool) -> None:
    """Force (True) the public ``jax.dlpack.from_dlpack`` path, or re-select (False). For tests."""
    global _import_impl
    if enabled:
        _import_impl = _public_import
    else:
        _select_import()


# -- fp8: native DLPack when both sides speak it, else a uint8 bit-cast ---------------------

_fp8_native: bool | None = None


def fp8_native() -> bool:
    global _fp8_native
    if _fp8_native is None:
        _fp8_native = _probe_fp8()
    return _fp8_native


def set_fp8_native(value: bool | None) -> None:
    """Override the fp8 route (True: native DLPack, False: uint8 bit-cast, None: probe). For tests."""
    global _fp8_native
    _fp8_native = value


def _probe_fp8() -> bool:
    try:
        bits = torch.arange(0, 120, 7, dtype=torch.uint8)
        for td in _FP8_TORCH:
            t = bits.view(td)
            a = tensor_to_jax(t, None, fp8_route="native")
            if a.dtype != TORCH_TO_JAX_DTYPE[td] or a.unsafe_buffer_pointer() != t.data_ptr():
                return False
            if not np.array_equal(np.asarray(a).view(np.uint8), bits.numpy()):
                return False
            back = array_to_torch(a, None, fp8_route="native")
            if back.dtype != td or not torch.equal(back.view(torch.uint8), bits):
                return False
        return True
    except Exception:
        return False


# -- layouts ------------------------------------------------------------------------------

def _is_stride_error(err: Exception) -> bool:
    msg = str(err)
    return "compact" in msg or "striding" in msg


# -- torch -> jax ---------------------------------------------------------------------------

def _unexportable(tensor: torch.Tensor) -> str | None:
    """Why a tensor has no memory to hand over, if that is why export failed."""
    if torch._is_functional_tensor(tensor):
        return (
            "the tensor is a functional tensor (torch.func.functionalize): it has no memory of its own to "
            "hand to JAX; call the JAX code outside functionalize"
        )
    try:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor(tensor)
    except Exception:  # pragma: no cover - private API moved
        wrapped = False
    if wrapped:
        return (
            "the tensor is a torch.func (vmap / grad / jacrev ...) wrapped tensor; JAX code cannot run under "
            "torch.func transforms -- use jax.vmap / jax.grad inside the JAX function instead"
        )
    try:
        legacy = torch._C._functorch.is_legacy_batchedtensor(tensor)
    except Exception:  # pragma: no cover - private API moved
        legacy = False
    if legacy:  # the backward's incoming grads under is_grads_batched=True / vectorize=True
        return (
            "the tensor is batched by torch's legacy vmap (torch.autograd.grad(is_grads_batched=True), "
            "torch.autograd.functional.jacobian/hessian(vectorize=True)), which JAX code cannot receive -- "
            "use vectorize=False (one backward per row), or jax.jacrev inside the JAX function"
        )
    if isinstance(tensor, torch._subclasses.FakeTensor):  # torch.export (non-strict) traces with these
        return (
            "the tensor is a FakeTensor (torch.export or another fake-tensor tracer): it has no data "
            "for JAX, and a JAX call cannot be traced into a torch graph; use torch.compile, which "
            "runs it eagerly between graphs"
        )
    if tensor.is_nested:  # torch's own error: "Internal error: NestedTensorImpl doesn't support sizes"
        return (
            "the tensor is a nested tensor (ragged: no one strided layout for DLPack); pass "
            ".to_padded_tensor(0) or its .unbind() components instead"
        )
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return f"the tensor is a {type(tensor).__name__} (a subclass without exportable storage)"
    return None


def check_tensor(tensor: torch.Tensor) -> None:
    """Raise ConversionError for tensors DLPack cannot carry (dtype, layout)."""
    if tensor.dtype not in TORCH_TO_JAX_DTYPE:
        raise ConversionError(
            TypeError,
            f"dtype {tensor.dtype} has no jax equivalent that DLPack can carry "
            f"(supported: {', '.join(sorted(str(d).removeprefix('torch.') for d in TORCH_TO_JAX_DTYPE))})",
        )
    if tensor.layout != torch.strided:
        if tensor.is_nested:  # jagged: .to_dense() does not apply to it
            raise ConversionError(TypeError, _unexportable(tensor))
        raise ConversionError(TypeError, f"layout {tensor.layout} is not supported; call .to_dense() first")


def tensor_to_jax(tensor: torch.Tensor, copy: bool | None, fp8_route: str | None = None):
    """torch.Tensor -> jax.Array. Raises ConversionError (no argument name) on bad input."""
    impl = _import_impl or _select_import()
    dtype = tensor.dtype
    if dtype not in TORCH_TO_JAX_DTYPE or tensor.layout != torch.strided:
        check_tensor(tensor)
    if tensor.is_conj() or tensor.is_neg():
        # A lazy conjugate / negation view: DLPack carries no such flag, so the values must be
        # materialised first, which is a copy.
        if copy is False:
            raise ConversionError(
                ValueError,
                "the tensor is a lazy conjugate or negated view; materialising it makes a copy, so copy=False "
                "cannot be honoured (call .resolve_conj() / .resolve_neg() first, or pass copy=None)",
            )
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor._is_zerotensor():
        # torch's efficient zeros have no memory: DLPack handed jax a null pointer, read as
        # garbage values (or a segfault). Materialised first, which is a copy.
        if copy is False:
            raise ConversionError(
                ValueError,
                "the tensor is a ZeroTensor (no memory to share); materialising it makes a copy, so "
                "copy=False cannot be honoured (call .clone() first, or pass copy=None)",
            )
        tensor, copy = tensor.clone(), None  # already an independent copy
    if tensor.is_xla:  # PyTorch/XLA: synced, then through torch_xla's DLPack
        from . import _xla

        return _xla.tensor_to_jax(tensor, copy)
    # After the XLA branch: torch_xla's tensors may be functional wrappers, which torch_xla exports.
    if torch._is_functional_tensor(tensor):  # DLPack exported a null pointer: garbage, or a segfault
        raise ConversionError(TypeError, _unexportable(tensor))
    jdev = _cpu_device or _init_cpu_device() if tensor.is_cpu else jax_device_for(tensor.device)
    if copy:
        # Copy on the torch side (jax 0.10's from_dlpack(copy=True) still aliases on CPU);
        # the clone is then owned by the jax array alone. On CUDA it is queued on torch's
        # current stream, which the DLPack hand-off below orders before jax's work.
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        copy = None

    if dtype in _FP8_TORCH and (fp8_route or ("native" if fp8_native() else "bitcast")) == "bitcast":
        if copy is False:
            raise ConversionError(
                ValueError,
                f"{dtype} crosses as a uint8 bit-cast with this torch/jax pair, which makes a copy; "
                "copy=False cannot be honoured",
            )
        bits = tensor_to_jax(tensor.view(torch.uint8), None)
        return jax.lax.bitcast_convert_type(bits, TORCH_TO_JAX_DTYPE[dtype])

    try:
        return impl(tensor, jdev, copy)
    except ConversionError:
        raise
    except Exception as err:
        if _is_stride_error(err):
            if copy is False:
                raise ConversionError(
                    ValueError,
                    f"shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())} is not a "
                    "(permuted) compact layout, which jax cannot alias; copy=False cannot be honoured "
                    "(pass copy=None to copy, or call .contiguous())",
                ) from None
            return impl(tensor.contiguous(), jdev, None)
        reason = _unexportable(tensor)
        if reason:
            raise ConversionError(TypeError, reason) from err
        if "aligned" in str(err) and copy is False:
            raise ConversionError(
                ValueError,
                f"data pointer {tensor.data_ptr():#x} (storage offset {tensor.storage_offset()}) is "
                f"not aligned as jax requires to alias it ({err}); copy=False cannot be honoured",
            ) from None
        if impl is not _public_import:
            # Something the fast path does not know (e.g. a producer quirk): the public
            # jax.dlpack.from_dlpack is the reference behaviour, so let it decide.
            try:
                return _public_import(tensor, jdev, copy)
            except Exception:
                pass
        raise


# -- jax -> torch ---------------------------------------------------------------------------

def check_array(array) -> None:
    if isinstance(array, jax.core.Tracer):
        raise ConversionError(
            TypeError,
            "got a traced value (inside jax.jit / grad / vmap); convert concrete arrays outside "
            "jax transformations, or wrap the whole function with jax_to_torch",
        )
    if getattr(array, "dtype", None) == jax.dtypes.float0:  # e.g. jax.grad(allow_int=True)'s
        raise ConversionError(TypeError, "got a float0 array (an integer input's gradient), which has no torch "
                                         "dtype; leave it out of what the function returns")
    if not isinstance(array, jax.Array):
        raise ConversionError(TypeError, f"expected a jax.Array, got {type(array).__name__}")
    # Not np.dtype(array.dtype): extended dtypes (typed PRNG keys) have none, and numpy's own
    # error named neither the argument nor the output leaf.
    if array.dtype not in JAX_TO_TORCH_DTYPE:
        raise ConversionError(
            TypeError, f"dtype {array.dtype} has no torch equivalent that DLPack can carry"
        )


def array_to_torch(array, copy: bool | None, fp8_route: str | None = None,
                   device: torch.device | None = None) -> torch.Tensor:
    """jax.Array -> torch.Tensor. Raises ConversionError (no argument name) on bad input.

    ``device``: only an XLA device changes anything (the result is imported by torch_xla onto
    it); otherwise the array's own device decides (cpu or cuda:i)."""
    if device is not None and device.type == "xla":
        from . import _xla

        return _xla.array_to_torch(array, copy, device)
    dtype = getattr(array, "dtype", None)
    if dtype not in JAX_TO_TORCH_DTYPE or not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer):
        check_array(array)
    if dtype in _FP8_JAX and (fp8_route or ("native" if fp8_native() else "bitcast")) == "bitcast":
        if copy is False:
            raise ConversionError(
                ValueError,
                f"{dtype} crosses as a uint8 bit-cast with this torch/jax pair, which makes a copy; "
                "copy=False cannot be honoured",
            )
        bits = jax.lax.bitcast_convert_type(array, jnp.uint8)
        return array_to_torch(bits, None).view(JAX_TO_TORCH_DTYPE[np.dtype(dtype)])
    try:
        dl_type, dl_id = array.__dlpack_device__()
    except BufferError as err:
        n = len(array.sharding.device_set) if hasattr(array, "sharding") else "?"
        if n != 1:
            raise ConversionError(
                ValueError,
                f"array is sharded over {n} devices; DLPack exchanges one device's buffer "
                "(jax.device_put it onto one device first)",
            ) from None
        raise ConversionError(
            ValueError,
            f"array lives on {next(iter(array.devices()))}, which torch cannot address through "
            f"DLPack ({err}); jax.device_put it onto a cpu or cuda device first",
        ) from None
    except Exception:
        if array.is_deleted():  # jax's own error here is "'NoneType' has no len()"
            raise ConversionError(
                ValueError, "the array has been deleted (array.delete(), or donated to a jitted call)"
            ) from None
        raise
    if dl_type == _kDLCUDA:
        try:
            stream = _torch_stream_ptr(dl_id)
        except Exception:
            if not torch.cuda.is_available():
                raise ConversionError(
                    ValueError, "array is on a CUDA device but this torch has no CUDA support"
                ) from None
            raise
        capsule = array.__dlpack__(stream=stream)
    elif dl_type == _kDLCPU:
        capsule = array.__dlpack__()
    else:
        raise ConversionError(ValueError, f"array is on DLPack device type {int(dl_type)}, not cpu or cuda")
    out = torch.from_dlpack(capsule)
    if copy:
        out = out.clone()
    return out

