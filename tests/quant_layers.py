"""Quantised layers made from a Linear's shape for tests that need one without a file."""

from __future__ import annotations

import torch

from klein_core.quant import nvfp4


def random_nvfp4_layer(linear: torch.nn.Linear, scale: float = 0.01, seed: int = 0) -> nvfp4.NVFP4Linear:
    """An NVFP4 layer of ``linear``'s shape with plain random codes, block scales ``scale`` and a unit
    tensor scale (the weights are random, not ``linear``'s)."""
    out_f, in_f = linear.out_features, linear.in_features
    layer = nvfp4.NVFP4Linear(in_f, out_f)
    g = torch.Generator().manual_seed(seed)
    layer.qweight = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=g)
    plain = torch.full((out_f, in_f // 16), scale).to(torch.float8_e4m3fn)
    layer.block_scale = nvfp4.swizzle(plain).view(torch.uint8)
    layer.tensor_scale = torch.tensor(1.0).view(torch.int32)
    return layer
