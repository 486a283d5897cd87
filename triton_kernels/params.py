"""Kernel launch parameters a caller may override, and the rules that keep them launchable.

``FwdParams`` / ``BwdParams`` carry optional overrides (block sizes, warps, stages) for a plan;
``None`` means "let the plan decide". ``select_num_warps`` / ``select_num_stages`` are the
default heuristics, and ``check_shared_memory`` turns a config that cannot fit the device into a
clear ``ValueError`` before Triton fails at launch with an out-of-resources error.

``stable_json`` / ``short_hash`` give objects a textual identity that is the same in every
process and on every machine (unlike ``hash``), for config-cache keys and parameter hashes.
Standard library only: both fronts import this module.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .plan import DeviceFacts, next_power_of_2

# --------------------------------------------------------------------------------------------
# Stable identity
# --------------------------------------------------------------------------------------------


def _dtype_name_or_none(o: Any) -> str | None:
    """Name of ``o`` if it is a dtype of numpy, torch or jax (instance or scalar type), else None."""
    t = type(o)
    if isinstance(o, type):
        inner = getattr(o, "dtype", None)  # jnp.float32, ml_dtypes.bfloat16: carry a numpy dtype
        if isinstance(getattr(inner, "name", None), str):
            return inner.name
        return o.__name__ if (o.__module__ or "").startswith("numpy") else None
    if t.__module__ == "torch" and t.__name__ == "dtype":
        return str(o).removeprefix("torch.")
    if _is_numpy_dtype(o) and isinstance(getattr(o, "name", None), str):
        return o.name
    return None


def _is_numpy_dtype(o: Any) -> bool:
    """Whether ``o`` is a numpy dtype instance, without importing numpy. ml_dtypes >= 0.7 gives
    each of its dtypes a class of its own (``ml_dtypes.bfloat16``, a subclass of ``numpy.dtype``),
    so the class's module alone does not tell."""
    return any(c.__name__ == "dtype" and c.__module__ == "numpy" for c in type(o).__mro__)


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name shared by numpy, torch and jax: "float32", "bfloat16", "bool", ..."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    name = _dtype_name_or_none(dtype)
    if name is None:
        raise TypeError(f"not a dtype: {dtype!r}")
    return name


def _plain(o: Any, default: Callable[[Any], Any] | None) -> Any:
    """``o`` as JSON-able plain data, with a representation that does not depend on the process."""
    if o is None or isinstance(o, (bool, str)):
        return o
    if isinstance(o, enum.Enum):
        return _plain(o.value, default)
    if isinstance(o, int):
        return int(o)
    if isinstance(o, float):
        return float(o)
    if isinstance(o, Mapping):
        out = {}
        for k, v in o.items():
            if isinstance(k, enum.Enum):
                k = k.value
            # str only: JSON would write an int key 1 as "1", and {1: x} and {"1": x} share a key
            if not isinstance(k, str):
                raise TypeError(f"stable_json: mapping keys must be str, got {k!r}")
            out[k] = _plain(v, default)
        if len(out) != len(o):  # an enum key and its value
            raise TypeError("stable_json: keys collide once enums are replaced by their values")
        return out
    if isinstance(o, (list, tuple)):
        return [_plain(v, default) for v in o]
    if isinstance(o, (set, frozenset)):
        items = [_plain(v, default) for v in o]
        try:
            return sorted(items)
        except TypeError:  # mixed types: order by their JSON text instead
            return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        fields = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
        return {"__class__": type(o).__qualname__, **_plain(fields, default)}
    if isinstance(o, functools.partial):
        return {
            "__partial__": _plain(o.func, default),
            "args": _plain(o.args, default),
            "kwargs": _plain(o.keywords, default),
        }
    name = _dtype_name_or_none(o)
    if name is not None:
        return name
    if hasattr(o, "shape") and hasattr(o, "dtype") and not isinstance(o, type):
        # Arrays (numpy, torch, jax, ShapeDtypeStruct, meta tensors) are keyed by their abstract
        # value, never their data, so a key can be built from tracers too.
        if getattr(o, "ndim", None) == 0 and type(o).__module__ == "numpy":
            return _plain(o.item(), default)  # numpy scalars are values, not arrays
        return {"shape": [int(d) for d in o.shape], "dtype": dtype_name(o.dtype)}
    if callable(o) and hasattr(o, "__qualname__"):
        # Module + qualified name only: a source path would differ between machines.
        return {"__callable__": f"{getattr(o, '__module__', '?')}.{o.__qualname__}"}
    if default is not None:
        return _plain(default(o), None)
    raise TypeError(f"stable_json: cannot make a stable key from {type(o).__name__} {o!r}")


def stable_json(obj: Any, default: Callable[[Any], Any] | None = None) -> str:
    """Deterministic compact JSON for ``obj`` (sorted keys; tuples as lists; arrays as shape+dtype).

    ``default`` converts leaves this function does not know, like ``json.dumps``'s hook.
    """
    return json.dumps(_plain(obj, default), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def short_hash(obj: Any, length: int = 16, default: Callable[[Any], Any] | None = None) -> str:
    """Hex prefix of the SHA-256 of ``stable_json(obj)``: equal in every process and machine."""
    return hashlib.sha256(stable_json(obj, default).encode()).hexdigest()[:length]


# --------------------------------------------------------------------------------------------
# Parameter overrides
# --------------------------------------------------------------------------------------------

# Triton's tl.arange needs power-of-two extents, so block sizes are powers of two.
_POW2_FIELDS = ("blocksize_m", "blocksize_n", "blocksize_k", "q_blocksize", "kv_blocksize",
                "blocksize_heads", "blocksize_keys")


def _param_int(cls: str, name: str, value) -> int:
    """An integer field (Python's or numpy's, as other int options take them); bools refused."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{cls}.{name} must be an int or None, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{cls}.{name} must be an int or None, got {value!r}") from None


class _Params:
    """Shared behaviour of FwdParams/BwdParams (frozen dataclasses of optional ints)."""

    def __post_init__(self):
        cls = type(self).__name__
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            v = _param_int(cls, f.name, v)
            object.__setattr__(self, f.name, v)  # a numpy int as a Python one: params are cache keys and JSON
            if v < 1:
                raise ValueError(f"{cls}.{f.name} must be positive, got {v}")
            if f.name in _POW2_FIELDS and v & (v - 1):
                raise ValueError(f"{cls}.{f.name} must be a power of two, got {v}")
        if self.num_warps is not None and (self.num_warps & (self.num_warps - 1) or self.num_warps > 32):
            raise ValueError(f"{cls}.num_warps must be a power of two <= 32, got {self.num_warps}")

    def to_dict(self) -> dict[str, int]:
        """The fields that are set (``None`` fields are left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def field_names(cls) -> set[str]:
        # fields() of an instance: torch.compile (dynamo) cannot trace fields() of the class, so
        # a dict of params failed to compile where an instance did.
        return {f.name for f in dataclasses.fields(cls())}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = cls.field_names()
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def coerce(cls, value):
        """Accept an instance, a dict of fields or ``None`` (what ops take as ``fwd_params=``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"expected {cls.__name__}, a dict or None, got {type(value).__name__}")

    @classmethod
    def merge(cls, base, override):
        """Fields set in ``override`` win over ``base``; either may be ``None`` or a dict."""
        return cls(**{**cls.coerce(base).to_dict(), **cls.coerce(override).to_dict()})

    def stable_hash(self) -> str:
        """Same string in every process (``hash()`` of ``None`` fields is not, before 3.12)."""
        return short_hash([type(self).__name__, self.to_dict()])


@dataclass(frozen=True)
class FwdParams(_Params):
    """Optional forward-kernel overrides; ``None`` keeps the plan's choice."""

    blocksize_m: int | None = None
    blocksize_n: int | None = None
    blocksize_k: int | None = None
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    blocksize_heads: int | None = None
    blocksize_keys: int | None = None
    num_key_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class BwdParams(_Params):
    """Optional backward-kernel overrides; ``None`` keeps the plan's choice."""

    blocksize_m: int | None = None
    blocksize_n: int | None = None
    blocksize_k: int | None = None
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    @classmethod
    def from_fwd_params(cls, fwd: FwdParams | Mapping | None, scale: float = 0.5,
                        min_block: int = 16) -> "BwdParams":
        """Backward overrides derived from forward ones.

        The backward kernels keep more tiles live (dQ/dK/dV accumulators), so block sizes are
        scaled by ``scale`` (rounded down to a power of two, at least ``min_block``); warps and
        stages are kept. Fields unset in ``fwd`` stay unset.
        """
        fwd = FwdParams.coerce(fwd)
        out = {}
        for name in (f.name for f in dataclasses.fields(cls)):
            v = getattr(fwd, name)
            if v is None:
                continue
            if name in _POW2_FIELDS:
                scaled = max(1, int(v * scale))
                v = max(min(min_block, v), 1 << (scaled.bit_length() - 1))
            out[name] = v
        return cls(**out)


def op_params(cls, value, name: str, fields: tuple[str, ...] | None = None):
    """An op's ``fwd_params=``/``bwd_params=`` argument as ``cls``, or ``None`` when it overrides
    nothing (so plans, and their caches, stay exactly the defaults). Errors name ``name``.
    ``fields``: the only fields the op takes, if not all of ``cls``'s."""
    if value is None:  # the usual call, answered without building and scanning an empty instance
        return None
    try:
        params = cls.coerce(value) if fields is None else _coerce_fields(cls, value, fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    return params if params.to_dict() else None


def _coerce_fields(cls, value, fields: tuple[str, ...]):
    """``cls.coerce(value)`` for an op that takes only ``fields``: errors list those alone."""
    if isinstance(value, Mapping):
        unknown = set(value) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown, key=str)}; known: {sorted(fields)}")
    params = cls.coerce(value)
    unused = sorted(set(params.to_dict()) - set(fields))
    if unused:
        raise ValueError(f"field(s) {unused} do not apply; use {sorted(fields)}")
    return params


def encode_params(params: FwdParams | BwdParams | None) -> list[int] | None:
    """Params as a list of ints in field order (0 = unset): what a torch custom-op schema carries."""
    return None if params is None else [getattr(params, f.name) or 0 for f in dataclasses.fields(params)]


def decode_params(cls, encoded) -> FwdParams | BwdParams | None:
    if encoded is None:
        return None
    return cls(**{f.name: int(v) for f, v in zip(dataclasses.fields(cls), encoded) if v})


# --------------------------------------------------------------------------------------------
# Heuristics and the shared-memory rule
# --------------------------------------------------------------------------------------------

SMEM_LIMIT_ENV = "EJKERNEL_TRITON_SMEM_LIMIT"


def shared_memory_limit(facts: DeviceFacts) -> int:
    """Bytes of shared memory one program may use on ``facts``' device.

    ``EJKERNEL_TRITON_SMEM_LIMIT`` (bytes) lowers it, e.g. to plan for a smaller part; it is read
    by both fronts alike, so it never splits their plans.
    """
    limit = facts.shared_memory
    env = os.environ.get(SMEM_LIMIT_ENV)
    if env:
        try:
            limit = min(limit, int(env))
        except ValueError:
            raise ValueError(f"{SMEM_LIMIT_ENV} must be an integer number of bytes, got {env!r}") from None
    return limit


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def itemsize(dtype: Any) -> int:
    name = dtype_name(dtype)
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise TypeError(f"unknown dtype {name}") from None


def attention_smem_bytes(q_block: int, kv_block: int, head_dim: int, dtype: Any = "float16",
                         num_stages: int = 1) -> int:
    """Estimated shared memory of a flash-attention tile loop.

    The Q tile stays resident; K and V tiles are multi-buffered ``num_stages`` deep. Registers
    hold the accumulators, so they are not counted. An estimate, meant to reject configs that
    are far over the limit with a readable message rather than to predict Triton's allocator.
    """
    elements = q_block * head_dim + max(1, num_stages) * 2 * kv_block * head_dim
    return elements * itemsize(dtype)


def check_shared_memory(required: int, facts: DeviceFacts, what: str = "kernel config") -> None:
    """Raise ``ValueError`` naming ``what`` when ``required`` bytes exceed the device's limit."""
    limit = shared_memory_limit(facts)
    if required > limit:
        where = f"sm{facts.capability[0]}{facts.capability[1]}" if facts.capability else facts.platform
        raise ValueError(
            f"{what} needs about {required} bytes of shared memory, but {where} allows {limit}; "
            "use smaller block sizes or fewer stages"
        )


def select_num_warps(block_m: int, block_n: int, head_dim: int | None = None) -> int:
    """Warps for a ``block_m x block_n`` tile (x ``head_dim`` for attention-like loops).

    About one warp per 1024 elements of the largest live tile: small tiles do not leave warps
    idle, large ones do not spill registers. Clamped to 1..8 (16 rarely pays off in Triton).
    """
    tile = block_m * max(block_n, head_dim or 0)
    return max(1, min(8, next_power_of_2(max(1, tile // 1024))))


def select_num_stages(smem_per_stage: int, facts: DeviceFacts, max_stages: int | None = None,
                      fixed_smem: int = 0) -> int:
    """Most software-pipelining stages whose buffers fit shared memory.

    ``smem_per_stage`` is what each extra stage buffers, ``fixed_smem`` what stays resident.
    Pre-Ampere parts have no async copies, so more than 2 stages only costs memory there; the
    interpreter ignores stages, so CPU plans use 1. Raises ``ValueError`` when not even one
    stage fits.
    """
    if facts.is_cpu:
        return 1
    if max_stages is None:
        max_stages = 4 if facts.capability and facts.capability >= (8, 0) else 2
    limit = shared_memory_limit(facts)
    check_shared_memory(fixed_smem + smem_per_stage, facts, "one pipeline stage")
    fit = (limit - fixed_smem) // max(1, smem_per_stage)
    return int(max(1, min(max_stages, fit)))


MAX_TILE_NUMEL = 1 << 20  # Triton's limit on a tensor's elements (TRITON_MAX_TENSOR_NUMEL)


def check_tile_numel(what: str, *tiles: tuple[int, int]) -> None:
    """Every 2-D tile a config makes must be one Triton can hold, on every device."""
    for rows, cols in tiles:
        if rows * cols > MAX_TILE_NUMEL:
            raise ValueError(f"{what}: a {rows}x{cols} tile has {rows * cols} elements; Triton allows at most "
                             f"{MAX_TILE_NUMEL} per tensor")


def check_params(params: FwdParams | BwdParams, facts: DeviceFacts, smem_bytes: int,
                 what: str = "kernel config") -> None:
    """Validate overrides against the device: the config's shared memory must fit.

    Ops call this after merging user overrides into their plan and estimating the resulting
    shared memory (e.g. with ``attention_smem_bytes``).
    """
    check_shared_memory(smem_bytes, facts, f"{what} {params.to_dict()}")


__all__ = [
    "BwdParams", "FwdParams", "SMEM_LIMIT_ENV", "attention_smem_bytes",
    "MAX_TILE_NUMEL", "check_params", "check_shared_memory", "check_tile_numel", "decode_params", "dtype_name", "encode_params", "itemsize",
    "op_params", "select_num_stages",
    "select_num_warps", "shared_memory_limit", "short_hash", "stable_json",
]
