"""Tiny random reference models built with diffusers, shared by the parity tests."""

from __future__ import annotations

import torch

CTX = 24  # text width of the tiny transformer


def tiny_diffusers_transformer(seed: int = 0, in_channels: int = 8):
    """A 2+2-block ``Flux2Transformer2DModel`` (hidden 32, 2 heads, RoPE axes 4x4), all weights random."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=None, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=CTX,
        timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    ).eval()
    with torch.no_grad():  # default inits leave norms at 1 and some weights at 0: randomise all
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model
