"""A tiny kernel for tests/kernel_support/test_launch.py (``@triton.jit`` needs its source in a file)."""

import triton
import triton.language as tl


@triton.jit
def add_one(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=m) + 1.0, mask=m)
