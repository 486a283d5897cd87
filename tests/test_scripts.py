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
