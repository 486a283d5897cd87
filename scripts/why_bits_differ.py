"""Why a naive launch of one softmax kernel from torch and from jax-triton can differ in the last
bit, and how the plan removes it. Needs a CUDA GPU with torch, jax and jax-triton.

torch's launcher specializes every integer argument on ``value % 16 == 0`` (a 'divisibility 16'
hint); jax-triton never does. The hint changes the layout the compiler picks, hence the order in
which a row is summed. Marking runtime ints ``do_not_specialize_on_alignment`` makes both
launchers compile the same binary.
"""
import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import torch
import triton
import triton.language as tl


def softmax_rows(x_ptr, n_cols, y_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


# The same function jitted twice: as Triton does by default, and as our plans require.
naive_softmax = triton.jit(softmax_rows)
planned_softmax = triton.jit(do_not_specialize_on_alignment=["n_cols"])(softmax_rows)


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import jax
    import jax.numpy as jnp

    from ejkernel_jax.launch import _jax_triton

    jt = _jax_triton()
    rng = np.random.default_rng(0)
    for name, kernel in (("naive", naive_softmax), ("planned", planned_softmax)):
        for n_cols in (1000, 1024, 4000, 4096):
            x = rng.standard_normal((4096, n_cols)).astype(np.float32)
            block = triton.next_power_of_2(n_cols)
            xt = torch.from_numpy(x).cuda()
            yt = torch.empty_like(xt)
            kernel[(x.shape[0],)](xt, n_cols, yt, BLOCK=block, num_warps=4, num_stages=3)
            yj = jt.triton_call(jnp.asarray(x), n_cols, kernel=kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                grid=(x.shape[0],), num_warps=4, num_stages=3, BLOCK=block)
            a, b = yt.cpu().numpy(), np.asarray(yj)
            print(f"{name:16s} n_cols={n_cols:5d} (n_cols % 16 == 0: {n_cols % 16 == 0!s:5s})  "
                  f"bitwise equal: {a.tobytes() == b.tobytes()!s:5s}  max |diff| = {np.max(np.abs(a - b)):.3g}")


if __name__ == "__main__":
    main()
