"""Every script and benchmark answers ``--help`` on a CPU-only machine, without running anything.

They are GPU tools, but a user reads ``--help`` first: a script that ignored its arguments ran its
GPU sweep (or died importing a GPU-only dependency) instead of printing its usage.
"""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "scripts", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    if os.path.basename(p) not in ("__init__.py", "common.py")  # library modules, not scripts
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs_on_cpu(script):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout, result.stdout[-2000:]


# GPU-only scripts, each with arguments that make it do a little; without a GPU they must say so and
# stop. sweep_flash.py ran every config in a subprocess and wrote a JSON of "Torch not compiled with
# CUDA enabled" errors with exit status 0; the others died with that AssertionError's traceback.
GPU_ONLY = {
    "benchmarks/softmax.py": ["--cols", "128", "--dtypes", "float32", "--out", os.devnull],
    "benchmarks/flash_attention.py": ["--seqs", "128", "--head-dims", "64", "--out", os.devnull],
    "benchmarks/grouped_matmul.py": ["--shapes", "quick", "--only", "0", "--out", os.devnull],
    "scripts/sweep_flash.py": ["--head-dims", "64", "--causal", "false", "--out", os.devnull],
    "scripts/sweep_gmm_backward.py": ["--out", os.devnull],
    "scripts/tune_softmax.py": [],
    "scripts/why_bits_differ.py": [],
    "scripts/probe_vmap_fold.py": ["--out", os.devnull],
}


@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_script_without_a_gpu_says_so(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu", OUT=str(tmp_path))  # OUT: tune_softmax's
    result = subprocess.run([sys.executable, script, *GPU_ONLY[script]], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stderr.strip().splitlines()[-1].startswith("needs a CUDA GPU"), result.stderr[-2000:]
