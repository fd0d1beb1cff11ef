"""The FLUX.2 transformer's elementwise maths: timestep embedding, 4-axis RoPE, modulation.

Pure functions on tensors, shared by the modules (:mod:`klein_core.models.transformer`), the
plain block ops and the fused kernels' self-checks. Precision follows the references (SPEC §4.4):
the sinusoid is float32, RoPE angles float64 and their application float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ROPE_THETA = 2000.0
TIME_CHANNELS = 256  # sinusoidal timestep embedding width
NORM_EPS = 1e-6  # LayerNorm and QK-RMSNorm


def timestep_embedding(t: torch.Tensor, dim: int = TIME_CHANNELS, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[cos | sin]`` of ``t`` (already x1000), in float32: ``[B] -> [B, dim]``."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t.float()[:, None] * torch.exp(exponent)[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_cos_sin(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved 4-axis RoPE tables for position ids.

    ``ids``: ``[N, A]`` or ``[B, N, A]`` (A = len(axes_dim)). Returns cos and sin, float32,
    ``[N, head_dim]`` or ``[B, N, head_dim]``, each frequency repeated for its (2j, 2j+1) pair.
    Angles are computed in float64 (float32 on MPS, which has no float64), like the references.
    """
    f64 = torch.float32 if ids.device.type == "mps" else torch.float64
    pos = ids.to(torch.float32)
    cos, sin = [], []
    for a, d in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=f64, device=ids.device) / d))
        ang = pos[..., a : a + 1].to(f64) * freqs
        cos.append(ang.cos().repeat_interleave(2, dim=-1).float())
        sin.append(ang.sin().repeat_interleave(2, dim=-1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def rope_tables(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` shaped for the blocks: ``[1, 1, N, D]`` for ids ``[N, A]``, ``[B, 1, N, D]``
    for ids ``[B, N, A]`` (broadcast over the heads)."""
    cos, sin = rope_cos_sin(ids, axes_dim, theta)
    return (cos[None, None], sin[None, None]) if cos.ndim == 2 else (cos[:, None], sin[:, None])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` ``[B, H, L, D]`` by the angles in ``cos``/``sin`` (fp32 maths)."""
    xf = x.float()
    x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-x1, x0], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) + shift


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    # [B, H, L, D] -> [B, L, H*D]
    return x.transpose(1, 2).flatten(2)
