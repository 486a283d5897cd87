"""The plans each registered torch op's body may build, by op: small problems over the paths
(Triton tiles, the Triton and Gluon flash backwards, vmap's batches of problems, Gluon where the
facts allow it). Shared by the tests that check every plan of an op against torch.compile
(test_compile_mutations, test_compile_cache_key). Framework-free: plans only."""
from triton_kernels import flash_attention as fa
from triton_kernels import padded_attention as pa, softmax as sm
from triton_kernels.grouped_matmul import gmm_plan, tgmm_plan


def _flash_specs():
    shape = lambda seq, heads, d: (2, seq, heads, d)  # noqa: E731
    yield fa.dense_spec(shape(256, 4, 64), shape(256, 2, 64), shape(256, 2, 64), ("bfloat16",) * 3, causal=True)
    yield fa.dense_spec(shape(1024, 4, 128), shape(1024, 4, 128), shape(1024, 4, 128), ("bfloat16",) * 3,
                        causal=True)  # the Gluon kernels where the facts have them
    yield fa.dense_spec(shape(1024, 4, 64), shape(1024, 4, 64), shape(1024, 4, 64), ("bfloat16",) * 3)  # Triton dq
    yield fa.dense_spec(shape(37, 4, 80), shape(37, 4, 80), shape(37, 4, 80), ("float32",) * 3, dropout_p=0.1)


def _grouped(build, flag: bool, facts, **options):
    return build(64, 32, 48, 3, 3, flag, "bfloat16", "bfloat16", facts, **options)


def plans_by_op(facts) -> dict[str, list]:
    """{op name without the ``ejkernel::`` namespace: its plans on ``facts``}."""
    specs = list(_flash_specs())
    batches = [{}, {"batch": 4}]  # torch.func.vmap's batches of problems
    return {
        "flash_attention_fwd": [fa.forward_plan(s, facts) for s in specs],
        "flash_attention_bwd": [p for s in specs for dlse in (False, True)
                                for p in fa.backward_plans(s, facts, False, dlse)],
        "flash_attention_dropout_mask": [fa.dropout_mask_plan(2, 4, 37, 37, 0.1, facts)],
        "grouped_matmul": [_grouped(gmm_plan, t, facts, **b) for t in (False, True) for b in batches]
        + [_grouped(gmm_plan, True, facts, batch=4, shared_rhs=True)],
        # the first: the gmm backward's weight gradient, which takes the Gluon kernel on a Gluon Hopper
        "transposed_grouped_matmul": [tgmm_plan(256, 32, 48, 2, 2, True, "bfloat16", "bfloat16", facts)]
        + [_grouped(tgmm_plan, mk, facts, **b) for mk in (False, True) for b in batches],
        "padded_attention_fwd": [pa.attention_fwd_plan((2, 32, 16), "float32", 0.25, facts)],
        "padded_attention_bwd": list(pa.attention_bwd_plans((2, 32, 16), "float32", 0.25, facts)),
        "softmax_rows_fwd": [sm.softmax_fwd_plan(8, 32, "float32", facts)],
        "softmax_rows_bwd": [sm.softmax_bwd_plan(8, 32, "float32", facts)],
        "padded_softmax_fwd": [sm.padded_softmax_fwd_plan(2, 32, "float32", facts)],
        "padded_softmax_v_fwd": [pa.scores_v_fwd_plan((2, 32, 16), "float32", facts)],
        "padded_softmax_v_bwd": list(pa.scores_v_bwd_plans((2, 32, 16), "float32", facts)),
    }
