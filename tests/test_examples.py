"""The examples run end to end (small configurations)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_shcsa_example_agrees():
    result = _run("examples/shcsa.py")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch twin  vs flax kernel" in result.stdout


def test_parity_report_registry_and_output(tmp_path):
    out = tmp_path / "report.json"
    result = _run("examples/parity_report.py", "--only", "padded_softmax", "--repeats", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"padded_softmax", "padded_softmax d/d0"}
    assert all(r["bitwise_equal"] or r["max_abs_diff"] <= 1e-6 for r in rows if r["dtype"] == "float32")


def test_parity_report_fails_a_row_whose_error_is_nan(tmp_path, monkeypatch):
    # A NaN error (here a reference with a NaN in it) passed the job: max(nan, x) > bound is False.
    import numpy as np

    from examples import parity_report
    from examples.parity import Case
    from ejkernel_torch import reference

    def nan_reference(x):
        out = reference.softmax(x)
        out[0, 0] = float("nan")
        return out

    case = Case("softmax", "4x8", "float32", lambda rng: [rng.standard_normal((4, 8))], nan_reference)
    monkeypatch.setattr(parity_report, "all_cases", lambda: [case])
    monkeypatch.setattr(sys, "argv", ["parity_report.py", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert parity_report.main() == 1
    for errors in ((np.nan, 0.0), (0.0, np.nan)):  # either framework
        row = {"dtype": "float32", "rel_err_torch": errors[0], "rel_err_jax": errors[1], "rel_diff": 0.0,
               "out_dtypes": None}
        assert parity_report.failed_rows([row]) == [row]


def test_parity_report_fails_frameworks_that_disagree(tmp_path, monkeypatch):
    # Only the errors against float64 were judged: torch and jax apart by twice the bound (each
    # within it of the reference), or returning different dtypes, passed the job.
    from examples import parity_report

    good = {"dtype": "float32", "rel_err_torch": 0.0, "rel_err_jax": 0.0, "rel_diff": 0.0,
            "out_dtypes": ["float32", "float32"]}
    assert parity_report.failed_rows([good]) == []
    apart = {**good, "rel_err_torch": 9e-5, "rel_err_jax": 9e-5, "rel_diff": 1.8e-4}
    dtypes = {**good, "out_dtypes": ["float32", "bfloat16"]}
    assert parity_report.failed_rows([apart, dtypes]) == [apart, dtypes]

    import ejkernel_jax
    from ejkernel_torch import reference
    from examples.parity import Case

    real_softmax = ejkernel_jax.softmax  # jax returns the same values in float32: only the dtype differs
    monkeypatch.setattr(ejkernel_jax, "softmax", lambda x, **kw: real_softmax(x, **kw).astype("float32"))
    case = Case("softmax", "3x7", "bfloat16", lambda rng: [rng.standard_normal((3, 7))], reference.softmax)
    monkeypatch.setattr(parity_report, "all_cases", lambda: [case])
    monkeypatch.setattr(sys, "argv", ["parity_report.py", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert parity_report.main() == 1


@pytest.mark.parametrize("dtype, factor", [("float32", 1 + 5e-5), ("bfloat16", 1 + 4e-2)])
def test_parity_report_fails_a_kernel_off_by_a_small_factor(tmp_path, monkeypatch, dtype, factor):
    # The bounds were 1e-4 (float32) and 5e-2 (bfloat16) for every row, 300x and 17x the largest
    # errors the report measures (3e-7, 3e-3): a softmax scaled by 1 + 5e-5 / 1 + 4e-2 in both
    # frameworks (so torch and jax agree) passed the job. The unscaled op passes.
    import ejkernel_jax
    import ejkernel_torch
    from ejkernel_torch import reference
    from examples import parity_report
    from examples.parity import Case

    case = Case("softmax", "33x517", dtype, lambda rng: [rng.standard_normal((33, 517)) * 3], reference.softmax,
                n_diff=1)
    monkeypatch.setattr(parity_report, "all_cases", lambda: [case])
    monkeypatch.setattr(sys, "argv", ["parity_report.py", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert parity_report.main() == 0
    for module in (ejkernel_torch, ejkernel_jax):
        monkeypatch.setattr(module, "softmax", lambda x, _real=module.softmax, **kw: _real(x, **kw) * factor)
    assert parity_report.main() == 1
    import json

    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["op"] for r in parity_report.failed_rows(rows)] == ["softmax", "softmax d/d0"]
    # Gradient rows take the suites' gradient bounds, output rows their output bounds.
    for op, bound in (("softmax", parity_report.BOUNDS), ("softmax d/d0", parity_report.GRAD_BOUNDS)):
        row = {"op": op, "dtype": dtype, "rel_err_torch": 0.0, "rel_err_jax": 0.0, "rel_diff": 0.0, "out_dtypes": None}
        assert parity_report.failed_rows([{**row, "rel_err_torch": bound[dtype]}]) == []
        assert parity_report.failed_rows([{**row, "rel_err_jax": 1.01 * bound[dtype]}]) != []


@pytest.mark.slow
@pytest.mark.parametrize("example", ["torch_gpt", "flax_gpt"])
def test_gpt_examples_train_50_steps_like_plain_attention(example):
    # The script as a user runs it. Without -m slow,
    # test_gpt_examples_fail_a_slightly_wrong_attention still runs each example's main().
    result = _run(f"examples/{example}.py", "--steps", "50", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "max |loss difference|" in result.stdout


@pytest.mark.parametrize("example", ["torch_gpt", "flax_gpt"])
def test_gpt_examples_fail_a_nan_loss(example):
    # max() skipped a NaN |loss difference| after the first step: a short run with NaN passed.
    import importlib
    import math

    judge = importlib.import_module(f"examples.{example}").judge
    good = [3.4, 3.2, 3.0]
    assert judge({"ejkernel": good, "plain": good}, steps=3) == (0.0, True)
    diff, ok = judge({"ejkernel": [3.4, math.nan, math.nan], "plain": good}, steps=3)
    assert math.isnan(diff) and not ok
    assert not judge({"ejkernel": good, "plain": [3.4, 3.2, math.nan]}, steps=3)[1]


@pytest.mark.parametrize("example", ["torch_gpt", "flax_gpt"])
def test_gpt_examples_fail_a_slightly_wrong_attention(example, monkeypatch):
    # The judge's bound was 2e-3 on curves that agree within 5e-7: an attention output 2% off
    # (5.4e-4 apart after 10 steps) passed. Two steps (too short for the learning check) are
    # already 2.1e-4 (torch) / 5.4e-4 (flax) apart, 20-50x the bound; a step's backward included.
    import importlib

    module = importlib.import_module(f"examples.{example}")
    real = module.flash_attention
    monkeypatch.setattr(module, "flash_attention", lambda *args, **kwargs: real(*args, **kwargs) * 1.02)
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--steps", "2"])
    with pytest.raises(SystemExit, match="loss curves disagree"):
        module.main()


def _scale_torch_attention_backward(monkeypatch, factor: float) -> None:
    """ejkernel_torch.padded_attention with its input gradients scaled by ``factor``."""
    import torch

    import ejkernel_torch

    attention = ejkernel_torch.padded_attention

    class _ScaledBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * factor

    monkeypatch.setattr(ejkernel_torch, "padded_attention", lambda *a: _ScaledBackward.apply(attention(*a)))


def test_shcsa_example_judges_gradients(monkeypatch):
    # The input gradients were printed but not checked: a wrong torch backward passed.
    from examples import shcsa

    _scale_torch_attention_backward(monkeypatch, 1.01)
    with pytest.raises(AssertionError, match="input gradients disagree"):
        shcsa.main()


@pytest.mark.parametrize("side, factor, message", [("output", 1 + 3e-5, "outputs disagree"),
                                                    ("gradient", 1 + 5e-5, "input gradients disagree")])
def test_shcsa_example_judges_small_errors(monkeypatch, side, factor, message):
    # The bounds were 1e-4 on outputs and 1e-4 x the largest gradient (about 40) on gradients,
    # 200x and 500x the gaps float32 gives (5e-7, 8e-6): jax's attention output scaled by
    # 1 + 3e-5, or torch's attention backward by 1 + 5e-5, passed the example.
    import ejkernel_jax
    from examples import shcsa

    if side == "output":
        real = ejkernel_jax.padded_attention
        monkeypatch.setattr(ejkernel_jax, "padded_attention", lambda *a: real(*a) * factor)
    else:
        _scale_torch_attention_backward(monkeypatch, factor)
    with pytest.raises(AssertionError, match=message):
        shcsa.main()


@pytest.mark.parametrize("argv, message", [
    (["--only", "softmx"], "--only: unknown op name(s) softmx; expected some of "),
    (["--only", "softmax,nope"], "unknown op name(s) nope;"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
])
def test_parity_report_rejects_bad_options(argv, message, monkeypatch, capsys):
    # A misspelt --only name selected no case and crashed with ZeroDivisionError (--repeats 0: a
    # StatisticsError after running every case); both are now usage errors naming the option.
    from examples import parity_report

    monkeypatch.setattr(sys, "argv", ["parity_report.py", *argv, "--out", os.devnull])
    with pytest.raises(SystemExit) as exc:
        parity_report.main()
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("example", ["torch_moe", "flax_moe"])
def test_moe_examples_train_like_the_expert_loop(example):
    # The script as a user runs it, whole: grouped_matmul's loss curve against the per-expert loop
    # (torch: and compiled vs eager). Without -m slow, test_moe_examples_fail_wrong_experts still
    # runs each example's main() for two steps.
    result = _run(f"examples/{example}.py")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "max |loss difference|: ejkernel vs plain" in result.stdout


@pytest.mark.parametrize("factor", [1.01, 1 + 5e-5])
@pytest.mark.parametrize("example", ["torch_moe", "flax_moe"])
def test_moe_examples_fail_wrong_experts(example, factor, monkeypatch):
    # The examples must exit non-zero when the grouped matmul's loss curve leaves the loop's.
    # At a tolerance of 1e-4 (the curves agree within 6e-8), experts off by 5e-5 passed.
    import importlib

    module = importlib.import_module(f"examples.{example}")
    real = module.grouped_matmul
    monkeypatch.setattr(module, "grouped_matmul", lambda *args, **kwargs: real(*args, **kwargs) * factor)
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--steps", "2"])
    with pytest.raises(SystemExit, match="loss curves disagree"):
        module.main()


@pytest.mark.gpu
@pytest.mark.parametrize("args", [("torch_gpt.py", "--device", "cuda"), ("flax_gpt.py",),
                                  ("torch_moe.py", "--device", "cuda"), ("flax_moe.py",)], ids=lambda a: a[0])
def test_examples_agree_on_the_gpu(args):
    # CI runs the examples on CPU only. On a GPU jax's float32 matmuls default to TF32, and
    # flax_moe's curves came out 1.0e-4 apart there (ten times its bound) until it asked for
    # float32 as flax_gpt does. The flax examples run on jax's default backend: the GPU here.
    import jax

    assert jax.default_backend() == "gpu", "jax must see the GPU for this test"
    result = _run(f"examples/{args[0]}", *args[1:])
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert "max |loss difference|" in result.stdout
