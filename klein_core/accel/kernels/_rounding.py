"""Rounding to the storage dtype inside Triton kernels, bit-exact with torch on every backend."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round float32 ``x`` to ``dtype`` (nearest, ties to even) and return it as float32.

    bf16 is rounded with integer arithmetic rather than ``x.to(tl.bfloat16)``: the GPU cast is
    round-to-nearest-even, but Triton's CPU interpreter truncates, and the tests run there.
    The result is exactly representable in ``dtype``, so the final store-cast is exact anywhere.
    """
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        # NaN stays NaN (the carry could turn a small-payload NaN into inf)
        return tl.where(x != x, x, u.to(tl.float32, bitcast=True))
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
