"""Launch plans for flash attention, from a ``FlashSpec`` and ``DeviceFacts``.

Every kernel takes the same nine leading arrays (``FEATURE_INPUTS``); for features a call does
not use the fronts pass a one-element stand-in of the dtype ``feature_dtypes`` lists, so one
kernel signature serves all calls.
"""
from __future__ import annotations

import dataclasses
import functools

from ..padded_attention import _bwd_tiles, _dot_precision, _fwd_tiles, override_tiles
from ..params import BwdParams, FwdParams
from ..plan import DeviceFacts, LaunchPlan, Output, cdiv, fp32, next_power_of_2
from ..plan import fold_chunks as shared_fold_chunks
from .backward import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
from . import gluon_backward, gluon_forward
from .dropout import dropout_mask_kernel
from .forward import flash_fwd_kernel
from .schedule import claims_tiles, persistent_schedule
from .spec import FLOAT32_MAX, MAX_GRID_YZ, FlashSpec
from .tiles import LOG2E, softcap_mode

# The kernels each pass's plans launch (the Gluon ones where this Triton has Gluon).
FORWARD_KERNELS = (flash_fwd_kernel,) + ((gluon_forward.flash_fwd_gluon_kernel,) if gluon_forward.AVAILABLE else ())
BACKWARD_KERNELS = (flash_bwd_dq_kernel, flash_bwd_dkdv_kernel) + (
    (gluon_backward.flash_bwd_dq_gluon_kernel, gluon_backward.flash_bwd_dkdv_gluon_kernel)
    if gluon_forward.AVAILABLE else ())

# (kernel parameter, what the fronts pass) in kernel order.
FEATURE_INPUTS = ("q_ptr", "k_ptr", "v_ptr", "bias_ptr", "q_seg_ptr", "kv_seg_ptr", "cu_q_ptr", "cu_k_ptr", "seed_ptr")


def feature_dtypes(spec: FlashSpec) -> tuple[str, ...]:
    return (spec.dtype,) * 3 + (spec.bias_dtype or spec.dtype,) + (spec.segment_dtype,) * 2 + ("int32",) * 3


# The backward kernels' inputs by name: dq computes delta = rowsum(o * dO) - dlse, which dk/dv read.
DQ_INPUTS = FEATURE_INPUTS + ("do_ptr", "lse_ptr", "o_ptr", "dlse_ptr")
DKDV_INPUTS = FEATURE_INPUTS + ("do_ptr", "lse_ptr", "delta_ptr")
_FLOAT32_INPUTS = frozenset({"lse_ptr", "dlse_ptr", "delta_ptr"})


def backward_input_dtypes(spec: FlashSpec, inputs: tuple[str, ...]) -> tuple[str, ...]:
    """The dtypes of a backward plan's ``inputs`` (FEATURE_INPUTS, then o/dO in the call's dtype,
    lse/dlse/delta in float32)."""
    extra = inputs[len(FEATURE_INPUTS):]
    return feature_dtypes(spec) + tuple("float32" if name in _FLOAT32_INPUTS else spec.dtype for name in extra)


def dq_outputs(spec: FlashSpec) -> tuple[Output, Output]:
    """dq, and delta in the lse's layout, as both dq kernels write them."""
    zeroed = _outputs_zeroed(spec)
    return (Output("dq_ptr", spec.q_shape, spec.dtype, zeroed), Output("delta_ptr", spec.lse_shape, "float32", zeroed))


def _check_grid(spec: FlashSpec) -> None:
    if spec.batch > MAX_GRID_YZ or spec.heads_q > MAX_GRID_YZ:
        raise ValueError(f"batch ({spec.batch}) and heads ({spec.heads_q}) must each be <= {MAX_GRID_YZ}")


def fold_chunks(n: int, batch: int) -> list[tuple[int, int]]:
    """(first sample, samples) of each launch that a vmap over ``n`` samples of ``batch`` rows
    folds into the batch (the fronts' vmap rules): the folded batch is a grid axis, so a launch
    takes at most ``MAX_GRID_YZ // batch`` samples (at least one: a sample past the limit fails
    in its own plan, naming its own batch). One launch for ``n`` = 0."""
    return shared_fold_chunks(n, batch, MAX_GRID_YZ)


def _scalars(spec: FlashSpec) -> tuple[tuple[str, int | float], ...]:
    left, right = spec.window or (0, 0)
    if spec.softcap is not None:
        logit_scale = spec.softmax_scale / spec.softcap
    elif spec.bias is not None:
        logit_scale = spec.softmax_scale
    else:
        logit_scale = spec.softmax_scale * LOG2E
    if not abs(logit_scale) <= FLOAT32_MAX:
        raise ValueError(f"softmax_scale={spec.softmax_scale} (logits_soft_cap={spec.softcap}) gives a logit scale "
                         "beyond float32's range")
    return (
        ("seq_q", spec.seq_q), ("seq_k", spec.seq_k), ("total_q", spec.total_q), ("total_k", spec.total_k),
        ("win_left", left), ("win_right", right),
        ("logit_scale", fp32(logit_scale)), ("softcap", fp32(spec.softcap or 1.0)),
        ("dropout_p", fp32(spec.dropout_p)), ("dropout_scale", fp32(1.0 / (1.0 - spec.dropout_p))),
    )


def _features(spec: FlashSpec) -> tuple[tuple[str, object], ...]:
    bias_b, bias_h = spec.bias or (1, 1)
    return (
        ("HEADS_Q", spec.heads_q), ("HEADS_KV", spec.heads_kv), ("HEAD_DIM", spec.head_dim),
        ("IS_VARLEN", spec.varlen), ("USE_WINDOW", spec.window is not None),
        ("USE_SOFTCAP", softcap_mode(spec.softcap)), ("USE_BIAS", spec.bias is not None),
        ("BIAS_BATCHED", int(bias_b > 1)), ("BIAS_HEADS", bias_h),
        ("USE_SEGMENTS", spec.segments), ("USE_DROPOUT", spec.dropout_p > 0.0),
    )


def _cpu_block(n: int) -> int:
    # The interpreter pays mostly per op, little per element. Short and middling lengths keep
    # tiles of at most 64, so lengths from 65 up still cross tile edges (what the CPU tests
    # check); from 512 on, 128-wide tiles take a quarter of the steps (a 1000x1000 test: 2x faster).
    return 128 if n >= 512 else min(64, max(16, next_power_of_2(n)))


def _tiles(spec: FlashSpec, facts: DeviceFacts, backward: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages). Half-precision head_dim <= 128 on a GPU
    uses the best configs of ``scripts/sweep_flash.py`` on an H200 (bf16, seq 4096; results in
    benchmarks/results/sweep_flash-nvidia-h200.json); the rest falls back to the padded-attention
    heuristics."""
    block_d = max(16, next_power_of_2(spec.head_dim))
    if facts.is_cpu:
        return (*map(_cpu_block, _extent(spec)), block_d, 4, 1)
    if spec.dtype != "float32" and block_d <= 128:
        if backward:  # (64, 64, 4 warps, 2 stages) is as fast but faults on Triton 3.6 at head_dim 128
            return 32, 64, block_d, 4, 3
        return 128, 64, block_d, 4 if block_d <= 64 else 8, 3
    return (_bwd_tiles if backward else _fwd_tiles)(spec.head_dim, spec.dtype, facts)


def _extent(spec: FlashSpec) -> tuple[int, int]:
    """(queries, keys) a program grid must cover: varlen sequences are no longer than the packed
    tokens either (the kernels clamp them so), which a generous max_seqlen (up to 2**31 - 1)
    passes by far: its grid was mostly programs that return at once (hours in the interpreter)."""
    if spec.varlen:
        return min(spec.seq_q, spec.total_q), min(spec.seq_k, spec.total_k)
    return spec.seq_q, spec.seq_k


def _outputs_zeroed(spec: FlashSpec) -> bool:
    # Varlen: tokens past cu_seqlens[-1] belong to no program; they read as zeros.
    return spec.varlen


@functools.lru_cache(maxsize=512)
def forward_plan(spec: FlashSpec, facts: DeviceFacts, params: FwdParams | None = None) -> LaunchPlan:
    """Inputs: FEATURE_INPUTS. Outputs: out (q's shape and dtype), lse (float32, natural log).

    The warp-specialized Gluon kernel where it applies (``uses_gluon``), else ``flash_fwd_kernel``.
    ``params`` overrides block sizes, warps and stages (``padded_attention.override_tiles``) of the
    latter, so any ``params`` also selects it."""
    if params is None and uses_gluon(spec, facts):
        return gluon_forward_plan(spec, facts)
    return triton_forward_plan(spec, facts, params)


# The persistent Gluon dq at head_dim 64 takes 0.91-0.93x the Triton dq kernel's time from seq 4096,
# 0.96-0.97x at 2048, 1.00-1.06x at 1024 (H100, bf16; probe_flash_gluon_dq-persistent-nvidia-h100-80gb-hbm3.json).
# At head_dim 128 it wins from seq 1024.
GLUON_DQ_MIN_SEQ_K_D64 = 2048


def _gluon_covers(spec: FlashSpec, facts: DeviceFacts) -> bool:
    """A Hopper whose launcher runs Gluon, and a plain call the Gluon kernels cover (see ``gluon_forward``)."""
    causal_only = spec.window is not None and spec.window[1] == 0 and spec.window[0] >= spec.seq_k - 1
    return (facts.gluon and facts.capability == (9, 0) and gluon_forward.AVAILABLE
            and spec.dtype in ("float16", "bfloat16") and spec.softmax_scale > 0 and spec.head_dim in (64, 128)
            and not spec.varlen and spec.softcap is None and spec.bias is None and not spec.segments
            and spec.dropout_p == 0.0 and spec.seq_q >= 1 and spec.seq_k >= 1
            # causal: with seq_q <= seq_k every row sees key 0, so no row is fully masked
            and (spec.window is None or (causal_only and spec.seq_q <= spec.seq_k)))


@functools.lru_cache(maxsize=512)
def uses_gluon(spec: FlashSpec, facts: DeviceFacts) -> bool:
    """Whether ``forward_plan`` (without params) picks the Gluon kernel: wherever it covers the
    call. The Gluon forward takes 0.74-0.91x flash_fwd_kernel's time at head_dim 128
    and 0.89-0.97x at 64, from seq 1024 to 16384 (H100, bf16, 16k tokens a batch;
    benchmarks/results/probe_flash_gluon_fwd-nvidia-h100-80gb-hbm3.json)."""
    return _gluon_covers(spec, facts)


@functools.lru_cache(maxsize=512)
def uses_gluon_dkdv(spec: FlashSpec, facts: DeviceFacts) -> bool:
    """Whether ``backward_plans`` (without params) picks the Gluon dk/dv kernel: wherever it
    covers the call. On an H100 (bf16, 16k tokens a batch,
    benchmarks/results/probe_flash_gluon_dkdv-persistent-nvidia-h100-80gb-hbm3.json) the
    persistent dk/dv takes 0.76-0.86x the Triton dk/dv kernel's time at head_dim 64 and
    0.79-0.89x at 128, from seq 1024 to 16384, with the same bits."""
    return _gluon_covers(spec, facts)


def _query_work(spec: FlashSpec, tile: int) -> list[float]:
    """Each query tile's work (``tile`` rows) in blocks: the keys it sees over 128."""
    offset = spec.seq_k - spec.seq_q  # causal: bottom-right aligned
    return [(min(spec.seq_k, min(m + tile, spec.seq_q) + offset) if spec.window is not None else spec.seq_k) / tile
            for m in range(0, spec.seq_q, tile)]


def _query_tiles(spec: FlashSpec, facts: DeviceFacts, tile: int = gluon_forward.TILE_M) -> tuple[tuple[int], bool]:
    """(grid, PAIRS) of the persistent kernels that hold query tiles of ``tile`` rows (forward,
    dq): a tile's work is the keys it sees; they walk ``schedule.query_walk``."""
    return persistent_schedule(_query_work(spec, tile), spec.batch * spec.heads_q, spec.window is not None,
                               facts.num_sms, spec.head_dim, tail=True)


def _key_tiles(spec: FlashSpec, facts: DeviceFacts) -> tuple[tuple[int], bool]:
    """(grid, PAIRS) of the persistent dk/dv kernel, which holds 128-key tiles of a kv head: a
    tile's work is the queries of the group's heads that see it."""
    tile = gluon_backward.TILE_N
    group = spec.heads_q // spec.heads_kv
    offset = spec.seq_k - spec.seq_q
    work = [group * (spec.seq_q - (min(spec.seq_q, max(0, n - offset)) if spec.window is not None else 0)) / tile
            for n in range(0, spec.seq_k, tile)]
    return persistent_schedule(work, spec.batch * spec.heads_kv, spec.window is not None, facts.num_sms,
                               spec.head_dim)


def gluon_forward_plan(spec: FlashSpec, facts: DeviceFacts, consumers: int | None = None) -> LaunchPlan:
    """``gluon_forward.flash_fwd_gluon_kernel``'s plan, for the calls ``uses_gluon`` accepts, with
    ``forward_consumers`` consumer warpgroups unless ``consumers`` (2 or 3) says otherwise (probes)."""
    if consumers is None:
        consumers = gluon_forward.forward_consumers(spec.head_dim, spec.window is not None, spec.seq_q,
                                                     spec.seq_k)
    elif consumers not in (2, 3):
        raise ValueError(f"consumers must be 2 or 3, got {consumers!r}")
    tile = consumers * gluon_forward.ROWS
    grid, pairs = _query_tiles(spec, facts, tile)
    dynamic = claims_tiles(_query_work(spec, tile), spec.batch * spec.heads_q, spec.window is not None,
                           spec.head_dim, grid[0], pairs)
    return LaunchPlan(
        kernel=gluon_forward.flash_fwd_gluon_kernel,
        grid=grid,
        inputs=FEATURE_INPUTS, input_dtypes=feature_dtypes(spec),
        scalars=(("batch", spec.batch), ("seq_q", spec.seq_q), ("seq_k", spec.seq_k),
                 ("logit_scale", fp32(spec.softmax_scale * LOG2E))),
        outputs=(Output("o_ptr", spec.q_shape, spec.dtype), Output("lse_ptr", spec.lse_shape, "float32"),
                 # the dynamic schedule's tile counter (zeroed then, and left zero; not read otherwise)
                 Output("next_tile_ptr", (1,), "int32", zeroed=dynamic, returned=False, resets=dynamic)),
        constexprs=(("HEADS_Q", spec.heads_q), ("HEADS_KV", spec.heads_kv), ("HEAD_DIM", spec.head_dim),
                    ("CAUSAL", spec.window is not None), ("PAIRS", pairs), ("BLOCK_N", gluon_forward.BLOCK_N),
                    ("STAGES", gluon_forward.forward_stages(spec.head_dim)),
                    ("KEY_TAIL", spec.seq_k % gluon_forward.BLOCK_N != 0), ("CONSUMERS", consumers),
                    ("DYNAMIC", dynamic)),
        num_warps=4, num_stages=1, maxnreg=gluon_forward.forward_maxnreg(consumers),
    )


def static_walk(plan: LaunchPlan) -> LaunchPlan:
    """``plan`` (a Gluon forward's that claims its tiles) walking them in the static order instead:
    ``DYNAMIC`` off, its tile counter not zeroed. What claiming is timed and checked against."""
    outputs = tuple(dataclasses.replace(o, zeroed=False, resets=False) if o.name == "next_tile_ptr" else o
                    for o in plan.outputs)
    return dataclasses.replace(plan.with_constexprs(DYNAMIC=False), outputs=outputs)


@functools.lru_cache(maxsize=512)
def uses_gluon_dq(spec: FlashSpec, facts: DeviceFacts) -> bool:
    """Whether ``backward_plans`` (without params) picks the Gluon dq kernel: where it covers
    the call, at head_dim 64 from seq_k ``GLUON_DQ_MIN_SEQ_K_D64``. On an H100 (bf16, 16k tokens
    a batch, benchmarks/results/probe_flash_gluon_dq-persistent-nvidia-h100-80gb-hbm3.json) the
    persistent dq takes 0.71-0.81x the Triton dq kernel's time at head_dim 128 from seq 1024,
    and at 64 0.91-0.97x from seq 2048."""
    return _gluon_covers(spec, facts) and (spec.head_dim == 128 or spec.seq_k >= GLUON_DQ_MIN_SEQ_K_D64)


def _gluon_backward_plan(spec: FlashSpec, kernel, schedule: tuple[tuple[int], bool], inputs: tuple[str, ...],
                         outputs: tuple[Output, ...], constexprs: tuple[tuple[str, object], ...]) -> LaunchPlan:
    """A Gluon backward kernel's plan: ``inputs`` named as the Triton backward plans name them, the
    scalars the Gluon kernels read, the persistent ``schedule`` (grid, PAIRS), and the kernel's
    own ``constexprs`` (the streamed block, ring stages)."""
    grid, pairs = schedule
    return LaunchPlan(
        kernel=kernel, grid=grid,
        inputs=inputs, input_dtypes=backward_input_dtypes(spec, inputs),
        scalars=(("batch", spec.batch), ("seq_q", spec.seq_q), ("seq_k", spec.seq_k),
                 ("logit_scale", fp32(spec.softmax_scale * LOG2E)), ("sm_scale", fp32(spec.softmax_scale))),
        outputs=outputs,
        constexprs=(("HEADS_Q", spec.heads_q), ("HEADS_KV", spec.heads_kv), ("HEAD_DIM", spec.head_dim),
                    ("CAUSAL", spec.window is not None), ("PAIRS", pairs)) + constexprs,
        num_warps=4, num_stages=1, maxnreg=gluon_backward.MAXNREG,
    )


def gluon_dq_plan(spec: FlashSpec, facts: DeviceFacts, use_dlse: bool = False) -> LaunchPlan:
    """``gluon_backward.flash_bwd_dq_gluon_kernel``'s plan: the inputs and outputs of the Triton dq
    plan of ``backward_plans`` (dq and delta), for calls that ``uses_gluon`` accepts."""
    return _gluon_backward_plan(spec, gluon_backward.flash_bwd_dq_gluon_kernel, _query_tiles(spec, facts),
                                DQ_INPUTS, dq_outputs(spec), (("BLOCK_N", gluon_backward.BLOCK_N),
                                                               ("STAGES", gluon_backward.STAGES),
                                                               ("USE_DLSE", use_dlse)))


def gluon_dkdv_plan(spec: FlashSpec, facts: DeviceFacts) -> LaunchPlan:
    """``gluon_backward.flash_bwd_dkdv_gluon_kernel``'s plan: the inputs and outputs of the dk/dv
    plan of ``backward_plans`` without a bias gradient, for calls that ``uses_gluon`` accepts."""
    outputs = (Output("dk_ptr", spec.kv_shape, spec.dtype), Output("dv_ptr", spec.kv_shape, spec.dtype),
               Output("ds_ptr", (1,), "float32"))  # the stand-in: these calls have no bias
    stages = gluon_backward.dkdv_stages(spec.head_dim, spec.window is not None)
    return _gluon_backward_plan(spec, gluon_backward.flash_bwd_dkdv_gluon_kernel, _key_tiles(spec, facts),
                                DKDV_INPUTS, outputs, (("BLOCK_M", gluon_backward.BLOCK_M), ("STAGES", stages)))


@functools.lru_cache(maxsize=512)
def triton_forward_plan(spec: FlashSpec, facts: DeviceFacts, params: FwdParams | None = None) -> LaunchPlan:
    """``flash_fwd_kernel``'s plan, whatever ``uses_gluon`` says (autotuning times its tiles)."""
    _check_grid(spec)
    bm, bn, bd, warps, stages = override_tiles(_tiles(spec, facts, backward=False), params, spec.dtype, facts,
                                               "flash_attention fwd_params")
    zeroed = _outputs_zeroed(spec)
    return LaunchPlan(
        kernel=flash_fwd_kernel, grid=(cdiv(_extent(spec)[0], bm), spec.heads_q, spec.batch),
        inputs=FEATURE_INPUTS, input_dtypes=feature_dtypes(spec), scalars=_scalars(spec),
        outputs=(Output("o_ptr", spec.q_shape, spec.dtype, zeroed),
                 Output("lse_ptr", spec.lse_shape, "float32", zeroed)),
        constexprs=_features(spec) + (("NEGATIVE_SCALE", spec.softmax_scale < 0),
                                      ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd),
                                      ("DOT_PRECISION", _dot_precision(spec.dtype, facts))),
        num_warps=warps, num_stages=stages,
    )


@dataclasses.dataclass(frozen=True)
class BackwardPlans:
    """The backward's launches, in the order they run (iterating gives it). Each plan names its
    inputs: the arrays a backward starts from (``BACKWARD_INPUTS``) or an earlier launch's
    outputs, by their names (``run``).

    * dq (``DQ_INPUTS``: FEATURE_INPUTS, do, lse, o, dlse) -> dq, delta: each program computes
      delta = rowsum(o * do) - dlse (lse layout) for its query rows, uses it and stores it.
    * dkdv (``DKDV_INPUTS``: FEATURE_INPUTS, do, lse, delta) -> dk, dv, ds. ``ds`` is the float32
      gradient of the logits [batch, heads_q, seq_q, seq_k] for a bias gradient, else a
      one-element placeholder.
    """
    dq: LaunchPlan
    dkdv: LaunchPlan

    def __iter__(self):
        return iter((self.dq, self.dkdv))

    def run(self, launch, arrays: dict) -> dict:
        """``arrays`` (``backward_inputs``) and every launch's outputs by name, each plan run by
        ``launch(plan, *its inputs)``."""
        arrays = dict(arrays)
        for plan in self:
            arrays.update(zip(plan.result_names, launch(plan, *plan.inputs_from(arrays))))
        return arrays

    def gradients(self, launch, features, o, do, lse, dlse) -> tuple:
        """(dq, dk, dv, ds) of a backward run from ``backward_inputs(features, o, do, lse, dlse)``."""
        arrays = self.run(launch, backward_inputs(features, o, do, lse, dlse))
        return arrays["dq_ptr"], arrays["dk_ptr"], arrays["dv_ptr"], arrays["ds_ptr"]


# The arrays a backward starts from, as the plans name them.
BACKWARD_INPUTS = FEATURE_INPUTS + ("o_ptr", "do_ptr", "lse_ptr", "dlse_ptr")


def backward_inputs(features, o, do, lse, dlse) -> dict:
    """The arrays a backward starts from by name (``BACKWARD_INPUTS``): the ``FEATURE_INPUTS``
    arrays in order, the forward's output and lse, the incoming gradients of both (dlse: a
    one-element stand-in unless the plans use it)."""
    return dict(zip(BACKWARD_INPUTS, (*features, o, do, lse, dlse)))


@functools.lru_cache(maxsize=512)
def backward_plans(spec: FlashSpec, facts: DeviceFacts, write_ds: bool = False, use_dlse: bool = False,
                   params: BwdParams | None = None) -> BackwardPlans:
    """The backward's plans (``BackwardPlans``). ``write_ds``: dk/dv also write the logits'
    gradient (for a bias gradient); ``use_dlse``: a gradient of the lse folds into delta.

    dk/dv run the Gluon kernel (``gluon_dkdv_plan``) where ``uses_gluon_dkdv``, dq where
    ``uses_gluon_dq``. ``params`` overrides the Triton kernels' tiles as dk/dv sees them:
    ``blocksize_m`` queries streamed past ``blocksize_n`` resident keys; dq uses the transpose
    (``blocksize_n`` resident queries, ``blocksize_m`` keys a step). So ``params`` select the
    Triton kernels.
    """
    _check_grid(spec)
    bm, bn, bd, warps, stages = override_tiles(_tiles(spec, facts, backward=True), params, spec.dtype, facts,
                                               "flash_attention bwd_params")
    zeroed = _outputs_zeroed(spec)
    scalars = _scalars(spec) + (("sm_scale", fp32(spec.softmax_scale)),)
    precision = (("DOT_PRECISION", _dot_precision(spec.dtype, facts)),)
    if write_ds and spec.bias is None:
        raise ValueError("write_ds needs a bias")
    ds = Output("ds_ptr", spec.dbias_full_shape if write_ds else (1,), "float32", zeroed=write_ds)
    gluon = params is None and uses_gluon_dkdv(spec, facts)
    dkdv = gluon_dkdv_plan(spec, facts) if gluon else LaunchPlan(
        kernel=flash_bwd_dkdv_kernel, grid=(cdiv(_extent(spec)[1], bn), spec.heads_kv, spec.batch),
        inputs=DKDV_INPUTS, input_dtypes=backward_input_dtypes(spec, DKDV_INPUTS), scalars=scalars,
        outputs=(Output("dk_ptr", spec.kv_shape, spec.dtype, zeroed),
                 Output("dv_ptr", spec.kv_shape, spec.dtype, zeroed), ds),
        constexprs=_features(spec) + (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_D", bd), ("WRITE_DS", write_ds))
        + precision,
        num_warps=warps, num_stages=stages,
    )
    if params is None and uses_gluon_dq(spec, facts):
        return BackwardPlans(gluon_dq_plan(spec, facts, use_dlse), dkdv)
    # dq transposes the tile: its program holds bn queries and steps over bm keys. So one
    # (bm, bn) gives both kernels a long resident side and a short streamed one.
    dq = LaunchPlan(
        kernel=flash_bwd_dq_kernel, grid=(cdiv(_extent(spec)[0], bn), spec.heads_q, spec.batch),
        inputs=DQ_INPUTS, input_dtypes=backward_input_dtypes(spec, DQ_INPUTS), scalars=scalars,
        outputs=dq_outputs(spec),
        constexprs=_features(spec) + (("BLOCK_M", bn), ("BLOCK_N", bm), ("BLOCK_D", bd), ("USE_DLSE", use_dlse))
        + precision,
        num_warps=warps, num_stages=stages,
    )
    return BackwardPlans(dq, dkdv)


@functools.lru_cache(maxsize=128)
def dropout_mask_plan(batch: int, heads: int, seq_q: int, seq_k: int, dropout_p: float,
                      facts: DeviceFacts) -> LaunchPlan:
    """(seed int32 [1]) -> int32 keep-mask (0/1) [batch, heads, seq_q, seq_k], as flash attention draws it."""
    block_m, block_n = (_cpu_block(seq_q), _cpu_block(seq_k)) if facts.is_cpu else (64, 64)
    return LaunchPlan(
        kernel=dropout_mask_kernel, grid=(cdiv(seq_q, block_m), heads, batch),
        inputs=("seed_ptr",), input_dtypes=("int32",),
        scalars=(("seq_q", seq_q), ("seq_k", seq_k), ("dropout_p", fp32(dropout_p))),
        outputs=(Output("mask_ptr", (batch, heads, seq_q, seq_k), "int32"),),
        constexprs=(("HEADS", heads), ("BLOCK_M", block_m), ("BLOCK_N", block_n)),
        num_warps=4, num_stages=1,
    )
