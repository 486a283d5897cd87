"""On a CUDA GPU: after a plan's first launch the torch launcher launches its compiled kernel
directly (``ejkernel_torch.launch._compiled``), with the same results, and a tensor whose address
has another 16-byte alignment gets its own binary, as Triton's own launch would give it."""
import numpy as np
import pytest
import torch

import ejkernel_torch
from ejkernel_torch import launch as launch_mod
from tests import kernels_for_tests as kt
from tests.frameworks import registered_ops

pytestmark = pytest.mark.gpu


def _count_direct_launches(monkeypatch, key) -> list:
    calls = []
    run = launch_mod._compiled[key]

    def counted(*args):
        calls.append(1)
        return run(*args)

    monkeypatch.setitem(launch_mod._compiled, key, counted)
    return calls


def test_second_launch_is_direct_and_alignment_is_part_of_the_key(monkeypatch):
    plan = kt.half_plan(37)
    buffer = torch.arange(38, dtype=torch.float32, device="cuda")
    aligned, shifted = buffer[:37], buffer[1:]  # both contiguous; shifted starts 4 bytes in
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4

    (y,) = launch_mod.launch(plan, aligned)
    key = launch_mod._alignment_key(plan, (aligned,), (y,))
    assert key in launch_mod._compiled
    calls = _count_direct_launches(monkeypatch, key)
    (y2,) = launch_mod.launch(plan, aligned)
    assert calls == [1]
    np.testing.assert_array_equal(y2[:18].cpu().numpy(), np.arange(18, dtype=np.float32))

    (z,) = launch_mod.launch(plan, shifted)  # a new alignment: Triton's launch, then remembered
    assert calls == [1]
    assert launch_mod._alignment_key(plan, (shifted,), (z,)) in launch_mod._compiled
    np.testing.assert_array_equal(z[:18].cpu().numpy(), np.arange(1, 19, dtype=np.float32))
    (z2,) = launch_mod.launch(plan, shifted)
    np.testing.assert_array_equal(z2[:18].cpu().numpy(), np.arange(1, 19, dtype=np.float32))


def test_flash_attention_relaunch_is_bitwise_the_first(rng):
    q, k, v, dout = (torch.tensor(rng.standard_normal((2, 77, 4, 64)), dtype=torch.bfloat16, device="cuda")
                     for _ in range(4))
    results = []
    for _ in range(3):  # the first call compiles (or loads) through Triton, the others launch directly
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ejkernel_torch.flash_attention(*leaves, causal=True)
        out.backward(dout)
        results.append([out.detach().cpu()] + [t.grad.cpu() for t in leaves])
    for later in results[1:]:
        for a, b in zip(results[0], later):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_plain_eager_launches_keep_their_scratch_per_stream(rng, monkeypatch):
    """The public function's plain eager launches keep their kernels' scratch from launch to launch
    (``launch._kept_scratch``), one buffer a stream; a launch under CUDA graph capture allocates
    afresh (the graph's pool owns it). Every way gives the registered op's bits."""
    monkeypatch.setattr(launch_mod, "_kept", {})
    q, k, v = (torch.tensor(rng.standard_normal((2, 300, 4, 64)), dtype=torch.bfloat16, device="cuda")
               for _ in range(3))

    with registered_ops():  # not plain eager: the registered ops
        want = ejkernel_torch.flash_attention(q, k, v, causal=True)
    assert launch_mod._kept == {}
    first = ejkernel_torch.flash_attention(q, k, v, causal=True)
    if not launch_mod._kept:
        pytest.skip("this GPU's forward plan needs no scratch")
    kept = dict(launch_mod._kept)
    assert len(kept) == 1
    second = ejkernel_torch.flash_attention(q, k, v, causal=True)
    assert launch_mod._kept == kept  # the same buffer again
    assert torch.equal(first, want) and torch.equal(second, want)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = ejkernel_torch.flash_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    assert len(launch_mod._kept) == 2 and torch.equal(on_side, want)

    kept = dict(launch_mod._kept)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ejkernel_torch.flash_attention(q, k, v, causal=True)
    assert launch_mod._kept == kept  # nothing kept from the capture
    captured.zero_()
    graph.replay()
    assert torch.equal(captured, want)


def test_compiled_calls_launch_as_planned_where_triton_would_not_fuse(rng, monkeypatch):
    """With Triton's default fusion off (Triton 3.10's default), torch.compile, which does not
    forward ``enable_fp_fusion``, runs a fusing plan through the opaque op, and gives eager's bits."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    monkeypatch.delenv("TRITON_FORCE_DISABLE_FP_FUSION", raising=False)
    x = torch.from_numpy(rng.standard_normal((37, 300)).astype(np.float32)).cuda()
    want = ejkernel_torch.softmax(x)
    texts = []
    real = launch_mod.plan_from_text
    monkeypatch.setattr(launch_mod, "plan_from_text", lambda text: texts.append(text) or real(text))
    torch._dynamo.reset()
    got = torch.compile(ejkernel_torch.softmax, fullgraph=True)(x)
    assert texts, "the compiled softmax did not take the opaque op"
    assert torch.equal(got, want)
