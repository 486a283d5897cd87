"""torch.func reverse mode over every torch op: grad, vjp, jacrev, and vmap of grad (per-sample
gradients) give .backward()'s gradients. They all raised "In order to use an autograd.Function
with functorch transforms ... it must override the setup_context staticmethod" (torch's custom-op
autograd has none: pytorch/pytorch#168393), and .backward() through torch.func.vmap of softmax
raised "no autograd formula was registered". Forward mode is refused: test_forward_mode_ad.py."""
import warnings

import numpy as np
import pytest

from tests.frameworks import rel_error

OPS = ["softmax", "padded_softmax", "padded_softmax_v", "padded_attention", "flash_attention",
       "flash_attention_varlen", "grouped_matmul", "transposed_grouped_matmul"]
GRAD_TOLERANCE = 2e-5  # float32 gradients vs float64, as the ops' own gradient tests


def _case(fw, rng, op, seq, dim):
    """(the op as a function of its float arguments, its float64 reference, those arguments).
    Tests that compare vmapped calls bit for bit take sizes that keep each slice 16-byte aligned
    (seq 4): the kernels compiled for unaligned pointers may sum in another order on a GPU."""
    import torch
    from ejkernel_torch import reference as ref

    ops = fw.ops
    t = lambda *shape: fw.asarray(rng.standard_normal(shape), "float32")  # noqa: E731
    n_pad = torch.tensor([1], dtype=torch.int32, device=fw.device)
    cu = torch.tensor([0, 2, seq], dtype=torch.int32, device=fw.device)
    sizes = torch.tensor([2, 0, seq - 2], dtype=torch.int32, device=fw.device)
    varlen = lambda f: lambda q, k, v: f(q, k, v, cu, cu, seq, seq, causal=True)  # noqa: E731
    return {
        "softmax": (ops.softmax, ref.softmax, [t(2, seq)]),
        "padded_softmax": (lambda s: ops.padded_softmax(s, n_pad), lambda s: ref.padded_softmax(s, n_pad),
                           [t(1, seq, seq)]),
        "padded_softmax_v": (lambda s, v: ops.padded_softmax_v(s, v, n_pad),
                             lambda s, v: ref.padded_softmax_v(s, v, n_pad), [t(1, seq, seq), t(1, seq, dim)]),
        "padded_attention": (lambda q, k, v: ops.padded_attention(q, k, v, n_pad),
                             lambda q, k, v: ref.padded_attention(q, k, v, n_pad), [t(1, seq, dim) for _ in "qkv"]),
        # GQA, causal, and a broadcast bias that gets a gradient too
        "flash_attention": (lambda q, k, v, b: ops.flash_attention(q, k, v, causal=True, bias=b),
                            lambda q, k, v, b: ref.flash_attention(q, k, v, causal=True, bias=b),
                            [t(1, seq, 2, dim), t(1, seq, 1, dim), t(1, seq, 1, dim), t(1, 1, seq, seq)]),
        "flash_attention_varlen": (varlen(ops.flash_attention_varlen), varlen(ref.flash_attention_varlen),
                                   [t(seq, 2, dim), t(seq, 1, dim), t(seq, 1, dim)]),
        "grouped_matmul": (lambda lhs, rhs: ops.grouped_matmul(lhs, rhs, sizes),
                           lambda lhs, rhs: ref.grouped_matmul(lhs, rhs, sizes), [t(seq, dim), t(3, dim, 2)]),
        "transposed_grouped_matmul": (lambda lhs, rhs: ops.transposed_grouped_matmul(lhs, rhs, sizes),
                                      lambda lhs, rhs: ref.transposed_grouped_matmul(lhs, rhs, sizes),
                                      [t(dim, seq), t(seq, 2)]),
    }[op]


def _backward(fn, primals, cotangent) -> list:
    """Gradients of sum(fn(*primals) * cotangent) by .backward()."""
    leaves = [p.detach().clone().requires_grad_(True) for p in primals]
    (fn(*leaves) * cotangent).sum().backward()
    return [p.grad for p in leaves]


def _float64(fn, primals, cotangent) -> list:
    return _backward(fn, [p.double() for p in primals], cotangent.double())


def _equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.cpu().numpy(), w.cpu().numpy())


@pytest.mark.parametrize("op", OPS)
def test_grad_and_vjp_equal_backward(torch_fw, rng, op):
    import torch

    fn, reference, primals = _case(torch_fw, rng, op, seq=5, dim=8)
    cotangent = torch.randn_like(fn(*primals))
    want = _backward(fn, primals, cotangent)
    for g, r in zip(want, _float64(reference, primals, cotangent)):
        assert rel_error(g.cpu().double().numpy(), r.cpu().numpy()) < GRAD_TOLERANCE
    argnums = tuple(range(len(primals)))
    _equal(torch.func.grad(lambda *p: (fn(*p) * cotangent).sum(), argnums=argnums)(*primals), want)
    # vjp's function runs the backward after the transform has ended (on tensors it saved then)
    _, vjp_fn = torch.func.vjp(fn, *primals)
    _equal(vjp_fn(cotangent), want)
    with torch.no_grad():
        _equal(vjp_fn(cotangent), want)


@pytest.mark.parametrize("op", OPS)
def test_jacrev_equals_backward(torch_fw, rng, op):
    """jacrev is vmap over vjp: the backward kernels under torch.func.vmap (tiny shapes: one
    backward per output element)."""
    import torch

    fn, reference, primals = _case(torch_fw, rng, op, seq=4, dim=2)
    argnums = tuple(range(len(primals)))
    got = torch.func.jacrev(fn, argnums=argnums)(*primals)
    _equal(got, torch.autograd.functional.jacobian(fn, tuple(primals)))
    want = torch.autograd.functional.jacobian(reference, tuple(p.double() for p in primals))
    for g, w in zip(got, want):
        assert rel_error(g.cpu().double().numpy(), w.cpu().numpy()) < GRAD_TOLERANCE


@pytest.mark.parametrize("op", OPS)
def test_per_sample_grads(torch_fw, rng, op):
    """vmap(grad(loss)) over two samples, and .backward() through vmap(op), give each sample's
    own .backward() gradients."""
    import torch

    fn, _, first = _case(torch_fw, rng, op, seq=4, dim=8)
    _, _, second = _case(torch_fw, rng, op, seq=4, dim=8)
    cotangents = torch.randn_like(torch.stack([fn(*first), fn(*second)]))
    want = [_backward(fn, p, c) for p, c in zip((first, second), cotangents)]
    want = [torch.stack(grads) for grads in zip(*want)]
    batched = [torch.stack(pair) for pair in zip(first, second)]
    loss = lambda *args: (fn(*args[:-1]) * args[-1]).sum()  # noqa: E731
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=tuple(range(len(first)))))(*batched, cotangents)
    _equal(per_sample, want)
    _equal(_backward(torch.func.vmap(fn), batched, cotangents), want)


@pytest.mark.parametrize("op", OPS[:4] + OPS[6:])
def test_vmap_folds_without_the_fallback(torch_fw, rng, op):
    """vmap (with or without gradients) ran these ops through torch's per-sample fallback for ops
    without a batching rule, which warned "There is a performance drop because we have not yet
    implemented the batching rule for ejkernel::..."; their vmap rules now fold the samples into
    one launch (the grouped matmuls' into one launch's batch of problems), giving each sample's
    values."""
    import torch

    fn, _, first = _case(torch_fw, rng, op, seq=4, dim=8)
    _, _, second = _case(torch_fw, rng, op, seq=4, dim=8)
    batched = [torch.stack(pair) for pair in zip(first, second)]
    loss = lambda *args: fn(*args).sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.func.vmap(fn)(*batched)
        # (the gradients' values: test_per_sample_grads)
        torch.func.vmap(torch.func.grad(loss, argnums=tuple(range(len(first)))))(*batched)
    _equal([got], [torch.stack([fn(*first), fn(*second)])])


@pytest.mark.parametrize("op", OPS[:4])
def test_vmap_without_gradients_skips_the_autograd_function(torch_fw, rng, monkeypatch, op):
    """vmap with nothing to differentiate went through the ops' torch.func autograd functions,
    whose functorch machinery (generated vmap rule) made most of the call's host time; their
    kernels' vmap rules now serve alone, as flash_attention's do. With an input requiring grad
    outside vmap the autograd function is still used, and backward gives each sample's gradients."""
    import importlib

    import torch

    from ejkernel_torch.ops._common import KernelFunction

    used = []
    for module in ("softmax", "padded_attention"):
        module = importlib.import_module(f"ejkernel_torch.ops.{module}")  # the package exports the functions
        for function in [f for f in vars(module).values() if isinstance(f, KernelFunction)]:
            apply = function.transforms_function.apply
            record = staticmethod(lambda *a, _apply=apply: (used.append(1), _apply(*a))[1])
            monkeypatch.setattr(function, "transforms_function", type("Recording", (), {"apply": record}))
    fn, _, first = _case(torch_fw, rng, op, seq=4, dim=8)
    _, _, second = _case(torch_fw, rng, op, seq=4, dim=8)
    batched = [torch.stack(pair) for pair in zip(first, second)]
    _equal([torch.func.vmap(fn)(*batched)], [torch.stack([fn(*first), fn(*second)])])
    assert not used
    cotangents = torch.randn_like(torch.stack([fn(*first), fn(*second)]))
    want = [torch.stack(grads) for grads in zip(*(_backward(fn, p, c) for p, c in zip((first, second), cotangents)))]
    _equal(_backward(torch.func.vmap(fn), batched, cotangents), want)
    assert used


@pytest.mark.parametrize("op", OPS[:6])
def test_second_derivative_names_the_op(torch_fw, rng, op):
    """grad of grad raises, as create_graph=True gradients do: the backward kernels have no derivative."""
    import torch

    fn, _, primals = _case(torch_fw, rng, op, seq=5, dim=8)
    loss = lambda x: (fn(x, *primals[1:]) ** 2).sum()  # noqa: E731
    name = "flash_attention" if op.startswith("flash") else op
    with pytest.raises(NotImplementedError, match=f"{name} has no second derivative"):
        torch.func.grad(lambda x: torch.func.grad(loss)(x).sum())(primals[0])


@pytest.mark.parametrize("op", OPS[:6])
def test_create_graph_second_derivative_names_the_op(torch_fw, rng, op):
    """The same through create_graph=True: flash attention's raised torch's generic "no autograd
    formula ... ejkernel.flash_attention_bwd", naming an internal op."""
    import torch

    fn, _, primals = _case(torch_fw, rng, op, seq=5, dim=8)
    x = primals[0].detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((fn(x, *primals[1:]) ** 2).sum(), x, create_graph=True)
    name = "flash_attention" if op.startswith("flash") else op
    with pytest.raises(NotImplementedError, match=f"{name} has no second derivative"):
        torch.autograd.grad(grad.sum(), x)


@pytest.mark.parametrize("op", OPS[6:])
def test_grouped_matmul_second_derivative(torch_fw, rng, op):
    """The grouped matmuls' backward is made of the ops: grad of grad equals create_graph's."""
    import torch

    fn, _, (lhs, rhs) = _case(torch_fw, rng, op, seq=5, dim=8)
    inner = lambda a, b: (torch.func.grad(lambda a: (fn(a, b) ** 2).sum())(a) ** 2).sum()  # noqa: E731
    got = torch.func.grad(inner, argnums=(0, 1))(lhs, rhs)
    a, b = (t.detach().clone().requires_grad_(True) for t in (lhs, rhs))
    (ga,) = torch.autograd.grad((fn(a, b) ** 2).sum(), a, create_graph=True)
    (ga ** 2).sum().backward()
    _equal(got, [a.grad, b.grad])


@pytest.mark.parametrize("op", OPS)
def test_batched_cotangents(torch_fw, rng, op):
    """autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) run torch's older vmap,
    whose batched tensors have no storage: the backward launched on them and failed inside the
    launcher ("Cannot access storage of BatchedTensorImpl"). Now it goes through the registered
    ops, which that vmap runs once per cotangent: the gradients of a loop over cotangents."""
    import torch

    fn, _, args = _case(torch_fw, rng, op, seq=4, dim=8)
    args = [a.detach().requires_grad_() for a in args]
    out = fn(*args)
    cotangents = torch_fw.asarray(rng.standard_normal((3, *out.shape)), "float32")
    with warnings.catch_warnings():  # torch warns that its fallback runs one slice at a time
        warnings.simplefilter("ignore", UserWarning)
        got = torch.autograd.grad(out, args, cotangents, is_grads_batched=True, retain_graph=True)
    loop = [torch.autograd.grad(out, args, c, retain_graph=True) for c in cotangents]
    for i, g in enumerate(got):
        want = torch.stack([grads[i] for grads in loop])
        assert not torch.isnan(g).any() and rel_error(torch_fw.to_numpy(g), torch_fw.to_numpy(want)) < 1e-6, i


# The folding ops (OPS[:4]) were the broken ones, under the eager backend too; the rest once each.
@pytest.mark.parametrize("op, backend", [(op, b) for op in OPS[:4] for b in ("eager", "aot_eager")]
                         + [(op, "aot_eager") for op in OPS[4:]])
def test_compiled_vmap_backward(torch_fw, rng, op, backend):
    """.backward() through torch.func.vmap (nested) of an op inside torch.compile (fullgraph)
    gives each sample's own gradients. The batched tensors hide requires_grad there,
    so the folding ops ran outside their autograd functions: the eager backend returned gradients
    without their share (0.45 off for softmax), aot_eager and inductor failed ("no autograd
    formula was registered"). They now carry their derivative themselves (register_autograd)."""
    import torch

    fn = _case(torch_fw, rng, op, seq=4, dim=8)[0]
    grid = [[_case(torch_fw, rng, op, seq=4, dim=8)[2] for _ in range(3)] for _ in range(2)]
    cotangents = [[torch.randn_like(fn(*p)) for p in row] for row in grid]
    want = [[_backward(fn, p, c) for p, c in zip(*rows)] for rows in zip(grid, cotangents)]
    stack = lambda rows: torch.stack([torch.stack(row) for row in rows])  # noqa: E731  [2, 3, ...]
    n_args = len(grid[0][0])
    batched = [stack([[p[i] for p in row] for row in grid]) for i in range(n_args)]
    torch._dynamo.reset()
    try:
        vmapped = torch.compile(torch.func.vmap(torch.func.vmap(fn)), backend=backend, fullgraph=True)
        got = _backward(vmapped, batched, stack(cotangents))
    finally:
        torch._dynamo.reset()
    for i, g in enumerate(got):
        expected = stack([[grads[i] for grads in row] for row in want])
        assert rel_error(torch_fw.to_numpy(g), torch_fw.to_numpy(expected)) < 1e-6, i


def test_vmap_of_a_backward_kernel_refuses_inputs_that_require_grad(torch_fw, rng):
    """The backward kernels have no derivative: their vmap rule raises rather than drop one."""
    import importlib

    import torch

    softmax = importlib.import_module("ejkernel_torch.ops.softmax")  # the package exports the function
    y = torch_fw.asarray(rng.standard_normal((3, 2, 4)), "float32").requires_grad_()
    with pytest.raises(NotImplementedError, match="softmax_rows_bwd under torch.func.vmap .* no derivative"):
        torch.func.vmap(softmax._rows_backward_op.op)(y, y.detach())


@pytest.mark.parametrize("name", ["softmax_rows_fwd", "softmax_rows_bwd", "padded_softmax_fwd",
                                  "padded_softmax_v_fwd", "padded_attention_fwd", "padded_attention_bwd"])
def test_folding_ops_pass_opcheck(torch_fw, rng, name):
    """The registered ops behind softmax, padded_softmax(_v) and padded_attention, the forward ones
    with their derivative (register_autograd): schema, fake tensors, autograd registration and
    aot_dispatch (compiled against eager, gradients included)."""
    import torch

    import ejkernel_torch  # noqa: F401  (registers the ops)

    def t(*shape, grad=True):
        return torch_fw.asarray(rng.standard_normal(shape), "float32").requires_grad_(grad)

    n_pad = torch.tensor([1, 0], dtype=torch.int32, device=torch_fw.device)
    out = t(2, 5, 8, grad=False)
    lse = t(2, 5, grad=False)
    args = {
        "softmax_rows_fwd": (t(3, 7),),
        "softmax_rows_bwd": (torch.softmax(t(3, 7, grad=False), -1), t(3, 7, grad=False)),
        "padded_softmax_fwd": (t(2, 5, 5), n_pad),
        "padded_softmax_v_fwd": (t(2, 5, 5), t(2, 5, 8), n_pad),
        "padded_attention_fwd": (t(2, 5, 8), t(2, 5, 8), t(2, 5, 8), n_pad, 0.3, None, None),
        "padded_attention_bwd": (*(t(2, 5, 8, grad=False) for _ in "qkv"), out, lse, n_pad, out, 0.3, None),
    }[name]
    torch.library.opcheck(getattr(torch.ops.ejkernel, name).default, args)
