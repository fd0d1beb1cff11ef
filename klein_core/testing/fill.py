"""Full-size Klein models with random weights, built on the device (benchmarks and the GPU tests)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.qwen3 import Qwen3Config
from ..models.transformer import TransformerConfig
from ..models.vae import VAEConfig
from ..models.variants import Variant

# Qwen3-4B / Qwen3-8B MLP widths (by hidden size): the one size the Variant table does not give
_ENCODER_MLP = {2560: 9728, 4096: 12288}


def full_size_configs(variant: Variant) -> tuple[TransformerConfig, Qwen3Config, VAEConfig]:
    """The published shapes of ``variant`` (``klein_core.KLEIN_4B`` / ``KLEIN_9B``): its transformer,
    its Qwen3 encoder as the file holds it (36 layers, 27 of them loaded) and the FLUX.2 VAE."""
    transformer = TransformerConfig(hidden_size=variant.hidden, num_heads=variant.heads, depth=variant.depth,
                                    depth_single=variant.depth_single, context_dim=variant.text_width,
                                    mlp_hidden=3 * variant.hidden)
    encoder = Qwen3Config(hidden_size=variant.encoder_hidden, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=_ENCODER_MLP[variant.encoder_hidden],
                          vocab_size=151936, num_layers_in_file=36)
    return transformer, encoder, VAEConfig()


def random_fill_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Fill every parameter and buffer of a ``to_empty``-ed ``module`` in place on its device and
    return it in eval mode without gradients.

    Matrices get N(0, 1/fan_in) so activations keep their scale through deep stacks; 1-D weights
    (norm scales) 1 + N(0, 0.1^2), biases N(0, 0.02^2); latent BatchNorm statistics a random mean and
    a variance in [0.5, 1.5]; other float buffers zero. ``generator`` must be on the module's device.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=generator)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=generator)
            else:
                p.normal_(1.0, 0.1, generator=generator)
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0.0, 0.3, generator=generator)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5, generator=generator)
            elif b.is_floating_point():
                b.zero_()
    return module.eval().requires_grad_(False)


__all__ = ["full_size_configs", "random_fill_"]
