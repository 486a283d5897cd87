"""On a CUDA GPU: flash attention's compiled kernels are correct, and torch-launched and
jax-launched outputs, lse and gradients are bitwise identical (same plan -> same PTX).
Skipped without a GPU."""
import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error

pytestmark = pytest.mark.gpu

GRAD_TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}

# (batch, seq_q, seq_k, heads_q, heads_kv, head_dim), options, bias broadcast, segments
CASES = [
    ((2, 1000, 1000, 8, 2, 64), dict(causal=True), None, False),
    ((1, 333, 1024, 4, 4, 128), dict(causal=True, sliding_window=100, logits_soft_cap=20.0), None, False),
    ((2, 257, 300, 4, 1, 80), {}, (1, 4), True),
    ((2, 129, 129, 2, 2, 256), dict(dropout_p=0.2, dropout_seed=17), None, False),
    ((1, 17, 17, 2, 1, 192), dict(causal=True), (1, 1), False),
    ((4, 2048, 2048, 4, 4, 96), dict(causal=True), None, False),
]


def _inputs(rng, shape, bias, segments):
    batch, seq_q, seq_k, hq, hkv, d = shape
    arrays = [rng.standard_normal((batch, seq_q, hq, d)), rng.standard_normal((batch, seq_k, hkv, d)),
              rng.standard_normal((batch, seq_k, hkv, d))]
    if bias is not None:
        arrays.append(rng.standard_normal((*bias, seq_q, seq_k)))
    seg = None
    if segments:
        seg = [np.sort(rng.integers(0, 3, size=(batch, s)), axis=1).astype(np.int32) for s in (seq_q, seq_k)]
    return arrays, seg


def _run(fw, arrays, seg, options, dtype, cotangent):
    xs = [fw.asarray(a, dtype) for a in arrays]
    extra = {} if seg is None else dict(q_segment_ids=fw.asarray(seg[0]), kv_segment_ids=fw.asarray(seg[1]))

    def op(q, k, v, bias=None, return_lse=False):
        return fw.ops.flash_attention(q, k, v, bias=bias, return_lse=return_lse, **options, **extra)

    out, lse = op(*xs, return_lse=True)
    grads = fw.vjp(op, xs, fw.asarray(cotangent, dtype))
    return [fw.to_numpy(out), fw.to_numpy(lse), *grads], [fw.to_numpy(x) for x in xs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flash_attention_bitwise_and_correct_on_gpu(torch_fw, jax_fw, rng, dtype, case):
    import jax

    assert jax.default_backend() == "gpu", "jax must see the GPU for this test"
    shape, options, bias, segments = CASES[case]
    arrays, seg = _inputs(rng, shape, bias, segments)
    cot = rng.standard_normal(shape[:2] + (shape[3], shape[5]))
    torch_results, values = _run(torch_fw, arrays, seg, options, dtype, cot)
    jax_results, _ = _run(jax_fw, arrays, seg, options, dtype, cot)
    for i, (a, b) in enumerate(zip(torch_results, jax_results)):
        assert a.tobytes() == b.tobytes(), (case, i, np.nanmax(np.abs(a - b)))

    ref_options = dict(options)
    if "dropout_p" in options:
        seed = ref_options.pop("dropout_seed")
        ref_options["dropout_mask"] = torch_fw.to_numpy(torch_fw.ops.flash_attention_dropout_mask(
            seed, shape[0], shape[3], shape[1], shape[2], options["dropout_p"], device="cuda"))
    if seg is not None:
        ref_options |= dict(q_segment_ids=seg[0], kv_segment_ids=seg[1])
    tensors = {k: ref._t(v) for k, v in ref_options.items() if isinstance(v, np.ndarray)}
    ref_options |= tensors

    def reference(q, k, v, bias=None):
        return ref.flash_attention(q, k, v, bias=bias, **ref_options)

    assert rel_error(torch_results[0], ref.forward(reference, *values)) < TOLERANCE[dtype]
    cot_seen = torch_fw.to_numpy(torch_fw.asarray(cot, dtype))
    for got, want in zip(torch_results[2:], ref.vjp(reference, values, cot_seen, n_diff=len(values))):
        assert rel_error(got, want) < 2 * GRAD_TOLERANCE[dtype]


def test_varlen_bitwise_on_gpu(torch_fw, jax_fw, rng):
    cu_q, cu_k = np.array([0, 100, 100, 1100, 1300], np.int32), np.array([0, 50, 300, 1200, 1500], np.int32)
    arrays = [rng.standard_normal((1300, 8, 128)), rng.standard_normal((1500, 2, 128)),
              rng.standard_normal((1500, 2, 128))]
    results = []
    for f in (torch_fw, jax_fw):
        xs = [f.asarray(a, "bfloat16") for a in arrays]
        cu = f.asarray(cu_q), f.asarray(cu_k)

        def op(q, k, v):
            return f.ops.flash_attention_varlen(q, k, v, *cu, 1000, 900, causal=True, dropout_p=0.1, dropout_seed=3)

        results.append([f.to_numpy(op(*xs)), *f.vjp(op, xs, f.asarray(np.ones((1300, 8, 128)), "bfloat16"))])
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()


def test_long_sequence_runs_in_linear_memory(torch_fw):
    import torch

    q = torch.randn(1, 65536, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch_fw.ops.flash_attention(q, q, q, causal=True)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert torch.cuda.max_memory_allocated() < 2 * 1024**3  # no [seq, seq] tensor anywhere


def test_torch_compile_fullgraph_on_gpu():
    import torch

    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(256, 4, 2, sliding_window=64, logits_soft_cap=30.0).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        layer.zero_grad()
        out = fn(x)
        out.square().mean().backward()
        results.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    for eager, compiled in zip(*results):
        assert rel_error(compiled.cpu().numpy(), eager.cpu().numpy()) < 1e-4


def test_autotune_on_gpu_torch_tunes_jax_reads(torch_fw, jax_fw, rng, tmp_path, monkeypatch):
    """Autotuning on the GPU (test_tuning.py checks it on CPU plans): torch times the candidates
    and stores the fastest forward and backward configs; jax, as a fresh process would, reads
    them; both launch them with bitwise equal results, still correct."""
    import json

    from triton_kernels import config_cache as cc
    from triton_kernels import tuning

    path = tmp_path / "configs.json"
    monkeypatch.setenv(cc.CACHE_ENV, str(path))
    for fresh in (True, False):  # first a clean cache; then the jax side's fresh view of it
        monkeypatch.setattr(cc, "_caches", {})
        monkeypatch.setattr(cc, "_caches_by_env", {})
        tuning.clear_memo()
        if fresh:
            shape = (2, 512, 512, 4, 2, 32)  # head_dim 32: the Triton kernels (the Gluon ones are not tuned)
            arrays, _ = _inputs(rng, shape, None, False)
            cot = rng.standard_normal(shape[:2] + (shape[3], shape[5]))
            tuned, values = _run(torch_fw, arrays, None, dict(causal=True, autotune=True), "bfloat16", cot)
            entries = json.loads(path.read_text())["entries"]
            ops = {json.loads(key)[1] for key, e in entries.items()  # key: [device, op, version, shapes]
                   if e["source"] == "autotune" and e["framework"] == "torch"}
            assert ops == {tuning.FLASH_FWD.op, tuning.FLASH_BWD.op}, entries
    read, _ = _run(jax_fw, arrays, None, dict(causal=True), "bfloat16", cot)
    assert json.loads(path.read_text())["entries"] == entries  # jax only read
    for i, (a, b) in enumerate(zip(tuned, read)):
        assert a.tobytes() == b.tobytes(), (i, np.nanmax(np.abs(a - b)))

    def reference(q, k, v):
        return ref.flash_attention(q, k, v, causal=True)

    assert rel_error(tuned[0], ref.forward(reference, *values)) < TOLERANCE["bfloat16"]
    cot_seen = torch_fw.to_numpy(torch_fw.asarray(cot, "bfloat16"))
    for got, want in zip(tuned[2:], ref.vjp(reference, values, cot_seen, n_diff=3)):
        assert rel_error(got, want) < 2 * GRAD_TOLERANCE["bfloat16"]


def test_registered_op_reads_strided_inputs_on_gpu():
    # The public function makes inputs contiguous; a direct call of the registered op with a strided
    # view read it as if dense on CUDA. Its launches now copy such inputs (the dispatcher itself
    # hands a body strided tensors: a ZeroTensor arrives as an expanded zero).
    import torch

    q = torch.randn(1, 2, 16, 32, device="cuda").transpose(1, 2)  # [1, 16, 2, 32], not contiguous
    k = torch.randn(1, 16, 2, 32, device="cuda")
    call = lambda q: torch.ops.ejkernel.flash_attention_fwd(q, k, k, None, None, None, None, None, None, 0, 0,  # noqa: E731
                                                           32 ** -0.5, -1, -1, 0.0, 0.0)
    for got, want in zip(call(q), call(q.contiguous()), strict=True):
        assert torch.equal(got, want)
