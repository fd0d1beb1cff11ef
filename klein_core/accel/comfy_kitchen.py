"""comfy-kitchen (ComfyUI's own kernel library) as the fused-kernel backend of the fast paths.

When :func:`klein_core.accel.enable_fast_paths` asks for fused kernels, two steps of every block run
through it: ``rms_rope`` (per-head RMSNorm of q and k, then interleaved RoPE) and ``adaln``
(LayerNorm, then ``(1 + scale) * x + shift``). :func:`klein_core.accel.enable_fast_vae` runs each VAE
GroupNorm and its SiLU as one ``group_norm_silu_pad3d``. comfy-kitchen picks its backend per call.

Optional: ``pip install "klein-nodes[kernels]"`` (ComfyUI already requires it). Without it these
steps run on the plain PyTorch path. Why comfy-kitchen: docs/DESIGN.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Sequence
from types import ModuleType

import torch

from ..models.block_ops import PLAIN_OPS, BlockOps, QKPart
from ..models.transformer_math import NORM_EPS
from .qk_norm_rope_grad import FusedQKNormRope, records_grad

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install comfy-kitchen (or pip install 'klein-nodes[kernels]')"
_TABLES = 4  # RoPE table sets whose rotation matrices are kept (see KitchenOps._freqs)


def kitchen_available() -> bool:
    """Whether comfy-kitchen can be imported (checked without importing it)."""
    return importlib.util.find_spec("comfy_kitchen") is not None


def _kitchen() -> ModuleType:
    try:
        import comfy_kitchen
    except ImportError as exc:
        raise ImportError(f"comfy-kitchen is not installed: {INSTALL_HINT}") from exc
    return comfy_kitchen


def freqs_cis(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """klein_core's interleaved RoPE tables ``[..., L, D]`` (each angle repeated for its pair) as the
    ``[..., L, D/2, 2, 2]`` rotation matrices ComfyUI's and comfy-kitchen's kernels take."""
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([torch.stack([c, -s], dim=-1), torch.stack([s, c], dim=-1)], dim=-2)


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch: a kernel library launching on the current CUDA device
    rather than the tensors' one fails (or reads another GPU's memory) when ``cuda:1`` holds the
    model while ``cuda:0`` is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class KitchenOps(BlockOps):
    """Block steps through comfy-kitchen (see the module doc).

    ``rope`` / ``modulation`` choose which of the two steps it runs; the other stays plain, and so
    do modulations with per-token vectors (the timestep-zero reference mode). Attention is plain
    here; :class:`klein_core.accel.fast.FastOps` combines these steps with an attention backend.

    Under autograd (training a LoRA on the fast path) the kernels, which have no backward, still run
    the QK-norm + RoPE forward, with the backward of :mod:`klein_core.accel.qk_norm_rope_grad`; the
    modulation runs plain (LayerNorm is already one kernel each way there).
    """

    def __init__(self, rope: bool = True, modulation: bool = True) -> None:
        self._ck = _kitchen()
        self.rope = rope
        self.modulation = modulation
        # Rotation matrices of the last few RoPE tables: every block of a forward gets the same
        # cos/sin tensors, and a run reuses its tables every step (two sets with CFG and prompts of
        # other lengths). Strong references, so an identity match can never be a reused address.
        self._tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not self.modulation or shift.shape[1] != 1 or records_grad(x, shift, scale):
            return PLAIN_OPS.modulate(x, shift, scale)
        with _device_guard(x.device):
            return self._ck.adaln(x, scale, shift, NORM_EPS)

    def _freqs(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[1 or B, N, 1, D/2, 2, 2]`` float32: the layout comfy-kitchen reads as [B, N, H, D] q/k."""
        for c, s, freqs in self._tables:
            if c is cos and s is sin:
                return freqs
        freqs = freqs_cis(cos[:, 0], sin[:, 0]).unsqueeze(2).contiguous()
        self._tables = [*self._tables[-(_TABLES - 1):], (cos, sin, freqs)]
        return freqs

    def qk_norm_rope(
        self, parts: Sequence[QKPart], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.rope:
            return PLAIN_OPS.qk_norm_rope(parts, cos, sin)
        freqs = self._freqs(cos, sin)
        qs, ks, offset = [], [], 0
        with _device_guard(parts[0][0].device):
            for q, k, q_scale, k_scale in parts:
                n = q.shape[1]
                # q/k [B, L_i, H, D] views of the projection in, new contiguous [B, L_i, H, D] out:
                # the attention kernels read that layout (as [B, H, L, D] views) without a copy.
                part_freqs = freqs[:, offset : offset + n]
                if records_grad(q, k, q_scale, k_scale):
                    qq, kk = FusedQKNormRope.apply(q, k, part_freqs, q_scale, k_scale, NORM_EPS, self._ck.rms_rope)
                else:
                    qq, kk = self._ck.rms_rope(q, k, part_freqs, q_scale, k_scale, NORM_EPS)
                qs.append(qq)
                ks.append(kk)
                offset += n
        q_all = qs[0] if len(qs) == 1 else torch.cat(qs, dim=1)
        k_all = ks[0] if len(ks) == 1 else torch.cat(ks, dim=1)
        return q_all.transpose(1, 2), k_all.transpose(1, 2)


def kitchen_serves_group_norm(channels: int, groups: int, batch: int) -> bool:
    """Whether comfy-kitchen's CUDA GroupNorm kernel takes this shape (its own rule, read from
    comfy-kitchen 0.2.36's ``group_norm_silu_pad3d``): other shapes go to its eager code, which is
    the plain path plus a layout copy, so klein_core runs the plain path for them instead. The
    FLUX.2 VAE's widths (128, 256, 512) qualify; the small decoder's 96 does not."""
    return (channels % 8 == 0 and 256 % (channels // 8) == 0 and channels % groups == 0
            and groups <= 1024 and batch <= 65535)


def group_norm_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float, silu: bool
) -> torch.Tensor:
    """GroupNorm of ``x`` ``[B, C, H, W]`` (statistics in float32), then SiLU when ``silu``, in one
    pass through comfy-kitchen's ``group_norm_silu_pad3d`` (a video kernel, given one frame and no
    padding). Returns ``[B, C, H, W]`` channels-last, the layout it writes (and cuDNN's tensor-core
    convolutions read)."""
    ck = _kitchen()
    with _device_guard(x.device):
        y = ck.group_norm_silu_pad3d(x.unsqueeze(2), weight, bias, groups, eps, (0, 0, 0, 0, 0), silu)
    return y.squeeze(2)


__all__ = [
    "INSTALL_HINT", "KitchenOps", "freqs_cis", "group_norm_silu", "kitchen_available", "kitchen_serves_group_norm",
]
