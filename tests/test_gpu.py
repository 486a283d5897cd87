"""On a CUDA GPU: compiled kernels are correct, and torch-launched and jax-launched results are
bitwise identical for the same inputs (same plan -> same PTX). Skipped without a GPU."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error

pytestmark = pytest.mark.gpu


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _softmax_case(rng, shape):
    return dict(args=[rng.standard_normal(shape) * 3], op="softmax", kwargs={}, n_diff=1)


def _padded_case(rng, op, batch, seq, head_dim=None):
    n_pad = rng.integers(0, seq + 1, size=batch).astype(np.int32)
    n_pad[0] = 0
    if op == "padded_attention":
        args = [rng.standard_normal((batch, seq, head_dim)) for _ in range(3)] + [n_pad]
        n_diff = 3
    elif op == "padded_softmax_v":
        args = [rng.standard_normal((batch, seq, seq)), rng.standard_normal((batch, seq, head_dim)), n_pad]
        n_diff = 2
    else:
        args = [rng.standard_normal((batch, seq, seq)), n_pad]
        n_diff = 1
    return dict(args=args, op=op, kwargs={}, n_diff=n_diff)


def _cases(rng):
    cases = [_softmax_case(rng, s) for s in [(1, 1), (17, 127), (4096, 1024), (64, 32768), (8, 100_000)]]
    cases += [_padded_case(rng, "padded_softmax", 3, s) for s in (17, 300)]
    cases += [_padded_case(rng, "padded_softmax_v", 3, 300, d) for d in (24, 128)]
    cases += [_padded_case(rng, "padded_attention", 3, s, d) for s, d in [(17, 24), (1000, 64), (333, 128), (200, 256)]]
    return cases


def _run(fw, case, dtype):
    arrays = [fw.asarray(a, dtype if np.issubdtype(a.dtype, np.floating) else None) for a in case["args"]]
    op = getattr(fw.ops, case["op"])
    n = case["n_diff"]
    out = op(*arrays)
    cot = fw.asarray(np.random.default_rng(0).standard_normal(tuple(out.shape)), dtype)
    grads = fw.vjp(lambda *d: op(*d, *arrays[n:]), arrays[:n], cot)
    return [fw.to_numpy(out), *grads], [fw.to_numpy(a) for a in arrays], fw.to_numpy(cot)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_and_jax_are_bitwise_identical_on_gpu(torch_fw, jax_fw, rng, dtype):
    import jax

    assert jax.default_backend() == "gpu", "jax must see the GPU for this test"
    for case in _cases(rng):
        torch_results, inputs, cot = _run(torch_fw, case, dtype)
        jax_results, _, _ = _run(jax_fw, case, dtype)
        for i, (a, b) in enumerate(zip(torch_results, jax_results)):
            assert _bits(a) == _bits(b), (case["op"], [x.shape for x in inputs], i, np.max(np.abs(a - b)))
        # and the compiled kernels are right
        reference = getattr(ref, case["op"])
        assert rel_error(torch_results[0], ref.forward(reference, *inputs)) < TOLERANCE[dtype], case["op"]
        expected = ref.vjp(reference, inputs, cot, n_diff=case["n_diff"])
        for got, want in zip(torch_results[1:], expected):
            assert rel_error(got, want) < 3 * TOLERANCE[dtype], case["op"]


def test_interpreter_and_compiled_launches_share_a_process(torch_fw, rng):
    import torch

    import ejkernel_torch as ejk

    x = rng.standard_normal((33, 77)).astype(np.float32)
    expected = ref.forward(ref.softmax, x)
    for device in ("cpu", "cuda", "cpu", "cuda"):
        y = ejk.softmax(torch.from_numpy(x).to(device))
        assert y.device.type == device
        assert rel_error(y.cpu().numpy(), expected) < 1e-5


def test_jax_ops_follow_jax_default_device_to_the_cpu(rng):
    """On a GPU machine, jax.default_device(cpu) runs the jax ops on the CPU (the interpreter),
    where the GPU launch failed to lower: "MLIR translation rule ... not found for platform cpu"."""
    import jax
    import jax.numpy as jnp

    import ejkernel_jax

    x = rng.standard_normal((7, 33)).astype(np.float32)
    q = rng.standard_normal((1, 9, 2, 16)).astype(np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        y = ejkernel_jax.softmax(jnp.asarray(x))
        out = ejkernel_jax.flash_attention(*(jnp.asarray(q),) * 3, causal=True)
        assert next(iter(y.devices())).platform == "cpu"
    assert rel_error(np.asarray(y), ref.forward(ref.softmax, x)) < TOLERANCE["float32"]
    assert rel_error(np.asarray(out), ref.forward(ref.flash_attention, q, q, q, causal=True)) < TOLERANCE["float32"]
