"""flash_attention / flash_attention_varlen over a feature matrix (issue #3), both fronts.

Features: dtype x causal x sliding window x GQA/MQA x soft cap x bias (grad / broadcast grad /
float32 without grad) x segment ids x varlen x dropout x (seq_q, seq_k) x head_dim. The default
set is a covering array built below: every value of every feature, and every allowed pair of
values of two features, appears in at least one case (``test_matrix_covers_every_pair`` checks
it), at small odd sizes. The ``slow`` set adds seq 1000 / 127 vs 1000 / 1 vs 1000 and head_dim
80/128. Every case checks out, lse, dq/dk/dv (and dbias when the bias is differentiated) against
float64 with fresh random inputs; dropout cases use the kernels' own keep mask and check that the
other front draws the same one. test_flash_attention.py holds the hand-picked cases; this file
fills the combinations it does not reach (dropout with bias/segments/GQA/windows/varlen, dbias
with broadcasts and soft caps, decode shapes, float32 bias with half inputs, ...).

Every assertion message carries ``seed``: ``_check(frameworks.get(front), CASE, seed)`` replays it
(slow cases: add ``batch=1, n_seq=2``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import numpy as np
import pytest

from tests import frameworks
from tests import references as ref
from tests.frameworks import TOLERANCE, lse_error, rel_error
# Gradients: the flash suite's bound, against float64 gradients that model the kernels' delta
# (ref.flash_vjp: delta = rowsum(out * dout) reads the rounded out, as in FlashAttention-2).
from tests.test_flash_attention import GRAD_TOLERANCE

LSE_TOLERANCE = 1e-5  # lse is float32 in every dtype
DROPOUT_P = 0.25
SOFTCAP = 2.0
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1), "mqa2": (2, 1), "mha1": (1, 1)}  # (heads_q, heads_kv)
WINDOWS = {"none": [None], "int": [5, 2], "pair": [(7, 2), (None, 3), (4, None)]}  # picked by case index
BIAS_BROADCAST = [(1, 0), (0, 1), (1, 1)]  # (batch is 1, heads is 1) for "bcast", picked by case index


@dataclass(frozen=True)
class Case:
    dtype: str
    causal: bool
    window: str  # key of WINDOWS
    heads: str  # key of HEADS
    softcap: bool
    bias: str  # none | full (differentiated) | bcast (differentiated, broadcast) | const (float32, no grad)
    segments: bool
    varlen: bool
    dropout: bool
    seq: tuple[int, int]  # (seq_q, seq_k); varlen: the max lengths
    head_dim: int
    index: int = 0  # picks the window / broadcast variant

    @property
    def id(self) -> str:
        parts = [{"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[self.dtype], self.heads,
                 f"{self.seq[0]}x{self.seq[1]}", f"d{self.head_dim}", "causal" * self.causal,
                 "" if self.window == "none" else f"win={self.sliding_window}".replace(" ", ""),
                 "cap" * self.softcap, "" if self.bias == "none" else f"bias-{self.bias}",
                 "seg" * self.segments, "varlen" * self.varlen, "drop" * self.dropout]
        return "-".join(p for p in parts if p)

    @property
    def sliding_window(self):
        options = WINDOWS[self.window]
        return options[self.index % len(options)]


# -- the covering array ------------------------------------------------------------------------------

FACTORS = {
    "dtype": ("float32", "float16", "bfloat16"),
    "causal": (False, True),
    "window": ("none", "int", "pair"),
    "heads": ("mha", "gqa", "mqa"),
    "softcap": (False, True),
    "bias": ("none", "full", "bcast", "const"),
    "segments": (False, True),
    "varlen": (False, True),
    "dropout": (False, True),
    "seq": ((1, 1), (17, 17), (1, 37), (23, 45), (45, 23)),  # decode, self, q < k, q > k (masked rows)
    "head_dim": (32, 64),
}


def _allowed(row: dict) -> bool:
    """Varlen takes no bias or segment ids (a ValueError, tested below)."""
    if row.get("varlen"):
        return row.get("bias", "none") == "none" and not row.get("segments", False)
    return True


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(FACTORS, 2) if a in row and b in row}


def _required_pairs() -> set:
    return {p for a, b in itertools.combinations(FACTORS, 2) for va in FACTORS[a] for vb in FACTORS[b]
            if _allowed({a: va, b: vb}) for p in _pairs({a: va, b: vb})}


def covering_rows() -> list[dict]:
    """Greedy, deterministic pairwise covering: seed each row with the first uncovered pair, then
    give every other factor the allowed value that covers the most uncovered pairs."""
    uncovered = _required_pairs()
    rows = []
    while uncovered:
        (fa, va), (fb, vb) = min(uncovered, key=lambda p: (list(FACTORS).index(p[0][0]), list(FACTORS).index(p[1][0]),
                                                             FACTORS[p[0][0]].index(p[0][1]),
                                                             FACTORS[p[1][0]].index(p[1][1])))
        row = {fa: va, fb: vb}
        for name, values in FACTORS.items():
            if name in row:
                continue
            scored = [(len(_pairs({**row, name: v}) & uncovered), -i, v) for i, v in enumerate(values)
                      if _allowed({**row, name: v})]
            row[name] = max(scored, key=lambda s: s[:2])[2]
        uncovered -= _pairs(row)
        rows.append({n: row[n] for n in FACTORS})
    return rows


CASES = [Case(**row, index=i) for i, row in enumerate(covering_rows())]


def test_matrix_covers_every_pair():
    covered = set().union(*(_pairs({f.name: getattr(c, f.name) for f in fields(Case) if f.name in FACTORS})
                            for c in CASES))
    missing = _required_pairs() - covered
    assert not missing, sorted(missing)[:5]
    assert all(_allowed(vars(c)) for c in CASES)
    # every window / broadcast variant is reached too
    for window in ("int", "pair"):
        assert {c.sliding_window for c in CASES if c.window == window} == set(WINDOWS[window])
    assert {BIAS_BROADCAST[c.index % len(BIAS_BROADCAST)] for c in CASES if c.bias == "bcast"} == set(BIAS_BROADCAST)
    assert len(CASES) <= 30  # the default set's CPU budget


# -- one case ----------------------------------------------------------------------------------------


def _segments(rng, batch, seq, n_ids=3):
    """Sorted ids 1..n_ids, and a tail of padding (<= 0) in every row but the first."""
    ids = np.sort(rng.integers(1, n_ids + 1, size=(batch, seq)), axis=1).astype(np.int32)
    for b in range(1, batch):
        ids[b, seq - rng.integers(1, seq + 1):] = -int(rng.integers(0, 2))  # 0 or -1: both padding
    return ids


def _lengths(rng, n, max_len, empty=True):
    """n lengths in [0, max_len] with max_len reached and (with ``empty``) one empty sequence."""
    lengths = rng.integers(0 if empty else 1, max_len + 1, size=n)
    lengths[0] = max_len
    if empty:
        lengths[-1] = 0
    return rng.permutation(lengths)


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@dataclass
class _Problem:
    diff: list  # framework arrays that get gradients: q, k, v[, bias]
    values: list  # the numpy values they hold
    op: callable  # op(*diff, return_lse=False)
    reference: callable  # float64 torch, same signature
    dtype: str
    keep: np.ndarray | None = None  # dense: [batch|1, 1, seq_q, seq_k] which logits the masks keep


def _problem(fw, case: Case, seed: int, batch: int = 2, n_seq: int = 3, tail: int = 2,
             lengths: tuple | None = None) -> _Problem:
    """Inputs, op and float64 reference of a case. Varlen: ``lengths`` = (lengths_q, lengths_k)
    overrides the drawn sequence lengths."""
    rng = np.random.default_rng(seed)
    dtype, (heads_q, heads_kv), (seq_q, seq_k), head_dim = case.dtype, HEADS[case.heads], case.seq, case.head_dim
    options = dict(causal=case.causal)
    if case.window != "none":
        options["sliding_window"] = case.sliding_window
    if case.softcap:
        options["logits_soft_cap"] = SOFTCAP
    op_kw, ref_kw = dict(options), dict(options)

    if case.varlen:
        # one empty query sequence; every sequence has keys (test_varlen_sequence_without_keys has none)
        lengths_q = _lengths(rng, n_seq, seq_q)
        lengths_k = np.maximum(lengths_q, 1) if seq_q == seq_k else _lengths(rng, n_seq, seq_k, empty=False)
        if lengths is not None:
            lengths_q, lengths_k = (np.array(n) for n in lengths)
            n_seq = len(lengths_q)
        cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
        # tokens past cu_seqlens[-1]: outputs and gradients there must be 0
        shapes = [(cu_q[-1] + tail, heads_q, head_dim)] + [(cu_k[-1] + tail, heads_kv, head_dim)] * 2
        mask_batch = n_seq
    else:
        shapes = [(batch, seq_q, heads_q, head_dim)] + [(batch, seq_k, heads_kv, head_dim)] * 2
        mask_batch = batch
    diff = [fw.asarray(rng.standard_normal(s), dtype) for s in shapes]

    if case.bias in ("full", "bcast"):
        bb, bh = (batch, heads_q)
        if case.bias == "bcast":
            one_b, one_h = BIAS_BROADCAST[case.index % len(BIAS_BROADCAST)]
            bb, bh = (1 if one_b else batch), (1 if one_h else heads_q)
        diff.append(fw.asarray(rng.standard_normal((bb, bh, seq_q, seq_k)), dtype))
    elif case.bias == "const":
        bias = fw.asarray(rng.standard_normal((1, heads_q, seq_q, seq_k)), "float32")
        op_kw["bias"], ref_kw["bias"] = bias, ref._t(fw.to_numpy(bias))
    if case.segments:
        q_seg = _segments(rng, batch, seq_q)
        kv_seg = q_seg if seq_q == seq_k else _segments(rng, batch, seq_k)
        op_kw.update(q_segment_ids=fw.asarray(q_seg), kv_segment_ids=fw.asarray(kv_seg))
        ref_kw.update(q_segment_ids=ref._t(q_seg), kv_segment_ids=ref._t(kv_seg))
    if case.dropout:
        dropout_seed = int(rng.integers(-2**31, 2**31))
        mask = fw.to_numpy(fw.ops.flash_attention_dropout_mask(dropout_seed, mask_batch, heads_q, seq_q, seq_k,
                                                               DROPOUT_P))
        assert mask.dtype == np.bool_ and mask.shape == (mask_batch, heads_q, seq_q, seq_k)
        other = frameworks.get("jax" if fw.name == "torch" else "torch")
        other_mask = other.to_numpy(other.ops.flash_attention_dropout_mask(dropout_seed, mask_batch, heads_q, seq_q,
                                                                           seq_k, DROPOUT_P))
        np.testing.assert_array_equal(mask, other_mask, err_msg=f"torch and jax masks differ, seed={seed}")
        op_kw.update(dropout_p=DROPOUT_P, dropout_seed=dropout_seed)
        ref_kw.update(dropout_p=DROPOUT_P, dropout_mask=ref._t(mask))

    if case.varlen:
        cu = fw.asarray(cu_q), fw.asarray(cu_k)

        def op(q, k, v, return_lse=False):
            return fw.ops.flash_attention_varlen(q, k, v, *cu, seq_q, seq_k, return_lse=return_lse, **op_kw)

        def reference(q, k, v, return_lse=False):
            return ref.flash_attention_varlen(q, k, v, ref._t(cu_q), ref._t(cu_k), seq_q, seq_k,
                                              return_lse=return_lse, **ref_kw)
    else:
        def op(q, k, v, bias=None, return_lse=False):
            kw = op_kw if bias is None else dict(op_kw, bias=bias)
            return fw.ops.flash_attention(q, k, v, return_lse=return_lse, **kw)

        def reference(q, k, v, bias=None, return_lse=False):
            kw = ref_kw if bias is None else dict(ref_kw, bias=bias)
            return ref.flash_attention(q, k, v, return_lse=return_lse, **kw)

    keep = None if case.varlen else ref.flash_attention_keep(
        seq_q, seq_k, causal=case.causal, sliding_window=options.get("sliding_window"),
        q_segment_ids=ref_kw.get("q_segment_ids"), kv_segment_ids=ref_kw.get("kv_segment_ids")).numpy()
    return _Problem(diff, [fw.to_numpy(a) for a in diff], op, reference, dtype, keep)


def _run(fw, problem: _Problem, seed: int):
    """(out, lse, grads, dout values) from the framework."""
    out, lse = problem.op(*problem.diff, return_lse=True)
    out, lse = fw.to_numpy(out), fw.to_numpy(lse)
    dout = fw.asarray(np.random.default_rng(seed + 1).standard_normal(out.shape), problem.dtype)
    grads = fw.vjp(problem.op, problem.diff, dout)
    return out, lse, grads, fw.to_numpy(dout)


def _grad_error(got, want, scale, zero: bool) -> float:
    """rel_error against ``want`` (ref.flash_vjp), except where the exact gradient is identically 0
    (``zero``: dq/dk/dbias when every row attends at most one key, softmax has no slope there).
    ``want`` is then only the modelled rounding noise of delta, and float32 arithmetic noise around
    it is as large, so the difference is measured against ``scale`` (dv)."""
    if not zero or not np.isfinite(got).all():
        return rel_error(got, want)
    return float(np.linalg.norm(got - want) / (np.linalg.norm(scale) or 1.0))


def _check(fw, case: Case, seed: int, **problem_options):
    problem = _problem(fw, case, seed, **problem_options)
    out, lse, grads, dout = _run(fw, problem, seed)
    tol, grad_tol = TOLERANCE[case.dtype], GRAD_TOLERANCE[case.dtype]
    msg = f"{fw.name} {case.id} seed={seed}"

    want_out, want_lse = (t.numpy() for t in problem.reference(*(ref._t(a) for a in problem.values),
                                                                return_lse=True))
    err = rel_error(out, want_out)
    assert err < tol, f"out: rel error {err:.3g} >= {tol} ({msg})"
    empty = np.isneginf(want_lse)  # rows that attend nothing: lse -inf, out and dq exactly 0
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg=f"lse -inf pattern ({msg})")
    err = lse_error(lse[~empty], want_lse[~empty])
    assert err < LSE_TOLERANCE, f"lse: rel error {err:.3g} ({msg})"
    # rows of out / dq in lse's layout: [b, hq, sq] dense, [hq, total_q] varlen
    rows = (lambda x: x.transpose(1, 0, 2)) if case.varlen else (lambda x: x.transpose(0, 2, 1, 3))
    assert not rows(out)[empty].any(), f"rows that attend nothing are not 0 ({msg})"

    n = len(problem.values)
    exact = ref.vjp(problem.reference, problem.values, dout, n_diff=n)
    expected = ref.flash_vjp(problem.reference, problem.values, out, dout, n_diff=n, varlen=case.varlen)
    for name, got, want, zero in zip(["dq", "dk", "dv", "dbias"], grads, expected, exact):
        assert got.shape == want.shape, (name, got.shape, want.shape, msg)
        err = _grad_error(got, want, expected[2], zero=not zero.any())
        assert err < grad_tol, f"{name}: rel error {err:.3g} >= {grad_tol} ({msg})"
    assert not rows(grads[0])[empty].any(), f"dq of rows that attend nothing is not 0 ({msg})"
    if case.varlen:  # tokens past cu_seqlens[-1]
        for name, x in (("out", out), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
            assert not x[-2:].any(), f"{name} past cu_seqlens[-1] is not 0 ({msg})"
    else:  # keys no query may attend (window, causal, segments) get exactly zero dk, dv; masked logits 0 dbias
        keep = np.broadcast_to(problem.keep, (out.shape[0], out.shape[2], *problem.keep.shape[2:]))
        unseen = ~keep.any(axis=(1, 2))  # [b, sk]
        for name, g in (("dk", grads[1]), ("dv", grads[2])):
            assert not g[unseen].any(), f"{name} of keys nobody attends is not 0 ({msg})"
        if len(grads) == 4:
            dims = tuple(d for d in (0, 1) if grads[3].shape[d] == 1)
            reached = keep.any(axis=dims, keepdims=True) if dims else keep
            assert not grads[3][~np.broadcast_to(reached, grads[3].shape)].any(), f"dbias of masked logits ({msg})"


def _seed(rng) -> int:
    return int(rng.integers(0, 2**31 - 1))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matrix_matches_float64(fw, rng, case):
    _check(fw, case, _seed(rng))


# -- slow: long sequences, head_dim 80 / 128 ---------------------------------------------------------
# One front per case (both run the same kernels; they are compared on small shapes).

SLOW_CASES = [  # batch 1 / 2 sequences, few heads: a 1000 x 1000 problem costs ~10-40 s per head here
    ("torch", Case("bfloat16", True, "int", "mqa2", False, "full", False, False, True, (1000, 1000), 80, index=0)),
    ("jax", Case("float32", False, "int", "mqa2", True, "bcast", True, False, False, (1000, 1000), 128, index=2)),
    ("jax", Case("float16", True, "none", "mha1", True, "none", False, True, False, (1000, 1000), 128)),
    ("torch", Case("float16", False, "none", "mqa2", False, "const", True, False, True, (127, 1000), 80)),
    ("jax", Case("bfloat16", True, "none", "mha", True, "bcast", False, False, False, (1000, 127), 80, index=1)),
    ("torch", Case("float32", True, "none", "gqa", False, "full", False, False, True, (1, 1000), 128)),
    ("torch", Case("bfloat16", False, "pair", "mqa", False, "none", False, True, True, (127, 1000), 64, index=0)),
]


@pytest.mark.slow
@pytest.mark.parametrize("front, case", SLOW_CASES, ids=[f"{f}-{c.id}" for f, c in SLOW_CASES])
def test_matrix_long(rng, front, case):
    _check(frameworks.get(front), case, _seed(rng), batch=1, n_seq=2)


# -- torch vs jax ------------------------------------------------------------------------------------


def _parity_cases() -> list[Case]:
    """The first dense and the first varlen dropout case, the first broadcast (summed) dbias, the first bf16."""
    picked = {}
    for c in CASES:
        for key, wanted in ((("drop", c.varlen), c.dropout), ("bcast", c.bias == "bcast"),
                            ("bf16", c.dtype == "bfloat16")):
            if wanted and c not in picked.values():
                picked.setdefault(key, c)
    return list(picked.values())


PARITY_CASES = _parity_cases()


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c.id for c in PARITY_CASES])
def test_torch_and_jax_agree(torch_fw, jax_fw, rng, case):
    """Same inputs, same plans: the same bits in both fronts (out, lse, dq, dk, dv, dbias)."""
    seed = _seed(rng)
    results = [_run(f, _problem(f, case, seed), seed) for f in (torch_fw, jax_fw)]
    (out_t, lse_t, grads_t, _), (out_j, lse_j, grads_j, _) = results
    for name, a, b in [("out", out_t, out_j), ("lse", lse_t, lse_j)] + list(zip(["dq", "dk", "dv", "dbias"],
                                                                                grads_t, grads_j)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} differs between torch and jax ({case.id} seed={seed})")


# (seed, batch, heads, seq_q, seq_k, p): extreme seeds, odd sizes, p from 0 to 0.9
MASK_CASES = [(0, 1, 1, 1, 1, 0.5), (-1, 2, 3, 17, 45, 0.1), (2**31 - 1, 3, 2, 45, 23, 0.9),
              (-2**31, 1, 5, 7, 127, 0.0), (123456789, 2, 1, 33, 70, 0.5)]


@pytest.mark.parametrize("seed, batch, heads, seq_q, seq_k, p", MASK_CASES)
def test_dropout_masks_agree(torch_fw, jax_fw, seed, batch, heads, seq_q, seq_k, p):
    masks = [f.to_numpy(f.ops.flash_attention_dropout_mask(seed, batch, heads, seq_q, seq_k, p))
             for f in (torch_fw, jax_fw)]
    for m in masks:
        assert m.dtype == np.bool_ and m.shape == (batch, heads, seq_q, seq_k)
    np.testing.assert_array_equal(*masks)
    if p == 0.0:
        assert masks[0].all()
    elif masks[0].size >= 1000:
        assert abs(masks[0].mean() - (1 - p)) < 0.05
    # a Python int seed is taken modulo 2**32
    wrapped = torch_fw.to_numpy(torch_fw.ops.flash_attention_dropout_mask(seed + 2**32, batch, heads, seq_q, seq_k, p))
    np.testing.assert_array_equal(wrapped, masks[0])


def test_dropout_mask_is_the_padded_problem_for_varlen(fw):
    """Varlen sequence i draws the [i, :, :len_q, :len_k] corner of the padded mask: with v = I the
    output rows are the kept probabilities, so zeros of the output sit exactly where the mask drops."""
    seed, p, d = 77, 0.5, 16
    lengths_q, lengths_k = np.array([5, 0, 9]), np.array([7, 3, 16])
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    q = fw.asarray(np.zeros((cu_q[-1], 1, d)), "float32")
    k = fw.asarray(np.zeros((cu_k[-1], 1, d)), "float32")  # uniform attention over each sequence
    v = fw.asarray(np.concatenate([np.eye(d)[:n] for n in lengths_k])[:, None, :], "float32")  # key j carries e_j
    out = fw.to_numpy(fw.ops.flash_attention_varlen(q, k, v, fw.asarray(cu_q), fw.asarray(cu_k), 9, 16,
                                                    dropout_p=p, dropout_seed=seed))
    mask = fw.to_numpy(fw.ops.flash_attention_dropout_mask(seed, 3, 1, 9, 16, p))
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        got = out[cu_q[i]:cu_q[i + 1], 0, :lk]
        np.testing.assert_allclose(got, mask[i, 0, :lq, :lk] / (lk * (1 - p)), rtol=1e-6, atol=0)


def test_varlen_sequence_without_keys(fw, rng):
    """Packed sequences with queries but no keys, and with neither: those rows attend nothing (out 0,
    lse -inf, dq 0), and the others match float64."""
    case = Case("float32", False, "none", "gqa", False, "none", False, True, True, (17, 23), 32)
    lengths, seed = ([17, 5, 0, 9], [0, 23, 0, 4]), _seed(rng)
    problem = _problem(fw, case, seed, lengths=lengths)
    out, lse = (fw.to_numpy(t) for t in problem.op(*problem.diff, return_lse=True))
    assert not out[:17].any() and np.isneginf(lse[:, :17]).all() and np.isfinite(lse[:, 17:31]).all()
    dq = fw.vjp(problem.op, problem.diff, fw.asarray(np.ones(out.shape), "float32"))[0]
    assert np.isfinite(dq).all() and not dq[:17].any()
    _check(fw, case, seed, lengths=lengths)  # float64 reference included


# -- varlen with bias / segment ids: rejected by design ----------------------------------------------


@pytest.mark.parametrize("arg, match", [("bias", "bias"), ("q_segment_ids", "segment ids"),
                                        ("kv_segment_ids", "segment ids"), ("both_segment_ids", "segment ids")])
def test_varlen_rejects_bias_and_segment_ids(fw, arg, match):
    x = fw.asarray(np.zeros((10, 2, 16)), "float32")
    cu = fw.asarray(np.array([0, 4, 10], np.int32))
    seg = fw.asarray(np.ones((2, 5), np.int32))
    kwargs = {"bias": dict(bias=fw.asarray(np.zeros((2, 2, 6, 6)), "float32")),
              "q_segment_ids": dict(q_segment_ids=seg), "kv_segment_ids": dict(kv_segment_ids=seg),
              "both_segment_ids": dict(q_segment_ids=seg, kv_segment_ids=seg)}[arg]
    with pytest.raises(ValueError, match=match):
        fw.ops.flash_attention_varlen(x, x, x, cu, cu, 6, 6, **kwargs)
