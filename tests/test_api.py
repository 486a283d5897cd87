"""The two fronts expose the same names, arguments and defaults (README: "Same names, arguments
and defaults in both fronts"), except for the framework-specific extras listed here."""
import inspect
import types

import numpy as np
import pytest

# (module pair, function) -> {front: extra keyword-only arguments only that front has}
EXTRAS = {
    ("", "flash_attention_dropout_mask"): {"torch": {"device"}},  # jax arrays have no device= to choose
    ("", "grouped_matmul"): {"jax": {"platform"}},  # jax picks Pallas (TPU) or Triton
    ("", "transposed_grouped_matmul"): {"jax": {"platform"}},
    ("reference", "flash_attention_keep"): {"torch": {"device"}},
    ("utils", "generate_attention_inputs"): {"torch": {"device"}},
    ("tpu", "grouped_matmul"): {"jax": {"check_values"}},  # torch always checks (one host sync)
    ("tpu", "transposed_grouped_matmul"): {"jax": {"check_values"}},
}


def _modules():
    import ejkernel_jax
    import ejkernel_jax.pallas.tpu.grouped_matmul as jax_gmm
    import ejkernel_torch
    import ejkernel_torch.tpu

    jax_tpu = types.SimpleNamespace(
        blocksparse_attention=ejkernel_jax.pallas.tpu.blocksparse_attention.blocksparse_attention,
        grouped_matmul=jax_gmm.grouped_matmul, transposed_grouped_matmul=jax_gmm.transposed_grouped_matmul)
    return {
        "": (ejkernel_torch, ejkernel_jax),
        "reference": (ejkernel_torch.reference, ejkernel_jax.reference),
        "xla_utils": (ejkernel_torch.xla_utils, ejkernel_jax.xla_utils),
        "utils": (ejkernel_torch.utils, ejkernel_jax.utils),
        "tpu": (ejkernel_torch.tpu, jax_tpu),
    }


def _functions(module, names=None):
    if names is None:
        names = getattr(module, "__all__", None) or [
            n for n, f in vars(module).items()
            if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__]
    return {n: getattr(module, n) for n in names if inspect.isfunction(getattr(module, n, None))}


def _default(value):
    """torch.int32 and jnp.int32 are the same default; so are the other dtypes."""
    if value is inspect.Parameter.empty:
        return value
    try:
        import torch

        if isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")
        if isinstance(value, type) and hasattr(value, "dtype"):  # jnp.int32 and friends
            return np.dtype(value).name
    except TypeError:
        pass
    return value


def _params(fn, extras):
    return [(p.name, p.kind, _default(p.default)) for p in inspect.signature(fn).parameters.values()
            if p.name not in extras]


@pytest.mark.parametrize("where", ["", "reference", "xla_utils", "utils", "tpu"])
def test_fronts_have_the_same_signatures(where):
    torch_mod, jax_mod = _modules()[where]
    names = ["blocksparse_attention", "grouped_matmul", "transposed_grouped_matmul"] if where == "tpu" else None
    torch_fns, jax_fns = _functions(torch_mod, names), _functions(jax_mod, names)
    assert sorted(torch_fns) == sorted(jax_fns), f"{where or 'top level'}: the fronts export different functions"
    for name in sorted(torch_fns):
        extras = EXTRAS.get((where, name), {})
        for front, fn in (("torch", torch_fns[name]), ("jax", jax_fns[name])):
            for extra in extras.get(front, ()):  # the allowed extras exist, keyword-only
                assert inspect.signature(fn).parameters[extra].kind is inspect.Parameter.KEYWORD_ONLY
        assert _params(torch_fns[name], extras.get("torch", ())) == _params(jax_fns[name], extras.get("jax", ())), \
            f"{where + '.' if where else ''}{name}"
