"""klein_core: an exact, self-contained PyTorch implementation of FLUX.2 Klein.

Never imports ComfyUI. The names below are the stable public API (see README.md).
"""

from .lora import AppliedLoRAs, LoRA, LoRAPatch, apply_loras, check_loras, load_lora, with_loras
from .offload import BlockOffloader, StagePlacer, offload_blocks, on_device, pin_memory_
from .pipeline import (
    BASE_DEFAULTS,
    DISTILLED_DEFAULTS,
    GenerationResult,
    KleinOutOfMemory,
    PromptCache,
    check_compatible,
    decode_to_pixels,
    default_prompt_cache,
    encode_prompts,
    encode_references,
    generate,
    guess_model_kind,
    resolve_size,
)
from .planner import MemoryEstimate, MemoryPlan, MemoryRequest, ModelSizes, choose_plan, estimate, plan_for
from .quant import FP8Linear, fp8_layers, quantize_model_, quantize_state_dict
from .qwen3 import Qwen3Config, Qwen3TextEncoder, load_text_encoder
from .refs import PUBLISHED_REFERENCE_LIMIT, prepare_reference_image, reference_size
from .sampling import (
    MAX_SEED,
    GenerationCancelled,
    compute_empirical_mu,
    denoise,
    get_schedule,
    make_noise,
    pack,
    reference_tokens,
    unpack,
)
from .tokenizer import tokenize_prompts
from .transformer import TEXT_ENCODER_FOR_WIDTH, Flux2Transformer, bfl_to_diffusers, TransformerConfig, load_transformer, position_ids, text_position_ids
from .vae import Flux2VAE, VAEConfig, load_vae
from .vae_tiling import decode_tiled, encode_tiled
from .weights import WeightFormatError, WeightSource, open_weights

__version__ = "0.1.0"

__all__ = [
    "BlockOffloader", "StagePlacer", "offload_blocks", "on_device", "pin_memory_",
    "MemoryEstimate", "MemoryPlan", "MemoryRequest", "ModelSizes", "choose_plan", "estimate", "plan_for",
    "bfl_to_diffusers", "FP8Linear", "fp8_layers", "quantize_model_", "quantize_state_dict", "decode_tiled", "encode_tiled",
    "BASE_DEFAULTS", "DISTILLED_DEFAULTS", "MAX_SEED", "PUBLISHED_REFERENCE_LIMIT", "TEXT_ENCODER_FOR_WIDTH",
    "AppliedLoRAs", "LoRA", "LoRAPatch", "apply_loras", "check_loras", "load_lora", "with_loras",
    "Flux2Transformer", "Flux2VAE", "GenerationCancelled", "GenerationResult", "KleinOutOfMemory", "PromptCache", "Qwen3Config",
    "Qwen3TextEncoder", "TransformerConfig", "VAEConfig", "WeightFormatError", "WeightSource",
    "check_compatible", "compute_empirical_mu", "decode_to_pixels", "default_prompt_cache", "denoise",
    "encode_prompts", "encode_references", "generate", "get_schedule", "guess_model_kind", "load_text_encoder",
    "load_transformer", "load_vae", "make_noise", "open_weights", "pack", "position_ids",
    "prepare_reference_image", "reference_size", "reference_tokens", "resolve_size", "text_position_ids",
    "tokenize_prompts", "unpack",
]
