"""What a weight file is, from its tensor names and shapes alone (no tensor data).

Two uses: before loading anything, so a mismatched pair (a Qwen3-4B encoder with a Klein 9B
transformer, a VAE picked as a transformer) is named in one sentence with the file to use
(:func:`probe`, :func:`matching_text_encoders`); and in the loaders' refusals, which say what a
wrong file seems to be and where it belongs (:func:`what_is`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..models.variants import encoder_name, transformer_name
from .gguf import gguf_header, is_gguf
from .safetensors import NotSafetensors, open_safetensors

_TEXT_MARK = "layers.0.self_attn.q_norm.weight"  # QK-norm: what sets Qwen3 apart from Qwen2/Llama


@dataclass(frozen=True)
class WhatItIs:
    """``kind``: "transformer", "text_encoder", "vae", "lora" or "other"; ``noun``: a phrase such
    as "a FLUX.1 transformer (it has per-block modulation)"; ``where``: where such a file belongs."""

    kind: str
    noun: str
    where: str = ""

    def sentence(self, expected_kind: str) -> str:
        """``noun``, plus where the file belongs when it is another component than expected."""
        return self.noun + (f"; {self.where}" if self.where and self.kind != expected_kind else "")


def _vae_description(keys: set[str], shape: Callable[[str], tuple[int, ...]] | None) -> str:
    def has(*parts: str) -> bool:
        return any(p in k for k in keys for p in parts)

    conv = "decoder.conv_in.weight" if "decoder.conv_in.weight" in keys else "encoder.conv_in.weight"
    if conv not in keys:
        return "a tiny autoencoder (TAESD-style), not the full FLUX.2 VAE"
    if shape is not None and len(shape(conv)) != 4:
        return "a video (3-D) VAE"
    if "decoder.conv_in.weight" not in keys:
        return "a VAE encoder without its decoder"
    if "encoder.conv_in.weight" not in keys and not has("encoder.down"):
        return "a VAE decoder without its encoder"
    z = shape("decoder.conv_in.weight")[1] if shape is not None else None
    if "bn.running_mean" not in keys:
        if z == 16:
            return "a FLUX.1 / SD3 16-channel VAE: use flux2-vae.safetensors"
        if z == 4:
            return "an SD 1.x / SDXL 4-channel VAE: use flux2-vae.safetensors"
        return f"a {z}-channel VAE without FLUX.2's latent BatchNorm ('bn.running_mean')" if z else "a VAE"
    bn = list(shape("bn.running_mean")) if shape is not None else "?"
    return f"a {z}-channel VAE with a {bn} BatchNorm" if z else "a VAE with a latent BatchNorm"


def what_is(keys: Iterable[str], shape: Callable[[str], tuple[int, ...]] | None = None) -> WhatItIs:
    """Name the model a set of tensors belongs to (``shape(key)`` gives shapes when known)."""
    ks = set(keys)

    def has(*parts: str) -> bool:
        return any(p in k for k in ks for p in parts)

    def ends(*suffixes: str) -> bool:
        return any(k.endswith(suffixes) for k in ks)

    if has("lora_A", "lora_B", "lora_down", "lora_up", "lokr_w", "hada_w") or ends(".alpha"):
        return WhatItIs("lora", "a LoRA", "load it with Klein LoRA Loader (models/loras/) on a Klein model")
    if ends("double_blocks.0.img_mod.lin.weight"):
        return WhatItIs("other", "a FLUX.1 transformer (it has per-block modulation); Klein needs a FLUX.2 Klein "
                                 "file such as flux-2-klein-4b.safetensors")
    if ends("stream_modulation.lin.weight") or has("double_blocks.", "single_blocks."):
        return WhatItIs("transformer", "a FLUX diffusion transformer (BFL/ComfyUI layout)",
                        "put it in models/diffusion_models and pick it in Klein Model Loader")
    if has("transformer_blocks.") and has("x_embedder"):
        return WhatItIs("transformer", "a FLUX diffusion transformer (diffusers layout)",
                        "load the transformer folder as the model")
    if ends(_TEXT_MARK):
        return WhatItIs("text_encoder", "a Qwen3 text encoder (LLM)",
                        "put it in models/text_encoders and pick it in Qwen3 Layer-Concat Encoder")
    te_where = "text encoders go in models/text_encoders; Klein needs Qwen3-4B or Qwen3-8B"
    if has("text_model.encoder.layers.", "text_model.embeddings."):
        return WhatItIs("other", "a CLIP text encoder", te_where)
    if has("encoder.block.0.layer.0.SelfAttention") or "shared.weight" in ks:
        return WhatItIs("other", "a T5 text encoder", te_where)
    if has("layers.0.self_attn.q_proj.bias"):
        return WhatItIs("other", "a Qwen2/Qwen2.5-style LLM text encoder (attention biases, no QK-norm)", te_where)
    if has("layers.0.self_attn.q_proj.weight"):
        return WhatItIs("other", "a Llama/Mistral-style LLM text encoder without QK-norm", te_where)
    if has("decoder.conv_in.", "encoder.conv_in.", "encoder.layers.", "decoder.layers."):
        noun = _vae_description(ks, shape)
        kind = "vae" if "bn.running_mean" in ks else "other"
        return WhatItIs(kind, noun, "put it in models/vae and pick it as vae_name in Klein Model Loader")
    if any(k.startswith(("model.diffusion_model.input_blocks", "input_blocks.")) for k in ks):
        return WhatItIs("other", "a Stable Diffusion UNet checkpoint")
    first = ", ".join(f"'{k}'" for k in sorted(ks)[:3])
    return WhatItIs("other", f"a model klein_core does not recognise (first tensors: {first})")


@dataclass(frozen=True)
class FileInfo:
    """``kind`` is "transformer", "text_encoder", "vae", "lora" or "unknown"; ``text_width`` is
    the text feature width the transformer expects or the encoder produces (3 x Qwen3 hidden)."""

    path: Path
    kind: str
    text_width: int | None = None
    description: str = ""


def _count_blocks(keys: Iterable[str], names: tuple[str, ...]) -> int:
    pattern = re.compile(r"(?:^|\.)(?:" + "|".join(names) + r")\.(\d+)\.")
    return len({m.group(1) for k in keys if (m := pattern.search(k))})


def probe(path: str | os.PathLike) -> FileInfo:
    """Classify a ``.safetensors`` or ``.gguf`` file from its header. Never raises for a readable file."""
    path = Path(path)
    try:
        tensors = gguf_header(path) if path.is_file() and is_gguf(path) else open_safetensors(path).tensors
    except NotSafetensors as exc:  # says what the file is when its first bytes tell (an image, a web page...)
        return FileInfo(path, "unknown", None, f"{exc.what}, not safetensors / GGUF" if exc.what else
                        "unreadable or not safetensors / GGUF")
    except (OSError, ValueError):
        return FileInfo(path, "unknown", None, "unreadable or not safetensors / GGUF")
    for key, info in tensors.items():
        if key.endswith(("txt_in.weight", "context_embedder.weight")) and len(info.shape) == 2:
            hidden, width = info.shape
            depth = _count_blocks(tensors, ("double_blocks", "transformer_blocks"))
            single = _count_blocks(tensors, ("single_blocks", "single_transformer_blocks"))
            return FileInfo(path, "transformer", width, transformer_name(hidden, depth, single, width))
    for key, info in tensors.items():
        if key.endswith("embed_tokens.weight") and any(k.endswith(_TEXT_MARK) for k in tensors):
            hidden = info.shape[1]
            return FileInfo(path, "text_encoder", 3 * hidden, encoder_name(hidden))
    what = what_is(tensors, lambda k: tensors[k].shape)
    if what.kind == "vae":
        return FileInfo(path, "vae", None, "VAE")
    if what.kind == "lora":
        return FileInfo(path, "lora", None, "LoRA")
    return FileInfo(path, "unknown", None, what.noun)


def matching_text_encoders(text_width: int, candidates: Sequence[str | os.PathLike]) -> list[Path]:
    """The candidate files that are text encoders producing ``text_width`` features."""
    out = []
    for c in candidates:
        info = probe(c)
        if info.kind == "text_encoder" and info.text_width == text_width:
            out.append(info.path)
    return out


__all__ = ["FileInfo", "WhatItIs", "matching_text_encoders", "probe", "what_is"]
