"""The launch machinery: plans, both launchers, the interpreter scope, jit/vmap, jax-triton import."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from tests import kernels_for_tests as kt
from tests import references as ref
from tests.frameworks import rel_error
from triton_kernels.plan import LaunchPlan, Output, fp32


def _launch(fw, plan, *arrays):
    return fw.launch(plan, *(fw.asarray(a) for a in arrays))


# -- plans --------------------------------------------------------------------------------------


def test_plan_rejects_specialized_scalars():
    with pytest.raises(ValueError, match="do_not_specialize_on_alignment"):
        LaunchPlan(kernel=kt.unmarked_scalar_kernel, grid=(1,), inputs=("x_ptr",), input_dtypes=("float32",),
                   scalars=(("n", 4),), outputs=(Output("y_ptr", (4,), "float32"),), constexprs=(("BLOCK", 4),))


def test_plan_rejects_wrong_bindings_and_order():
    with pytest.raises(ValueError, match="binds"):
        LaunchPlan(kernel=kt.write_first_half_kernel, grid=(1,), inputs=("x_ptr",), input_dtypes=("float32",),
                   outputs=(Output("y_ptr", (4,), "float32"),), constexprs=(("BLOCK", 4),))
    with pytest.raises(ValueError, match="inputs/scalars, outputs, constexprs"):
        LaunchPlan(kernel=kt.write_first_half_kernel, grid=(1,), inputs=("y_ptr",), input_dtypes=("float32",),
                   scalars=(("n", 4),), outputs=(Output("x_ptr", (4,), "float32"),), constexprs=(("BLOCK", 4),))


def test_plan_scalars_are_int32_and_fp32_exact():
    with pytest.raises(ValueError, match="does not fit int32"):
        kt.half_plan(2**31)
    assert fp32(0.1) != 0.1 and fp32(fp32(0.1)) == fp32(0.1)


def test_launch_args_are_every_parameter_in_kernel_order():
    import triton_kernels.flash_attention as fa
    from triton_kernels.flash_attention.plan import gluon_forward_plan
    from tests.test_flash_gluon import HOPPER_GLUON

    spec = fa.dense_spec((2, 300, 4, 64), (2, 300, 2, 64), (2, 300, 2, 64), ("bfloat16",) * 3, causal=True)
    plans = [kt.half_plan(37), fa.forward_plan(spec, HOPPER_GLUON), gluon_forward_plan(spec, HOPPER_GLUON),
             *fa.backward_plans(spec, HOPPER_GLUON)]
    for plan in plans:
        inputs, outputs = [object() for _ in plan.inputs], [object() for _ in plan.outputs]
        args = dict(zip(plan.kernel.arg_names, plan.launch_args(inputs, outputs), strict=True))
        assert [args[n] for n in plan.inputs] == inputs
        assert [args[o.name] for o in plan.outputs] == outputs
        assert {n: args[n] for n in plan.constexpr_dict} == plan.constexpr_dict
        assert {n: args[n] for n in plan.scalar_dict} == plan.scalar_dict
        assert len(plan.inputs) + len(plan.outputs) + len(plan.constexpr_dict) + len(plan.scalar_dict) == len(args)
        # and the runtime arguments (Triton's kernel[grid] call) are the same ones without the constexprs
        assert plan.runtime_args(inputs, outputs) == [v for n, v in args.items() if n not in plan.constexpr_dict]
        with pytest.raises(ValueError, match="expected"):
            plan.launch_args(inputs[1:], outputs)


# -- launchers -------------------------------------------------------------------------------------


def test_unwritten_outputs_are_poisoned(fw):
    if fw.name == "jax" and fw.device == "cuda":
        pytest.skip("jax-triton allocates outputs itself: no poisoning on the jax GPU path")
    y = fw.to_numpy(_launch(fw, kt.half_plan(10), np.arange(10, dtype=np.float32))[0])
    np.testing.assert_array_equal(y[:5], np.arange(5))
    assert np.isnan(y[5:]).all()


@pytest.mark.parametrize("dtype, sentinel", [("int8", -128), ("uint8", 255), ("int16", -0x5EED), ("int32", -0x5EED)])
def test_unwritten_integer_outputs_are_poisoned(fw, dtype, sentinel):
    # -0x5EED does not fit 8 bits: filling an int8 output with it raised inside the launcher.
    if fw.name == "jax" and fw.device == "cuda":
        pytest.skip("jax-triton allocates outputs itself: no poisoning on the jax GPU path")
    y = fw.to_numpy(_launch(fw, kt.half_plan(10, dtype), np.arange(10, dtype=dtype))[0])
    np.testing.assert_array_equal(y[:5], np.arange(5))
    assert (y[5:] == sentinel).all()


def test_zeroed_outputs_and_aliases(fw, rng):
    x = rng.standard_normal(37).astype(np.float32)
    acc = rng.standard_normal(37).astype(np.float32)
    total, out = (fw.to_numpy(a) for a in _launch(fw, kt.accumulate_plan(37), x, acc))
    # The kernel adds block sums atomically, in any order. A float32 sum of n terms is within
    # (n - 1) u sum|x| of the exact one (u = 2**-24): a relative bound on the total fails whenever
    # the terms cancel (a total of -0.046 from 37 normal draws was off by 1.3e-5 relative).
    assert total.shape == (1,) and abs(float(total[0]) - x.astype(np.float64).sum()) <= (
        (len(x) - 1) * 2.0**-24 * np.abs(x.astype(np.float64)).sum())
    np.testing.assert_allclose(out, acc + x, rtol=1e-6)


def _accumulate_keeping_the_sum(n: int) -> LaunchPlan:
    """accumulate_plan with its zeroed sum a buffer only the kernel sees (``Output.returned``)."""
    plan = kt.accumulate_plan(n)
    return dataclasses.replace(plan, outputs=(dataclasses.replace(plan.outputs[0], returned=False),
                                              *plan.outputs[1:]))


def test_unreturned_outputs_are_passed_to_the_kernel_but_not_returned(fw, rng):
    x, acc = (rng.standard_normal(37).astype(np.float32) for _ in range(2))
    plan = _accumulate_keeping_the_sum(37)
    runs = [lambda *a: _launch(fw, plan, *a)]
    if fw.name == "jax":
        import jax

        runs.append(lambda *a: jax.jit(lambda *b: fw.launch(plan, *b))(*(fw.asarray(b) for b in a)))
    for run in runs:
        results = run(x, acc)
        assert len(results) == 1
        np.testing.assert_allclose(fw.to_numpy(results[0]), acc + x, rtol=1e-6)


def test_plan_text_keeps_unreturned_outputs_and_reads_older_texts():
    from ejkernel_torch.launch import plan_from_text, plan_text

    plan = _accumulate_keeping_the_sum(5)
    assert plan_from_text(plan_text(plan)) == plan
    doc = json.loads(plan_text(kt.accumulate_plan(5)))
    doc["outputs"] = [o[:4] for o in doc["outputs"]]  # a text from before the flag
    assert plan_from_text(json.dumps(doc)) == kt.accumulate_plan(5)
    x = torch.arange(5, dtype=torch.float32)
    results = torch.ops.ejkernel.interpret_plan([x, torch.zeros(5)], plan_text(plan))  # the opaque op
    assert len(results) == 1 and torch.equal(results[0], x)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.ejkernel.interpret_plan([mode.from_tensor(x)] * 2, plan_text(plan))
    assert [tuple(t.shape) for t in fake] == [(5,)]


def test_plan_text_keeps_the_global_scratch_flag():
    """A plan whose kernel makes tensor descriptors needs scratch from its launcher, also after
    the JSON round trip torch.compile's opaque op makes; texts from before the flag read as False."""
    from ejkernel_torch.launch import plan_from_text, plan_text
    from triton_kernels import HOPPER_GLUON
    from triton_kernels.grouped_matmul import tgmm_plan

    plan = tgmm_plan(4096, 2048, 1408, 8, 8, False, "bfloat16", "bfloat16", HOPPER_GLUON)  # Triton, TMA store
    assert plan.global_scratch and plan.needs_scratch and not plan.is_gluon
    assert plan_from_text(plan_text(plan)) == plan
    gluon = tgmm_plan(4096, 2048, 1408, 8, 8, True, "bfloat16", "bfloat16", HOPPER_GLUON)  # the backward's
    assert gluon.is_gluon and gluon.needs_scratch and plan_from_text(plan_text(gluon)) == gluon
    doc = json.loads(plan_text(kt.accumulate_plan(5)))
    del doc["global_scratch"]
    assert not plan_from_text(json.dumps(doc)).needs_scratch


def test_float32_to_bfloat16_rounds_to_nearest_even(fw, rng):
    """As compiled kernels (and torch) do; Triton's interpreter alone truncated (interpret.py)."""
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0xBF808000, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                        0x80000000, 0x00000001, 0x00018000, 0x7FC00001, 0x7F800001], dtype=np.uint32).view(np.float32)
    x = np.concatenate([special, rng.standard_normal(45).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 45)])
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # round to nearest even; NaN stays NaN
    for name, got in zip(("stored", "cast"), _launch(fw, kt.to_bfloat16_plan(len(x)), x)):
        got = np.asarray(fw.to_numpy(got), dtype=np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)
        number = ~np.isnan(want)  # -0.0 keeps its sign; a NaN's sign means nothing
        np.testing.assert_array_equal(np.signbit(got[number]), np.signbit(want[number]), err_msg=name)


def test_launch_checks_input_dtypes(fw):
    with pytest.raises(ValueError, match="input x_ptr must be"):
        _launch(fw, kt.half_plan(4), np.zeros(4, np.int32))


def test_torch_launchers_read_lazy_tensors_as_values(torch_fw):
    # A lazy negation (the neg bit) keeps its values out of its memory and a ZeroTensor has none
    # (a null data pointer, yet is_contiguous()): launch read the memory, the un-negated values
    # silently, or failed inside the interpreter ("invalid python storage"). launch_traceable also
    # copies a strided input: the dispatcher hands a registered op's body a ZeroTensor argument as
    # a zero expanded to its shape (stride 0), which the contiguity check refused.
    from ejkernel_torch.launch import launch, launch_traceable

    x = torch_fw.asarray(np.arange(1, 11, dtype=np.float32))
    first_half = lambda run, a: torch_fw.to_numpy(run(kt.half_plan(10), a)[0])[:5]  # noqa: E731
    for run in (launch, launch_traceable):
        np.testing.assert_array_equal(first_half(run, x._neg_view()), -np.arange(1, 6))
        np.testing.assert_array_equal(first_half(run, torch._efficientzerotensor(10, device=x.device)), np.zeros(5))
    np.testing.assert_array_equal(first_half(launch_traceable, x.new_ones(()).expand(10)), np.ones(5))
    with pytest.raises(ValueError, match="input x_ptr must be a contiguous float32 tensor"):
        launch(kt.half_plan(10), x.new_ones(()).expand(10))


def test_interpreted_launch_leaves_triton_language_intact(fw):
    before = (tl.load, tl.core.load, tl.zeros, tl.max, tl.tensor.__dict__.get("__bool__"), tl.dtype.to_ir)
    _launch(fw, kt.half_plan(8), np.ones(8, np.float32))
    fw.ops.softmax(fw.asarray(np.ones((3, 5), np.float32)))
    after = (tl.load, tl.core.load, tl.zeros, tl.max, tl.tensor.__dict__.get("__bool__"), tl.dtype.to_ir)
    assert all(a is b for a, b in zip(before, after))
    assert isinstance(tl.zeros, JITFunction) and isinstance(kt.write_first_half_kernel, JITFunction)
    assert "TRITON_INTERPRET" not in os.environ


def test_interpreted_launch_patches_the_language_once_not_at_every_helper_call(fw, monkeypatch):
    # The interpreter re-patched triton.language at every @triton.jit helper call (~2 ms each, 40%
    # of a small training step). Four programs call _in_first_half and accumulate's tl.sum (Triton's
    # standard library, whose globals hold triton.language.core, a module the kernel's do not).
    from triton_kernels import interpret
    patched, original = [], interpret._original_patch_lang

    def counted(fn):
        patched.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpret, "_original_patch_lang", counted)
    plan = dataclasses.replace(kt.half_plan(10, kernel=kt.first_half_by_helper_kernel), grid=(4,))
    np.testing.assert_array_equal(fw.to_numpy(_launch(fw, plan, np.arange(10, dtype=np.float32))[0])[:5],
                                  np.arange(5))
    assert patched == ["first_half_by_helper_kernel"]
    patched.clear()
    x = np.arange(1, 41, dtype=np.float32)
    total, _ = _launch(fw, kt.accumulate_plan(40, block=8), x, np.zeros(40, np.float32))
    assert fw.to_numpy(total)[0] == x.sum()
    assert patched[0] == "accumulate_kernel" and len(patched) == 2  # then once for triton.language.core


def test_plans_built_during_another_threads_interpreted_launch(fw):
    # An interpreted launch swaps interpreted twins into the kernels' modules. A plan built
    # meanwhile on another thread (jax runs a sharded jit's callbacks on threads of its own
    # while the caller goes on) read the twin: AttributeError ('params'), or a plan that no
    # GPU launcher could run. Here a thread holds a launch's interpreter scope open.
    import threading

    from triton_kernels import interpret

    opened, done = threading.Event(), threading.Event()
    hash(kt.write_first_half_kernel)  # an unhashed kernel's plan waits for the launch (next test)

    def launch_in_progress():
        with interpret._lock, interpret._interpreter_scope(kt.write_first_half_kernel.fn):
            opened.set()
            done.wait(60)

    thread = threading.Thread(target=launch_in_progress)
    thread.start()
    try:
        assert opened.wait(60)
        assert not isinstance(kt.write_first_half_kernel, JITFunction)  # the twin, for now
        plan = kt.half_plan(6)
    finally:
        done.set()
        thread.join()
    assert plan.kernel is kt.write_first_half_kernel
    y = fw.to_numpy(_launch(fw, plan, np.arange(6, dtype=np.float32))[0])
    np.testing.assert_array_equal(y[:3], np.arange(3))

def test_plan_hashes_its_kernel_after_another_threads_interpreted_launch(fw):
    # The first hash of a kernel resolves the helpers it calls in its module. While another
    # thread's interpreted launch had twins there, that raised "Unsupported function referenced:
    # <_Twin ...>" (an eager shard_map's gmm backward built its tgmm plan while a callback thread
    # ran the gmm). The plan now waits for the launch to put its module back.
    import threading

    import triton

    from triton_kernels import interpret

    fresh = triton.jit(kt.first_half_by_helper_kernel.fn, do_not_specialize_on_alignment=["n"])  # never hashed
    opened, done, plans, errors = threading.Event(), threading.Event(), [], []

    def launch_in_progress():
        with interpret._lock, interpret._interpreter_scope(fresh.fn):
            opened.set()
            done.wait(60)

    def build_plan():
        try:
            plans.append(kt.half_plan(6, kernel=fresh))
            hash(plans[0])  # what the launchers' caches do with it
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    launch, builder = threading.Thread(target=launch_in_progress), threading.Thread(target=build_plan)
    launch.start()
    assert opened.wait(60)
    builder.start()
    builder.join(1.0)  # unfixed, it failed at once; fixed, it waits for the launch's lock
    done.set()
    launch.join()
    builder.join(60)
    assert not errors, errors
    y = fw.to_numpy(_launch(fw, plans[0], np.arange(6, dtype=np.float32))[0])
    np.testing.assert_array_equal(y[:3], np.arange(3))


# -- jax transformations -------------------------------------------------------------------------------


def test_jax_jit_grad_and_vmap(jax_fw, rng):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ejk

    x = rng.standard_normal((4, 6, 33)).astype(np.float32)
    expected = ref.forward(ref.softmax, x)
    assert rel_error(np.asarray(jax.jit(ejk.softmax)(x)), expected) < 1e-6
    assert rel_error(np.asarray(jax.vmap(ejk.softmax)(jnp.asarray(x))), expected) < 1e-6
    assert rel_error(np.asarray(jax.vmap(jax.vmap(ejk.softmax))(jnp.asarray(x))), expected) < 1e-6

    dy = rng.standard_normal(x.shape).astype(np.float32)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(ejk.softmax(a) * dy)))(jnp.asarray(x))
    (expected_grad,) = ref.vjp(ref.softmax, [x], dy, n_diff=1)
    assert rel_error(np.asarray(grad), expected_grad) < 1e-5


def test_jax_vmap_of_padded_attention_over_extra_axis(rng):
    import jax
    import jax.numpy as jnp

    import ejkernel_jax as ejk

    q, k, v = (rng.standard_normal((3, 2, 19, 16)).astype(np.float32) for _ in range(3))
    n_pad = np.array([[0, 4], [2, 19], [0, 0]], np.int32)
    out = jax.vmap(ejk.padded_attention)(*(jnp.asarray(a) for a in (q, k, v, n_pad)))
    expected = np.stack([ref.forward(ref.padded_attention, q[i], k[i], v[i], n_pad[i]) for i in range(3)])
    assert rel_error(np.asarray(out), expected) < 1e-5

    loss = lambda q: jnp.sum(jax.vmap(ejk.padded_attention)(q, *(jnp.asarray(a) for a in (k, v, n_pad))) ** 2)
    dq = jax.jit(jax.grad(loss))(jnp.asarray(q))
    for i in range(3):
        out_i = ref.forward(ref.padded_attention, q[i], k[i], v[i], n_pad[i])
        (dq_ref,) = ref.vjp(ref.padded_attention, [q[i], k[i], v[i], n_pad[i]], 2 * out_i, n_diff=1)
        assert rel_error(np.asarray(dq[i]), dq_ref) < 1e-5


def test_jax_n_pad_under_jit_is_clamped_not_checked(rng):
    import jax

    import ejkernel_jax as ejk

    scores = rng.standard_normal((2, 6, 6)).astype(np.float32)
    y = jax.jit(ejk.padded_softmax)(scores, np.array([-3, 99], np.int32))
    expected = ref.forward(ref.padded_softmax, scores, np.array([0, 6], np.int32))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-6, atol=1e-7)


def test_jax_eager_calls_skip_the_fold_rules(jax_fw, rng, monkeypatch):
    # Under vmap, padded_attention and the softmax ops fold the samples through custom_vmap rules;
    # a custom_vmap function traces itself on every eager call (about 0.2 ms on CPU). Concrete
    # inputs cannot be vmapped, so they skip the fold and launch rules, as flash_attention does.
    import jax.numpy as jnp

    import ejkernel_jax as ejk
    from ejkernel_jax import launch
    from ejkernel_jax.ops import _folding

    q, k, v, scores = (jnp.asarray(rng.standard_normal((2, 5, 5)), jnp.float32) for _ in range(4))
    n_pad = jnp.asarray([0, 2], jnp.int32)
    calls = [lambda: ejk.softmax(scores), lambda: ejk.padded_softmax(scores, n_pad),
             lambda: ejk.padded_softmax_v(scores, v, n_pad), lambda: ejk.padded_attention(q, k, v, n_pad)]
    want = [np.asarray(call()) for call in calls]

    def refuse(*_):
        raise AssertionError("an eager call went through a vmap rule")
    monkeypatch.setattr(_folding, "_folding", refuse)
    monkeypatch.setattr(launch, "_batchable", refuse)
    for call, expected in zip(calls, want):
        np.testing.assert_array_equal(np.asarray(call()), expected)


# -- jax-triton import hygiene ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dir", ["/tmp/my-triton-cache", None])
def test_jax_triton_import_restores_triton_cache_dir(tmp_path, cache_dir):
    # A stand-in jax_triton that does what the real one does at import time.
    (tmp_path / "jax_triton.py").write_text('import os\nos.environ["TRITON_CACHE_DIR"] = ""\n')
    script = textwrap.dedent("""
        import os
        from ejkernel_jax import launch
        launch._jax_triton()
        print(repr(os.environ.get("TRITON_CACHE_DIR")))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(cache_dir)


def test_jax_bfloat16_on_the_interpreter_warns_nothing():
    """jax hands the interpreter read-only buffers; torch warns about wrapping one (once a
    process, hence a fresh one). Every dtype's wrap was silenced but bfloat16's."""
    script = textwrap.dedent("""
        import warnings
        import jax.numpy as jnp
        import ejkernel_jax
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ejkernel_jax.softmax(jnp.ones((2, 8), jnp.bfloat16)).block_until_ready()
        print([str(w.message)[:80] for w in caught])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_jax_result_not_waited_for_exits_cleanly():
    # A jax-only CPU script that exits with a kernel still queued (behind slow matmuls): the callback
    # ran during interpreter shutdown, imported torch there for the first time and printed "can't
    # register atexit after shutdown" tracebacks from jax's atexit handlers.
    script = textwrap.dedent("""
        import jax.numpy as jnp
        import ejkernel_jax as ek
        x = jnp.ones((2048, 2048)) / 2048
        for _ in range(4):
            x = x @ x
        y = ek.softmax(x[:8, :8])  # not waited for
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]


def test_grids_past_cuda_limits_are_errors_before_launch():
    # Grid axes 1 and 2 hold at most 65535 programs on CUDA. Flash attention checked its batch and
    # heads; the padded-attention, scores-v and dropout-mask plans went on to a launch error.
    from triton_kernels import HOPPER
    from triton_kernels import flash_attention as fa
    from triton_kernels.padded_attention import attention_bwd_plans, attention_fwd_plan, scores_v_fwd_plan

    too_many = 65_536
    for make in (lambda: attention_fwd_plan((too_many, 128, 64), "float16", 0.125, HOPPER),
                 lambda: attention_bwd_plans((too_many, 128, 64), "float16", 0.125, HOPPER),
                 lambda: scores_v_fwd_plan((too_many, 128, 64), "float16", HOPPER),
                 lambda: fa.dropout_mask_plan(too_many, 1, 16, 16, 0.5, HOPPER)):
        with pytest.raises(ValueError, match="exceeds CUDA's limits"):
            make()
    attention_fwd_plan((65_535, 128, 64), "float16", 0.125, HOPPER)  # the limit itself is fine


def test_plan_text_cached_by_an_older_kernel_version(torch_fw, rng):
    """torch.compile's on-disk caches key a graph before its op bodies are traced, so a cached
    graph carries the plan text of the kernel version that compiled it. A text without the
    grouped matmul's later BATCH/SHARED_RHS/BATCH_P2 constexprs failed the plan's binding check
    ("plan for gmm_kernel binds [...], kernel takes [...]"); they take the kernel's defaults,
    which compute what that version did."""
    from ejkernel_torch.launch import device_facts, launch, plan_from_text, plan_text
    from triton_kernels import grouped_matmul as gm

    plan = gm.gmm_plan(37, 16, 24, 3, 3, False, "float32", "float32", device_facts(torch.device(torch_fw.device)))
    doc = json.loads(plan_text(plan))
    doc["constexprs"] = [c for c in doc["constexprs"] if c[0] not in ("BATCH", "SHARED_RHS", "BATCH_P2")]
    old = plan_from_text(json.dumps(doc))
    lhs, rhs = (torch_fw.asarray(rng.standard_normal(s), "float32") for s in ((37, 16), (3, 16, 24)))
    sizes, offset = torch_fw.asarray(np.array([10, 0, 20], np.int32)), torch_fw.asarray(np.zeros(1, np.int32))
    np.testing.assert_array_equal(torch_fw.to_numpy(launch(old, lhs, rhs, sizes, offset)[0]),
                                  torch_fw.to_numpy(launch(plan, lhs, rhs, sizes, offset)[0]))


def test_interpreter_lists_triton_language_while_another_thread_imports(monkeypatch):
    """The interpreter lists triton.language's modules from sys.modules at every launch; jax runs
    host callbacks on several threads, and an import landing in the middle of that listing raised
    "dictionary changed size during iteration" (a flaky CI failure of a two-device shard_map test).
    The listing now copies sys.modules in one C call first."""
    import types

    from triton_kernels import interpret

    class Growing(dict):
        def items(self):  # an import from another thread at every step of a Python-level walk
            for item in super().items():
                self[f"_ejkernel_test_module_{len(self)}"] = None
                yield item

    monkeypatch.setattr(interpret, "sys", types.SimpleNamespace(modules=Growing(sys.modules)))
    names = {getattr(m, "__name__", "") for m in interpret._language_namespaces()}
    assert "triton.language" in names and "triton.language.core" in names


def test_with_constexprs_changes_only_what_it_names_and_refuses_unknown_names():
    from triton_kernels.grouped_matmul import gmm_plan
    from triton_kernels.plan import DeviceFacts

    plan = gmm_plan(64, 32, 48, 4, 4, False, "bfloat16", "bfloat16", DeviceFacts.cpu())
    variant = plan.with_constexprs(BLOCK_N=32, GROUP_M=4)
    assert variant.constexpr_dict == {**plan.constexpr_dict, "BLOCK_N": 32, "GROUP_M": 4}
    assert [n for n, _ in variant.constexprs] == [n for n, _ in plan.constexprs]  # order kept
    assert variant.grid == plan.grid and variant.kernel is plan.kernel and plan.constexpr_dict["GROUP_M"] == 8
    with pytest.raises(ValueError, match="gmm_kernel has no constexpr TMA_LOADS"):
        plan.with_constexprs(TMA_LOADS=False)


def test_plain_eager_is_off_while_a_profiler_records(monkeypatch):
    """A profiler's traces keep showing the registered ops: the plain eager path (which skips them)
    is off while one records, and on again after. ``_profiling`` is the one place that asks, so a
    probe that times the plain path under a profiler (scripts/probe_flash_gaps.py) can override it."""
    from ejkernel_torch import launch

    x = torch.zeros(2)
    assert launch.plain_eager(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not launch.plain_eager(x)
        monkeypatch.setattr(launch, "_profiling", lambda: False)
        assert launch.plain_eager(x)
    monkeypatch.undo()
    assert launch.plain_eager(x)


def test_device_facts_under_torch_compile_skip_the_cache_without_a_warning(monkeypatch):
    """torch.compile traces the plans' device facts; Dynamo warns its users about every
    lru_cache it traces through, so compiled code takes the uncached function (the facts are pure)."""
    import types
    import warnings

    from ejkernel_torch import launch as launch_mod

    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    def sms_times(x):
        return x * launch_mod.device_facts(torch.device("cuda", 0)).num_sms

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(sms_times, fullgraph=True, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 132.0))
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    # Eager calls still go through the cache.
    launch_mod._cuda_facts.cache_clear()
    assert launch_mod.device_facts(torch.device("cuda", 0)) is launch_mod.device_facts(torch.device("cuda", 0))
    assert launch_mod._cuda_facts.cache_info().hits == 1
    launch_mod._cuda_facts.cache_clear()  # no fake facts left for later tests


def _fusion_plan(fuses: bool) -> LaunchPlan:
    return dataclasses.replace(kt.half_plan(9), enable_fp_fusion=fuses)


def test_traced_launches_follow_the_plans_fusion_where_triton_defaults_otherwise(monkeypatch):
    """torch.compile does not forward ``enable_fp_fusion``: where Triton's default differs from a
    plan's (Triton 3.10 turns it off), the plan takes the opaque op, which launches as planned."""
    from ejkernel_torch import launch as launch_mod

    monkeypatch.delenv("TRITON_FORCE_DISABLE_FP_FUSION", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    assert launch_mod._traced_fusion_as_planned(_fusion_plan(True))
    assert not launch_mod._traced_fusion_as_planned(_fusion_plan(False))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # Triton 3.10's default
    assert not launch_mod._traced_fusion_as_planned(_fusion_plan(True))
    assert launch_mod._traced_fusion_as_planned(_fusion_plan(False))
    import triton

    if hasattr(triton.knobs.language, "force_disable_fp_fusion"):  # Triton >= 3.9: no kernel fuses
        monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", "1")
        assert launch_mod._traced_fusion_as_planned(_fusion_plan(True))


def test_fusion_default_is_read_while_torch_compile_traces(monkeypatch):
    from ejkernel_torch import launch as launch_mod

    monkeypatch.delenv("TRITON_FORCE_DISABLE_FP_FUSION", raising=False)
    plan = _fusion_plan(True)

    def as_planned(x):
        return x + 1 if launch_mod._traced_fusion_as_planned(plan) else x - 1

    for default, want in (("1", 2.0), ("0", 0.0)):
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", default)
        torch._dynamo.reset()
        out = torch.compile(as_planned, fullgraph=True, backend="eager")(torch.ones(2))
        assert torch.equal(out, torch.full((2,), want))
