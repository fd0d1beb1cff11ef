"""Fused modulated LayerNorm ``(1 + scale) * LayerNorm(x) + shift`` (Triton).

One program per token row ``[D]``: mean and variance in float32, then the plain path's
roundings one by one (``klein_core.models.transformer_math.modulate`` in the input dtype): the normalised
row, ``1 + scale``, the product and the sum are each rounded to the input dtype. Eager PyTorch
makes four passes over the activations for this (norm, add, multiply, add); this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import round_to


@triton.jit
def _modulate_kernel(
    x_ptr, shift_ptr, scale_ptr, out_ptr,
    L, D,
    sx_b, sx_l,
    ssh_b, ssc_b,
    so_b, so_l,
    eps,
    BLOCK_D: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    b = (row // L).to(tl.int64)
    t = (row % L).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + b * sx_b + t * sx_l + d, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / D
    xc = tl.where(m, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / D
    y = round_to(xc * tl.math.rsqrt(var + eps), dtype)
    scale = tl.load(scale_ptr + b * ssc_b + d, mask=m, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + b * ssh_b + d, mask=m, other=0.0).to(tl.float32)
    out = round_to(round_to(round_to(1.0 + scale, dtype) * y, dtype) + shift, dtype).to(dtype)
    tl.store(out_ptr + b * so_b + t * so_l + d, out, mask=m)


def launch(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """Launch on validated arguments (see ``klein_core.accel.kernels.modulate``)."""
    b, length, dim = x.shape
    block = triton.next_power_of_2(dim)
    _modulate_kernel[(b * length,)](
        x, shift, scale, out,
        length, dim,
        x.stride(0), x.stride(1),
        shift.stride(0), scale.stride(0),
        out.stride(0), out.stride(1),
        eps,
        BLOCK_D=block,
        num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False,
    )
