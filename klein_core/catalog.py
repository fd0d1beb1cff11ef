"""What a weight file is, read from its safetensors header alone (no tensor data).

Used before loading anything, so a mismatched pair (a Qwen3-4B encoder with a Klein 9B
transformer, a VAE picked as a transformer) is named in one sentence with the file to use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .weights import read_safetensors_header

_TEXT_MARK = "layers.0.self_attn.q_norm.weight"
_QWEN_NAMES = {2560: "Qwen3-4B", 4096: "Qwen3-8B"}
_KLEIN_NAMES = {7680: "Klein 4B", 12288: "Klein 9B"}


@dataclass(frozen=True)
class FileInfo:
    """``kind`` is "transformer", "text_encoder", "vae" or "unknown"; ``text_width`` is the text
    feature width the transformer expects or the encoder produces (3 x Qwen3 hidden)."""

    path: Path
    kind: str
    text_width: int | None = None
    description: str = ""


def probe(path: str | os.PathLike) -> FileInfo:
    """Classify a ``.safetensors`` file from its header. Never raises for a readable file."""
    path = Path(path)
    try:
        tensors, _ = read_safetensors_header(path)
    except (OSError, ValueError):
        return FileInfo(path, "unknown", None, "unreadable or not safetensors")
    for key, info in tensors.items():
        if key.endswith(("txt_in.weight", "context_embedder.weight")) and len(info.shape) == 2:
            w = info.shape[1]
            return FileInfo(path, "transformer", w, _KLEIN_NAMES.get(w, f"Flux2 transformer (text width {w})"))
    for key, info in tensors.items():
        if key.endswith("embed_tokens.weight") and any(k.endswith(_TEXT_MARK) for k in tensors):
            h = info.shape[1]
            return FileInfo(path, "text_encoder", 3 * h, _QWEN_NAMES.get(h, f"Qwen3 (hidden {h})"))
    if any(k.endswith("decoder.conv_in.weight") for k in tensors):
        return FileInfo(path, "vae", None, "VAE")
    return FileInfo(path, "unknown", None, "not a Klein component")


def matching_text_encoders(text_width: int, candidates: Iterable[str | os.PathLike]) -> list[Path]:
    """The candidate files that are text encoders producing ``text_width`` features."""
    out = []
    for c in candidates:
        info = probe(c)
        if info.kind == "text_encoder" and info.text_width == text_width:
            out.append(info.path)
    return out
