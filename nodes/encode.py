"""Qwen3 Layer-Concat Encoder: prompt (and negative prompt) -> Klein text embeddings."""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

import klein_core as kc

from . import cache, host
from .common import activation_bytes, check_choices, errors_named, model_file
from .types import KleinConditioning, KleinCondType

logger = logging.getLogger(__name__)

NODE = "Qwen3 Layer-Concat Encoder"


def encoder_dtype(device: torch.device) -> torch.dtype:
    """bf16 (what Qwen3 was trained in) wherever it runs; fp16 on GPUs without bf16."""
    return torch.bfloat16 if host.bf16_supported(device) else torch.float16


class KleinTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinTextEncode",
            display_name=NODE,
            category="Klein/conditioning",
            description="Encodes the prompt with Qwen3 (hidden states of layers 9, 18 and 27, concatenated "
                        "per token) for FLUX.2 Klein. Only changed texts are re-encoded.",
            inputs=[
                io.Combo.Input("text_encoder", options=host.filename_list("text_encoders"), tooltip=(
                    "Qwen3 file from models/text_encoders: qwen_3_4b.safetensors for Klein 4B models, "
                    "qwen_3_8b.safetensors for Klein 9B models.")),
                io.String.Input("prompt", multiline=True, dynamic_prompts=True,
                                tooltip="What to generate, or for edits what to change in the references."),
                io.String.Input("negative_prompt", multiline=True, dynamic_prompts=True, default="",
                                tooltip="What to avoid. Used only by base models with guidance > 1 "
                                        "(classifier-free guidance); distilled models ignore it."),
            ],
            outputs=[KleinCondType.Output(display_name="conditioning",
                                          tooltip="Prompt and negative embeddings [1, 512, text width].")],
        )

    @classmethod
    def validate_inputs(cls, text_encoder: str) -> bool | str:
        return check_choices(cls, {"text_encoder": "text_encoders"}, text_encoder=text_encoder)

    @classmethod
    def execute(cls, text_encoder: str, prompt: str, negative_prompt: str = "") -> io.NodeOutput:
        path = model_file(NODE, "text_encoder", "text_encoders", text_encoder, expect="text_encoder")
        device = host.text_encoder_device()
        ref = cache.model_ref("text_encoder", path, text_encoder, device, encoder_dtype(device))
        with errors_named(NODE, "text_encoder", text_encoder):
            encoder = ref.get(activation_bytes("text", kc.MemoryRequest(batch=2, denoise=False, decode=False),
                                               text_encoder=kc.weightless(path, "text_encoder").config))
        engine = kc.Engine(text_encoder=encoder, device=device, prompt_cache=cache.prompts)
        embeds = engine.encode_prompts([prompt], negative_prompt)
        cfg = encoder.config
        return io.NodeOutput(KleinConditioning(embeds.positive, embeds.negative, text_encoder, cfg.text_dim,
                                               cfg.variant))
