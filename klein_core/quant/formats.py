"""Which quantised storage formats a loaded model's Linear layers keep, named for people."""

from __future__ import annotations

from collections import Counter

from torch import nn

from .fp8 import FP8Linear
from .ggml import GGMLLinear
from .nvfp4 import NVFP4Linear

# what each on-load quantisation choice (``quantize=``) makes of a float block Linear
MADE_BY = {"fp8": "fp8 e4m3fn", "q8": "GGUF Q8_0", "q4": "GGUF Q4_0"}


def layer_format(module: nn.Module) -> str | None:
    """The storage format of one quantised Linear (``"fp8 e4m3fn"``, ``"GGUF Q4_K"``, ``"NVFP4"``),
    ``None`` for any other module."""
    if isinstance(module, FP8Linear):
        return f"fp8 {module.fmt.removeprefix('float8_')}"
    if isinstance(module, GGMLLinear):
        return f"GGUF {module.qtype.name}"
    if isinstance(module, NVFP4Linear):
        return "NVFP4"
    return None


def stored_formats(model: nn.Module) -> dict[str, int]:
    """How many Linear layers of ``model`` keep each quantised format, most common first
    (``{}`` for a model held entirely in a float dtype)."""
    counts = Counter(f for f in map(layer_format, model.modules()) if f is not None)
    return dict(counts.most_common())


def describe_formats(counts: dict[str, int]) -> str:
    """``{"fp8 e4m3fn": 80, "GGUF Q6_K": 2}`` -> ``"80 layers in fp8 e4m3fn and 2 in GGUF Q6_K"``."""
    parts = [f"{n} layer{'s' if n != 1 else ''} in {fmt}" if i == 0 else f"{n} in {fmt}"
             for i, (fmt, n) in enumerate(counts.items())]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def prequantized_layers(model: nn.Module, quantize: str | None) -> dict[str, int]:
    """The quantised layers of ``model`` that an on-load ``quantize`` choice (``"fp8"``, ``"q8"``,
    ``"q4"``) did not make: the file stored them so, and they stay as stored. ``{}`` when the choice
    made every quantised layer, or when no such choice was made."""
    made = MADE_BY.get(quantize or "")
    if made is None:
        return {}
    return {fmt: n for fmt, n in stored_formats(model).items() if fmt != made}


__all__ = ["MADE_BY", "describe_formats", "prequantized_layers", "layer_format", "stored_formats"]
