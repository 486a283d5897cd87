"""On a CUDA GPU, torch only: the ops can be captured in CUDA graphs (``make_graphed_callables``,
forward and backward), as a training step under graphs or ``mode="reduce-overhead"`` does. The
value checks that read tensors (host syncs, illegal while capturing) step aside during capture,
and the captured graphs read group sizes, n_pad and cu_seqlens from the device: replayed on new
values they give the eager results, bit for bit. Skipped without a GPU."""
import gc

import numpy as np
import pytest
import torch

import ejkernel_torch as ejk
from tests.frameworks import TOLERANCE, rel_error

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def no_graphs_left_to_collect():
    """Collect dead graphs before each test captures. ``make_graphed_callables`` leaves its graphs
    in reference cycles, and torch no longer runs ``gc.collect()`` before a capture (unless
    ``TORCH_CUDAGRAPH_GC=1``): a collection that happens to run inside a later capture destroys
    a graph there, which invalidates that capture ("operation failed due to a previous error
    during capture"). Seen on an H100 when a worker ran these tests one after another."""
    gc.collect()


def _rand(rng, *shape, dtype=torch.bfloat16, grad=True):
    t = torch.tensor(rng.standard_normal(shape), dtype=torch.float32, device=DEVICE).to(dtype)
    return t.requires_grad_(grad)


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _cases(rng):
    """name -> (function, sample args, new args): the new args have other values (group sizes,
    n_pad, cu_seqlens too) and the same shapes."""
    qkv = lambda: [_rand(rng, 2, 300, 4, 64), _rand(rng, 2, 300, 2, 64), _rand(rng, 2, 300, 2, 64)]  # noqa: E731
    packed = lambda: [_rand(rng, 500, 4, 64) for _ in range(3)]  # noqa: E731
    single = lambda: [_rand(rng, 3, 200, 64) for _ in range(3)]  # noqa: E731
    gmm = lambda: [_rand(rng, 700, 128), _rand(rng, 4, 128, 96)]  # noqa: E731
    varlen = lambda q, k, v, cu: ejk.flash_attention_varlen(q, k, v, cu, cu, 300, 300, causal=True)  # noqa: E731
    return {
        "flash_attention": (lambda q, k, v: ejk.flash_attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=7),
                            qkv(), qkv()),
        "flash_attention_varlen": (varlen, [*packed(), _ints([0, 200, 500])], [*packed(), _ints([0, 299, 450])]),
        "padded_attention": (ejk.padded_attention, [*single(), _ints([0, 5, 199])], [*single(), _ints([3, 0, 200])]),
        "padded_softmax": (ejk.padded_softmax, [_rand(rng, 3, 200, 200), _ints([0, 5, 199])],
                           [_rand(rng, 3, 200, 200), _ints([7, 200, 0])]),
        "padded_softmax_v": (ejk.padded_softmax_v,
                             [_rand(rng, 3, 200, 200), _rand(rng, 3, 200, 64), _ints([0, 5, 199])],
                             [_rand(rng, 3, 200, 200), _rand(rng, 3, 200, 64), _ints([7, 200, 0])]),
        "softmax": (ejk.softmax, [_rand(rng, 37, 1000)], [_rand(rng, 37, 1000)]),
        "grouped_matmul": (ejk.grouped_matmul, [*gmm(), _ints([100, 0, 350, 200])],
                           [*gmm(), _ints([300, 300, 0, 17])]),
        "transposed_grouped_matmul": (ejk.transposed_grouped_matmul,
                                      [_rand(rng, 128, 700), _rand(rng, 700, 96), _ints([100, 0, 350, 200])],
                                      [_rand(rng, 128, 700), _rand(rng, 700, 96), _ints([300, 300, 0, 17])]),
    }


def _run(fn, args, cotangent):
    out = fn(*args)
    grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], cotangent)
    return [out.detach().clone(), *(g.clone() for g in grads)]


@pytest.mark.parametrize("name", ["flash_attention", "flash_attention_varlen", "padded_attention", "padded_softmax",
                                  "padded_softmax_v", "softmax", "grouped_matmul", "transposed_grouped_matmul"])
def test_graphed_forward_and_backward_match_eager(name):
    rng = np.random.default_rng(0)
    fn, sample, new = _cases(rng)[name]
    graphed = torch.cuda.make_graphed_callables(fn, tuple(sample))
    cotangent = torch.randn_like(fn(*new))
    want = _run(fn, new, cotangent)
    for _ in range(2):  # replays: the graph must not have baked in the sample's values
        got = _run(graphed, new, cotangent)
        for i, (g, w) in enumerate(zip(got, want)):
            assert not torch.isnan(g).any(), f"{name}: output {i} has NaN"
            assert torch.equal(g, w), f"{name}: output {i} differs from eager"


def test_default_dropout_seed_is_drawn_anew_on_each_replay():
    """Without a seed, flash attention draws one from torch's CUDA generator: a captured draw
    advances with each replay (as torch's own dropout does), so replays drop different elements."""
    rng = np.random.default_rng(1)
    q, k, v = _rand(rng, 1, 128, 2, 64), _rand(rng, 1, 128, 2, 64), _rand(rng, 1, 128, 2, 64)
    graphed = torch.cuda.make_graphed_callables(lambda *t: ejk.flash_attention(*t, dropout_p=0.5), (q, k, v))
    first, second = (graphed(q, k, v).detach().clone() for _ in range(2))
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    assert not torch.equal(first, second)


def test_torch_compile_reduce_overhead_matches_eager():
    """mode="reduce-overhead" runs the compiled graph (our registered ops inside) as CUDA graphs."""
    rng = np.random.default_rng(2)

    def step(q, k, v, tokens, weights, sizes):
        attn = ejk.flash_attention(q, k, v, causal=True)
        return attn.float().square().mean() + ejk.grouped_matmul(tokens, weights, sizes).float().square().mean()

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for sizes in ([100, 0, 350, 200], [300, 300, 0, 17], [0, 0, 0, 650]):
        args = [_rand(rng, 2, 256, 4, 64), _rand(rng, 2, 256, 2, 64), _rand(rng, 2, 256, 2, 64),
                _rand(rng, 700, 128), _rand(rng, 4, 128, 96), _ints(sizes)]
        leaves = [a for a in args if a.requires_grad]
        want = [step(*args), *torch.autograd.grad(step(*args), leaves)]
        loss = compiled(*args)
        got = [loss.detach().clone(), *(g.clone() for g in torch.autograd.grad(loss, leaves))]
        # Inductor rounds the loss's elementwise ops its own way: bf16 gradients may differ by an ulp.
        for i, (g, w) in enumerate(zip(got, want)):
            err = rel_error(g.double().cpu().numpy(), w.detach().double().cpu().numpy())
            assert err <= TOLERANCE["bfloat16"], f"sizes {sizes}: output {i} off by {err:.2e}"
