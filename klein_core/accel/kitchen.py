"""comfy-kitchen (ComfyUI's own kernel library) as a block-ops backend: its fused ``rms_rope``
(per-head RMSNorm of q and k, then interleaved RoPE) and ``adaln`` (LayerNorm, then ``(1 + scale)
* x + shift``). Optional: ``pip install "klein-nodes[kernels]"`` (inside ComfyUI it is already
installed); without it :func:`enable_kitchen_ops` raises naming the package.

comfy-kitchen picks its backend per call (CUDA, Triton, or its eager PyTorch code on the CPU).
Attention stays klein_core's (:mod:`klein_core.accel.fast`). Measured against the plain path on the
CPU (eager backend) by ``tests/test_kitchen.py``; GPU speed was not measured (no GPU in the session
that added this), so the Triton kernels of :mod:`klein_core.accel.fast` stay the default fast path.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

import torch

from ..models.block_ops import PLAIN_OPS, BlockOps, QKPart
from ..models.transformer import Flux2Transformer
from ..models.transformer_math import NORM_EPS

logger = logging.getLogger(__name__)


def kitchen_available() -> bool:
    return importlib.util.find_spec("comfy_kitchen") is not None


def freqs_cis(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """klein_core's interleaved RoPE tables ``[..., L, D]`` (each angle repeated for its pair) as the
    ``[..., L, D/2, 2, 2]`` rotation matrices ComfyUI's and comfy-kitchen's kernels take."""
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([torch.stack([c, -s], dim=-1), torch.stack([s, c], dim=-1)], dim=-2)


class KitchenOps(BlockOps):
    """Block steps through comfy-kitchen; modulation with per-token vectors (the timestep-zero
    reference mode) stays on the plain path."""

    def __init__(self) -> None:
        import comfy_kitchen

        self._ck = comfy_kitchen

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if shift.shape[1] != 1:
            return PLAIN_OPS.modulate(x, shift, scale)
        return self._ck.adaln(x, scale, shift, NORM_EPS)

    def qk_norm_rope(
        self, parts: Sequence[QKPart], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = freqs_cis(cos, sin)  # [1|B, 1, N, D/2, 2, 2]
        qs, ks, offset = [], [], 0
        for q, k, q_scale, k_scale in parts:
            n = q.shape[1]
            qq, kk = self._ck.rms_rope(q.transpose(1, 2), k.transpose(1, 2), freqs[:, :, offset : offset + n],
                                       q_scale, k_scale, NORM_EPS)
            qs.append(qq)
            ks.append(kk)
            offset += n
        return (qs[0], ks[0]) if len(qs) == 1 else (torch.cat(qs, dim=2), torch.cat(ks, dim=2))


def enable_kitchen_ops(model: Flux2Transformer) -> Flux2Transformer:
    """Run ``model``'s blocks through comfy-kitchen (see the module doc); returns the model."""
    if not kitchen_available():
        raise ImportError("comfy-kitchen is not installed: pip install comfy-kitchen (or "
                          "pip install 'klein-nodes[kernels]')")
    model.ops = KitchenOps()
    logger.info("klein block ops: comfy-kitchen rms_rope + adaln (attention: plain)")
    return model


__all__ = ["KitchenOps", "enable_kitchen_ops", "freqs_cis", "kitchen_available"]
