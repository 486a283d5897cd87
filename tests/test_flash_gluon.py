"""The warp-specialized Gluon flash kernels (the forward, and the backward's dk/dv and dq passes):
which calls the plans route to them, that their plans compile for sm_90 (CPU CI, no GPU), and on a Hopper GPU
that they are correct, forward and through the backward, and bitwise the same from torch and jax."""
import dataclasses
import re

import numpy as np
import pytest

from tests import references as ref
from tests.frameworks import TOLERANCE, rel_error
from tests.test_flash_attention import check_dq_plan
from tests.test_gpu_flash_attention import GRAD_TOLERANCE, _inputs, _run
from triton_kernels import HOPPER, HOPPER_GLUON
from triton_kernels import flash_attention as fa
from triton_kernels.flash_attention import gluon_backward, gluon_forward
from triton_kernels.flash_attention.plan import (GLUON_DQ_MIN_SEQ_K_D64, gluon_dkdv_plan, gluon_dq_plan,
                                                gluon_forward_plan, static_walk, triton_forward_plan,
                                                uses_gluon, uses_gluon_dkdv, uses_gluon_dq)
from triton_kernels.flash_attention.schedule import claim_order, pair_walk, persistent_schedule, query_walk
from triton_kernels.params import BwdParams, FwdParams

needs_gluon = pytest.mark.skipif(not gluon_forward.AVAILABLE, reason="this Triton has no Gluon")


def _spec(dtype="bfloat16", head_dim=128, seq_q=300, seq_k=8192, **options):
    q, kv = (2, seq_q, 4, head_dim), (2, seq_k, 2, head_dim)
    return fa.dense_spec(q, kv, kv, (dtype,) * 3, **options)


# -- routing (any machine) --------------------------------------------------------------------------

@needs_gluon
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(head_dim=64, dtype="float16"),
                                     dict(causal=True, seq_q=8192), dict(sliding_window=(20_000, 0)),
                                     dict(seq_k=1000), dict(seq_q=1, seq_k=1), dict(head_dim=64, seq_k=1000)])
def test_plain_calls_on_hopper_take_the_gluon_forward(options):
    plan = fa.forward_plan(_spec(**options), HOPPER_GLUON)
    assert plan.is_gluon and plan.maxnreg == gluon_forward.forward_maxnreg(plan.constexpr_dict["CONSUMERS"])


@needs_gluon
@pytest.mark.parametrize("head_dim, causal, seq_q, seq_k, consumers", [
    (64, False, 2048, 16384, 3), (64, False, 16384, 16384, 3), (64, False, 300, 16384, 3),
    (64, False, 150, 128, 3),
    (64, False, 1024, 16384, 3),  # 192-row tiles pad to 1152 rows: the last tile's two empty parts skip
    (64, False, 1000, 16384, 3), (64, False, 100, 16384, 3),
    (64, False, 2048, 16383, 2),  # a partial key block
    (64, True, 16384, 16384, 2), (128, False, 16384, 16384, 2)])
def test_gluon_forward_takes_three_consumers_at_head_dim_64_without_a_mask(head_dim, causal, seq_q, seq_k,
                                                                           consumers):
    spec = _spec(head_dim=head_dim, seq_q=seq_q, seq_k=seq_k, causal=causal)
    plan = fa.forward_plan(spec, HOPPER_GLUON)
    assert plan.is_gluon and plan.constexpr_dict["CONSUMERS"] == consumers
    # 4 warps a consumer and 4 for the loader's warpgroup share the 64K-register file
    assert plan.maxnreg * 32 * 4 * (consumers + 1) <= 65536 and plan.maxnreg == (168 if consumers == 2 else 128)
    want_grid = -(-seq_q // (64 * consumers)) * 2 * 4  # 2 batch rows, 4 heads: a program a tile if it fits
    assert plan.grid == (min(want_grid, HOPPER_GLUON.num_sms),)


@needs_gluon
def test_gluon_forward_plan_takes_a_consumer_count_for_probes():
    spec = _spec(head_dim=64, causal=True)
    assert fa.forward_plan(spec, HOPPER_GLUON).constexpr_dict["CONSUMERS"] == 2
    three = gluon_forward_plan(spec, HOPPER_GLUON, consumers=3)
    assert three.constexpr_dict["CONSUMERS"] == 3 and three.maxnreg == 128
    with pytest.raises(ValueError, match="consumers must be 2 or 3"):
        gluon_forward_plan(spec, HOPPER_GLUON, consumers=4)


@needs_gluon
@pytest.mark.parametrize("seq_k, causal, tail", [(8192, False, False), (1000, False, True), (1, False, True),
                                                 (8192, True, False), (1000, True, True)])
def test_gluon_forward_compiles_the_key_mask_only_for_a_partial_last_block(seq_k, causal, tail):
    plan = fa.forward_plan(_spec(seq_q=min(300, seq_k), seq_k=seq_k, causal=causal), HOPPER_GLUON)
    assert plan.is_gluon and plan.constexpr_dict["KEY_TAIL"] is tail


@pytest.mark.parametrize("options", [
    dict(dtype="float32"), dict(head_dim=80), dict(head_dim=256),
    dict(causal=True, seq_q=8193), dict(sliding_window=100), dict(sliding_window=(20_000, 5)),
    dict(logits_soft_cap=30.0), dict(softmax_scale=-0.1), dict(dropout_p=0.1),
    dict(bias_shape=(1, 4, 300, 8192), bias_dtype="bfloat16"),
    dict(q_segment_shape=(2, 300), q_segment_dtype="int32", kv_segment_shape=(2, 8192), kv_segment_dtype="int32"),
])
def test_other_calls_keep_the_triton_forward(options):
    assert not uses_gluon(_spec(**options), HOPPER_GLUON)
    assert not fa.forward_plan(_spec(**options), HOPPER_GLUON).is_gluon


@needs_gluon
@pytest.mark.parametrize("seq_q, causal, grid, pairs", [
    (300, False, 2 * 4 * 3, False), (16384, False, 132, False),
    (128, True, 2 * 4, False), (1, True, 2 * 4, False),
    (300, True, 2 * 4 * 3, False),  # 16 pairs would leave most SMs idle: a program a tile
    (16384, True, 132, True), (1100, True, 2 * 4 * 9, False)])
def test_gluon_forward_and_dq_schedules(seq_q, causal, grid, pairs):
    """The query-tile kernels' (grid, PAIRS) for 2 batch rows of 4 query heads, 16384 keys."""
    spec = _spec(seq_q=seq_q, seq_k=16384, causal=causal)
    for plan in (fa.forward_plan(spec, HOPPER_GLUON), fa.backward_plans(spec, HOPPER_GLUON).dq):
        assert plan.is_gluon and plan.grid == (grid,) and plan.constexpr_dict["PAIRS"] == pairs


@needs_gluon
@pytest.mark.parametrize("shape, causal, grid, pairs", [
    ((2, 300, 8192, 4, 2), False, 132, False),  # 256 key tiles
    ((16, 1024, 1024, 16, 16), True, 132, True),  # the benchmark's: 4 units an SM
    ((14, 1100, 1100, 16, 4), True, 14 * 4 * 9, False),  # 280 heavy GQA pairs (2.1 an SM): a program a tile
    ((3, 2048, 2048, 32, 4), True, 96, True),  # 96 pairs, one a program
])
def test_gluon_dkdv_schedules(shape, causal, grid, pairs):
    """The dk/dv kernel holds key tiles of each kv head; a tile's work is its queries in all the
    group's heads."""
    b, sq, sk, hq, hkv = shape
    spec = fa.dense_spec((b, sq, hq, 128), (b, sk, hkv, 128), (b, sk, hkv, 128), ("bfloat16",) * 3, causal=causal)
    plan = fa.backward_plans(spec, HOPPER_GLUON).dkdv
    assert plan.is_gluon and plan.grid == (grid,) and plan.constexpr_dict["PAIRS"] == pairs


def test_persistent_schedule_without_a_mask_is_a_program_an_sm_at_most():
    assert persistent_schedule([8.0] * 8, 500, False, 132, 128) == ((132,), False)
    assert persistent_schedule([8.0] * 3, 8, False, 132, 128) == ((24,), False)


def test_persistent_schedule_pairs_causal_tiles_where_the_round_robin_balances():
    causal_tiles = [m + 1.0 for m in range(8)]  # a square causal forward: tile m sees m + 1 blocks
    assert persistent_schedule(causal_tiles, 132, True, 132, 128) == ((132,), True)  # 4 equal units an SM
    assert persistent_schedule(causal_tiles, 2000, True, 132, 64) == ((132,), True)  # many units an SM
    assert persistent_schedule([5.0], 1000, True, 132, 128) == ((132,), False)  # one tile a row: nothing to pair


def test_persistent_schedule_runs_a_program_a_tile_where_the_last_round_would_idle():
    heavy = [72.0 - 8 * n for n in range(9)]  # GQA key tiles: 4 heads' queries
    assert persistent_schedule(heavy, 56, True, 132, 128) == ((504,), False)  # 280 pairs, 2.1 an SM
    # Light tiles: a program's start outweighs the idle tail.
    assert persistent_schedule([1.0 + n for n in range(9)], 56, True, 132, 128) == ((132,), True)


@pytest.mark.parametrize("walk", [pair_walk, query_walk])
def test_schedule_walks_cover_every_tile_once(walk):
    for programs in (1, 7, 132):
        for n_tiles in (2, 3, 8, 9, 19):
            for rows in (1, 2, 5, 31, 132, 133, 400):
                units = rows * -(-n_tiles // 2)
                if units < programs:
                    continue  # the grid is at most a program a unit
                tiles = [tile for g in range(programs) for tile in walk(g, programs, rows, n_tiles)]
                assert sorted(tiles) == [(r, t) for r in range(rows) for t in range(n_tiles)], (programs, n_tiles, rows)


@pytest.mark.parametrize("pairs", [True, False])
def test_claim_order_covers_every_tile_once_the_tail_largest_first(pairs):
    for programs in (1, 7, 132):
        for n_tiles in (1, 2, 3, 8, 9, 19):
            for rows in (1, 2, 5, 31, 132, 133, 400):
                order = claim_order(programs, rows, n_tiles, pairs)
                assert sorted(order) == [(r, t) for r in range(rows) for t in range(n_tiles)], (programs, n_tiles, rows)
                if pairs:  # the static walk's tiles, in another order
                    walked = [tile for g in range(min(programs, rows * -(-n_tiles // 2)))
                              for tile in query_walk(g, min(programs, rows * -(-n_tiles // 2)), rows, n_tiles)]
                    assert sorted(walked) == sorted(order)
    # The benchmark's causal seq 1024 at head_dim 128 on an H100: 7 rounds of pairs (rows 0-230),
    # then rows 231-255's tiles, every row's last tile before any row's next to last.
    order = claim_order(132, 256, 8, True)
    assert order[:4] == [(0, 7), (0, 0), (0, 6), (0, 1)] and len(order) == 256 * 8
    tail = order[2 * 924:]
    assert tail[:2] == [(231, 7), (232, 7)] and [t for _, t in tail] == sorted((t for _, t in tail), reverse=True)


def test_query_walk_evens_out_the_last_round():
    # The benchmark's causal seq 1024 at head_dim 128 on an H100: 1024 pair units of 9 blocks on
    # 132 programs. Pairs alone give the busiest program 8 units (72 blocks); the tail 71.
    work = [m + 1.0 for m in range(8)]
    def busiest(walk):
        return max(sum(work[t] for _, t in walk(g, 132, 256, 8)) for g in range(132))
    assert (busiest(pair_walk), busiest(query_walk)) == (72.0, 71.0)
    # Pairs of rows 0-230 (7 rounds), then rows 231-255 tile by tile, the last tiles first: program
    # 131 takes the first (row 231's tile 7) and nothing more; program 0 the 132nd and 133rd.
    assert query_walk(131, 132, 256, 8)[-3:] == [(230, 4), (230, 3), (231, 7)]
    assert query_walk(0, 132, 256, 8)[-4:] == [(198, 7), (198, 0), (237, 2), (238, 2)]


def test_gluon_forward_needs_a_launcher_for_it_and_no_params():
    spec = _spec()
    assert not fa.forward_plan(spec, HOPPER).is_gluon  # facts of a front that cannot run Gluon
    assert not fa.forward_plan(spec, dataclasses.replace(HOPPER_GLUON, capability=(8, 0))).is_gluon
    # params are the Triton kernel's tiles: giving them selects it
    plan = fa.forward_plan(spec, HOPPER_GLUON, FwdParams(blocksize_m=64))
    assert not plan.is_gluon and plan.constexpr_dict["BLOCK_M"] == 64
    assert triton_forward_plan(spec, HOPPER_GLUON) == fa.forward_plan(spec, HOPPER)


def _same_interface(plan, other):
    """The fronts launch either plan alike: same inputs, dtypes and outputs."""
    return (plan.inputs, plan.input_dtypes, plan.outputs) == (other.inputs, other.input_dtypes, other.outputs)


@needs_gluon
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(dtype="float16", seq_q=1, seq_k=1)])
def test_head_dim_128_backward_takes_the_gluon_dkdv_and_dq(options):
    plans = fa.backward_plans(_spec(**options), HOPPER_GLUON)
    assert plans.dq.is_gluon and plans.dkdv.is_gluon
    assert plans.dq.maxnreg == plans.dkdv.maxnreg == gluon_backward.MAXNREG
    assert list(plans) == [plans.dq, plans.dkdv]  # dq computes delta, which dk/dv read
    triton = fa.backward_plans(_spec(**options), HOPPER)
    assert list(triton) == [triton.dq, triton.dkdv]
    assert _same_interface(plans.dkdv, triton.dkdv) and _same_interface(plans.dq, triton.dq)
    for use_dlse in (False, True):
        gluon_dq = fa.backward_plans(_spec(**options), HOPPER_GLUON, False, use_dlse).dq
        assert gluon_dq.is_gluon and gluon_dq.constexpr_dict["USE_DLSE"] == use_dlse


@needs_gluon
@pytest.mark.parametrize("seq_k", [1, 1000, GLUON_DQ_MIN_SEQ_K_D64, 16384])
def test_head_dim_64_backward_takes_the_gluon_dkdv_and_from_its_own_length_dq(seq_k):
    spec = _spec(head_dim=64, seq_q=min(300, seq_k), seq_k=seq_k)
    plans = fa.backward_plans(spec, HOPPER_GLUON)
    assert plans.dkdv.is_gluon and uses_gluon_dkdv(spec, HOPPER_GLUON)
    assert plans.dq.is_gluon == uses_gluon_dq(spec, HOPPER_GLUON) == (seq_k >= GLUON_DQ_MIN_SEQ_K_D64)
    assert list(plans) == [plans.dq, plans.dkdv]
    assert fa.forward_plan(spec, HOPPER_GLUON).is_gluon


@pytest.mark.parametrize("options", [dict(dropout_p=0.1), dict(dtype="float32"), dict(head_dim=96),
                                     dict(causal=True, seq_q=8193)])
def test_other_backwards_keep_the_triton_kernels(options):
    assert not uses_gluon_dq(_spec(**options), HOPPER_GLUON) and not uses_gluon_dkdv(_spec(**options), HOPPER_GLUON)
    assert not any(plan.is_gluon for plan in fa.backward_plans(_spec(**options), HOPPER_GLUON))


def test_gluon_backward_needs_a_launcher_for_it_and_no_params():
    assert not any(plan.is_gluon for plan in fa.backward_plans(_spec(), HOPPER))
    plans = fa.backward_plans(_spec(), HOPPER_GLUON, params=BwdParams(blocksize_m=32))
    assert not any(plan.is_gluon for plan in plans) and plans.dkdv.constexpr_dict["BLOCK_M"] == 32



@needs_gluon
def test_tuning_leaves_the_gluon_forward_alone(isolated_config_cache):
    from triton_kernels import tuning

    spec = _spec()
    measured = []
    params = tuning.resolve(tuning.FLASH_FWD, spec, HOPPER_GLUON, "gpu0", autotune=True,
                            measure=lambda p: measured.append(p) or 1.0)
    assert params is None and not measured
    # where the Triton kernel is the default, its tiles are tuned as before
    assert tuning.FLASH_FWD.defaults(spec, HOPPER_GLUON)["blocksize_m"] == triton_forward_plan(
        spec, HOPPER).constexpr_dict["BLOCK_M"]


@needs_gluon
def test_tuning_leaves_the_gluon_backward_alone(isolated_config_cache):
    from triton_kernels import tuning

    measured = []
    params = tuning.resolve(tuning.FLASH_BWD, _spec(), HOPPER_GLUON, "gpu0", autotune=True,
                            measure=lambda p: measured.append(p) or 1.0)
    assert params is None and not measured


@needs_gluon
@pytest.mark.parametrize("head_dim, causal, shape, dynamic", [
    (128, True, (16, 1024, 16), True),  # causal pairs, 70 blocks a program
    (128, True, (8, 2048, 16), True),  # 132 blocks a program
    (128, True, (4, 4096, 16), False),  # 256: long enough for the static walk
    (128, True, (1, 4096, 16), True),  # 64
    (64, True, (16, 1024, 32), True),
    (64, True, (4, 4096, 32), False),  # a head_dim 64 block counts half: 256
    (64, False, (16, 1024, 32), True),  # more tiles than SMs
    (64, False, (4, 4096, 32), True),  # three consumers
    (128, False, (16, 1024, 16), False),  # measured slower there
    (64, False, (2, 300, 4), False),  # a program a tile
    (128, True, (1, 1000, 16), False)])  # a program a tile under a causal mask
def test_persistent_gluon_forward_claims_its_tiles(head_dim, causal, shape, dynamic):
    batch, seq, heads = shape
    q = (batch, seq, heads, head_dim)
    plan = fa.forward_plan(fa.dense_spec(q, q, q, ("bfloat16",) * 3, causal=causal), HOPPER_GLUON)
    assert plan.is_gluon and plan.constexpr_dict["DYNAMIC"] == dynamic
    counter = plan.outputs[-1]
    assert (counter.name, counter.shape, counter.dtype) == ("next_tile_ptr", (1,), "int32")
    assert counter.zeroed == dynamic and counter.resets == dynamic and not counter.returned
    assert [o.name for o in plan.outputs if o.returned] == ["o_ptr", "lse_ptr"]
    walked = static_walk(plan)  # what the GPU test and the probe compare claiming with
    assert not walked.constexpr_dict["DYNAMIC"] and not walked.outputs[-1].zeroed and not walked.outputs[-1].resets
    assert dataclasses.replace(walked, constexprs=plan.constexprs, outputs=plan.outputs) == plan
    from ejkernel_torch.launch import plan_from_text, plan_text  # the opaque op's text keeps the flags

    assert plan_from_text(plan_text(plan)) == plan and plan_from_text(plan_text(walked)) == walked


# -- ahead-of-time compile for sm_90 (any machine) --------------------------------------------------

@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gluon_plans_compile_for_hopper(dtype, causal, head_dim):
    from triton_kernels.aot import compile_plan

    spec = _spec(dtype, head_dim, causal=causal)
    plans = [fa.forward_plan(spec, HOPPER_GLUON), gluon_dq_plan(spec, HOPPER_GLUON), gluon_dkdv_plan(spec, HOPPER_GLUON)]
    if dtype == "bfloat16":  # the dq that folds a lse gradient into delta
        plans.append(gluon_dq_plan(spec, HOPPER_GLUON, use_dlse=True))
    for plan in plans:
        compiled = compile_plan(plan)
        assert compiled.metadata.shared <= HOPPER.shared_memory, plan.name
        # the default partition's 4, the other consumers' 4 each, the loader's 1 (+3 idle)
        assert compiled.metadata.num_warps == 4 * (plan.constexpr_dict.get("CONSUMERS", 2) + 1)
        assert compiled.metadata.global_scratch_size > 0  # the per-program TMA descriptors


@needs_gluon
@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, True)])
def test_gluon_forward_claiming_its_tiles_compiles_for_hopper(head_dim, causal):
    from triton_kernels.aot import compile_plan

    q = (8, 2048, 2048 // head_dim, head_dim)
    plan = fa.forward_plan(fa.dense_spec(q, q, q, ("bfloat16",) * 3, causal=causal), HOPPER_GLUON)
    assert plan.constexpr_dict["DYNAMIC"]
    compiled = compile_plan(plan)
    assert compiled.metadata.shared <= HOPPER.shared_memory
    assert compiled.metadata.num_warps == 4 * (plan.constexpr_dict["CONSUMERS"] + 1)
    # the claims, relaxed (a claim orders no other memory: no fence before each), and the last
    # claim's reset of the counter that the torch launcher keeps
    ptx = compiled.asm["ptx"]
    claims = re.findall(r"atom\.global\.[\w.]*add[\w.]*", ptx)
    assert claims and all(".relaxed." in c for c in claims), claims
    assert re.search(r"atom\.global\.[\w.]*exch", ptx)
    # the epilogue divides once a row (a thread holds two of a warpgroup's rows), not once an
    # output element (32 or 64 a thread), and multiplies
    divisions = re.findall(r"\bdiv\.[\w.]*f32", ptx)
    assert len(divisions) == 2 * plan.constexpr_dict["CONSUMERS"], divisions


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_sass_loops_finds_a_key_loop_for_each_consumer_warpgroup(causal):
    """``scripts/sass_loops.py`` weighs a forward's code without a GPU: each consumer warpgroup
    is a partition of its own, so each runs its own copy of the loop over key blocks."""
    from scripts.sass_loops import report

    q = (16, 1024, 32, 64)
    plan = fa.forward_plan(fa.dense_spec(q, q, q, ("bfloat16",) * 3, causal=causal), HOPPER_GLUON)
    found = report(plan)
    loops = found["key_loops"]
    assert len(loops) == plan.constexpr_dict["CONSUMERS"] == (2 if causal else 3)
    assert all(loop["exp2"] > 0 and loop["wgmma"] > 0 for loop in loops)
    sizes = [loop["instructions"] for loop in loops]
    assert max(sizes) - min(sizes) <= 8  # copies of one loop, scheduled alike
    assert found["instructions"] > sum(loop["instructions"] for loop in loops)


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_jax_call_hands_the_kernel_its_scratch_in_the_global_scratch_slot(causal):
    """The jax launch passes the global scratch as one more array parameter after the plan's own
    (``ejkernel_jax._gluon_call``): that is where Triton's ABI takes it, so the compiled entry must
    have exactly the plan's parameters, then the global and the profile scratch pointers."""
    from ejkernel_jax._gluon_call import Array, parameters, scratch_bytes
    from triton_kernels.aot import compile_plan

    q = (8, 1024, 2048 // 64, 64)
    spec = fa.dense_spec(q, q, q, ("bfloat16",) * 3, causal=causal)
    plans = fa.backward_plans(spec, HOPPER_GLUON)
    for plan in (fa.forward_plan(spec, HOPPER_GLUON), plans.dkdv, gluon_dq_plan(spec, HOPPER_GLUON)):
        compiled = compile_plan(plan)
        md = compiled.metadata
        own = parameters(plan, None)
        assert sum(isinstance(p, Array) for p in own) == len(plan.inputs) + len(plan.outputs)
        entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", compiled.asm["ptx"], re.S).group(1)
        assert entry.count(".param") == len(own) + 2, plan.name
        with_scratch = parameters(plan, md.global_scratch_align)
        assert with_scratch[:-1] == own and with_scratch[-1] == Array(0, max(16, md.global_scratch_align))
        assert scratch_bytes(plan, md.global_scratch_size) == md.global_scratch_size * plan.grid[0] > 0
        counter = {o.name: o for o in plan.outputs}.get("next_tile_ptr")
        if counter is not None:  # zeroed by the call where the forward claims its tiles
            index = list(n for n in plan.kernel.arg_names if n not in plan.aot_constexprs()).index("next_tile_ptr")
            assert own[index] == Array(4 if counter.zeroed else 0, 16)


@needs_gluon
def test_gluon_plan_with_unit_sequences_compiles():
    from triton_kernels.aot import compile_plan

    spec = _spec(seq_q=1, seq_k=1, causal=True)
    plans = fa.backward_plans(spec, HOPPER_GLUON)
    for plan in (fa.forward_plan(spec, HOPPER_GLUON), plans.dkdv, plans.dq):
        assert plan.is_gluon and plan.aot_constexprs()["seq_q"] == 1
        compile_plan(plan)


def test_plan_text_round_trips_maxnreg():
    from ejkernel_torch.launch import plan_from_text, plan_text

    for plan in (fa.forward_plan(_spec(), HOPPER_GLUON), *fa.backward_plans(_spec(), HOPPER_GLUON)):
        assert plan_from_text(plan_text(plan)) == plan


# -- on a Hopper GPU -------------------------------------------------------------------------------

GLUON_CASES = [
    ((2, 1000, 777, 4, 2, 128), {}),
    ((1, 129, 300, 2, 1, 128), dict(causal=True)),
    ((3, 64, 1, 2, 2, 128), {}),
    ((2, 255, 255, 4, 4, 128), dict(causal=True)),
    ((1, 1, 1000, 2, 1, 128), dict(causal=True)),
    ((1, 300, 8200, 8, 1, 64), dict(causal=True, softmax_scale=0.3)),
    ((1, 77, 8192, 2, 2, 64), {}),
    ((1, 200, 5000, 4, 2, 64), dict(causal=True)),
    # Three consumers (192-row tiles): a last tile of 80 rows (the third warpgroup's part empty),
    # seq_q != seq_k; and a single tile whose third part is past seq_q.
    ((2, 2000, 1536, 4, 2, 64), {}),
    ((1, 150, 384, 2, 1, 64), {}),
    # The schedules on an H100 (132 SMs). Query-tile kernels: causal pairs with an odd tile count
    # (the middle tile alone), programs looping (240 units, one round of pairs over 26 heads, then
    # 22 heads tile by tile; the forward claims them in that order); dk/dv a program a tile (the
    # Triton dq beside).
    ((3, 1100, 1100, 16, 4, 64), dict(causal=True)),
    # Query tiles in pairs with seq_q < seq_k; dk/dv a program a tile.
    ((3, 700, 1500, 16, 2, 128), dict(causal=True)),
    # Single tiles, programs looping.
    ((4, 600, 1500, 16, 8, 128), {}),
    # dk/dv pairs (an odd count of key tiles), programs looping; the forward's 640 units: four
    # rounds of pairs (105 heads), then 23 heads tile by tile.
    ((8, 1100, 1100, 16, 16, 64), dict(causal=True)),
    ((5, 1000, 1500, 8, 8, 128), dict(causal=True)),
    # Tiles claimed from a counter without a mask (head_dim 64): two consumers, then three.
    ((4, 600, 1500, 16, 8, 64), {}),
    ((2, 1150, 1152, 16, 4, 64), {}),
]


def _torch_facts():
    import torch

    from ejkernel_torch.launch import device_facts

    return device_facts(torch.device("cuda"))


def _hopper_with_gluon():
    import torch

    if not torch.cuda.is_available() or not _torch_facts().gluon:
        pytest.skip("needs a Hopper GPU and a Triton with Gluon (and not EJKERNEL_GLUON=0)")
    if _torch_facts().capability != (9, 0):
        pytest.skip("the Gluon kernels are for sm_90")


def _assert_gluon(spec):
    assert uses_gluon(spec, _torch_facts())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(len(GLUON_CASES)))
def test_gluon_kernels_correct_and_bitwise_across_frameworks(torch_fw, jax_fw, rng, dtype, case):
    _hopper_with_gluon()
    from ejkernel_jax.launch import device_facts as jax_device_facts

    shape, options = GLUON_CASES[case]
    arrays, _ = _inputs(rng, shape, None, False)
    spec = fa.dense_spec(*(a.shape for a in arrays), (dtype,) * 3, **options)
    for facts in (_torch_facts(), jax_device_facts()):
        assert uses_gluon(spec, facts)
        assert uses_gluon_dkdv(spec, facts)
        assert uses_gluon_dq(spec, facts) == (shape[-1] == 128 or shape[2] >= GLUON_DQ_MIN_SEQ_K_D64)
    cot = rng.standard_normal(shape[:2] + (shape[3], shape[5]))
    torch_results, values = _run(torch_fw, arrays, None, options, dtype, cot)
    jax_results, _ = _run(jax_fw, arrays, None, options, dtype, cot)
    for i, (a, b) in enumerate(zip(torch_results, jax_results)):
        assert a.tobytes() == b.tobytes(), (case, i, np.nanmax(np.abs(a - b)))

    def reference(q, k, v):
        return ref.flash_attention(q, k, v, **options)

    assert rel_error(torch_results[0], ref.forward(reference, *values)) < TOLERANCE[dtype]
    _, want_lse = ref.flash_attention(*(ref._t(x) for x in values), return_lse=True, **options)
    assert rel_error(torch_results[1], want_lse.numpy()) < 1e-3
    cot_seen = torch_fw.to_numpy(torch_fw.asarray(cot, dtype))
    for got, want in zip(torch_results[2:], ref.vjp(reference, values, cot_seen, n_diff=3)):
        assert rel_error(got, want) < 2 * GRAD_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, causal", [((3, 1100, 16, 64), True), ((3, 700, 16, 128), True),
                                           ((4, 600, 16, 64), False), ((2, 1152, 16, 64), False)])
def test_claimed_tiles_give_the_static_walks_bits(rng, shape, causal):
    """The forward claiming its tiles and walking them statically (long causal calls, head_dim 128
    without a mask) compute each tile alike: the same bits, every element written (outputs
    poisoned), the counter zeroed for every call; or, for the public functions' plain eager
    launches (``launch_prechecked``), kept from call to call on a stream, every plan (the
    parametrized shapes run in turn) leaving it zero for the next."""
    _hopper_with_gluon()
    import torch

    from ejkernel_torch import launch as launch_mod
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels.debug import poison_outputs

    q, k, v = (torch.tensor(rng.standard_normal(shape), dtype=torch.bfloat16, device="cuda") for _ in range(3))
    plan = fa.forward_plan(fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=causal), _torch_facts())
    assert plan.constexpr_dict["DYNAMIC"] and plan.outputs[-1].zeroed and plan.outputs[-1].resets
    static = static_walk(plan)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    with poison_outputs():
        claimed, walked, again = (launch_mod.launch(p, *arrays) for p in (plan, static, plan))
        kept = [launch_mod.launch_prechecked(plan, *arrays) for _ in range(2)]
    assert not claimed[0].isnan().any() and not claimed[1].isnan().any()
    for a, b, c, d, e in zip(claimed, walked, again, *kept):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d) and torch.equal(a, e)
    counters = [t for key, t in launch_mod._kept.items() if len(key) == 4]  # (device, stream, shape, dtype)
    assert counters and all(int(t.item()) == 0 for t in counters)


@pytest.mark.gpu
@pytest.mark.parametrize("q_shape, kv_shape, causal", [((2, 300, 4, 128), (2, 777, 2, 128), True),
                                                       ((1, 129, 2, 128), (1, 129, 2, 128), False),
                                                       ((1, 200, 8, 64), (1, 2100, 2, 64), False),
                                                       ((2, 333, 4, 64), (2, 2049, 4, 64), True)])
def test_gluon_dq_stores_delta_for_every_row(fw, rng, q_shape, kv_shape, causal):
    """The Gluon dq computes delta = rowsum(o * do) - dlse for its rows, uses it and stores it
    (the lse layout) for dk/dv (``check_dq_plan``: every row, and dq, against float64). Odd sizes,
    GQA, a lse gradient."""
    _hopper_with_gluon()
    spec = fa.dense_spec(q_shape, kv_shape, kv_shape, ("bfloat16",) * 3, causal=causal)
    plans = fa.backward_plans(spec, _torch_facts(), False, True)
    assert plans.dq.is_gluon and list(plans) == [plans.dq, plans.dkdv]
    check_dq_plan(fw, rng, plans.dq, spec, q_shape, kv_shape)


@pytest.mark.gpu
def test_gluon_kernels_take_unaligned_views_and_leave_the_allocator_alone():
    _hopper_with_gluon()
    import torch
    from triton.runtime import _allocation

    import ejkernel_torch as ejk

    shape = (2, 300, 4, 128)
    n = int(np.prod(shape))
    flat = torch.randn(3 * n + 1, device="cuda", dtype=torch.bfloat16)
    q, k, v = (flat[1 + i * n:1 + (i + 1) * n].view(shape).requires_grad_() for i in range(3))  # 2 bytes off 16
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    spec = fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=True)
    _assert_gluon(spec)
    plans = fa.backward_plans(spec, _torch_facts())
    assert plans.dkdv.is_gluon and plans.dq.is_gluon
    cot = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    before = _allocation._allocator.get()
    out = ejk.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    assert _allocation._allocator.get() is before
    aligned = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = ejk.flash_attention(*aligned, causal=True)
    assert torch.equal(out, want)
    for got, expected in zip(grads, torch.autograd.grad(want, aligned, cot)):
        assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("seq, heads", [(257, 4), (1100, 16)])  # the static walk; tiles claimed from a counter
def test_gluon_forward_under_cuda_graph_replay(rng, seq, heads):
    """A captured Gluon launch (its TMA descriptors built in scratch from the graph's pool, its
    tile counter zeroed by a captured fill) replays on new inputs to what eager calls give, with
    eager Gluon launches on the stream in between."""
    _hopper_with_gluon()
    import torch

    import ejkernel_torch as ejk

    def inputs(seq):
        return [torch.tensor(rng.standard_normal((2, seq, heads, 64)), dtype=torch.bfloat16, device="cuda")
                for _ in range(3)]

    q, k, v = inputs(seq)
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=True)
    _assert_gluon(spec)
    assert fa.forward_plan(spec, _torch_facts()).constexpr_dict["DYNAMIC"] == (seq == 1100)
    ejk.flash_attention(q, k, v, causal=True)  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ejk.flash_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ejk.flash_attention(q, k, v, causal=True)
    for _ in range(2):
        fresh = inputs(seq)
        for dst, src in zip((q, k, v), fresh):
            dst.copy_(src)
        want = ejk.flash_attention(*fresh, causal=True)
        ejk.flash_attention(*inputs(1000), causal=True)  # eager, same stream
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(want.view(torch.int16), captured.view(torch.int16))


@pytest.mark.gpu
def test_gluon_forward_under_torch_compile_fullgraph():
    _hopper_with_gluon()
    import torch

    from ejkernel_torch.nn import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(512, 4, 2, causal=True).cuda().to(torch.bfloat16)  # head_dim 128
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    _assert_gluon(fa.dense_spec((2, 300, 4, 128), (2, 300, 2, 128), (2, 300, 2, 128), ("bfloat16",) * 3, causal=True))
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        layer.zero_grad()
        out = fn(x)
        out.float().square().mean().backward()
        results.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    for eager, compiled in zip(*results):
        assert rel_error(compiled.float().cpu().numpy(), eager.float().cpu().numpy()) < 1e-2
