"""The three networks as PyTorch modules with frozen configs: transformer, Qwen3 encoder, VAE.

Modules and configs only: no file reading (:mod:`klein_core.files`), no placement
(:mod:`klein_core.memory`). Build them with the loaders in :mod:`klein_core.files.loaders`.
"""

from .qwen3 import OUTPUT_LAYERS, Qwen3Config, Qwen3TextEncoder
from .transformer import Flux2Transformer, TransformerConfig
from .vae import Flux2VAE, VAEConfig

__all__ = ["OUTPUT_LAYERS", "Flux2Transformer", "Flux2VAE", "Qwen3Config", "Qwen3TextEncoder", "TransformerConfig",
           "VAEConfig"]
