"""Which config an op launches: explicit params, else the shared config cache, else the heuristic.

Both fronts call ``resolve`` where they build a plan, with the same ``Tunable`` and the same
problem (a hashable description of the call, e.g. a ``FlashSpec``), so they derive the same
cache key on the same device and launch the same binary:

1. ``fwd_params=``/``bwd_params=`` given by the caller: used as they are, nothing is read;
2. else the entry of the persistent cache (``config_cache``) for
   (device fingerprint, op, op version, shape/dtype key), if there is one and it still builds
   a valid plan (an entry that does not, e.g. one edited by hand, warns and is ignored);
3. else ``None``: the plan's own heuristic. Nothing is written.

Autotuning is opt-in (``autotune=True`` on the op, or ``EJKERNEL_AUTOTUNE=1``). The public ops
then call ``resolve`` once more with a ``measure(params) -> seconds`` callable, before their
kernels run: on a cache miss it times the op's candidates (``Tunable.candidate_params``: the
heuristic's config first, then a short list that fits the device's shared memory; two on CPU),
stores the fastest and returns it. Whichever framework tuned, the other reads the entry.

Fronts only tune on concrete arrays: under ``jax.jit`` (or ``grad``/``vmap`` tracing) and while
``torch.compile`` traces, ops read the cache and never time anything. A jitted function reads
the cache when it is traced; entries stored later reach it only when it is traced again.

Hot path: a lookup costs one ``stat`` of the cache file plus a dict lookup. Results (misses
too) are memoized per (op, device, problem) and dropped when the file changes; the file is
re-parsed only then. Fronts memoize what they build from several lookups the same way
(``memoized``), with one ``stat`` for all of them.

Bump a ``Tunable``'s ``version`` when its kernel or plan changes in a way that makes stored
configs stale (their old entries are then simply not found).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Any, Callable, Hashable, Sequence

from .config_cache import CacheKey, ConfigCache, autotune_enabled, get_cache, tune
from .params import BwdParams, FwdParams
from .plan import DeviceFacts, LaunchPlan, next_power_of_2

Params = FwdParams | BwdParams
Launch = Callable[..., Sequence[Any]]  # a front's launch(plan, *arrays) -> outputs

MIN_BLOCK = 16  # tl.dot needs every tile side >= 16


class Tunable:
    """One tuned launch of an op: how to key it, build its plan, list candidates and run it.

    * ``key(problem)``: the JSON-able shape/dtype part of the cache key;
    * ``plan(problem, facts, params)``: the plan whose tiles are tuned (raises for params that
      do not apply: this is how cached entries and candidates are validated);
    * ``candidates(problem, facts, default)``: config dicts to time; ``default`` is the
      heuristic's config, read off the plan;
    * ``workload(problem, facts, arrays, launch)``: ``run(params)`` that launches the tuned
      kernels once on ``arrays`` with a front's ``launch``;
    * ``untuned(problem, facts)`` (optional): True where the op's default is a kernel without
      these tiles (the Gluon flash forward, the Gluon dq kernel), which neither a cached entry nor tuning replaces.
    """

    def __init__(self, op: str, version: int, params: type, key: Callable[[Any], dict],
                 plan: Callable[[Any, DeviceFacts, Any], LaunchPlan], tiles: tuple[tuple[str, str], ...],
                 candidates: Callable[[Any, DeviceFacts, dict], list[dict]],
                 workload: Callable[[Any, DeviceFacts, Sequence[Any], Launch], Callable[[Any], Sequence[Any]]],
                 untuned: Callable[[Any, DeviceFacts], bool] | None = None):
        self.op, self.version, self.params = op, version, params
        self.key, self.plan, self.tiles = key, plan, tiles
        self.candidates, self.workload = candidates, workload
        self.untuned = untuned

    def __repr__(self) -> str:
        return f"Tunable({self.op!r}, version={self.version})"

    def cache_key(self, problem: Hashable, device: str) -> CacheKey:
        return CacheKey(device, self.op, self.version, self.key(problem))

    def config_of(self, plan: LaunchPlan) -> dict[str, int]:
        """The config a plan launches, as params fields."""
        consts = plan.constexpr_dict
        return {**{field: consts[const] for field, const in self.tiles},
                "num_warps": plan.num_warps, "num_stages": plan.num_stages}

    def defaults(self, problem: Hashable, facts: DeviceFacts) -> dict[str, int]:
        return self.config_of(self.plan(problem, facts, None))

    def candidate_params(self, problem: Hashable, facts: DeviceFacts) -> list[Params]:
        """The candidates that build a valid plan here (shared memory included), deduplicated."""
        out, seen = [], set()
        for config in self.candidates(problem, facts, self.defaults(problem, facts)):
            try:
                params = self.params.from_dict(config)
                self.plan(problem, facts, params)
            except (TypeError, ValueError):
                continue
            fields = tuple(sorted(params.to_dict().items()))
            if fields not in seen:
                seen.add(fields)
                out.append(params)
        return out


# --------------------------------------------------------------------------------------------
# Resolving


_memo: dict[tuple, tuple[int, Any]] = {}  # (key, cache path) -> (the cache's generation, value)
_memo_lock = threading.Lock()
_MEMO_LIMIT = 4096


def clear_memo() -> None:
    """Forget memoized lookups (the next call of each op reads the cache again)."""
    with _memo_lock:
        _memo.clear()


def memoized(key: Hashable, build: Callable[..., Any], *args: Any, cache: ConfigCache | None = None) -> Any:
    """``build(*args)``, memoized under ``key`` while ``cache`` (default: ``get_cache()``) keeps one
    generation, i.e. until its file changes or it stores an entry; ``clear_memo`` forgets it too.
    For what is derived from the cache's entries: ``resolve``'s lookups, and what a front builds
    from several of them (its plans), which then costs one generation check (a ``stat``) in all.
    ``key`` must hold everything else ``build`` reads (``args`` included)."""
    cache = cache if cache is not None else get_cache()
    generation = cache.generation()  # unique across ConfigCache objects: any view of the file may store
    memo_key = (key, cache.path)
    hit = _memo.get(memo_key)
    if hit is not None and hit[0] == generation:
        return hit[1]
    value = build(*args)
    with _memo_lock:
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        _memo[memo_key] = (generation, value)
    return value


def _lookup(tunable: Tunable, problem, facts: DeviceFacts, device: str, cache: ConfigCache) -> Params | None:
    config = cache.lookup(tunable.cache_key(problem, device))
    return None if config is None else _valid(tunable, problem, facts, config, cache)


def _valid(tunable: Tunable, problem, facts: DeviceFacts, config: dict, cache: ConfigCache) -> Params | None:
    try:
        params = tunable.params.from_dict(config)
        tunable.plan(problem, facts, params)
    except (TypeError, ValueError) as e:
        warnings.warn(f"config cache {cache.path}: the {tunable.op} entry {config} does not apply ({e}); "
                      "using the heuristic", stacklevel=6)
        return None
    return params


def _value_types(problem) -> tuple:
    """The types of a problem's values (a tuple's items, a dataclass's fields), for the memo: ==
    finds True == 1 == 1.0, which cache keys (stable_json) keep apart. Cheaper than repr on the
    per-call path."""
    if isinstance(problem, tuple):
        return tuple(map(type, problem))
    # ``_hash``: hash_fields_once's memo, present after the first hash, is not a value
    return tuple(type(v) for k, v in getattr(problem, "__dict__", {}).items() if k != "_hash")


def resolve(tunable: Tunable, problem: Hashable, facts: DeviceFacts, device: str, explicit: Params | None = None,
            *, autotune: bool | None = None, measure: Callable[[Params], float] | None = None,
            cache: ConfigCache | None = None, framework: str | None = None) -> Params | None:
    """The params to build ``tunable``'s plan with for ``problem`` on ``device`` (a fingerprint).

    ``explicit`` (the caller's override) wins. Otherwise the cached entry, else ``None`` (the
    heuristic). With ``measure`` given and autotuning enabled (``autotune``, default
    ``EJKERNEL_AUTOTUNE``), a miss is tuned: the candidates are timed with ``measure``, the
    fastest is stored (with ``framework`` noted beside it) and returned.
    """
    if explicit is not None:
        return explicit
    if tunable.untuned is not None and tunable.untuned(problem, facts):
        return None
    cache = cache if cache is not None else get_cache()
    params = memoized((tunable.op, tunable.version, device, problem, _value_types(problem), facts), _lookup,
                      tunable, problem, facts, device, cache, cache=cache)
    if params is None and measure is not None and autotune_enabled(autotune):
        key = tunable.cache_key(problem, device)
        stale = cache.lookup(key) is not None  # on file, but it does not apply here: replace it
        candidates = tunable.candidate_params(problem, facts)
        config = tune(key, [c.to_dict() for c in candidates], lambda config: measure(tunable.params.from_dict(config)),
                      cache=cache, force=stale, meta={"framework": framework} if framework else None)
        params = _valid(tunable, problem, facts, config, cache)
    return params


def measure(tunable: Tunable, problem: Hashable, facts: DeviceFacts, arrays: Sequence[Any], launch: Launch,
            sync: Callable[[Any], Any], reps: int | None = None) -> Callable[[Params], float]:
    """``measure(params) -> seconds`` for ``resolve``: wall time of ``tunable``'s kernels on
    ``arrays`` through a front's ``launch`` (``sync(outputs)`` waits for them). On a GPU each
    config runs once untimed (compilation), then ``reps`` (10) times; the interpreter runs it
    once. Inputs the kernels need beyond ``arrays`` (e.g. a forward's outputs for a backward)
    are computed on the first call, outside the timing."""
    warmup, reps = (0, reps or 1) if facts.is_cpu else (1, reps or 10)
    state: dict[str, Callable] = {}

    def seconds(params: Params) -> float:
        if "run" not in state:
            state["run"] = tunable.workload(problem, facts, arrays, launch)
        run = state["run"]
        for _ in range(warmup):
            sync(run(params))
        start = time.perf_counter()
        for _ in range(reps):
            out = run(params)
        sync(out)
        return (time.perf_counter() - start) / reps

    return seconds


# --------------------------------------------------------------------------------------------
# Candidates


def _table(fields: tuple[str, ...], rows: tuple[tuple[int, ...], ...]) -> Callable:
    """Candidates: the heuristic's config, then ``rows`` on a GPU; on CPU (the interpreter ignores
    warps and stages) the heuristic and one other tiling: halved, or doubled where already minimal."""

    def candidates(problem, facts: DeviceFacts, default: dict) -> list[dict]:
        if facts.is_cpu:
            blocks = [f for f in default if f.startswith("blocksize")]
            other = {f: max(MIN_BLOCK, default[f] // 2) for f in blocks}
            if other == {f: default[f] for f in blocks}:
                other = {f: 2 * default[f] for f in blocks}
            return [dict(default), {**default, **other}]
        return [dict(default)] + [dict(zip(fields, row)) for row in rows]

    return candidates


_ATTENTION = ("blocksize_m", "blocksize_n", "num_warps", "num_stages")
_ATTENTION_FWD_GPU = ((128, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2),
                      (128, 128, 8, 2))
_ATTENTION_BWD_GPU = ((64, 64, 4, 1), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1), (128, 64, 8, 1),
                      (64, 128, 8, 1))
_GMM = ("blocksize_m", "blocksize_n", "blocksize_k", "num_warps")  # stages: the most that fit
_GMM_GPU = ((64, 128, 64, 4), (128, 128, 64, 8), (128, 64, 64, 4), (64, 64, 32, 4), (128, 256, 64, 8))
_TGMM_GPU = ((64, 128, 128, 8), (32, 64, 64, 4), (64, 64, 64, 4), (128, 128, 64, 8))
_MN = (("blocksize_m", "BLOCK_M"), ("blocksize_n", "BLOCK_N"))
_MNK = _MN + (("blocksize_k", "BLOCK_K"),)

# --------------------------------------------------------------------------------------------
# flash_attention(_varlen): the problem is the call's FlashSpec


def _flash_key(spec) -> dict:
    """The spec without the values that do not change which tiles are fast (scales, dropout
    probability); varlen token totals by power of two (they change with every packed batch)."""
    key = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    del key["softmax_scale"], key["dropout_p"], key["segment_dtype"]
    key["softcap"] = spec.softcap is not None
    key["dropout"] = spec.dropout_p > 0.0
    if spec.varlen:
        key["total_q"], key["total_k"] = next_power_of_2(max(spec.total_q, 1)), next_power_of_2(max(spec.total_k, 1))
    return key


def _flash_fwd_plan(spec, facts, params):
    from .flash_attention import plan

    return plan.triton_forward_plan(spec, facts, params)


def _flash_fwd_untuned(spec, facts):
    """Where a Gluon kernel runs by default, the Triton tiles have nothing to tune."""
    from .flash_attention import plan

    return plan.uses_gluon(spec, facts)


def _flash_bwd_untuned(spec, facts):
    from .flash_attention import plan

    return plan.uses_gluon_dkdv(spec, facts)  # the tuned workload is the dk/dv kernel


def _flash_bwd_plan(spec, facts, params):
    from . import flash_attention as fa

    return fa.backward_plans(spec, facts, False, False, params).dkdv


def _flash_fwd_workload(spec, facts, features, launch):
    from . import flash_attention as fa

    return lambda params: launch(fa.forward_plan(spec, facts, params), *features)


def _flash_bwd_workload(spec, facts, features, launch):
    """dk/dv and dq kernels (the tuned ones) on the heuristic forward's outputs, with dout = out."""
    from . import flash_attention as fa

    out, lse = launch(fa.forward_plan(spec, facts, None), *features)

    def run(params):  # out stands in for dO, lse for the unused dlse
        return fa.backward_plans(spec, facts, False, False, params).gradients(launch, features, out, out, lse, lse)[:3]

    return run


FLASH_FWD = Tunable("flash_attention_fwd", 1, FwdParams, _flash_key, _flash_fwd_plan, _MN,
                    _table(_ATTENTION, _ATTENTION_FWD_GPU), _flash_fwd_workload, _flash_fwd_untuned)
FLASH_BWD = Tunable("flash_attention_bwd", 1, BwdParams, _flash_key, _flash_bwd_plan, _MN,
                    _table(_ATTENTION, _ATTENTION_BWD_GPU), _flash_bwd_workload, _flash_bwd_untuned)

# --------------------------------------------------------------------------------------------
# padded_attention: the problem is (q_shape, dtype, softmax_scale); arrays (q, k, v, n_pad)


def _padded_key(problem) -> dict:
    q_shape, dtype, _ = problem
    return {"q": list(q_shape), "dtype": dtype}


def _padded_fwd_plan(problem, facts, params):
    from .padded_attention import attention_fwd_plan

    return attention_fwd_plan(*problem, facts, params)


def _padded_bwd_plan(problem, facts, params):
    from .padded_attention import attention_bwd_plans

    return attention_bwd_plans(*problem, facts, params)[1]


def _padded_fwd_workload(problem, facts, arrays, launch):
    from .padded_attention import attention_fwd_plan

    return lambda params: launch(attention_fwd_plan(*problem, facts, params), *arrays)


def _padded_bwd_workload(problem, facts, arrays, launch):
    from .padded_attention import attention_bwd_plans, attention_fwd_plan

    q, k, v, n_pad = arrays
    out, lse2 = launch(attention_fwd_plan(*problem, facts, None), *arrays)
    (delta,) = launch(attention_bwd_plans(*problem, facts)[0], out, out)

    def run(params):
        _, dkdv, dq = attention_bwd_plans(*problem, facts, params)
        args = (q, k, v, out, lse2, delta, n_pad)
        return (*launch(dkdv, *args), *launch(dq, *args))

    return run


PADDED_FWD = Tunable("padded_attention_fwd", 1, FwdParams, _padded_key, _padded_fwd_plan, _MN,
                     _table(_ATTENTION, _ATTENTION_FWD_GPU), _padded_fwd_workload)
PADDED_BWD = Tunable("padded_attention_bwd", 1, BwdParams, _padded_key, _padded_bwd_plan, _MN,
                     _table(_ATTENTION, _ATTENTION_BWD_GPU), _padded_bwd_workload)

# --------------------------------------------------------------------------------------------
# grouped matmuls: the problem is gmm_plan's / tgmm_plan's arguments before the device facts,
# (m, k, n, num_groups, num_selected, transpose_rhs | lhs_mk, dtype, out_dtype);
# arrays (lhs, rhs, group_sizes, group_offset)

_GMM_FIELDS = ("m", "k", "n", "num_groups", "num_selected", "transpose_rhs", "dtype", "out_dtype")
_TGMM_FIELDS = _GMM_FIELDS[:5] + ("lhs_mk",) + _GMM_FIELDS[6:]


def _gmm_plan(problem, facts, params):
    from .grouped_matmul import gmm_plan

    return gmm_plan(*problem, facts, params)


def _tgmm_plan(problem, facts, params):
    from .grouped_matmul import tgmm_plan

    return tgmm_plan(*problem, facts, params)


def _tgmm_untuned(problem, facts):
    # The Gluon weight gradient takes no params: not tuned, as the Gluon flash kernels.
    from .grouped_matmul import uses_gluon_tgmm

    m, k, n, _, num_selected, lhs_mk, dtype, out_dtype = problem
    return uses_gluon_tgmm(m, k, n, num_selected, lhs_mk, dtype, out_dtype, facts)


def _single_plan_workload(plan_fn):
    def workload(problem, facts, arrays, launch):
        return lambda params: launch(plan_fn(problem, facts, params), *arrays)

    return workload


GMM = Tunable("grouped_matmul", 1, FwdParams, lambda p: dict(zip(_GMM_FIELDS, p)), _gmm_plan, _MNK,
              _table(_GMM, _GMM_GPU), _single_plan_workload(_gmm_plan))
TGMM = Tunable("transposed_grouped_matmul", 1, FwdParams, lambda p: dict(zip(_TGMM_FIELDS, p)), _tgmm_plan, _MNK,
               _table(_GMM, _TGMM_GPU), _single_plan_workload(_tgmm_plan), _tgmm_untuned)

TUNABLES = {t.op: t for t in (FLASH_FWD, FLASH_BWD, PADDED_FWD, PADDED_BWD, GMM, TGMM)}

__all__ = [
    "FLASH_BWD", "FLASH_FWD", "GMM", "PADDED_BWD", "PADDED_FWD", "TGMM", "TUNABLES", "Tunable", "autotune_enabled",
    "clear_memo", "measure", "memoized", "resolve",
]
