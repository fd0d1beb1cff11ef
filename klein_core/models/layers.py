"""Small building blocks shared by the text encoder and the transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 and cast back before the weight multiply.

    This is the order both Qwen3 (``Qwen3RMSNorm``) and BFL's QK-norm use; it differs from
    ``torch.nn.RMSNorm`` only at bf16 rounding level.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``x`` over its last dim in float32, cast back, then scale by ``weight``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(dtype) * weight.to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention on ``[B, H, L, D]`` tensors with the default 1/sqrt(D) scale.

    ``mask`` is a boolean ``[B, 1, Lq, Lk]`` (True = attend) or None. Returns ``[B, H, Lq, D]``.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
