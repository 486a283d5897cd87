"""Tiny kernels that exercise launcher features: poisoning, zeroed outputs, aliases."""
import triton
import triton.language as tl

from triton_kernels.plan import LaunchPlan, Output


@triton.jit(do_not_specialize_on_alignment=["n"])
def write_first_half_kernel(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n // 2), mask=offs < n // 2)


@triton.jit
def _in_first_half(offs, n):
    return offs < n // 2


@triton.jit(do_not_specialize_on_alignment=["n"])
def first_half_by_helper_kernel(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    # write_first_half_kernel with the mask from a jit helper: hashing it resolves the helper.
    offs = tl.arange(0, BLOCK)
    mask = _in_first_half(offs, n)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["n"])
def accumulate_kernel(x_ptr, acc_ptr, n, sum_ptr, out_ptr, BLOCK: tl.constexpr):
    # sum_ptr is zeroed by the launcher; out_ptr aliases acc_ptr (starts as a copy of it).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.atomic_add(sum_ptr, tl.sum(x, axis=0))
    tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=mask) + x, mask=mask)


@triton.jit
def unmarked_scalar_kernel(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def half_plan(n: int, dtype: str = "float32", kernel=None) -> LaunchPlan:
    return LaunchPlan(kernel=kernel or write_first_half_kernel, grid=(1,), inputs=("x_ptr",), input_dtypes=(dtype,),
                      scalars=(("n", n),), outputs=(Output("y_ptr", (n,), dtype),),
                      constexprs=(("BLOCK", triton.next_power_of_2(n)),))


def accumulate_plan(n: int, block: int = 16) -> LaunchPlan:
    return LaunchPlan(kernel=accumulate_kernel, grid=(triton.cdiv(n, block),), inputs=("x_ptr", "acc_ptr"),
                      input_dtypes=("float32", "float32"), scalars=(("n", n),),
                      outputs=(Output("sum_ptr", (1,), "float32", zeroed=True), Output("out_ptr", (n,), "float32")),
                      constexprs=(("BLOCK", block),), aliases=((1, 1),))


@triton.jit(do_not_specialize_on_alignment=["n"])
def to_bfloat16_kernel(x_ptr, n, stored_ptr, cast_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(stored_ptr + offs, x, mask=offs < n)  # converted by the store
    tl.store(cast_ptr + offs, x.to(tl.bfloat16), mask=offs < n)  # converted by an explicit cast


def to_bfloat16_plan(n: int) -> LaunchPlan:
    return LaunchPlan(kernel=to_bfloat16_kernel, grid=(1,), inputs=("x_ptr",), input_dtypes=("float32",),
                      scalars=(("n", n),),
                      outputs=(Output("stored_ptr", (n,), "bfloat16"), Output("cast_ptr", (n,), "bfloat16")),
                      constexprs=(("BLOCK", triton.next_power_of_2(n)),))
