"""Shared fixtures: every test that takes ``fw`` runs once per framework.

A test is written against the small ``Framework`` adapter below (numpy in, numpy out,
gradients through the framework's own autodiff), so the same assertions check the torch
front and the jax front.
"""
from __future__ import annotations

import os
import tempfile
import zlib

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# References and the XLA-computed sides of comparisons assume float32 matmuls; a GPU's default
# is TF32 (~1e-3). Set before jax is imported, so example subprocesses inherit it too.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Some tests compare two separately compiled XLA programs bitwise (eager against shard_map, say).
# On a GPU, XLA's autotuner picks each program's GEMM kernels by timing them, and when several
# test processes share the GPU the picks can differ, and with them the last bits (seen on an H100
# under `pytest -n 8`). Level 0 takes XLA's fixed heuristic choice instead.
if "--xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
# The suite never reads or tunes a developer's config cache: a private empty one, tuning off
# (tests that tune point EJKERNEL_CONFIG_CACHE elsewhere themselves).
os.environ["EJKERNEL_CONFIG_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="ejkernel-test-cache-"), "configs.json")
os.environ.pop("EJKERNEL_AUTOTUNE", None)

import numpy as np
import pytest

from tests import frameworks

FRAMEWORKS = ("torch", "jax")


@pytest.fixture(params=FRAMEWORKS)
def fw(request) -> frameworks.Framework:
    return frameworks.get(request.param)


@pytest.fixture
def torch_fw() -> frameworks.Framework:
    return frameworks.get("torch")


@pytest.fixture
def jax_fw() -> frameworks.Framework:
    return frameworks.get("jax")


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Kernel outputs start as NaN (floats) / a sentinel (ints), so unwritten elements fail."""
    from triton_kernels import debug

    with debug.poison_outputs(True):
        yield


# Fresh inputs every run, replayable: a test's seed is its id's CRC32 mixed with this run's salt,
# which the report header names (EJKERNEL_TEST_SEED=<salt> replays the run). The seed was
# hash(nodeid), which Python salts per process (PYTHONHASHSEED): "reproducible from the test id"
# it was not, and a failing draw could not be found again. Set at import, so pytest-xdist's
# workers and the examples' subprocesses inherit the same salt.
SEED_ENV = "EJKERNEL_TEST_SEED"
os.environ.setdefault(SEED_ENV, str(int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    return f"rng fixture: {SEED_ENV}={os.environ[SEED_ENV]} replays this run's random inputs"


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ[SEED_ENV]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A failing test that drew random inputs says how to draw them again (-q hides the header).
    report = (yield).get_result()
    if report.failed and "rng" in getattr(item, "fixturenames", ()):
        report.sections.append(("rng", f"{SEED_ENV}={os.environ[SEED_ENV]} replays this test's random inputs"))


def pytest_collection_modifyitems(config, items):
    # gpu tests need CUDA; cpu_plans tests expect the CPU plans the fronts make without it.
    if frameworks.cuda_available():
        marker, skip = "cpu_plans", pytest.mark.skip(reason="expects CPU plans; the fronts plan for the CUDA GPU here")
    else:
        marker, skip = "gpu", pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def isolated_config_cache(tmp_path, monkeypatch):
    """A config cache file of the test's own, autotuning off, no cache objects or memoized
    lookups carried over from other tests (never ~/.cache). Yields the file's path."""
    from triton_kernels import config_cache as cc
    from triton_kernels import tuning

    path = tmp_path / "configs.json"
    monkeypatch.setenv(cc.CACHE_ENV, str(path))
    monkeypatch.delenv(cc.AUTOTUNE_ENV, raising=False)
    monkeypatch.setattr(cc, "_caches", {})
    monkeypatch.setattr(cc, "_caches_by_env", {})
    tuning.clear_memo()
    yield path
    tuning.clear_memo()
