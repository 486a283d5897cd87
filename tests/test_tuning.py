"""The config cache wired into the ops: heuristics by default, opt-in autotuning from either
framework, the tuned config launched by both (bitwise parity kept), explicit params first,
jit reads only, bad files and stale entries fall back to the heuristic."""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import types
import warnings

import numpy as np
import pytest

from tests.frameworks import TOLERANCE, rel_error
from triton_kernels import config_cache as cc
from triton_kernels import tuning
from triton_kernels.config_cache import ConfigCache
from triton_kernels.flash_attention.spec import FlashSpec
from triton_kernels.params import BwdParams, FwdParams
from triton_kernels.plan import DeviceFacts

CPU = DeviceFacts.cpu()
# The expected plans and candidates are the CPU ones: where a CUDA GPU is present the fronts
# plan for it instead, so these tests run on CPU machines only (CI).
pytestmark = pytest.mark.cpu_plans


@pytest.fixture(autouse=True)
def cache_path(isolated_config_cache):
    """Every test has its own cache file and starts with autotuning off (never ~/.cache)."""
    return isolated_config_cache


def fresh_process_view(monkeypatch):
    """What another process would see: no memoized lookups, no cache objects yet."""
    tuning.clear_memo()
    monkeypatch.setattr(cc, "_caches", {})
    monkeypatch.setattr(cc, "_caches_by_env", {})


# --------------------------------------------------------------------------------------------
# the ops under test: tiny shapes; candidates are two configs that both differ from the CPU
# heuristic, so the launched plan shows whether the cache was used


class Case:
    def __init__(self, name, shapes, call, module, problem, candidates, tuned=None):
        self.name, self.shapes, self.call, self.module = name, shapes, call, module
        self.problem = problem  # the problem both fronts key the call by (shapes -> problem)
        self.candidates = candidates  # {tunable: [config, config]}
        # shapes -> {tunable: [problems]}: what a call with a gradient to take tunes, in order
        # (default: the call's problem for each tunable, as flash's forward and backward share it)
        self._tuned = tuned

    def tuned(self, shapes) -> dict:
        if self._tuned is not None:
            return self._tuned(shapes)
        return {t: [self.problem(shapes)] for t in self.candidates}

    def inputs(self, fw, rng):
        return [fw.asarray(rng.standard_normal(s), "float32") for s in self.shapes]


def _flash(fw, arrays, **kw):
    return fw.ops.flash_attention(*arrays, causal=True, **kw)


def _flash_problem(shapes):
    from triton_kernels import flash_attention as fa

    return fa.dense_spec(*shapes, ("float32",) * 3, causal=True)


def _padded(fw, arrays, **kw):
    return fw.ops.padded_attention(*arrays, fw.asarray(np.array([0, 5], np.int32)), **kw)


def _gmm(fw, arrays, **kw):
    return fw.ops.grouped_matmul(*arrays, fw.asarray(np.array([10, 0, 25], np.int32)), **kw)


def _gmm_tuned(shapes):
    """The forward's problem, then the backward's: d_lhs a gmm of (grad, rhs) with the transpose
    flag flipped, d_rhs a tgmm of (lhs, grad) with lhs read as [m, k]."""
    return {tuning.GMM: [(40, 32, 24, 3, 3, False, "float32", "float32"),
                         (40, 24, 32, 3, 3, True, "float32", "float32")],
            tuning.TGMM: [(40, 32, 24, 3, 3, True, "float32", "float32")]}


CASES = {
    # CPU heuristic: 32 x 32 tiles (seq 20 / 24)
    "flash": Case("flash", [(1, 20, 2, 16), (1, 24, 1, 16), (1, 24, 1, 16)], _flash, "flash_attention",
                  _flash_problem, {
        tuning.FLASH_FWD: [dict(blocksize_m=16, blocksize_n=16), dict(blocksize_m=16, blocksize_n=64)],
        tuning.FLASH_BWD: [dict(blocksize_m=16, blocksize_n=32), dict(blocksize_m=64, blocksize_n=16)],
    }),
    # CPU heuristic: 64 x 64
    "padded": Case("padded", [(2, 37, 24)] * 3, _padded, "padded_attention",
                   lambda shapes: (shapes[0], "float32", 24 ** -0.5), {
        tuning.PADDED_FWD: [dict(blocksize_m=16, blocksize_n=32), dict(blocksize_m=32, blocksize_n=16)],
        tuning.PADDED_BWD: [dict(blocksize_m=16, blocksize_n=16), dict(blocksize_m=32, blocksize_n=32)],
    }),
    # CPU heuristic: 64 x 64 x 64
    "gmm": Case("gmm", [(40, 32), (3, 32, 24)], _gmm, "grouped_matmul",
                lambda shapes: (40, 32, 24, 3, 3, False, "float32", "float32"), {
        tuning.GMM: [dict(blocksize_m=16, blocksize_n=32, blocksize_k=16),
                     dict(blocksize_m=32, blocksize_n=16, blocksize_k=32, num_warps=2)],
        tuning.TGMM: [dict(blocksize_m=16, blocksize_n=16, blocksize_k=32),
                      dict(blocksize_m=32, blocksize_n=32, blocksize_k=16, num_warps=2)],
    }, _gmm_tuned),
}


def spy_candidates(monkeypatch, case):
    """Replace the case's candidate lists; returns {tunable: [problems it was asked to tune]}."""
    asked = {t: [] for t in case.candidates}
    for tunable, configs in case.candidates.items():
        def candidates(problem, facts, default, tunable=tunable, configs=configs):
            assert facts == CPU and tunable.params.from_dict(default) != tunable.params.from_dict(configs[0])
            asked[tunable].append(problem)
            return [dict(c) for c in configs]
        monkeypatch.setattr(tunable, "candidates", candidates)
    return asked


def spy_launches(monkeypatch, fw, case) -> list:
    """Plans the op module launches (tuning's own timing launches are not recorded)."""
    module = importlib.import_module(f"ejkernel_{fw.name}.ops.{case.module}")
    plans = []
    # torch ops launch with launch_traceable, or with launch (launch_prechecked) where they know
    # the call is plain eager
    for name in ("launch_traceable", "launch", "launch_prechecked"):
        if hasattr(module, name):
            def spy(plan, *arrays, real=getattr(module, name)):
                plans.append(plan)
                return real(plan, *arrays)

            monkeypatch.setattr(module, name, spy)
    return plans


def run(fw, case, values, rng_cot, **kw):
    """Output and input gradients (numpy) of one call."""
    arrays = [fw.asarray(v, "float32") for v in values]
    out = case.call(fw, arrays, **kw)
    cot = fw.asarray(rng_cot.standard_normal(tuple(out.shape)), "float32")
    grads = fw.vjp(lambda *a: case.call(fw, a, **kw), arrays, cot)
    return [fw.to_numpy(out), *grads]


def entry(path, tunable, problem, device):
    doc = json.loads(path.read_text())
    return doc["entries"].get(tunable.cache_key(problem, device).text)


def fingerprint(fw):
    return importlib.import_module(f"ejkernel_{fw.name}.utils").device_fingerprint()


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_default_is_the_heuristic_and_writes_nothing(fw, case, rng, cache_path, monkeypatch):
    asked = spy_candidates(monkeypatch, case)
    plans = spy_launches(monkeypatch, fw, case)
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "0")
    run(fw, case, [fw.to_numpy(a) for a in case.inputs(fw, rng)], rng)
    assert plans and not any(asked.values())
    assert not cache_path.exists() and not list(cache_path.parent.iterdir())
    for tunable, problems in case.tuned(case.shapes).items():  # every tuned kernel launched with the plan's own choice
        assert all(tunable.plan(problem, CPU, None) in plans for problem in problems)


@pytest.mark.parametrize("tuner", ["torch", "jax"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_one_framework_tunes_the_other_launches_it(case, tuner, torch_fw, jax_fw, rng, cache_path, monkeypatch):
    tune_fw, read_fw = (torch_fw, jax_fw) if tuner == "torch" else (jax_fw, torch_fw)
    values = [torch_fw.to_numpy(a) for a in case.inputs(torch_fw, rng)]
    seed = int(rng.integers(1 << 30))
    heuristic = run(tune_fw, case, values, np.random.default_rng(seed))
    asked = spy_candidates(monkeypatch, case)

    # tune: torch tunes the backward when an input requires grad; jax tunes on concrete arrays
    arrays = [tune_fw.asarray(v, "float32") for v in values]
    if tuner == "torch":
        for a in arrays:
            a.requires_grad_(True)
    case.call(tune_fw, arrays, autotune=True)
    tuned = {}
    for tunable, problems in case.tuned(case.shapes).items():
        assert asked[tunable] == problems  # each timed once
        for problem in problems:
            stored = entry(cache_path, tunable, problem, fingerprint(tune_fw))
            assert stored["framework"] == tuner and stored["source"] == "autotune"
            assert stored["config"] in case.candidates[tunable]
            tuned[tunable, problem] = tunable.plan(problem, CPU, tunable.params.from_dict(stored["config"]))
    tuner_plans = spy_launches(monkeypatch, tune_fw, case)
    tuned_run = run(tune_fw, case, values, np.random.default_rng(seed), autotune=True)  # stored: no new timing
    assert sum(map(len, asked.values())) == len(tuned)
    for got, want in zip(tuned_run, heuristic, strict=True):
        assert rel_error(got, want) < 1e-5  # other tilings (the gradients' too), same result

    # the other framework, as a fresh process would: reads the entries, launches the same plans
    fresh_process_view(monkeypatch)
    reader_plans = spy_launches(monkeypatch, read_fw, case)
    read_run = run(read_fw, case, values, np.random.default_rng(seed))
    for (tunable, problem), plan in tuned.items():
        heuristic_plan = tunable.plan(problem, CPU, None)
        assert plan != heuristic_plan
        for plans in (tuner_plans, reader_plans):
            assert plan in plans and heuristic_plan not in plans
    assert sum(map(len, asked.values())) == len(tuned)  # the reader timed nothing
    for a, b in zip(tuned_run, read_run, strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise


def test_explicit_params_beat_the_cache(fw, rng, cache_path, monkeypatch):
    case = CASES["flash"]
    asked = spy_candidates(monkeypatch, case)
    values = [fw.to_numpy(a) for a in case.inputs(fw, rng)]
    # store entries as a tuning run would (autotune from this framework)
    fw_arrays = [fw.asarray(v, "float32") for v in values]
    if fw.name == "torch":
        for a in fw_arrays:
            a.requires_grad_(True)
    case.call(fw, fw_arrays, autotune=True)
    (problem,) = asked[tuning.FLASH_FWD]
    stored = {t: tunable_plan(t, problem, entry(cache_path, t, problem, fingerprint(fw))["config"])
              for t in case.candidates}
    explicit_fwd, explicit_bwd = FwdParams(blocksize_m=64, blocksize_n=32), BwdParams(blocksize_m=32, blocksize_n=64)
    want = {tuning.FLASH_FWD: tuning.FLASH_FWD.plan(problem, CPU, explicit_fwd),
            tuning.FLASH_BWD: tuning.FLASH_BWD.plan(problem, CPU, explicit_bwd)}
    plans = spy_launches(monkeypatch, fw, case)
    run(fw, case, values, rng, fwd_params=explicit_fwd, bwd_params=explicit_bwd, autotune=True)
    for t in case.candidates:
        assert want[t] in plans and stored[t] not in plans
    plans.clear()  # one explicit, the other from the cache
    run(fw, case, values, rng, fwd_params=explicit_fwd)
    assert want[tuning.FLASH_FWD] in plans and stored[tuning.FLASH_BWD] in plans
    assert stored[tuning.FLASH_FWD] not in plans
    assert sum(map(len, asked.values())) == 2  # explicit params are never tuned over


def tunable_plan(tunable, problem, config):
    return tunable.plan(problem, CPU, tunable.params.from_dict(config))


def test_autotune_from_the_environment(fw, rng, cache_path, monkeypatch):
    case = CASES["gmm"]
    asked = spy_candidates(monkeypatch, case)
    arrays = case.inputs(fw, rng)
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    case.call(fw, arrays, autotune=False)  # the argument beats the environment
    assert not cache_path.exists() and not asked[tuning.GMM]
    case.call(fw, arrays)
    problem = asked[tuning.GMM][0]  # the forward's (jax tunes the backward's too)
    stored = entry(cache_path, tuning.GMM, problem, fingerprint(fw))
    assert stored["framework"] == fw.name and stored["config"] in case.candidates[tuning.GMM]
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "0")
    plans = spy_launches(monkeypatch, fw, case)
    case.call(fw, arrays, autotune=None)  # env off now: still reads what was tuned
    assert tunable_plan(tuning.GMM, problem, stored["config"]) in plans


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_bad_autotune_variable_is_an_error(fw, case, rng, cache_path, monkeypatch):
    """EJKERNEL_AUTOTUNE=2 (or "enabled") was read as off, silently."""
    asked = spy_candidates(monkeypatch, case)
    arrays = case.inputs(fw, rng)
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "enabled")
    with pytest.raises(ValueError, match="EJKERNEL_AUTOTUNE must be one of .*got 'enabled'"):
        case.call(fw, arrays)
    case.call(fw, arrays, autotune=False)  # the argument beats the environment
    assert not any(asked.values()) and not cache_path.exists()


def test_jit_reads_the_cache_and_never_tunes(jax_fw, rng, cache_path, monkeypatch):
    import jax

    fw, case = jax_fw, CASES["flash"]
    asked = spy_candidates(monkeypatch, case)
    values = [fw.to_numpy(a) for a in case.inputs(fw, rng)]
    arrays = [fw.asarray(v, "float32") for v in values]
    problem = case.problem([tuple(a.shape) for a in arrays])
    fwd_cfg, bwd_cfg = case.candidates[tuning.FLASH_FWD][1], case.candidates[tuning.FLASH_BWD][1]
    cache = ConfigCache(cache_path)  # pre-stored, as by an earlier tuning run (of either framework)
    cache.store(tuning.FLASH_FWD.cache_key(problem, fingerprint(fw)), fwd_cfg)
    cache.store(tuning.FLASH_BWD.cache_key(problem, fingerprint(fw)), bwd_cfg)
    before = cache_path.read_bytes()
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    plans = spy_launches(monkeypatch, fw, case)

    loss = lambda *a: (case.call(fw, a, autotune=True) ** 2).sum()  # noqa: E731
    jax.block_until_ready(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*arrays))
    assert tunable_plan(tuning.FLASH_FWD, problem, fwd_cfg) in plans
    assert tunable_plan(tuning.FLASH_BWD, problem, bwd_cfg) in plans
    assert tuning.FLASH_FWD.plan(problem, CPU, None) not in plans

    # a problem with no entry: the heuristic, and still nothing timed or written under jit
    other = [fw.asarray(np.ones((1, 9, 2, 16)), "float32")] * 3
    plans.clear()
    jax.block_until_ready(jax.jit(lambda *a: case.call(fw, a, autotune=True))(*other))
    assert tuning.FLASH_FWD.plan(case.problem([a.shape for a in other]), CPU, None) in plans
    assert not any(asked.values()) and cache_path.read_bytes() == before


def test_vmap_reads_the_cache_and_never_tunes(fw, rng, cache_path, monkeypatch):
    """torch.func.vmap with autotuning on raised "autotuning grouped_matmul: no candidate ran
    (... Cannot access storage of BatchedTensorImpl)": the candidates were launched on vmap's
    batched tensors. Now the cache is only read there, as under jax.vmap."""
    asked = spy_candidates(monkeypatch, CASES["gmm"])
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    lhs, rhs = CASES["gmm"].inputs(fw, rng)
    sizes = np.array([[10, 0, 25], [3, 30, 2]], np.int32)
    gmm = fw.ops.grouped_matmul
    got = fw.vmap(lambda g: gmm(lhs, rhs, g, autotune=True), (0,))(fw.asarray(sizes))
    want = np.stack([fw.to_numpy(gmm(lhs, rhs, fw.asarray(s), autotune=False)) for s in sizes])
    # To rounding: the vmapped call tiles both samples' rows of an expert together.
    np.testing.assert_allclose(fw.to_numpy(got), want, rtol=1e-5, atol=1e-5)
    assert not asked[tuning.GMM] and not cache_path.exists()


def test_vmap_with_shared_weights_reads_the_plain_calls_entry(fw, rng, cache_path, monkeypatch):
    """vmap with the expert weights shared tiles an expert's rows of all samples together, as
    one call on all the tokens: it reads that call's tuned config, not the one tuned for one
    sample's rows (which sized the tiles for a sample)."""
    from triton_kernels import grouped_matmul as gm

    lhs, rhs = (fw.asarray(rng.standard_normal(s), "float32") for s in ((2, 40, 32), (3, 32, 24)))
    sizes = fw.asarray(np.array([[10, 0, 25], [3, 30, 2]], np.int32))
    one_sample = (40, 32, 24, 3, 3, False, "float32", "float32")
    plain, config = (80, *one_sample[1:]), dict(blocksize_m=16, blocksize_n=32, blocksize_k=16)
    ConfigCache(cache_path).store(tuning.GMM.cache_key(plain, fingerprint(fw)), config)
    plans = spy_launches(monkeypatch, fw, CASES["gmm"])
    got = fw.vmap(lambda x, g: fw.ops.grouped_matmul(x, rhs, g), (0, 0))(lhs, sizes)
    assert gm.gmm_plan(*one_sample, CPU, FwdParams(**config), batch=2, shared_rhs=True) in plans
    for i in range(2):
        one = fw.ops.grouped_matmul(lhs[i], rhs, sizes[i])
        np.testing.assert_allclose(fw.to_numpy(got)[i], fw.to_numpy(one), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_jit_over_closed_over_arrays_never_tunes(jax_fw, case, rng, cache_path, monkeypatch):
    """Arrays a jitted function closes over are concrete: autotuning ran at trace time, where
    the candidates' launches were only recorded, so it stored the config fastest to trace."""
    import jax

    asked = spy_candidates(monkeypatch, case)
    extra = {"flash": [], "padded": [np.array([0, 5], np.int32)], "gmm": [np.array([10, 0, 25], np.int32)]}[case.name]
    arrays = case.inputs(jax_fw, rng) + [jax_fw.asarray(a) for a in extra]  # all made outside the trace
    op = getattr(jax_fw.ops, case.module)
    kwargs = {"causal": True} if case.name == "flash" else {}
    plans = spy_launches(monkeypatch, jax_fw, case)
    for stage in (jax.jit, lambda f: functools.partial(jax.lax.scan, lambda c, _: (c, f()), 0, length=1)):
        jax.block_until_ready(stage(lambda: op(*arrays, autotune=True, **kwargs))())
    assert not any(asked.values()) and not cache_path.exists()
    forward = next(iter(case.candidates))  # launched with the heuristic's plan
    assert forward.plan(case.problem(case.shapes), CPU, None) in plans


def test_no_home_directory_uses_the_temp_dir(fw, rng, tmp_path, monkeypatch):
    """Without HOME and a passwd entry (a container run as an unnamed uid) every op call raised
    "RuntimeError: Could not determine home directory", autotuning on or off."""
    import pathlib
    import tempfile

    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(cc.CACHE_ENV)
    monkeypatch.setattr(pathlib.Path, "home", classmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    case = CASES["gmm"]
    asked = spy_candidates(monkeypatch, case)
    arrays = case.inputs(fw, rng)
    case.call(fw, arrays)
    case.call(fw, arrays, autotune=True)
    problem = asked[tuning.GMM][0]  # the forward's (jax tunes the backward's too)
    (path,) = (tmp_path / "tmp").glob("ejkernel-*/configs.json")
    assert entry(path, tuning.GMM, problem, fingerprint(fw))["config"] in case.candidates[tuning.GMM]


@pytest.mark.parametrize("content", ["{not json", '{"format": "something else"}'])
def test_corrupt_cache_file_warns_and_uses_the_heuristic(fw, rng, cache_path, monkeypatch, content):
    case = CASES["padded"]
    values = [fw.to_numpy(a) for a in case.inputs(fw, rng)]
    seed = int(rng.integers(1 << 30))
    clean = run(fw, case, values, np.random.default_rng(seed))
    cache_path.write_text(content)
    fresh_process_view(monkeypatch)
    plans = spy_launches(monkeypatch, fw, case)
    with pytest.warns(UserWarning, match="config cache .* ignoring it"):
        got = run(fw, case, values, np.random.default_rng(seed))
    for a, b in zip(clean, got, strict=True):
        np.testing.assert_array_equal(a, b)
    problem = case.problem(case.shapes)
    assert all(t.plan(problem, CPU, None) in plans for t in case.candidates)  # the heuristic's plans
    # autotuning over a corrupt file replaces it (the old one is kept aside) and works
    asked = spy_candidates(monkeypatch, case)
    with pytest.warns(UserWarning, match="moved it to"):
        case.call(fw, case.inputs(fw, rng), autotune=True)
    assert cache_path.with_name("configs.json.bad").read_text() == content
    (problem,) = asked[tuning.PADDED_FWD]
    stored = entry(cache_path, tuning.PADDED_FWD, problem, fingerprint(fw))
    assert stored["config"] in case.candidates[tuning.PADDED_FWD]


@pytest.mark.parametrize("config, why", [
    ({"blocksize_q": 32}, "unknown field"),
    ({"blocksize_m": 8}, "at least 16"),
    ({"blocksize_m": 256, "blocksize_n": 256, "num_stages": 4}, "shared memory"),
])
def test_stale_entry_warns_and_uses_the_heuristic(fw, rng, cache_path, monkeypatch, config, why):
    monkeypatch.setenv("EJKERNEL_TRITON_SMEM_LIMIT", str(64 * 1024))
    case = CASES["flash"]
    arrays = case.inputs(fw, rng)
    problem = case.problem([tuple(a.shape) for a in arrays])
    ConfigCache(cache_path).store(tuning.FLASH_FWD.cache_key(problem, fingerprint(fw)), config)
    plans = spy_launches(monkeypatch, fw, case)
    with pytest.warns(UserWarning, match=f"flash_attention_fwd entry .*does not apply.*{why}"):
        case.call(fw, arrays)
    assert tuning.FLASH_FWD.plan(problem, CPU, None) in plans
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per version of the file, not per call
        case.call(fw, arrays)
    # autotuning replaces the stale entry
    asked = spy_candidates(monkeypatch, case)
    plans.clear()
    case.call(fw, arrays, autotune=True)
    assert asked[tuning.FLASH_FWD] == [problem]
    tuned = entry(cache_path, tuning.FLASH_FWD, problem, fingerprint(fw))["config"]
    assert tuned in case.candidates[tuning.FLASH_FWD] and tunable_plan(tuning.FLASH_FWD, problem, tuned) in plans


def test_lookups_are_memoized_until_the_file_changes(fw, rng, cache_path, monkeypatch):
    case = CASES["flash"]
    arrays = case.inputs(fw, rng)
    problem = case.problem([tuple(a.shape) for a in arrays])
    key = tuning.FLASH_FWD.cache_key(problem, fingerprint(fw))
    ConfigCache(cache_path).store(key, case.candidates[tuning.FLASH_FWD][0])
    reads, real_read = [], ConfigCache._read_file
    monkeypatch.setattr(ConfigCache, "_read_file", lambda self: reads.append(1) or real_read(self))
    lookups, real_lookup = [], ConfigCache.lookup
    monkeypatch.setattr(ConfigCache, "lookup", lambda self, k: lookups.append(k) or real_lookup(self, k))
    plans = spy_launches(monkeypatch, fw, case)
    for _ in range(3):
        case.call(fw, arrays)
    assert len(reads) == 1 and len(lookups) == 1  # parsed once, looked up once, then memoized
    assert plans.count(tunable_plan(tuning.FLASH_FWD, problem, case.candidates[tuning.FLASH_FWD][0])) == 3
    # another process replaces the entry: the next call sees it
    ConfigCache(cache_path).store(key, case.candidates[tuning.FLASH_FWD][1], overwrite=True)
    case.call(fw, arrays)
    assert plans[-1] == tunable_plan(tuning.FLASH_FWD, problem, case.candidates[tuning.FLASH_FWD][1])


def test_a_spec_is_looked_up_once(cache_path, monkeypatch):
    """Specs memoize their hash in ``__dict__`` (plan.hash_fields_once): that is not one of the
    values the memo keys on, so a fresh spec's second resolve is still a memo hit."""
    problem = FlashSpec(2, 17, 17, 2, 2, 16, "float32", 0.25)
    cache = ConfigCache(cache_path)
    lookups, real_lookup = [], ConfigCache.lookup
    monkeypatch.setattr(ConfigCache, "lookup", lambda self, k: lookups.append(k) or real_lookup(self, k))
    for _ in range(3):
        assert tuning.resolve(tuning.FLASH_FWD, problem, CPU, "cpu|test", cache=cache) is None
    assert len(lookups) == 1


def test_memoized_lookups_are_what_the_cache_holds(cache_path):
    """A memoized resolve gives what a fresh lookup gives, whatever was resolved before."""
    device, config = "cpu|test", dict(blocksize_m=16, blocksize_n=32, blocksize_k=16)
    problem = (40, 32, 24, 3, 3, False, "float32", "float32")
    first = ConfigCache(cache_path)
    first.store(tuning.GMM.cache_key((8,) + problem[1:], device), config)  # another problem's entry
    assert tuning.resolve(tuning.GMM, problem, CPU, device, cache=first) is None
    # another view of the same file stores this problem's entry: resolving through either sees it
    second = ConfigCache(cache_path)
    second.store(tuning.GMM.cache_key(problem, device), config)
    assert tuning.resolve(tuning.GMM, problem, CPU, device, cache=second) == FwdParams(**config)
    assert tuning.resolve(tuning.GMM, problem, CPU, device, cache=first) == FwdParams(**config)
    # True == 1 in Python, not in cache keys: transpose_rhs=1 has no entry, whatever came first
    true, one = problem[:5] + (True,) + problem[6:], problem[:5] + (1,) + problem[6:]
    second.store(tuning.GMM.cache_key(true, device), config)
    assert second.lookup(tuning.GMM.cache_key(one, device)) is None
    assert tuning.resolve(tuning.GMM, true, CPU, device, cache=second) == FwdParams(**config)
    assert tuning.resolve(tuning.GMM, one, CPU, device, cache=second) is None


@pytest.mark.parametrize("op", ["grouped_matmul", "transposed_grouped_matmul"])
def test_gmm_params_that_override_nothing_read_the_cache(fw, cache_path, monkeypatch, op):
    """fwd_params={} (or all None) is fwd_params=None: the cached entry, not the heuristic."""
    tunable, shapes = {"grouped_matmul": (tuning.GMM, [(40, 32), (3, 32, 24)]),
                       "transposed_grouped_matmul": (tuning.TGMM, [(32, 40), (40, 24)])}[op]
    problem = (40, 32, 24, 3, 3, False, "float32", "float32")
    config = dict(blocksize_m=16, blocksize_n=32, blocksize_k=16)
    ConfigCache(cache_path).store(tunable.cache_key(problem, fingerprint(fw)), config)
    arrays = [fw.asarray(np.ones(s), "float32") for s in shapes] + [fw.asarray(np.array([10, 0, 25], np.int32))]
    plans = spy_launches(monkeypatch, fw, CASES["gmm"])
    for params in (None, {}, {"blocksize_m": None}, FwdParams()):
        plans.clear()
        getattr(fw.ops, op)(*arrays, fwd_params=params)
        assert tunable_plan(tunable, problem, config) in plans, params
        assert tunable.plan(problem, CPU, None) not in plans, params


F32, BF16 = "float32", "bfloat16"
# op, shapes, dtype, kwargs, then the problems tuned: the forward's, d_lhs's, d_rhs's (written out
# here, not derived as the fronts derive them, so that a wrong derivation fails)
GMM_GRADS = {
    "gmm": ("grouped_matmul", [(40, 32), (3, 32, 24)], F32, {}, [
        (tuning.GMM, (40, 32, 24, 3, 3, False, F32, F32)), (tuning.GMM, (40, 24, 32, 3, 3, True, F32, F32)),
        (tuning.TGMM, (40, 32, 24, 3, 3, True, F32, F32))]),
    "gmm_transpose_rhs": ("grouped_matmul", [(40, 32), (3, 24, 32)], F32, {"transpose_rhs": True}, [
        (tuning.GMM, (40, 32, 24, 3, 3, True, F32, F32)), (tuning.GMM, (40, 24, 32, 3, 3, False, F32, F32)),
        (tuning.TGMM, (40, 24, 32, 3, 3, True, F32, F32))]),
    # the backward casts the gradient to the inputs' dtype
    "gmm_bf16_to_f32": ("grouped_matmul", [(40, 32), (3, 32, 24)], BF16, {"preferred_element_type": F32}, [
        (tuning.GMM, (40, 32, 24, 3, 3, False, BF16, F32)), (tuning.GMM, (40, 24, 32, 3, 3, True, BF16, BF16)),
        (tuning.TGMM, (40, 32, 24, 3, 3, True, BF16, BF16))]),
    "tgmm": ("transposed_grouped_matmul", [(32, 40), (40, 24)], F32, {}, [
        (tuning.TGMM, (40, 32, 24, 3, 3, False, F32, F32)), (tuning.GMM, (40, 24, 32, 3, 3, True, F32, F32)),
        (tuning.GMM, (40, 32, 24, 3, 3, False, F32, F32))]),
}
GMM_GRAD_CANDIDATES = {t: [dict(blocksize_m=16, blocksize_n=16, blocksize_k=16),
                           dict(blocksize_m=32, blocksize_n=16, blocksize_k=32, num_warps=2)]
                       for t in (tuning.GMM, tuning.TGMM)}


@pytest.mark.parametrize("name", GMM_GRADS)
def test_gmm_autotune_tunes_the_backward_problems(fw, name, rng, cache_path, monkeypatch):
    """The gradients' launches resolve problems of their own, which only the heuristic planned
    under autotuning. Now a call whose gradient may be taken tunes them too (torch: its inputs
    require grad; jax: always, as for flash_attention's backward, whether a gradient follows
    is not known there), and the backward launches what was stored."""
    check_gmm_grad_tuning(fw, name, "lhs and rhs", rng, cache_path, monkeypatch)


@pytest.mark.parametrize("grads_of", ["lhs", "rhs", "nothing", "no_grad"])
@pytest.mark.parametrize("name", ["gmm", "tgmm"])
def test_torch_tunes_only_the_gradients_to_be_taken(torch_fw, name, grads_of, rng, cache_path, monkeypatch):
    """Only the problems of the inputs that require grad (with grad mode on): without one, the
    forward's alone."""
    check_gmm_grad_tuning(torch_fw, name, grads_of, rng, cache_path, monkeypatch)


def test_gmm_fwd_params_leave_the_backward_tuned(fw, rng, cache_path, monkeypatch):
    """fwd_params are the forward's alone (the gradients' launches ignore them and read the
    cache): with them, autotuning tunes the backward's problems and not the forward's."""
    asked = spy_candidates(monkeypatch, types.SimpleNamespace(candidates=GMM_GRAD_CANDIDATES))
    _, shapes, _, _, (_, d_lhs, d_rhs) = GMM_GRADS["gmm"]
    arrays = [fw.asarray(rng.standard_normal(s), "float32") for s in shapes]
    if fw.name == "torch":
        for a in arrays:
            a.requires_grad_(True)
    fw.ops.grouped_matmul(*arrays, fw.asarray(np.array([10, 0, 25], np.int32)), fwd_params={"blocksize_m": 16},
                          autotune=True)
    assert asked == {tuning.GMM: [d_lhs[1]], tuning.TGMM: [d_rhs[1]]}


def check_gmm_grad_tuning(fw, name, grads_of, rng, cache_path, monkeypatch):
    op, shapes, dtype, kwargs, (forward, d_lhs, d_rhs) = GMM_GRADS[name]
    if "preferred_element_type" in kwargs:
        kwargs = {**kwargs, "preferred_element_type": fw.dtype(kwargs["preferred_element_type"])}
    sizes = fw.asarray(np.array([10, 0, 25], np.int32))
    values = [rng.standard_normal(s) for s in shapes]
    inputs = lambda: [fw.asarray(v, dtype) for v in values]  # noqa: E731
    call = lambda *a, **kw: getattr(fw.ops, op)(*a, sizes, **kwargs, **kw)  # noqa: E731
    cot = fw.asarray(rng.standard_normal(tuple(call(*inputs()).shape)), forward[1][-1])  # the output's dtype
    heuristic = fw.vjp(call, inputs(), cot)
    asked = spy_candidates(monkeypatch, types.SimpleNamespace(candidates=GMM_GRAD_CANDIDATES))

    arrays = inputs()
    if fw.name == "torch":  # under no_grad both require grad, and no gradient is taken
        for a, which in zip(arrays, ("lhs", "rhs")):
            a.requires_grad_(grads_of in (which, "lhs and rhs", "no_grad"))
    with torch_no_grad(fw, grads_of == "no_grad"):
        call(*arrays, autotune=True)
    want = [forward] + [p for p, of in ((d_lhs, "lhs"), (d_rhs, "rhs")) if grads_of in (of, "lhs and rhs")]
    assert asked == {t: [p for u, p in want if u is t] for t in asked}  # each once, in order
    assert len(json.loads(cache_path.read_text())["entries"]) == len(want)
    stored = {}
    for tunable, problem in want:
        e = entry(cache_path, tunable, problem, fingerprint(fw))
        assert e["framework"] == fw.name and e["source"] == "autotune" and e["config"] in GMM_GRAD_CANDIDATES[tunable]
        stored[tunable, problem] = tunable_plan(tunable, problem, e["config"])

    # the gradients (autotuning off: the cache is only read) launch the stored plans
    plans = spy_launches(monkeypatch, fw, CASES["gmm"])
    tuned = fw.vjp(lambda *a: call(*a, autotune=False), inputs(), cot)
    for (tunable, problem), plan in stored.items():
        assert plan in plans and tunable.plan(problem, CPU, None) not in plans, (tunable, problem)
    for got, reference in zip(tuned, heuristic, strict=True):
        assert rel_error(got, reference) < TOLERANCE[dtype]  # other tilings, same gradients


def torch_no_grad(fw, on: bool):
    if fw.name == "torch" and on:
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def test_varlen_keys_bucket_the_token_totals(fw, rng, cache_path, monkeypatch):
    asked = spy_candidates(monkeypatch, CASES["flash"])
    seq_lens = {25: [0, 7, 25], 29: [0, 11, 29]}  # both totals count as 32
    for total, cu in seq_lens.items():
        arrays = [fw.asarray(rng.standard_normal((total, 2, 16)), "float32") for _ in range(3)]
        cu = fw.asarray(np.array(cu, np.int32))
        fw.ops.flash_attention_varlen(*arrays, cu, cu, 18, 18, causal=True, autotune=True)
    assert len(asked[tuning.FLASH_FWD]) == 1  # the second total found the first one's entry
    (problem,) = asked[tuning.FLASH_FWD]
    assert problem.varlen and problem.total_q == 25
    assert tuning.FLASH_FWD.key(problem)["total_q"] == 32


def test_candidates_fit_the_device():
    from triton_kernels import flash_attention as fa
    from triton_kernels.plan import HOPPER

    spec = fa.dense_spec((2, 512, 8, 256), (2, 512, 8, 256), (2, 512, 8, 256), ("float32",) * 3, causal=True)
    for tunable in (tuning.FLASH_FWD, tuning.FLASH_BWD):
        cpu = tunable.candidate_params(spec, CPU)
        assert len(cpu) == 2 and cpu[0] == tunable.params.from_dict(tunable.defaults(spec, CPU))
        gpu = tunable.candidate_params(spec, HOPPER)
        assert gpu[0] == tunable.params.from_dict(tunable.defaults(spec, HOPPER))  # the heuristic first
        every = [tunable.params.from_dict(dict(zip(("blocksize_m", "blocksize_n", "num_warps", "num_stages"), row)))
                 for row in (tuning._ATTENTION_FWD_GPU if tunable is tuning.FLASH_FWD else tuning._ATTENTION_BWD_GPU)]
        assert 1 < len(gpu) < 1 + len(every)  # fp32, head_dim 256: the big tiles do not fit 227 KiB
        for params in gpu:
            tunable.plan(spec, HOPPER, params)  # raises if it did not fit
