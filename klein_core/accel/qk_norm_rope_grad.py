"""Gradients for a fused per-head RMSNorm + interleaved RoPE forward that has no backward of its own.

comfy-kitchen's ``rms_rope`` kernel (:mod:`klein_core.accel.comfy_kitchen`) is forward only: autograd
refuses to go back through it ("no autograd formula was registered"), so training a LoRA on a model
on the fast path failed at its first backward pass. :class:`FusedQKNormRope` keeps the kernel for the
forward (one pass, where the plain path makes about fifteen elementwise passes; with gradient
checkpointing each block's forward runs twice per step) and computes the backward in PyTorch, in
float32.

For one of q / k, ``x`` ``[B, L, H, D]`` and the norm's scale ``w`` ``[D]``, the forward is
``y = R · (round(x · r) · w)`` with ``r = rsqrt(mean(x²) + eps)`` over D and ``R`` the rotation of each
(2j, 2j+1) pair. Its gradient, given ``g = dL/dy``, treating the rounding to x's dtype as the
identity (as autograd does for the plain path's cast):

- ``gn = Rᵀ · g`` (each pair rotated back);
- ``dw = Σ gn · round(x · r)`` over every axis but D;
- ``dx = r · (gn·w - n · mean(gn·w · n))`` with ``n = x · r``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (q, k, freqs [1|B, L, 1, D/2, 2, 2], q_scale, k_scale, eps) -> (q, k) normed and rotated, [B, L, H, D]
RmsRopeKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on any of ``tensors`` (training, or a LoRA being fitted)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # float32, float64 for float64 (gradcheck)


def rotate_back(g: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``Rᵀ · g`` in float32 (float64 for float64): ``g`` ``[B, L, H, D]`` and the rotation matrices
    ``freqs`` ``[1|B, L, 1, D/2, 2, 2]`` (``[[cos, -sin], [sin, cos]]``), as one complex multiply by
    ``cos - i·sin`` per pair."""
    acc = _accumulate(g.dtype)
    conj = torch.complex(freqs[..., 0, 0].to(acc), -freqs[..., 1, 0].to(acc))  # [1|B, L, 1, D/2]
    pairs = torch.view_as_complex(g.to(acc).contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * conj).flatten(-2)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, gn: torch.Tensor, eps: float, want_weight: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of ``round(x · rsqrt(mean(x²) + eps)) · weight`` over x's last dim, given ``gn`` (x's
    shape, from :func:`rotate_back`): ``(dx in x's dtype, dweight in weight's dtype or None)``."""
    acc = _accumulate(x.dtype)
    xf = x.to(acc)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    n = xf * r
    dn = gn * weight.to(acc)
    dx = (dn - n * (dn * n).mean(-1, keepdim=True)) * r
    dw = None
    if want_weight:
        dw = (gn * n.to(x.dtype).to(acc)).flatten(0, -2).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw


class FusedQKNormRope(torch.autograd.Function):
    """``kernel(q, k, freqs, q_scale, k_scale, eps)`` forward, the backward of the module doc.

    q/k ``[B, L, H, D]`` (views of the projection are fine), freqs ``[1|B, L, 1, D/2, 2, 2]``
    float32, scales ``[D]``. Saves the inputs (not the kernel's outputs), as the plain path would.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, q_scale: torch.Tensor,
        k_scale: torch.Tensor, eps: float, kernel: RmsRopeKernel,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(q, k, freqs, q_scale, k_scale)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros to rotate
        return kernel(q, k, freqs, q_scale, k_scale, eps)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor | None, gk: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, freqs, q_scale, k_scale = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq = dk = dqs = dks = None
        if gq is not None and (need[0] or need[3]):
            dq, dqs = rms_norm_backward(q, q_scale, rotate_back(gq, freqs), ctx.eps, need[3])
        if gk is not None and (need[1] or need[4]):
            dk, dks = rms_norm_backward(k, k_scale, rotate_back(gk, freqs), ctx.eps, need[4])
        return (dq if need[0] else None, dk if need[1] else None, None, dqs, dks, None, None)


__all__ = ["FusedQKNormRope", "RmsRopeKernel", "records_grad", "rms_norm_backward", "rotate_back"]
