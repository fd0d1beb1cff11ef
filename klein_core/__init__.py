"""klein_core: an exact, self-contained PyTorch implementation of FLUX.2 Klein.

Never imports ComfyUI. The top level holds what a user needs: the loaders, :class:`Engine` and
:func:`generate`, the request, settings and result types, the model classes and their configs, the
errors, and LoRA. Everything else is imported from the module that defines it
(``klein_core.pipeline.sampling``, ``klein_core.memory``, ``klein_core.accel``...). docs/api.md lists these
names and where the rest lives; ``tests/test_public_api.py`` freezes ``__all__``, so the list only
grows on purpose.
"""

from .errors import GenerationCancelled, KleinOutOfMemory, NonFiniteWeights, WeightFormatError
from .files.loaders import load_text_encoder, load_transformer, load_vae
from .lora import LoRA, apply_loras, load_lora, with_loras
from .models.qwen3 import Qwen3Config, Qwen3TextEncoder
from .models.transformer import Flux2Transformer, TransformerConfig
from .models.vae import Flux2VAE, VAEConfig
from .pipeline.engine import Engine, GenerationResult, generate
from .pipeline.prompts import COMFYUI_TEXT, DiskPromptCache, PromptCache, TextOptions
from .pipeline.request import Conditioning, GenerationRequest, Settings

__version__ = "0.1.0"

__all__ = [
    # loading
    "load_text_encoder",
    "load_transformer",
    "load_vae",
    # running
    "Engine",
    "generate",
    # what a run takes and gives
    "COMFYUI_TEXT",
    "Conditioning",
    "DiskPromptCache",
    "GenerationRequest",
    "GenerationResult",
    "PromptCache",
    "Settings",
    "TextOptions",
    # the models and their configs
    "Flux2Transformer",
    "Flux2VAE",
    "Qwen3Config",
    "Qwen3TextEncoder",
    "TransformerConfig",
    "VAEConfig",
    # errors
    "GenerationCancelled",
    "KleinOutOfMemory",
    "NonFiniteWeights",
    "WeightFormatError",
    # LoRA
    "LoRA",
    "apply_loras",
    "load_lora",
    "with_loras",
]
