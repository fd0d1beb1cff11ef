"""The peers' models built from klein_core's configs, for the benchmarks that time against them."""

from __future__ import annotations

from typing import Any

import torch

from klein_core.models import TransformerConfig


def diffusers_flux2_transformer(diffusers: Any, cfg: TransformerConfig) -> Any:
    """diffusers' ``Flux2Transformer2DModel`` with the shapes of ``cfg``, on the meta device (the
    caller places and fills it)."""
    with torch.device("meta"):
        return diffusers.Flux2Transformer2DModel(
            patch_size=1, in_channels=cfg.in_channels, num_layers=cfg.depth, num_single_layers=cfg.depth_single,
            attention_head_dim=cfg.head_dim, num_attention_heads=cfg.num_heads, joint_attention_dim=cfg.context_dim,
            timestep_guidance_channels=256, mlp_ratio=cfg.mlp_hidden / cfg.hidden_size, axes_dims_rope=cfg.axes_dim,
            rope_theta=int(cfg.theta), eps=1e-6, guidance_embeds=False,
        )
