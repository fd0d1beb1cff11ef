"""The steps of a transformer block that a fast path may replace, and their plain PyTorch form."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .layers import attention, rms_norm
from .transformer_math import NORM_EPS, apply_rope, merge_heads, modulate

# One stream's share of the joint attention: (q, k, q_scale, k_scale), q/k [B, L_i, H, D].
QKPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class BlockOps:
    """The steps of a block that a fast path may replace (see :mod:`klein_core.accel.fast`).

    These methods are the plain PyTorch path: the default, and the reference every fast path is
    tested against. A model holds one in :attr:`Flux2Transformer.ops`; :meth:`bind` runs once per
    forward, outside the blocks, so a subclass can pick backends for the call's device and dtype
    there (and keep that decision out of any compiled region).
    """

    def bind(self, device: torch.device, dtype: torch.dtype) -> BlockOps:
        """The ops to use for one forward on ``device`` in ``dtype``."""
        return self

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``(1 + scale) * LayerNorm(x) + shift``: x ``[B, L, D]``, shift/scale ``[B, 1, D]``."""
        return modulate(x, shift, scale)

    def qk_norm_rope(
        self, parts: Sequence[QKPart], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k, joined along the sequence, then RoPE.

        ``parts``: one ``(q, k, q_scale, k_scale)`` per stream in sequence order ([txt, img] in
        double blocks), q/k ``[B, L_i, H, D]`` (views of the projection), scales ``[D]``.
        ``cos``/``sin``: ``[1 or B, 1, sum(L_i), D]`` float32. Returns q, k ``[B, H, sum(L_i), D]``.
        """
        q = [rms_norm(p[0].transpose(1, 2), p[2], NORM_EPS) for p in parts]
        k = [rms_norm(p[1].transpose(1, 2), p[3], NORM_EPS) for p in parts]
        q_all = q[0] if len(q) == 1 else torch.cat(q, dim=2)
        k_all = k[0] if len(k) == 1 else torch.cat(k, dim=2)
        return apply_rope(q_all, cos, sin), apply_rope(k_all, cos, sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unmasked attention, scale 1/sqrt(D): q/k/v ``[B, H, L, D]`` -> ``[B, L, H*D]``."""
        return merge_heads(attention(q, k, v))

    def gated_residual(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x + gate * y``: x/y ``[B, L, D]``, gate ``[B, 1, D]`` (or ``[B, L, D]``)."""
        return x + gate * y

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x = [gate | up]`` ``[..., 2F]`` -> ``[..., F]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention_and_mlp(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """A single block's second projection input: ``[attn | swiglu(mlp)]``, attn ``[B, L, D]``,
        mlp ``[B, L, 2F]`` -> ``[B, L, D + F]``."""
        return torch.cat([attn, self.swiglu(mlp)], dim=-1)


PLAIN_OPS = BlockOps()  # stateless, shared by every model that has no fast path enabled
