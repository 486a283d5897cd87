"""Checks of the DLPack bridge with PyTorch/XLA tensors; run by scripts/test_torch_xla.sh.

Runs on XLA:CPU (PJRT_DEVICE=CPU). Each check prints PASS/FAIL; the exit status is the number
of failures. Tensors are made lazily on purpose: exporting an unsynced lazy tensor through
torch_xla's DLPack aborts the process, so a crash here means the bridge forgot to sync.
"""
from __future__ import annotations

import argparse
import sys
import traceback

if __name__ == "__main__":  # before importing torch_xla, which only scripts/test_torch_xla.sh's venv has
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch_xla

from ejkernel_torch.interop import jax_to_torch, to_jax

DEV = torch_xla.device()
failures: list[str] = []


def check(name):
    def run(fn):
        try:
            fn()
            print(f"PASS  {name}")
        except Exception:
            failures.append(name)
            print(f"FAIL  {name}\n{traceback.format_exc()}")
        return fn

    return run


def lazy(values, dtype=torch.float32) -> torch.Tensor:
    """An XLA tensor with a pending (unsynced) graph behind it."""
    return torch.as_tensor(values, dtype=dtype).to(DEV) * 1


def buffer_ptr(t: torch.Tensor) -> int:
    return torch_xla._XLAC._unsafe_buffer_pointer(t)


@check("to_jax of a lazy XLA tensor: synced, zero-copy, exact")
def _():
    src = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    t = torch.as_tensor(src).to(DEV) * 2  # pending multiply
    a = to_jax(t)
    assert a.devices() == {jax.devices("cpu")[0]}, a.devices()
    assert a.unsafe_buffer_pointer() == buffer_ptr(t), "not zero-copy"
    np.testing.assert_array_equal(np.asarray(a), src * 2)


@check("to_jax dtypes (bit-exact), 64-bit kept without jax x64")
def _():
    rng = np.random.default_rng(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8, torch.bool):
        cpu = torch.as_tensor(rng.integers(0, 2, size=(3, 7))).to(dtype) if dtype == torch.bool else \
            torch.as_tensor(rng.standard_normal((3, 7)) * 50).to(dtype)
        a = to_jax(cpu.to(DEV) + 0 if dtype != torch.bool else cpu.to(DEV) | False)
        assert str(a.dtype) == str(cpu.dtype).removeprefix("torch."), (a.dtype, cpu.dtype)
        back = torch.from_numpy(np.asarray(a.astype(jnp.float32) if dtype == torch.bfloat16 else a).copy())
        want = cpu.to(torch.float32) if dtype == torch.bfloat16 else cpu
        assert torch.equal(back, want), dtype


@check("to_jax(copy=True) is independent; requires_grad tensors export detached")
def _():
    t = lazy([1.0, 2.0, 3.0])
    a = to_jax(t, copy=True)
    torch_xla.sync(wait=True)  # give t a buffer to compare with
    assert a.unsafe_buffer_pointer() != buffer_ptr(t)
    w = lazy([1.0, 2.0]).requires_grad_(True)
    np.testing.assert_array_equal(np.asarray(to_jax(w)), [1.0, 2.0])


@check("in-place update of the source after export leaves the jax array intact")
def _():
    t = lazy([1.0, 2.0, 3.0])
    a = to_jax(t)
    t.add_(10.0)
    torch_xla.sync(wait=True)
    np.testing.assert_array_equal(np.asarray(a), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(t.cpu().numpy(), [11.0, 12.0, 13.0])


@check("jax_to_torch: XLA in, XLA out, autograd vs the same function in torch, cached")
def _():
    f = jax_to_torch(lambda x, w: (jnp.tanh(x @ w), jnp.argmax(x, axis=1)))
    rng = np.random.default_rng(2)
    x0, w0 = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    x = torch.as_tensor(x0).to(DEV).requires_grad_(True)
    w = torch.as_tensor(w0).to(DEV).requires_grad_(True)
    y, idx = f(x, w)
    assert y.device.type == "xla" and idx.device.type == "xla", (y.device, idx.device)
    assert not idx.requires_grad
    (y * y).sum().backward()
    assert x.grad.device.type == "xla"
    xr, wr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (x0, w0))
    yr = torch.tanh(xr @ wr)
    (yr * yr).sum().backward()
    for got, want in ((y, yr), (x.grad, xr.grad), (w.grad, wr.grad)):
        got = got.detach().cpu().double()
        err = (got - want.detach()).norm() / want.detach().norm()
        assert torch.isfinite(got).all() and err < 1e-5, err
    assert torch.equal(idx.cpu(), torch.as_tensor(x0).argmax(1))
    before = f.cache_info()
    y2, _ = f(lazy(x0 + 1).requires_grad_(True), lazy(w0).requires_grad_(True))
    y2.sum().backward()
    after = f.cache_info()
    assert (after["traces"], after["backward_traces"]) == (before["traces"], before["backward_traces"]), after


@check("mixed XLA and cpu tensors: clear ValueError")
def _():
    f = jax_to_torch(lambda a, b: a + b)
    try:
        f(lazy([1.0]), torch.ones(1))
    except ValueError as err:
        assert "argument 'b' is on cpu" in str(err), err
    else:
        raise AssertionError("no error")


@check("ejkernel_torch.tpu.grouped_matmul on XLA tensors (Pallas interpret on XLA:CPU)")
def _():
    from ejkernel_torch import reference, tpu

    rng = np.random.default_rng(3)
    lhs0, rhs0 = rng.standard_normal((24, 16)).astype(np.float32), rng.standard_normal((3, 16, 8)).astype(np.float32)
    sizes = torch.tensor([10, 0, 12], dtype=torch.int32)
    lhs = torch.as_tensor(lhs0).to(DEV).requires_grad_(True)
    rhs = torch.as_tensor(rhs0).to(DEV).requires_grad_(True)
    out = tpu.grouped_matmul(lhs, rhs, sizes.to(DEV), tiling=(8, 8, 8))
    assert out.device.type == "xla"
    out.sum().backward()
    lr, rr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (lhs0, rhs0))
    want = reference.grouped_matmul(lr, rr, sizes)
    want.sum().backward()
    for got, ref in ((out, want), (lhs.grad, lr.grad), (rhs.grad, rr.grad)):
        got = got.detach().cpu().double()
        assert torch.isfinite(got).all() and (got - ref.detach()).norm() / ref.detach().norm() < 1e-5


@check("ejkernel_torch.tpu.blocksparse_attention on XLA tensors (dynamic mask, GQA), fwd + bwd")
def _():
    from ejkernel_torch import tpu

    rng = np.random.default_rng(4)
    q0, k0, v0 = (rng.standard_normal(s).astype(np.float32) for s in ((1, 16, 2, 8), (1, 16, 1, 8), (1, 16, 1, 8)))
    keep = torch.as_tensor(tpu.make_causal_mask((16, 16)))
    q, k, v = (torch.as_tensor(a).to(DEV).requires_grad_(True) for a in (q0, k0, v0))
    out = tpu.blocksparse_attention(q, k, v, mask=keep.to(DEV), block_sizes=tpu.BlockSizes(8, 8))
    assert out.device.type == "xla"
    out.sum().backward()
    # float64 reference: causal attention, kv head shared by both q heads
    qr, kr, vr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (q0, k0, v0))
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr.expand(-1, -1, 2, -1)) * 8**-0.5
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vr.expand(-1, -1, 2, -1))
    ref.sum().backward()
    for got, want in ((out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        got = got.detach().cpu().double()
        assert torch.isfinite(got).all() and (got - want.detach()).norm() / want.detach().norm() < 1e-5


# -- the call_jax route (what TPU tensors take), forced onto XLA:CPU -----------------------------------


@check("call_jax route: jax_to_torch in torch_xla's graph, autograd, int outputs, caching")
def _():
    from ejkernel_torch._interop import _xla

    _xla.set_route("graph")
    try:
        f = jax_to_torch(lambda x, w, scale: {"y": jnp.tanh(x @ w) * scale, "i": jnp.argmax(x, axis=1)})
        rng = np.random.default_rng(5)
        x0, w0 = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
        x, w = (torch.as_tensor(a).to(DEV).requires_grad_(True) for a in (x0, w0))
        out = f(x, w, 2.0)
        assert out["y"].device.type == "xla" and not out["i"].requires_grad
        (out["y"] ** 2).sum().backward()
        xr, wr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (x0, w0))
        yr = torch.tanh(xr @ wr) * 2.0
        (yr**2).sum().backward()
        for got, want in ((out["y"], yr), (x.grad, xr.grad), (w.grad, wr.grad)):
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all() and (got - want.detach()).norm() / want.detach().norm() < 1e-5
        assert torch.equal(out["i"].cpu(), torch.as_tensor(x0).argmax(1))
        before = f.cache_info()
        out2 = f(lazy(x0 - 1).requires_grad_(True), w, 2.0)
        out2["y"].sum().backward()
        after = f.cache_info()
        assert (after["traces"], after["backward_traces"]) == (before["traces"], before["backward_traces"]), after
    finally:
        _xla.set_route(None)


@check("call_jax route: ejkernel_torch.tpu ops (grouped_matmul, blocksparse_attention) fwd + bwd")
def _():
    from ejkernel_torch import reference, tpu
    from ejkernel_torch._interop import _xla

    _xla.set_route("graph")
    try:
        rng = np.random.default_rng(6)
        lhs0 = rng.standard_normal((24, 16)).astype(np.float32)
        rhs0 = rng.standard_normal((3, 16, 8)).astype(np.float32)
        sizes = torch.tensor([10, 0, 12], dtype=torch.int32)
        lhs, rhs = (torch.as_tensor(a).to(DEV).requires_grad_(True) for a in (lhs0, rhs0))
        out = tpu.grouped_matmul(lhs, rhs, sizes.to(DEV), tiling=(8, 8, 8))
        out.sum().backward()
        lr, rr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (lhs0, rhs0))
        want = reference.grouped_matmul(lr, rr, sizes)
        want.sum().backward()
        for got, ref in ((out, want), (lhs.grad, lr.grad), (rhs.grad, rr.grad)):
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all() and (got - ref.detach()).norm() / ref.detach().norm() < 1e-5

        q0, k0, v0 = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(3))
        q, k, v = (torch.as_tensor(a).to(DEV).requires_grad_(True) for a in (q0, k0, v0))
        att = tpu.blocksparse_attention(q, k, v, causal=True, block_sizes=tpu.BlockSizes(8, 8))
        att.sum().backward()
        qr, kr, vr = (torch.as_tensor(a, dtype=torch.float64).requires_grad_(True) for a in (q0, k0, v0))
        keep = torch.as_tensor(tpu.make_causal_mask((16, 16)))
        p = (torch.einsum("bqhd,bkhd->bhqk", qr, kr) * 8**-0.5).masked_fill(~keep, float("-inf")).softmax(-1)
        ref = torch.einsum("bhqk,bkhd->bqhd", p, vr)
        ref.sum().backward()
        for got, want in ((att, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all() and (got - want.detach()).norm() / want.detach().norm() < 1e-5
    finally:
        _xla.set_route(None)


print(f"\n{len(failures)} failed" + (f": {failures}" if failures else ""))
sys.exit(len(failures))
