"""klein_core: an exact, self-contained PyTorch implementation of FLUX.2 Klein.

Never imports ComfyUI. The names below are the stable public API (see README.md); the package map
is in README "Architecture".
"""

from .engine import (
    Conditioning,
    Engine,
    GenerationResult,
    InitLatents,
    check_compatible,
    decode_to_pixels,
    encode_references,
    generate,
)
from .errors import GenerationCancelled, KleinOutOfMemory, NonFiniteWeights, WeightFormatError
from .files.fp8 import quantize_state_dict
from .files.identify import FileInfo, matching_text_encoders, probe
from .files.opening import open_weights
from .files.source import WeightSource
from .files.transformer_layout import bfl_to_diffusers
from .images import PUBLISHED_REFERENCE_LIMIT, prepare_reference_image, reference_size, to_pil
from .inpaint import (
    InitImage,
    composite,
    composite_pixels,
    crop_for_inpaint,
    crop_region,
    crop_size,
    feather_mask,
    mask_for_latents,
    outpaint,
    prepare_inpaint,
    processing_size,
    steps_to_run,
    stitch,
)
from .kv import ReferenceKVCache, default_kv_cache
from .loading import LOADERS, load_text_encoder, load_transformer, load_vae, weightless
from .lora import AppliedLoRAs, LoRA, LoRAPatch, apply_loras, check_loras, has_loras, load_lora, with_loras
from .memory.placement import (
    BlockOffloader,
    StagePlacer,
    module_bytes,
    offload_blocks,
    on_device,
    pin_memory_,
)
from .memory.planner import (
    MemoryEstimate,
    MemoryPlan,
    MemoryRequest,
    ModelSizes,
    choose_plan,
    estimate,
    plan_for,
    weights_home,
)
from .memory.tiling import decode_tiled, encode_tiled
from .models.qwen3 import Qwen3Config, Qwen3TextEncoder
from .models.transformer import Flux2Transformer, TransformerConfig
from .models.vae import Flux2VAE, VAEConfig
from .prompts import (
    COMFYUI_TEXT,
    DiskPromptCache,
    PromptCache,
    TextOptions,
    default_prompt_cache,
    encode_prompts,
    encoder_identity,
    identity_of,
)
from .quant.formats import describe_formats, kept_from_file, stored_formats
from .quant.fp8 import FP8Linear, fp8_layers, quantize_model_, scaled_mm_available
from .request import (
    BASE_DEFAULTS,
    DISTILLED_DEFAULTS,
    GenerationRequest,
    Resolved,
    Settings,
    guess_model_kind,
    reference_mode,
    resolve_size,
)
from .request import resolve as resolve_settings
from .sampling import (
    MAX_SEED,
    REFERENCE_MODES,
    compute_empirical_mu,
    denoise,
    get_schedule,
    make_noise,
    pack,
    position_ids,
    reference_tokens,
    text_position_ids,
    unpack,
)
from .tokenizer import count_tokens, tokenize_prompts
from .variants import (
    KLEIN_4B,
    KLEIN_9B,
    VARIANTS,
    Variant,
    check_text_width,
    encoder_for_text_width,
    encoder_name,
    variant_for_text_width,
)

__version__ = "0.1.0"

# Text width -> the Qwen3 encoder (and ComfyUI file) that produces it; kept under its old name.
TEXT_ENCODER_FOR_WIDTH = {v.text_width: encoder_for_text_width(v.text_width) for v in VARIANTS}

__all__ = [
    "BASE_DEFAULTS",
    "COMFYUI_TEXT",
    "DISTILLED_DEFAULTS",
    "KLEIN_4B",
    "KLEIN_9B",
    "LOADERS",
    "MAX_SEED",
    "PUBLISHED_REFERENCE_LIMIT",
    "REFERENCE_MODES",
    "TEXT_ENCODER_FOR_WIDTH",
    "VARIANTS",
    "AppliedLoRAs",
    "BlockOffloader",
    "Conditioning",
    "DiskPromptCache",
    "Engine",
    "FP8Linear",
    "FileInfo",
    "Flux2Transformer",
    "Flux2VAE",
    "GenerationCancelled",
    "GenerationRequest",
    "GenerationResult",
    "InitImage",
    "InitLatents",
    "KleinOutOfMemory",
    "LoRA",
    "LoRAPatch",
    "MemoryEstimate",
    "MemoryPlan",
    "MemoryRequest",
    "ModelSizes",
    "NonFiniteWeights",
    "PromptCache",
    "Qwen3Config",
    "Qwen3TextEncoder",
    "ReferenceKVCache",
    "Resolved",
    "Settings",
    "StagePlacer",
    "TextOptions",
    "TransformerConfig",
    "VAEConfig",
    "Variant",
    "WeightFormatError",
    "WeightSource",
    "apply_loras",
    "bfl_to_diffusers",
    "check_compatible",
    "check_loras",
    "check_text_width",
    "choose_plan",
    "composite",
    "composite_pixels",
    "compute_empirical_mu",
    "count_tokens",
    "crop_for_inpaint",
    "crop_region",
    "crop_size",
    "decode_tiled",
    "decode_to_pixels",
    "default_kv_cache",
    "default_prompt_cache",
    "denoise",
    "describe_formats",
    "encode_prompts",
    "encode_references",
    "encode_tiled",
    "encoder_for_text_width",
    "encoder_identity",
    "encoder_name",
    "estimate",
    "feather_mask",
    "fp8_layers",
    "generate",
    "get_schedule",
    "guess_model_kind",
    "has_loras",
    "identity_of",
    "kept_from_file",
    "load_lora",
    "load_text_encoder",
    "load_transformer",
    "load_vae",
    "make_noise",
    "mask_for_latents",
    "matching_text_encoders",
    "module_bytes",
    "offload_blocks",
    "on_device",
    "open_weights",
    "outpaint",
    "pack",
    "pin_memory_",
    "plan_for",
    "position_ids",
    "prepare_inpaint",
    "prepare_reference_image",
    "probe",
    "processing_size",
    "quantize_model_",
    "quantize_state_dict",
    "reference_mode",
    "reference_size",
    "reference_tokens",
    "resolve_settings",
    "resolve_size",
    "scaled_mm_available",
    "steps_to_run",
    "stitch",
    "stored_formats",
    "text_position_ids",
    "to_pil",
    "tokenize_prompts",
    "unpack",
    "variant_for_text_width",
    "weightless",
    "weights_home",
    "with_loras",
]
