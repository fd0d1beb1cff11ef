"""Random weights for full-size models built on the device (benchmarks and the GPU tests)."""

from __future__ import annotations

import math

import torch
from torch import nn


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


__all__ = ["random_fill_"]
