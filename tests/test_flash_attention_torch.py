"""Torch-only: the registered ops pass opcheck, torch.compile(fullgraph=True) traces a model using
them, default dropout seeds follow torch's generator, non-contiguous inputs work."""
import numpy as np
import pytest
import torch

import ejkernel_torch as ejk
from tests import references as ref
from tests.frameworks import registered_ops, rel_error

OPS = torch.ops.ejkernel


def _qkv(batch=2, seq_q=9, seq_k=11, heads_q=4, heads_kv=2, head_dim=16, grad=True):
    gen = torch.Generator().manual_seed(0)
    shapes = [(batch, seq_q, heads_q, head_dim)] + [(batch, seq_k, heads_kv, head_dim)] * 2
    return [torch.randn(s, generator=gen).requires_grad_(grad) for s in shapes]


# op argument tail: max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p
def _opcheck_cases():
    q, k, v = _qkv()
    seed = torch.tensor([5], dtype=torch.int32)
    bias = torch.randn(1, 4, 9, 11, requires_grad=True)
    seg_q, seg_k = torch.tensor([[1] * 9, [1] * 5 + [0] * 4]), torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
    cu = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 7, 11], dtype=torch.int32)
    flat = [x.detach()[0].requires_grad_() for x in (q, k, v)]
    return {
        "plain": (q, k, v, None, None, None, None, None, None, 0, 0, 0.25, -1, -1, 0.0, 0.0),
        "all-features": (q, k, v, bias, seg_q.int(), seg_k.int(), None, None, seed, 0, 0, 0.25, 20, 0, 3.0, 0.2),
        "varlen": (*flat, None, None, None, *cu, seed, 5, 7, 0.25, 3, 1, 0.0, 0.1),
    }


@pytest.mark.parametrize("case", ["plain", "all-features", "varlen"])
def test_opcheck_forward(case):
    torch.library.opcheck(OPS.flash_attention_fwd.default, _opcheck_cases()[case])


def test_opcheck_backward():
    q, k, v, bias, qs, ks, cq, ck, seed, *scalars = _opcheck_cases()["all-features"]
    out, lse = OPS.flash_attention_fwd(q, k, v, bias, qs, ks, cq, ck, seed, *scalars)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    args = (dout, dlse, *(t.detach() for t in (q, k, v, out, lse, bias)), qs, ks, cq, ck, seed, *scalars, True)
    torch.library.opcheck(OPS.flash_attention_bwd.default, args)


class _TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 64)
        self.bias = torch.nn.Parameter(torch.zeros(1, 2, 9, 9))

    def forward(self, x, seg):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 4, 16).split([2, 1, 1], dim=2)
        out = ejk.flash_attention(q, k, v, causal=True, bias=self.bias, logits_soft_cap=5.0, q_segment_ids=seg,
                                  kv_segment_ids=seg, dropout_p=0.1, dropout_seed=3)
        return out.float().square().mean()


def _fresh_inductor_cache():
    from torch._inductor import utils

    return (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)()


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_value_checks_skip_fake_tensors(tracing_mode):
    """make_fx's fake and symbolic tracing (and FakeTensorMode) of the ops whose checks read
    values (cu_seqlens, n_pad, group_sizes) raised DataDependentOutputException / "guard on
    data-dependent": fake tensors have no values. The checks are skipped there, as under
    torch.compile; the traced graph holds the ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(5, 2, 16)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    sizes, n_pad = torch.tensor([2, 3], dtype=torch.int32), torch.tensor([1, 0, 0, 1, 0], dtype=torch.int32)
    lhs, rhs = torch.randn(5, 16), torch.randn(2, 16, 8)

    def fn(x, cu, lhs, rhs, sizes, n_pad):
        return (ejk.flash_attention_varlen(x, x, x, cu, cu, 3, 3), ejk.grouped_matmul(lhs, rhs, sizes),
                ejk.padded_attention(x, x, x, n_pad))

    graph = make_fx(fn, tracing_mode=tracing_mode)(x, cu, lhs, rhs, sizes, n_pad)
    names = str(graph.graph)
    assert "flash_attention_fwd" in names and "grouped_matmul" in names and "padded_attention" in names


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = _TinyAttention()
    x = torch.randn(2, 9, 32)
    seg = torch.tensor([[1] * 9, [1] * 4 + [2] * 3 + [0] * 2])
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    results = []
    with _fresh_inductor_cache():  # graphs cached by other versions of this code must not be reused
        for fn in (model, compiled):
            model.zero_grad()
            loss = fn(x, seg)
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for eager, comp in zip(*results):
        assert rel_error(comp.numpy(), eager.numpy()) < 1e-5


@pytest.mark.parametrize("options", [dict(causal=True), dict(sliding_window=2)])
def test_compile_with_a_window_across_sequence_lengths(options):
    # A new length recompiles with dynamic sizes; the window side clamped to seq_q + seq_k was then
    # a SymInt, which the op's spec cache could not hash (TypeError from the second length on).
    k, v = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    compiled = torch.compile(lambda q, k, v: ejk.flash_attention(q, k, v, **options), fullgraph=True)
    with _fresh_inductor_cache():
        for seq in (5, 7, 9):
            q = torch.randn(1, seq, 2, 8)
            assert rel_error(compiled(q, k, v).numpy(), ejk.flash_attention(q, k, v, **options).numpy()) < 1e-6


def test_compile_varlen_across_max_seqlens():
    # A second max_seqlen value makes dynamo trace the int arguments as SymInts (automatic dynamic
    # shapes), which the op's spec cache could not hash: TypeError "unhashable type: non-nested SymInt".
    fn = lambda q, cu, max_seqlen: ejk.flash_attention_varlen(q, q, q, cu, cu, max_seqlen, max_seqlen,  # noqa: E731
                                                              causal=True)
    compiled = torch.compile(fn, fullgraph=True)
    with _fresh_inductor_cache():
        for total in (5, 9):
            q, cu = torch.randn(total, 2, 8), torch.tensor([0, 2, total], dtype=torch.int32)
            assert rel_error(compiled(q, cu, total - 2).numpy(), fn(q, cu, total - 2).numpy()) < 1e-6


def test_compile_across_soft_caps():
    # A second soft cap makes dynamo trace the float as a SymFloat (automatic dynamic), and the
    # check's math.isfinite on it was a graph break ("torch.* op returned non-Tensor").
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 1, 8)
    fn = lambda q, k, cap: ejk.flash_attention(q, k, k, logits_soft_cap=cap)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    with _fresh_inductor_cache():
        for cap in (2.0, 3.0, 4.0):
            assert rel_error(compiled(q, k, cap).numpy(), fn(q, k, cap).numpy()) < 1e-6


def test_compile_dropout_mask_matches_eager():
    # flash_attention_dropout_mask launched its plan outside any registered op: dynamo traced into
    # the plan code and the Triton interpreter (fullgraph=True: Unsupported context manager RLock).
    fn = lambda q: q.new_ones(()) * ejk.flash_attention_dropout_mask(7, 1, 2, q.shape[1], 5, 0.3)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    with _fresh_inductor_cache():
        for seq in (3, 4):
            q = torch.randn(1, seq, 2, 8)
            assert torch.equal(compiled(q), fn(q))


def test_dropout_mask_under_vmap_over_seeds():
    # Launched outside a registered op, the mask failed under torch.vmap over seed tensors; as the
    # op ejkernel::flash_attention_dropout_mask it runs per seed (torch's batched fallback).
    seeds = torch.tensor([5, -7, 2**31 - 1], dtype=torch.int32)
    masks = torch.vmap(lambda s: ejk.flash_attention_dropout_mask(s, 1, 2, 5, 7, 0.25))(seeds)
    assert masks.shape == (3, 1, 2, 5, 7) and masks.dtype == torch.bool
    for seed, mask in zip(seeds.tolist(), masks):
        assert torch.equal(mask, ejk.flash_attention_dropout_mask(seed, 1, 2, 5, 7, 0.25))


def test_compile_checks_autotune():
    # Eager calls reject autotune="no" (bool("no") would turn tuning on); compiled ones skipped the check.
    q = torch.randn(1, 5, 2, 8)
    compiled = torch.compile(lambda q: ejk.flash_attention(q, q, q, autotune="no"))
    with pytest.raises(TypeError, match="autotune must be True, False or None"):
        compiled(q)


def test_default_seed_follows_torch_manual_seed():
    q, k, v = _qkv(grad=False)
    outs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        outs.append(ejk.flash_attention(q, k, v, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_non_contiguous_inputs_and_tensor_seed():
    q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in _qkv())  # strided views
    assert not q.is_contiguous()
    seed = torch.tensor(7)
    out = ejk.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=seed)
    mask = ejk.flash_attention_dropout_mask(7, 2, 4, 9, 11, 0.3)
    expected = ref.flash_attention(*(x.double() for x in (q, k, v)), dropout_p=0.3, dropout_mask=mask)
    assert rel_error(out.numpy(), expected.numpy()) < 1e-5


def test_tensor_options_changed_in_place_are_read_anew():
    """A 0-d tensor sliding_window or max_seqlen hashed by identity in the spec cache: after an
    in-place change the next call reused the spec of the old value (window 1 where 8 was asked,
    tokens past the old max_seqlen dropped), with no error."""
    q, k, v = (x.detach() for x in _qkv(batch=1, seq_q=12, seq_k=12, heads_q=1, heads_kv=1))
    window = torch.tensor(1)
    ejk.flash_attention(q, k, v, sliding_window=window)
    window.fill_(8)
    out = ejk.flash_attention(q, k, v, sliding_window=window)
    want = ref.forward(ref.flash_attention, q.numpy(), k.numpy(), v.numpy(), sliding_window=8)
    assert rel_error(out.numpy(), want) < 1e-5
    x = q[0]
    short, whole = torch.tensor([0, 4, 8, 12], dtype=torch.int32), torch.tensor([0, 12], dtype=torch.int32)
    max_seqlen = torch.tensor(4)
    ejk.flash_attention_varlen(x, x, x, short, short, max_seqlen, max_seqlen)
    max_seqlen.fill_(12)
    out = ejk.flash_attention_varlen(x, x, x, whole, whole, max_seqlen, max_seqlen)
    want = ref.forward(ref.flash_attention, x[None].numpy(), x[None].numpy(), x[None].numpy())[0]
    assert rel_error(out.numpy(), want) < 1e-5


def test_bias_without_grad_gets_none():
    q, k, v = _qkv()
    bias = torch.randn(2, 1, 9, 11)
    ejk.flash_attention(q, k, v, bias=bias).sum().backward()
    assert bias.grad is None and np.isfinite(q.grad.numpy()).all()


def test_vmap_without_gradients_runs_the_op_rule_alone(monkeypatch):
    """vmap with nothing to differentiate skips the autograd function (its functorch machinery was
    most of the call's host time); with an input requiring grad outside vmap it is still used,
    and backward through the vmapped call gives each sample's gradients."""
    import importlib

    fa_ops = importlib.import_module("ejkernel_torch.ops.flash_attention")  # the package exports the function
    q, k, v = (torch.stack([x.detach()] * 3) + torch.randn(3, *x.shape) for x in _qkv())
    f = lambda q, k, v: ejk.flash_attention(q, k, v, causal=True)  # noqa: E731
    want = torch.stack([f(q[i], k[i], v[i]) for i in range(3)])
    real_apply = fa_ops._FlashAttentionTransformsFn.apply
    used = []
    monkeypatch.setattr(fa_ops._FlashAttentionTransformsFn, "apply",
                        staticmethod(lambda *a: (used.append(1), real_apply(*a))[1]))
    torch.testing.assert_close(torch.func.vmap(f)(q, k, v), want, rtol=0, atol=0)
    assert not used
    q.requires_grad_()
    out = torch.func.vmap(f)(q, k, v)
    assert used
    (grad,) = torch.autograd.grad((out * out).sum(), q)
    for i in range(3):
        qi = q[i].detach().requires_grad_()
        (want_grad,) = torch.autograd.grad((f(qi, k[i], v[i]) ** 2).sum(), qi)
        torch.testing.assert_close(grad[i], want_grad, rtol=0, atol=0)


def test_eager_calls_resolve_once_per_cache_generation(isolated_config_cache, monkeypatch):
    """A plain eager forward + backward memoizes what its kernels are resolved with (one config
    cache check for both, nothing resolved again) until the cache changes; another dtype is
    another problem; a stored entry and clear_memo are seen at the next call. The results are
    those of the registered ops (called under a torch-function mode), bitwise."""
    import importlib

    from ejkernel_torch.ops import _tuning
    from ejkernel_torch.utils import device_fingerprint
    from triton_kernels import config_cache as cc
    from triton_kernels import flash_attention as fa
    from triton_kernels import tuning
    from triton_kernels.params import BwdParams

    fa_ops = importlib.import_module("ejkernel_torch.ops.flash_attention")
    path = isolated_config_cache
    resolves, generations, plans = [], [], []
    real_resolve, real_generation = _tuning.resolve, cc.ConfigCache.generation
    monkeypatch.setattr(_tuning, "resolve", lambda t, *a: resolves.append(t.op) or real_resolve(t, *a))
    monkeypatch.setattr(cc.ConfigCache, "generation", lambda self: generations.append(1) or real_generation(self))
    real_launch = fa_ops.launch_prechecked  # the plain eager forward's and backward's launcher
    monkeypatch.setattr(fa_ops, "launch_prechecked", lambda plan, *a: plans.append(plan) or real_launch(plan, *a))

    def step(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = ejk.flash_attention(q, k, v)
        out.backward(torch.ones_like(out))
        return [out.detach(), q.grad, k.grad, v.grad]

    q, k, v = _qkv(grad=False)
    first = step(q, k, v)
    assert sorted(resolves) == ["flash_attention_bwd", "flash_attention_fwd"]
    resolves.clear(), generations.clear(), plans.clear()
    assert all(torch.equal(a, b) for a, b in zip(step(q, k, v), first))
    assert resolves == [] and len(generations) == 1 and len(plans) == 3  # forward, dq (with delta), dk/dv

    plans.clear()
    step(*(x.to(torch.bfloat16) for x in (q, k, v)))  # another dtype: resolved for it
    assert sorted(resolves) == ["flash_attention_bwd", "flash_attention_fwd"]
    assert plans[0].input_dtypes[0] == "bfloat16"

    # an entry stored for the backward (as another process would): the next call launches it
    spec = fa.dense_spec(tuple(q.shape), tuple(k.shape), tuple(v.shape), ("float32",) * 3)
    tuned = BwdParams(blocksize_m=32, blocksize_n=32)
    tuned_plans = fa.backward_plans(spec, fa_ops.device_facts(q.device), False, False, tuned)
    assert tuned_plans != fa.backward_plans(spec, fa_ops.device_facts(q.device), False, False, None)
    cc.ConfigCache(path).store(tuning.FLASH_BWD.cache_key(spec, device_fingerprint(q.device)), tuned.to_dict())
    plans.clear()
    tuned_run = step(q, k, v)
    assert plans[1:] == list(tuned_plans)
    resolves.clear()
    tuning.clear_memo()
    step(q, k, v)
    assert sorted(resolves) == ["flash_attention_bwd", "flash_attention_fwd"]

    with registered_ops():  # not plain eager: the registered ops
        dispatched = step(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(tuned_run, dispatched, strict=True))


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_fast_path_matches_registered_ops_with_every_feature(varlen):
    """The plain eager path (memoized plans, direct launches, forward and backward) against the
    registered ops (run under a torch-function mode): outputs, lse and every gradient bitwise."""

    gen = torch.Generator().manual_seed(1)
    if varlen:
        q, k, v = (torch.randn(s, generator=gen) for s in [(9, 4, 16), (11, 2, 16), (11, 2, 16)])
        cu = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 7, 11], dtype=torch.int32)
        call = lambda q, k, v, b: ejk.flash_attention_varlen(  # noqa: E731
            q, k, v, *cu, 5, 7, sliding_window=(3, 1), logits_soft_cap=3.0, dropout_p=0.2, dropout_seed=5,
            return_lse=True)
        bias = None
    else:
        q, k, v = _qkv(grad=False)
        bias = torch.randn(1, 4, 9, 11, generator=gen)
        seg_q, seg_k = torch.tensor([[1] * 9, [1] * 5 + [0] * 4]), torch.tensor([[1] * 11, [1] * 6 + [0] * 5])
        call = lambda q, k, v, b: ejk.flash_attention(  # noqa: E731
            q, k, v, bias=b, causal=True, logits_soft_cap=3.0, q_segment_ids=seg_q, kv_segment_ids=seg_k,
            dropout_p=0.2, dropout_seed=5, return_lse=True)

    def step():
        leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, bias)]
        out, lse = call(*leaves)
        (out.square().sum() + lse.nan_to_num(neginf=0.0).sum()).backward()  # dlse too
        return [out.detach(), lse.detach()] + [x.grad for x in leaves if x is not None]

    fast = [step(), step()]  # the second from the memo
    with registered_ops():  # not plain eager: the registered ops
        dispatched = step()
    for got in fast:
        assert all(torch.equal(a, b) for a, b in zip(got, dispatched, strict=True))


def test_a_known_call_skips_the_checks_and_gives_the_same_bits(monkeypatch):
    """A call whose shapes, dtypes, devices and options equal a checked call's skips the checks
    (``_qkv`` is their first step) and gives the bits the checked path gives, gradients too, and
    with dropout the same mask for the same torch seed. Anything outside the key, or not plain
    eager, takes the checked path again."""
    import importlib

    fa_ops = importlib.import_module("ejkernel_torch.ops.flash_attention")
    checked = []
    real_qkv = fa_ops._qkv
    monkeypatch.setattr(fa_ops, "_qkv", lambda *a: checked.append(1) or real_qkv(*a))
    monkeypatch.setattr(fa_ops, "_known_specs", {})
    q, k, v = _qkv(grad=False)
    scale = 0.3

    def step(q, k, v, **options):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = ejk.flash_attention(*leaves, causal=True, softmax_scale=scale, return_lse=True, **options)
        out.square().sum().backward()
        return [out.detach(), lse] + [x.grad for x in leaves]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    first = step(q, k, v)
    assert len(checked) == 1
    assert same(step(q, k, v), first) and len(checked) == 1  # known: not checked again
    no_grad = ejk.flash_attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    assert same(no_grad, first[:2]) and len(checked) == 1

    strided_k = k.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, not contiguous: made so
    assert same(step(q, strided_k, v), first) and len(checked) == 1

    def dropped(q, k, v):
        torch.manual_seed(3)  # the seed is drawn from torch's generator on both paths
        return step(q, k, v, dropout_p=0.25)

    with_dropout = dropped(q, k, v)
    assert len(checked) == 2 and not same(with_dropout, first)
    assert same(dropped(q, k, v), with_dropout) and len(checked) == 2
    ejk.flash_attention(q, k, v, causal=True, softmax_scale=scale, dropout_p=0.25, dropout_seed=4)
    assert len(checked) == 3  # a given seed: checked

    with registered_ops():  # not plain eager: the registered ops
        assert same(step(q, k, v), first)
    assert len(checked) == 4

    scale = 1  # an int: as 1.0, but never a key (1 == 1.0 == True)
    by_int = [step(q, k, v), step(q, k, v)]
    assert len(checked) == 6
    scale = 1.0
    assert same(by_int[0], by_int[1]) and same(step(q, k, v), by_int[0]) and len(checked) == 7
    step(q, k, v, sliding_window=(2, None))  # another key
    assert len(checked) == 8
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: checked (and cast) every time
        assert ejk.flash_attention(q, k, v).dtype == torch.bfloat16
    assert len(checked) == 9
    with pytest.raises(ValueError, match="head_dim"):  # a bad call is never known
        ejk.flash_attention(q, k[..., :8].contiguous(), v[..., :8].contiguous())
    with pytest.raises(ValueError, match="head_dim"):
        ejk.flash_attention(q, k[..., :8].contiguous(), v[..., :8].contiguous())
    assert len(checked) == 11


@pytest.mark.parametrize("change", ["transpose_", "mul_"])
def test_eager_backward_refuses_inputs_changed_in_place(change):
    # The plain eager backward launches on its saved tensors without checking them again (its
    # forward's launch did): what it relies on is autograd refusing tensors changed in place since,
    # their strides too (a transposed k would be read as if contiguous).
    q, k, v = _qkv(grad=False)
    q.requires_grad_()
    out = ejk.flash_attention(q, k, v)
    k.transpose_(1, 2) if change == "transpose_" else k.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


_LAZY_CASES = {  # name: (op, its inputs' shapes)
    "flash_attention": (lambda q, k, v: ejk.flash_attention(q, k, v, causal=True), [(1, 9, 2, 16)] * 3),
    "flash_attention lse": (lambda q, k, v: ejk.flash_attention(q, k, v, return_lse=True), [(1, 9, 2, 16)] * 3),
    "softmax": (lambda s: ejk.softmax(s), [(5, 7)]),
    "padded_softmax": (lambda s: ejk.padded_softmax(s, torch.tensor([1, 2])), [(2, 6, 6)]),
    "padded_softmax_v": (lambda s, v: ejk.padded_softmax_v(s, v, torch.tensor([1, 2])), [(2, 6, 6), (2, 6, 4)]),
    "padded_attention": (lambda q, k, v: ejk.padded_attention(q, k, v, torch.tensor([1, 2])), [(2, 6, 16)] * 3),
}


@pytest.mark.parametrize("name", list(_LAZY_CASES))
def test_lazy_negation_and_zero_tensors_are_read_as_values(name):
    # A lazy negation (the neg bit) keeps its values out of its memory: the eager fast path read
    # the memory, so a negated input gave the un-negated result silently. A ZeroTensor input or
    # gradient (torch's efficient zeros, no memory) was refused by the kernels' checks ("do_ptr
    # must be a contiguous float32 tensor": the dispatcher hands it to the op as an expanded
    # zero), or read as memory it does not have.
    op, shapes = _LAZY_CASES[name]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, generator=gen) for s in shapes]
    flat = lambda out: out if isinstance(out, tuple) else (out,)
    assert all(torch.equal(a, b) for a, b in zip(flat(op(xs[0]._neg_view(), *xs[1:])), flat(op(-xs[0], *xs[1:]))))
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs = flat(op(*leaves))
    cots = [torch.randn(o.shape, generator=gen) for o in outs]
    lazy = torch.autograd.grad(outs, leaves, [c._neg_view() for c in cots], retain_graph=True)
    plain = torch.autograd.grad(outs, leaves, [-c for c in cots], retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(lazy, plain))
    zeros = torch.autograd.grad(outs, leaves, [torch._efficientzerotensor(o.shape) for o in outs])
    assert all(g.shape == x.shape and not g.any() for g, x in zip(zeros, xs))
    for i, x in enumerate(xs):  # a ZeroTensor input: checked as non-contiguous in the registered op
        with_zeros = lambda zeros: flat(op(*xs[:i], zeros, *xs[i + 1:]))  # noqa: E731
        assert all(torch.equal(a, b) for a, b in zip(with_zeros(torch._efficientzerotensor(x.shape)),
                                                     with_zeros(torch.zeros(x.shape)), strict=True))
