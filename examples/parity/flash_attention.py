"""Parity cases for flash attention: dense (causal GQA; window + soft cap + bias + segments) and varlen."""
import numpy as np

from ejkernel_torch import reference

from . import Case, register


def _dense(batch, seq_q, seq_k, heads_q, heads_kv, head_dim, bias=False, segments=False):
    def make(rng):
        arrays = [rng.standard_normal((batch, seq_q, heads_q, head_dim)),
                  rng.standard_normal((batch, seq_k, heads_kv, head_dim)),
                  rng.standard_normal((batch, seq_k, heads_kv, head_dim))]
        if bias:
            arrays.append(rng.standard_normal((1, heads_q, seq_q, seq_k)))
        if segments:
            arrays += [np.sort(rng.integers(0, 3, size=(batch, s)), axis=1).astype(np.int32) for s in (seq_q, seq_k)]
        return arrays

    return make


def _varlen(cu_q, cu_k, heads_q, heads_kv, head_dim):
    def make(rng):
        return [rng.standard_normal((cu_q[-1], heads_q, head_dim)), rng.standard_normal((cu_k[-1], heads_kv, head_dim)),
                rng.standard_normal((cu_k[-1], heads_kv, head_dim)), np.array(cu_q, np.int32),
                np.array(cu_k, np.int32)]

    return make


def _with_features(fn):
    """(q, k, v, bias, q_segment_ids, kv_segment_ids) positionally, for the report's calling convention."""
    def run(q, k, v, bias, q_seg, kv_seg, **options):
        return fn(q, k, v, bias=bias, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **options)

    return run


FEATURES = dict(sliding_window=(64, 16), logits_soft_cap=20.0)
VARLEN = dict(max_seqlen_q=300, max_seqlen_k=256, causal=True)
for dtype in ("float32", "bfloat16"):
    register(
        Case("flash_attention", "2x300,h4/2,d64", dtype, _dense(2, 300, 300, 4, 2, 64),
             reference.flash_attention, n_diff=3, kwargs=dict(causal=True)),
        Case("flash_attention", "2x200x260,d80+", dtype, _dense(2, 200, 260, 2, 1, 80, bias=True, segments=True),
             _with_features(reference.flash_attention), n_diff=4, kwargs=FEATURES,
             resolve=lambda m: _with_features(m.flash_attention)),
        Case("flash_attention_varlen", "3 seqs,d128", dtype, _varlen([0, 100, 400, 450], [0, 256, 300, 500], 4, 1, 128),
             reference.flash_attention_varlen, n_diff=3, kwargs=VARLEN),
    )
