"""Qwen3 Layer-Concat Encoder: prompt (and negative prompt) -> Klein text embeddings."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from comfy_api.latest import io

import klein_core as kc
from klein_core.models.variants import encoder_name
from klein_core.pipeline.prompts import TRIM_MULTIPLE, encoder_identity
from klein_core.pipeline.tokenizer import count_tokens

from . import cache, host, notices
from .common import check_choices, check_widget, file_state, model_file, open_engine
from .loaders import SPEEDS
from .lora import LoRAModelRef
from .types import KleinConditioning, KleinCondType

logger = logging.getLogger(__name__)

NODE = "Qwen3 Layer-Concat Encoder"
# Widget value -> klein_core TextOptions field. The first of each is the default (BFL / diffusers).
PRECISIONS: dict[str, torch.dtype | None] = {"model dtype": None, "fp32 activations": torch.float32}
# max_tokens widget -> (TextOptions.max_tokens, TextOptions.trim)
MAX_TOKENS: dict[str, tuple[int | None, int | None]] = {
    "512": (512, None), "whole prompt": (None, None), "512, padding trimmed (approximate)": (512, TRIM_MULTIPLE)}
NO_LORA = "none"
NATIVE_ENCODER_KEY = host.NATIVE_ENCODER_KEY  # in our CONDITIONING's options: the encoder file
NATIVE_WRITTEN_KEY = "klein_written"  # in the negative output's options: whether a negative prompt was written


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
                io.Combo.Input("text_encoder", options=host.filename_list("text_encoders", (".gguf",)), tooltip=(
                    "Qwen3 file from models/text_encoders: qwen_3_4b.safetensors for Klein 4B models, "
                    "qwen_3_8b.safetensors for Klein 9B models.")),
                io.String.Input("prompt", multiline=True, dynamic_prompts=True,
                                tooltip="What to generate, or for edits what to change in the references."),
                io.String.Input("negative_prompt", multiline=True, dynamic_prompts=True, default="",
                                tooltip="What to avoid. Used only by base models with guidance > 1 "
                                        "(classifier-free guidance); distilled models ignore it."),
                io.Combo.Input("precision", options=list(PRECISIONS), default="model dtype", optional=True,
                               tooltip="model dtype = the encoder computes in its weights' dtype (bf16), as "
                                       "BFL and diffusers do. fp32 activations = bf16 weights computing in "
                                       "fp32, as ComfyUI's own Flux.2 nodes do; choose it to match images "
                                       "made there."),
                io.Combo.Input("max_tokens", options=list(MAX_TOKENS), default="512", optional=True,
                               tooltip="512 = prompts are cut at 512 tokens, as BFL and diffusers do (a "
                                       "warning says how much was cut). whole prompt = nothing is cut (at "
                                       "least 512), as ComfyUI's own Flux.2 nodes do. padding trimmed = cut "
                                       f"at 512, padded only to a multiple of {TRIM_MULTIPLE} tokens: fewer "
                                       "tokens in every step (faster, most at small sizes), but approximate, "
                                       "since Klein was trained with 512; compare with 512 on your images."),
                io.Combo.Input("lora_name", options=[NO_LORA, *host.filename_list("loras")], default=NO_LORA,
                               optional=True, tooltip=(
                    "A LoRA from models/loras whose text-encoder part adapts the encoder (e.g. one trained by "
                    "Klein LoRA Trainer with text_encoder_rank > 0). Its transformer part is applied by Klein "
                    "LoRA Loader: give the same file to both. Prompts encoded with a LoRA are not cached.")),
                io.Float.Input("lora_strength", default=1.0, min=-10.0, max=10.0, step=0.05, optional=True,
                               tooltip="Strength of the text-encoder LoRA (0 = off)."),
                io.Combo.Input("speed", options=list(SPEEDS), default="fast", optional=True, tooltip=(
                    "fast = on the GPU the encoder's forward replayed as one CUDA graph per prompt length "
                    "(recorded at the first prompt of a length; the same result, 40 -> 14 ms on an H100). "
                    "fast + compile = its 27 layers compiled with torch.compile and replayed the same way; "
                    "the first prompt of a new length compiles (seconds, logged), later ones and later runs "
                    "reuse it. plain = the eager encoder.")),
            ],
            outputs=[KleinCondType.Output(display_name="conditioning",
                                          tooltip="Prompt and negative embeddings [1, tokens, text width] "
                                                  "(512 tokens, or more with max_tokens = whole prompt)."),
                     io.Conditioning.Output(display_name="positive", tooltip=(
                         "The prompt as ComfyUI's CONDITIONING, for ReferenceLatent, ConditioningZeroOut, "
                         "CFGGuider or Klein Sampler.")),
                     io.Conditioning.Output(display_name="negative", tooltip=(
                         "The negative prompt as ComfyUI's CONDITIONING (for CFG with base models)."))],
        )

    @classmethod
    def validate_inputs(cls, text_encoder: str) -> bool | str:
        # One input only: ComfyUI reports a failure under every input this signature names, so a
        # wrong lora_name named here was also shown under text_encoder. lora_name is checked by name
        # when the node runs (and by current ComfyUI when the prompt is queued, as every list input).
        return check_choices(cls, {"text_encoder": "text_encoders"}, text_encoder=text_encoder)

    @classmethod
    def fingerprint_inputs(cls, text_encoder: str = "", lora_name: str = NO_LORA, **_: object) -> object:
        # Encode again when the encoder or the LoRA file is replaced under the same name (a
        # retrained LoRA, another encoder file): the prompt cache is keyed by the file's state too.
        return (file_state("text_encoders", text_encoder),
                file_state("loras", lora_name) if lora_name not in (NO_LORA, None) else None)

    @classmethod
    @notices.reported
    def execute(cls, text_encoder: str, prompt: str, negative_prompt: str = "", precision: str = "model dtype",
                max_tokens: str = "512", lora_name: str = NO_LORA, lora_strength: float = 1.0,
                speed: str = "fast") -> io.NodeOutput:
        check_widget(NODE, "speed", speed, SPEEDS)
        options = text_options(precision, max_tokens)
        if options.truncate:
            for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
                warn_if_cut(name, text, options.max_tokens)  # type: ignore[arg-type]
        if lora_strength != 0.0:
            lora = text_encoder_lora(lora_name)
        else:  # off: not loaded, but a wrong name is still a wrong graph (0.3.75 does not check it at queue time)
            lora = None
            if lora_name not in (NO_LORA, None, "") and host.full_path("loras", lora_name) is None:
                raise FileNotFoundError(f"{NODE}: lora_name '{lora_name}' was not found in models/loras.")
        device = host.text_encoder_device()
        dtype = encoder_dtype(device)
        # With a LoRA the embeddings depend on it: never read from (or written to) the prompt cache.
        prompts = cache.prompt_cache() if lora is None else None
        # A prompt seen before (also before a restart, with the disk cache) needs no encoder at all:
        # the cache is keyed by the file's name, size and time, so the file is not even opened.
        path = host.full_path("text_encoders", text_encoder)
        embeds = None
        if path is not None and prompts is not None:
            with notices.ignoring("klein_core.pipeline.tokenizer"):  # cut prompts were reported above, by input name
                embeds = kc.Engine(device=device, prompt_cache=prompts, text=options).cached_prompts(
                    [prompt], negative_prompt, identity=encoder_identity(path, dtype, device))
        if embeds is None:
            path = model_file(NODE, "text_encoder", "text_encoders", text_encoder, expect="text_encoder")
            ref: Any = cache.model_ref("text_encoder", path, text_encoder, device, dtype)
            if lora is not None:
                ref = LoRAModelRef(ref, [(lora, float(lora_strength))])
            engine = open_engine(NODE, {"text_encoder": ("text_encoder", ref)}, device=device, prompt_cache=prompts,
                                 text=options, speed=SPEEDS[speed])
            with notices.ignoring("klein_core.pipeline.tokenizer"):  # cut prompts were reported above, by input name
                try:
                    embeds = engine.encode_prompts([prompt], negative_prompt)
                except FloatingPointError as exc:
                    if isinstance(exc, kc.NonFiniteWeights) or dtype != torch.float16 or options.activations is not None:
                        raise  # (corrupt weights are said as such)
                    # The node chose fp16 (a GPU without bf16): the remedy is its own precision input.
                    raise FloatingPointError(f"{NODE}: the text encoder overflowed float16, the dtype it runs in on "
                                             "this GPU (it has no bf16); set precision to 'fp32 activations'.") from exc
        else:
            logger.info("%s: prompt embeddings from the cache; %s not loaded", NODE, text_encoder)
        text_dim = embeds.positive.shape[-1]
        return io.NodeOutput(KleinConditioning(embeds.positive, embeds.negative, text_encoder, text_dim,
                                               encoder_name(text_dim // 3),
                                               has_negative=bool(negative_prompt.strip())),
                             native_conditioning(embeds.positive, text_encoder),
                             native_conditioning(embeds.negative, text_encoder, written=bool(negative_prompt.strip())))


def text_encoder_lora(lora_name: str) -> kc.LoRA | None:
    """The LoRA named by the encoder's ``lora_name`` input (None for "none"); one without a
    text-encoder part is refused, naming the node that applies it."""
    if lora_name in (NO_LORA, None, ""):
        return None
    path = host.full_path("loras", lora_name)
    if path is None:
        raise FileNotFoundError(f"{NODE}: lora_name '{lora_name}' was not found in models/loras.")
    try:
        lora = kc.load_lora(path)
    except (ValueError, NotImplementedError) as exc:
        raise type(exc)(f"{NODE}: lora_name '{lora_name}': {exc}") from exc
    if "text_encoder" not in lora.targets:
        raise ValueError(f"{NODE}: lora_name '{lora_name}' has no text-encoder part (it adapts the transformer "
                         "only); apply it with Klein LoRA Loader and set lora_name here to none.")
    # Its transformer part is Klein LoRA Loader's: leave it out here rather than report it as not applied.
    return dataclasses.replace(lora, patches=[p for p in lora.patches if p.component == "text_encoder"])


def native_conditioning(embeds: torch.Tensor, text_encoder: str, *, written: bool | None = None) -> list:
    """ComfyUI's CONDITIONING ``[[cond [1, L, D], {"pooled_output": None}]]`` (FLUX.2 has no pooled
    output); ``klein_encoder`` names the file, so a mismatch found later can name it too, and for the
    negative output ``klein_written`` says whether a negative prompt was written (a distilled model,
    which ignores it, says so only then)."""
    options: dict = {"pooled_output": None, NATIVE_ENCODER_KEY: text_encoder}
    if written is not None:
        options[NATIVE_WRITTEN_KEY] = written
    return [[embeds, options]]


def text_options(precision: str, max_tokens: str) -> kc.TextOptions:
    """The widgets' values as klein_core TextOptions; unknown values are refused by input name."""
    check_widget(NODE, "precision", precision, PRECISIONS)
    check_widget(NODE, "max_tokens", max_tokens, MAX_TOKENS)
    cut, trim = MAX_TOKENS[max_tokens]
    return kc.TextOptions(max_tokens=cut, activations=PRECISIONS[precision], trim=trim)


def warn_if_cut(input_name: str, text: str, limit: int) -> None:
    """Warn (shown on the node) when ``text`` is longer than ``limit`` tokens after the chat template."""
    try:
        n = count_tokens(text)
    except ValueError as exc:  # not valid Unicode text: say which input
        raise ValueError(f"{NODE}: {input_name}: {exc}") from None
    if n > limit:
        logger.warning("%s: %s is %d tokens; only the first %d are used (%d cut from the end, as BFL and "
                       "diffusers do). Set max_tokens to 'whole prompt' to keep all of it.", NODE, input_name, n,
                       limit, n - limit)
