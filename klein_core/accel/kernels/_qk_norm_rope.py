"""Fused per-head QK-RMSNorm + interleaved RoPE (Triton), for the transformer's q and k.

One program handles one token and a block of heads, for q and k together (they share the
token's angles). Per head row ``[D]`` it follows the plain path's rounding steps exactly:

1. RMS-normalise in float32 (``klein_core.models.layers.rms_norm``), round to the input dtype,
   multiply by the norm weight in that dtype (one rounding, as torch does);
2. rotate adjacent pairs ``(2j, 2j+1)`` in float32 (``klein_core.models.transformer_math.apply_rope``):
   ``o0 = y0*cos - y1*sin``, ``o1 = y1*cos + y0*sin``, each product rounded before the sum
   (the kernel is compiled without FMA contraction for that reason), then round to the dtype.

Only the order of the sum of squares differs from torch, so float32 results agree to a few
ulp and bf16 results to at most one bf16 ulp on rare elements.

The input is read in place from the projection output (``[B, L, H, D]`` views with any batch,
token and head strides, unit stride over D), and the result is written into a ``[B, L_out, H, D]``
buffer at a token offset, so the double block's [txt, img] concatenation costs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import round_to


@triton.jit
def _norm_rope_tile(x_ptrs, w_ptr, mask, c0, c1, s0, s1, eps, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """RMSNorm + RoPE of a ``[BLOCK_H, D]`` tile of head rows; returns it in the input dtype."""
    dtype = x_ptrs.dtype.element_ty
    d = tl.arange(0, D)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D
    n = round_to(x * tl.math.rsqrt(ms + eps)[:, None], dtype)
    w = tl.load(w_ptr + d).to(tl.float32)
    y = round_to(n * w[None, :], dtype)
    y0, y1 = tl.split(tl.reshape(y, (BLOCK_H, D // 2, 2)))
    o0 = y0 * c0[None, :] - y1 * s0[None, :]
    o1 = y1 * c1[None, :] + y0 * s1[None, :]
    return round_to(tl.reshape(tl.join(o0, o1), (BLOCK_H, D)), dtype).to(dtype)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr,
    L, H, offset,
    sq_b, sq_l, sq_h,
    sk_b, sk_l, sk_h,
    sc_b, sc_l,
    so_b, so_l, so_h,
    eps,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    # int64 offsets: batch x stride passes 2^31 elements for CFG batches with references.
    b = (row // L).to(tl.int64)
    t = (row % L).to(tl.int64)
    pos = t + offset  # this token's row in the joint sequence (RoPE table and output)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (h < H)[:, None]

    c = tl.load(cos_ptr + b * sc_b + pos * sc_l + d)
    s = tl.load(sin_ptr + b * sc_b + pos * sc_l + d)
    c0, c1 = tl.split(tl.reshape(c, (D // 2, 2)))
    s0, s1 = tl.split(tl.reshape(s, (D // 2, 2)))

    hh = h[:, None].to(tl.int64)
    out_offs = b * so_b + pos * so_l + hh * so_h + d[None, :]
    q = _norm_rope_tile(q_ptr + b * sq_b + t * sq_l + hh * sq_h + d[None, :], wq_ptr, mask,
                        c0, c1, s0, s1, eps, D, BLOCK_H)
    tl.store(oq_ptr + out_offs, q, mask=mask)
    k = _norm_rope_tile(k_ptr + b * sk_b + t * sk_l + hh * sk_h + d[None, :], wk_ptr, mask,
                        c0, c1, s0, s1, eps, D, BLOCK_H)
    tl.store(ok_ptr + out_offs, k, mask=mask)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_q: torch.Tensor,
    out_k: torch.Tensor,
    offset: int,
    eps: float,
) -> None:
    """Launch on validated arguments (see ``klein_core.accel.kernels.qk_norm_rope_into``)."""
    b, length, heads, dim = q.shape
    block_h = min(triton.next_power_of_2(heads), 8)
    grid = (b * length, triton.cdiv(heads, block_h))
    _qk_norm_rope_kernel[grid](
        q, k, q_weight, k_weight, cos, sin, out_q, out_k,
        length, heads, offset,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1),
        out_q.stride(0), out_q.stride(1), out_q.stride(2),
        eps,
        D=dim,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,  # keep a*b + c*d as two rounded products, as torch computes it
    )


def is_interpreted() -> bool:
    """True when this module was imported under ``TRITON_INTERPRET=1`` (kernels run on the CPU)."""
    return type(_qk_norm_rope_kernel).__name__ == "InterpretedFunction"
