"""Tiny random Klein components: an install check without downloads, and test fixtures.

The tiny models have the real structure and the real geometry (128 latent channels, 16 pixels per
token, the Qwen3 vocabulary, hidden states 9/18/27), so every code path runs, but their images are
noise. :func:`write_tiny_model_files` writes them in the real checkpoint layouts under the public
file names, for ComfyUI end-to-end tests and CLI tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.qwen3 import Qwen3Config, Qwen3TextEncoder
from ..models.transformer import Flux2Transformer, TransformerConfig
from ..models.vae import Flux2VAE, VAEConfig

logger = logging.getLogger(__name__)

QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny model family member; ``text_hidden`` ties the encoder to the transformer."""

    text_hidden: int = 32
    hidden: int = 64
    heads: int = 2
    depth: int = 1
    depth_single: int = 2


TINY_4B = TinySpec(text_hidden=32)
TINY_9B = TinySpec(text_hidden=48, hidden=96, heads=3)  # a "bigger" sibling whose encoder does not fit 4B


def tiny_text_encoder(spec: TinySpec = TINY_4B, seed: int = 0) -> Qwen3TextEncoder:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=spec.text_hidden, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=2 * spec.text_hidden, vocab_size=QWEN3_VOCAB, num_layers_in_file=27,
    )
    model = Qwen3TextEncoder(cfg)
    _jitter_norms(model, seed)
    return model.eval().requires_grad_(False)


def tiny_transformer(spec: TinySpec = TINY_4B, seed: int = 0) -> Flux2Transformer:
    torch.manual_seed(seed + 1)
    head_dim = spec.hidden // spec.heads
    cfg = TransformerConfig(
        hidden_size=spec.hidden, num_heads=spec.heads, depth=spec.depth, depth_single=spec.depth_single,
        context_dim=3 * spec.text_hidden, mlp_hidden=3 * spec.hidden, in_channels=128,
        axes_dim=(head_dim // 4,) * 4,
    )
    model = Flux2Transformer(cfg)
    _jitter_norms(model, seed)
    return model.eval().requires_grad_(False)


def tiny_vae(seed: int = 0) -> Flux2VAE:
    """Four levels (so 16 px per token, like the real VAE) of 32 channels each."""
    torch.manual_seed(seed + 2)
    model = Flux2VAE(VAEConfig(block_channels=(32,) * 4, decoder_block_channels=(32,) * 4, num_res_blocks=1))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("running_var"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith("running_mean"):
                buf.normal_(0.0, 0.2)
    return model.eval().requires_grad_(False)


def _jitter_norms(model: torch.nn.Module, seed: int) -> None:
    # Norm weights start at 1; perturb them so tests notice a norm applied in the wrong place.
    g = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def build_tiny_components(seed: int = 0) -> tuple[Flux2Transformer, Qwen3TextEncoder, Flux2VAE]:
    """(transformer, text encoder, VAE): tiny, random, mutually compatible, float32 on the CPU."""
    return tiny_transformer(TINY_4B, seed), tiny_text_encoder(TINY_4B, seed), tiny_vae(seed)


def _save(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {k: (v.to(dtype) if v.is_floating_point() and "running_" not in k else v).contiguous()
           for k, v in state.items()}
    save_file(out, str(path))


def write_tiny_model_files(models_dir: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, Path]:
    """Write tiny random models under ComfyUI's folder names and the public file names.

    Creates ``diffusion_models/flux-2-klein-4b.safetensors`` (BFL layout, same weights also as
    ``flux-2-klein-base-4b.safetensors``), ``diffusion_models/flux-2-klein-9b.safetensors`` (a
    bigger sibling that needs the other encoder, also as ``flux-2-klein-9b-kv.safetensors``), ``text_encoders/qwen_3_4b.safetensors`` and
    ``qwen_3_8b.safetensors`` (HF names with the ``model.`` prefix, as ComfyUI ships them) and
    ``vae/flux2-vae.safetensors``. Returns the paths by short name.
    """
    root = Path(models_dir)
    paths = {
        "klein_4b": root / "diffusion_models" / "flux-2-klein-4b.safetensors",
        "klein_base_4b": root / "diffusion_models" / "flux-2-klein-base-4b.safetensors",
        "klein_9b": root / "diffusion_models" / "flux-2-klein-9b.safetensors",
        "klein_9b_kv": root / "diffusion_models" / "flux-2-klein-9b-kv.safetensors",
        "qwen_4b": root / "text_encoders" / "qwen_3_4b.safetensors",
        "qwen_8b": root / "text_encoders" / "qwen_3_8b.safetensors",
        "vae": root / "vae" / "flux2-vae.safetensors",
    }
    tr4 = tiny_transformer(TINY_4B, seed).state_dict()
    _save(tr4, paths["klein_4b"], dtype)
    _save(tr4, paths["klein_base_4b"], dtype)
    tr9 = tiny_transformer(TINY_9B, seed).state_dict()
    _save(tr9, paths["klein_9b"], dtype)
    _save(tr9, paths["klein_9b_kv"], dtype)  # the KV model has the 9B structure; its name tells them apart
    for key, spec in (("qwen_4b", TINY_4B), ("qwen_8b", TINY_9B)):
        te = tiny_text_encoder(spec, seed).state_dict()
        _save({"model." + k: v for k, v in te.items()}, paths[key], dtype)
    _save(tiny_vae(seed).state_dict(), paths["vae"], dtype)
    (root / "loras").mkdir(parents=True, exist_ok=True)
    logger.info("wrote tiny model files under %s", root)
    return paths
