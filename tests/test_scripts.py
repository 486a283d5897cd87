"""Every script and benchmark answers ``--help`` on a CPU-only machine, without running anything.

They are GPU tools, but a user reads ``--help`` first: a script that ignored its arguments ran its
GPU sweep (or died importing a GPU-only dependency) instead of printing its usage.
"""
import glob
import inspect
import os
import subprocess
import sys
import tempfile

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
    "scripts/probe_gmm_shared_batch.py": ["--out", os.devnull],
    "scripts/profile_gmm_host.py": ["--out", os.devnull],
    "scripts/probe_tgmm_store.py": ["--out", os.devnull],
    "scripts/probe_moe_value_checks.py": ["--out", os.devnull],
    "scripts/probe_gluon_forward_timeline.py": ["--shapes", "1,128,128,1,64,false", "--out", os.devnull],
    "scripts/probe_gluon_backward_variants.py": ["--no-time", "--out", os.devnull],
    "scripts/probe_flash_builds.py": ["--shapes", "128:64:full", "--out", os.devnull],
    "scripts/probe_flash_gaps.py": ["--shapes", "128:64:full", "--out", os.devnull],
    "scripts/probe_flash_flush.py": ["--shapes", "128:64:full", "--out", os.devnull],
    "scripts/probe_flash_backward.py": ["--cases", "128:64:full", "--out", os.devnull],
    "scripts/ncu_stalls.py": ["--shapes", "128:64:full", "--out", os.devnull],
    "scripts/probe_bench_order.py": ["--shapes", "128:64:full", "--repeats", "1", "--out", os.devnull],
}


@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_script_without_a_gpu_says_so(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu", OUT=str(tmp_path))  # OUT: tune_softmax's
    result = subprocess.run([sys.executable, script, *GPU_ONLY[script]], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stderr.strip().splitlines()[-1].startswith("needs a CUDA GPU"), result.stderr[-2000:]


def _timeline_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "probe_gluon_forward_timeline", os.path.join(ROOT, "scripts", "probe_gluon_forward_timeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timeline_probe_instruments_the_plans_forward_kernel():
    """The timeline probe's clock stamps are text edits at fixed places of gluon_forward.py: they
    must still apply (each place found once) and compile for sm_90, or the probe, run only on a
    GPU, would break unseen when the kernel changes."""
    import dataclasses

    from triton_kernels.flash_attention import gluon_forward

    if not gluon_forward.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton_kernels import HOPPER_GLUON
    from triton_kernels import flash_attention as fa
    from triton_kernels.aot import compile_plan
    from triton_kernels.flash_attention.plan import gluon_forward_plan

    probe = _timeline_script()
    with open(gluon_forward.__file__) as f:
        source = probe.instrument(f.read())
    assert all(f"t{i} = _clock()" in source for i in range(4))
    assert all(f"{name} = _globaltimer()" in source for name in ("entry_ns", "setup_ns", "exit_ns"))
    module = probe._load(gluon_forward.__file__)
    assert "t0 = _clock()" in inspect.getsource(module)
    h100 = HOPPER_GLUON
    for shape, dynamic in (((2, 256, 2, 64), False), ((16, 1024, 32, 64), True)):  # the static walk, claimed tiles
        spec = fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=True)
        plan = dataclasses.replace(gluon_forward_plan(spec, h100), kernel=module.flash_fwd_gluon_kernel)
        assert plan.constexpr_dict["DYNAMIC"] == dynamic
        assert compile_plan(plan).asm["cubin"]


def test_timeline_probe_summary_takes_32_bit_clock_differences():
    probe = _timeline_script()
    programs = [[(0, 10, 110, 150, 2, 1, 0), (200, 205, 400, 450, 4, 3, 128)],
                [(2**32 - 5, 5, 50, 60, 1, 0, 0)], []]  # the clock wraps inside the third tile; an idle program
    summary = probe.summarize(programs)
    assert summary["program_span_cycles"] == {"median": 257.5, "max": 450}
    assert summary["to_next_cycles_median"] == 50
    assert summary["by_blocks"]["1 blocks, 1 masked"] == {"first_wait": 10, "loop": 45, "epilogue": 10, "tiles": 1}
    assert summary["by_blocks"]["4 blocks, 1 masked"]["loop"] == 195


def test_timeline_probe_launch_summary():
    """Two launches of two programs, timer in ns (the first entry wraps the 32-bit timer) and a
    clock of 2 cycles a ns."""
    probe = _timeline_script()
    t = 2**32 - 1000
    first = [([(100, 0, 0, 2100, 1, 0, 0)], (t, t + 500, t + 9000, 0, 18000, 7)),
             ([(50, 0, 0, 1050, 1, 0, 0), (1100, 0, 0, 1500, 3, 0, 128)], (t + 1000, t + 1400, t + 11000, 0, 20000, 3))]
    second = [([], (t + 12000, 0, 0, 0, 0, 7)), ([], (t + 11500, 0, 0, 0, 0, 3))]
    launch = probe.summarize_launch(first, second, 10.0)
    assert launch["launch_span_us"] == 11.0 and launch["entry_spread_us"] == 1.0
    assert launch["setup_us_median"] == 0.45 and launch["program_us_median"] == 9.5
    assert launch["tail_us"] == 1.0 and launch["clock_mhz_median"] == 2000
    assert launch["before_first_tile_us_median"] == 0.04  # 100 and 50 cycles at 2 cycles a ns
    assert launch["after_last_tile_us_median"] == 8.6  # median of 15900 and 18500 cycles
    assert launch["gap_to_next_launch_us"] == 0.5
    assert launch["slowest"] == [{"program": 1, "sm": 3, "tiles": 2, "key_blocks": 4, "after_median_us": 1.0},
                                 {"program": 0, "sm": 7, "tiles": 1, "key_blocks": 1, "after_median_us": -1.0}]


def test_backward_variants_probe_loads_a_copy_of_the_kernels_anywhere():
    """A variant is a copy of gluon_backward.py kept outside the package: the probe reads its
    relative imports as the package's, and its kernels drop into the plans and compile for sm_90."""
    import importlib.util
    import shutil

    from triton_kernels.flash_attention import gluon_backward

    if not gluon_backward.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    from triton_kernels import HOPPER_GLUON
    from triton_kernels import flash_attention as fa
    from triton_kernels.aot import compile_plan

    spec_ = importlib.util.spec_from_file_location(
        "probe_gluon_backward_variants", os.path.join(ROOT, "scripts", "probe_gluon_backward_variants.py"))
    probe = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(probe)
    variant = os.path.join(tempfile.mkdtemp(), "same.py")
    shutil.copy(gluon_backward.__file__, variant)
    name, module = probe.load_kernel(variant)
    assert name == "same" and module.flash_bwd_dq_gluon_kernel is not gluon_backward.flash_bwd_dq_gluon_kernel
    h100 = HOPPER_GLUON
    shape = (2, 256, 2, 128)
    spec = fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=True)
    plans = probe.variant_plans(spec, h100, module)
    assert {kind: plan.kernel for kind, plan in plans.items()} == {
        "dq": module.flash_bwd_dq_gluon_kernel, "dkdv": module.flash_bwd_dkdv_gluon_kernel}
    for plan in plans.values():
        assert compile_plan(plan).asm["cubin"]


def test_builds_probe_reassembles_tritons_own_cubin():
    """probe_flash_builds.py tells ptxas binaries apart by assembling a plan's PTX again: with
    Triton's ptxas that must give Triton's own cubin, or a difference it measures between
    binaries could be the flags'. Its SASS count must see past 0xffff bytes (the addresses'
    fifth hex digit cut an earlier count off at 4096 instructions)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import probe_flash_builds as probe
    finally:
        sys.path.pop(0)
    from triton_kernels import flash_attention as fa
    from triton_kernels.aot import compile_plan
    from triton_kernels.flash_attention import gluon_forward
    from triton_kernels.plan import DeviceFacts

    if not gluon_forward.enabled():
        pytest.skip("this Triton has no Gluon")
    facts = DeviceFacts(platform="cuda", capability=(9, 0), shared_memory=232448, num_sms=132, gluon=True)
    shape = (2, 1024, 2, 128)  # about 5800 instructions (Triton 3.6 and 3.9)
    plan = fa.forward_plan(fa.dense_spec(shape, shape, shape, ("bfloat16",) * 3, causal=True), facts, None)
    assert plan.is_gluon
    compiled = compile_plan(plan)
    assert probe.assemble(compiled) == compiled.kernel
    assert probe.assemble(compiled, probe.triton_ptxas()) == compiled.kernel
    count = probe.sass_instructions(compiled.kernel)
    assert count is None or count > 0x10000 // 16, count


def _source_page(instructions):
    """An ncu source page in CSV (``ncu --page source --csv --print-source sass``): (address,
    SASS, samples, executed, wait samples, long-scoreboard samples) a line."""
    lines = ['"Kernel Name","flash_fwd_gluon_kernel",',
             '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait",'
             '"stall_long_sb","stall_wait (Not Issued)"']
    for address, sass, samples, executed, wait, long_sb in instructions:
        lines.append(f'"0x{address:x}","      {sass}","{samples}","{executed:,}","{wait}","{long_sb}","0"')
    return "\n".join(lines) + "\n"


def test_ncu_stalls_puts_each_sample_in_its_partition_and_loop_region():
    """``scripts/ncu_stalls.py`` cuts the SASS at USETMAXREG into partitions: the one with a key
    loop (a back edge around HGMMA) is a consumer's, split before / in / after its loop; the one
    with TMA loads the loader's; the rest "other". Shares are of the kernel's and the consumer's."""
    from scripts.ncu_stalls import summarise

    page = _source_page([
        (0x7f0000000100, "USETMAXREG.DEALLOC.CTAPOOL 0x78", 0, 10, 0, 0),
        (0x7f0000000110, "NOP", 40, 10, 0, 0),
        (0x7f0000000120, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 0, 10, 0, 0),
        (0x7f0000000130, "IADD3 R1, R2, R3, RZ", 10, 1000, 10, 0),
        (0x7f0000000140, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR28], R24", 20, 4000, 15, 5),
        (0x7f0000000150, "MUFU.EX2 R5, R6", 30, 4000, 30, 0),
        (0x7f0000000160, "@P0 BRA 0x7f0000000140", 10, 4000, 0, 10),
        (0x7f0000000170, "STS [R1], R2", 5, 1000, 5, 0),
        (0x7f0000000180, "USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 10, 0, 0),
        (0x7f0000000190, "UTMALDG.3D [UR16], [UR28]", 7, 100, 0, 7),
        (0x7f00000001a0, "EXIT", 0, 10, 0, 0),
    ])
    regions = summarise(page)
    assert sorted(regions) == ["consumer 0 after loop", "consumer 0 before loop", "consumer 0 loop", "loader", "other"]
    loop = regions["consumer 0 loop"]
    assert (loop["samples"], loop["instructions"], loop["executed"]) == (60, 3, 12000)
    assert loop["share_of_kernel"] == round(60 / 122, 4) and loop["share_of_consumer"] == round(60 / 75, 4)
    assert loop["stalls"] == {"wait": 0.75, "long_sb": 0.25}
    assert regions["consumer 0 before loop"]["samples"] == 10 and regions["consumer 0 after loop"]["samples"] == 5
    assert regions["loader"]["samples"] == 7 and regions["loader"]["stalls"] == {"long_sb": 1.0}
    assert regions["other"]["samples"] == 40 and "share_of_consumer" not in regions["other"]
