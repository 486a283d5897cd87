"""Test helpers: which precision the matmuls of our Pallas kernels ask for, seen three ways.

* ``kernel_dots``: the ``dot_general`` equations inside each ``pallas_call`` of a jaxpr (the
  kernel bodies, forward and backward), with their precision and operand dtypes;
* ``hlo_dot_precisions``: the ``stablehlo.dot_general`` ops of an interpret-mode lowering (what
  XLA:CPU / XLA:GPU actually runs off TPU);
* ``mosaic_matmuls``: the ``tpu.matmul`` ops of a TPU (Mosaic) lowering, decoded from the
  ``tpu_custom_call`` payloads. This uses jax internals; it returns None when they moved.

A float32 dot must say HIGHEST everywhere (XLA:GPU would otherwise run TF32, Mosaic its default
contraction precision); bf16 / f16 dots say DEFAULT (Mosaic: no precision attribute).
"""
from __future__ import annotations

import base64
import collections
import json
import re

import jax


def _sub_jaxprs(params):
    for p in params.values():
        for x in p if isinstance(p, (tuple, list)) else (p,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _dots(jaxpr, out):
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            precision = e.params["precision"]
            precision = tuple(p.name for p in precision) if isinstance(precision, tuple) else precision
            out.append((precision, tuple(str(v.aval.dtype) for v in e.invars)))
        for sub in _sub_jaxprs(e.params):
            _dots(sub, out)
    return out


def _kernels(jaxpr, out):
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            name = e.params.get("name") or getattr(e.params.get("name_and_src_info"), "name", "?")
            out[str(name)].append(_dots(e.params["jaxpr"], []))
        else:
            for sub in _sub_jaxprs(e.params):
                _kernels(sub, out)
    return out


def kernel_dots(fn, *args) -> dict[str, list[list[tuple]]]:
    """``{kernel name: [[(precision pair, operand dtypes), ...] per pallas_call]}`` of ``fn``."""
    return dict(_kernels(jax.make_jaxpr(fn)(*args).jaxpr, collections.defaultdict(list)))


def hlo_dot_precisions(text: str) -> list[tuple[str, str]]:
    """``[(precision, lhs element type)]`` of every ``stablehlo.dot_general`` in ``text``."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            p = re.search(r"precision = \[(\w+), (\w+)\]", line)
            t = re.search(r":\s*\(tensor<(?:[0-9]+x)*(\w+)>", line)
            out.append((f"{p.group(1)},{p.group(2)}" if p else "none", t.group(1) if t else "?"))
    return out


def mosaic_matmuls(text: str) -> list[str] | None:
    """The ``tpu.matmul`` lines of every Mosaic kernel in a TPU lowering, or None if the
    payload cannot be decoded with this jax version."""
    try:
        from jax._src import tpu_custom_call as tcc
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir
    except ImportError:
        return None
    lines = []
    try:
        for m in re.finditer(r'@tpu_custom_call\(.*?backend_config = "((?:[^"\\]|\\.)*)"', text):
            config = re.sub(r"\\([0-9A-Fa-f]{2})", lambda g: chr(int(g.group(1), 16)), m.group(1))
            body = base64.b64decode(json.loads(config)["custom_call_config"]["body"])
            ctx = mlir.make_ir_context()
            tcc.tpu.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            with ctx:
                module = ir.Module.parse(body)
                tcc.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
                lines += [ln.strip() for ln in str(module).splitlines() if "tpu.matmul" in ln]
    except Exception:  # noqa: BLE001 - internals changed: the caller skips this check
        return None
    return lines
