"""Klein Sampler: text (+ references) -> FLUX.2 latents, with progress, previews and Cancel."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
from comfy_api.latest import io

import klein_core as kc
from klein_core.files.identify import matching_text_encoders
from klein_core.models.variants import TextWidthMismatch, encoder_name, variant_for_text_width
from klein_core.pipeline.inpaint import comfy_mask_to_latents, steps_to_run
from klein_core.pipeline.inputs import InitLatents, check_denoise_inputs, with_init_reference
from klein_core.pipeline.request import resolve
from klein_core.pipeline.sampling import MAX_SEED, make_noise

from . import cache, host, notices
from .common import check_widget, flux2_samples, open_engine
from .encode import NATIVE_ENCODER_KEY, NATIVE_WRITTEN_KEY
from .encode import NODE as ENCODER_NODE
from .preview import StepReporter
from .types import (
    KleinConditioning,
    KleinCondType,
    KleinModel,
    KleinModelType,
    KleinReferences,
    KleinRefsType,
)

logger = logging.getLogger(__name__)

NODE = "Klein Sampler"
REFERENCE_MODES = {"auto": None, "joint": "joint", "timestep zero": "timestep_zero", "kv": "kv"}
MAX_SIDE = 4096  # widget limit; the pixel count is limited to 4 megapixels (e.g. 2048x2048)
NATIVE_SOURCE = "CLIPTextEncode or another core encoder (not Qwen3 Layer-Concat Encoder)"
NATIVE_METHODS = (None, "index")  # reference_latents_method values the sampler runs (index = Klein's own)


def encoder_mismatch(model: KleinModel, cond: KleinConditioning, exc: TextWidthMismatch) -> TextWidthMismatch:
    """The engine's text-width refusal told in the node's terms: the files on both sides and which
    encoder to select."""
    want = model.config.context_dim
    files = {n: host.full_path("text_encoders", n) for n in host.filename_list("text_encoders")}
    names = {Path(p): n for n, p in files.items() if p}
    fits = sorted(names[p] for p in matching_text_encoders(want, list(names)))
    variant = variant_for_text_width(want)
    needed = f"{variant.encoder} ({variant.encoder_file})" if variant else f"a Qwen3 encoder with hidden size {want // 3}"
    fix = (f"set text_encoder in {ENCODER_NODE} to {' or '.join(fits)}" if fits else
           f"put {needed} into models/text_encoders and select it in {ENCODER_NODE}")
    if cond.encoder_name == NATIVE_SOURCE:
        fix += " and connect its positive output here (or give CLIPLoader type flux2 that file)"
    return exc.restated(fix=fix,
                        encoded_by=f"{NODE}: the conditioning was encoded with {cond.encoder_name} ({cond.variant})",
                        model=f"the model {model.name} ({model.config.variant})")


def _native_entry(value: object, input_name: str) -> tuple[torch.Tensor, dict]:
    """The one ``[cond [1, L, D], options]`` entry of a native CONDITIONING, refused by input name
    when it is not one."""
    ok = (isinstance(value, list) and len(value) == 1 and isinstance(value[0], (list, tuple)) and len(value[0]) == 2
          and isinstance(value[0][0], torch.Tensor) and value[0][0].ndim == 3 and isinstance(value[0][1], dict))
    if not ok:
        n = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{NODE}: {input_name} must be one CONDITIONING entry [1, tokens, width] (from "
                         f"{ENCODER_NODE} or CLIPTextEncode, through ReferenceLatent / ConditioningZeroOut), got "
                         f"{n} entries; combined or area conditioning is not supported.")
    if value[0][0].shape[0] != 1:  # several prompts in one entry: each would get batch_size images
        raise ValueError(f"{NODE}: {input_name} must be one CONDITIONING entry [1, tokens, width] (one prompt), "
                         f"got {list(value[0][0].shape)}; batch_size sets how many images, and each prompt "
                         "needs its own sampler.")
    return value[0][0], value[0][1]


# Options of a native CONDITIONING entry that ComfyUI's own samplers apply and the Klein Sampler
# cannot: (option, the node that sets it, whether the value leaves sampling as it is).
UNSUPPORTED_OPTIONS = (
    ("start_percent", "ConditioningSetTimestepRange", lambda v: v == 0.0),
    ("end_percent", "ConditioningSetTimestepRange", lambda v: v == 1.0),
    ("area", "ConditioningSetArea / ConditioningSetAreaPercentage", lambda v: False),
    ("mask", "ConditioningSetMask", lambda v: False),
    ("strength", "ConditioningSetAreaStrength / ConditioningSetMask", lambda v: v == 1.0),
    ("control", "a ControlNet node", lambda v: False),
    ("gligen", "GLIGENTextBoxApply", lambda v: False),
    ("hooks", "a hook node (Cond Set Props, Set CLIP Hooks...)", lambda v: False),
)


def check_options(options: dict, input_name: str) -> None:
    """Refuse a native CONDITIONING whose options would change sampling in ComfyUI's own samplers
    but which the Klein Sampler does not apply (it would otherwise ignore them without a word)."""
    for key, source, harmless in UNSUPPORTED_OPTIONS:
        if key not in options or options[key] is None:
            continue
        value = options[key]
        try:
            if harmless(value):
                continue
        except (TypeError, RuntimeError):  # a tensor or an odd value: it is set, so it would apply
            pass
        shown = value if isinstance(value, (int, float, str, tuple)) else type(value).__name__
        raise ValueError(f"{NODE}: {input_name} has '{key}' = {shown} (set by {source}), which the Klein Sampler "
                         f"does not apply; remove that node, or sample through Klein Model to MODEL with "
                         f"ComfyUI's own sampler nodes (SamplerCustomAdvanced, KSampler), which apply it.")


def native_references(options: dict, channels: int) -> list[torch.Tensor]:
    """A native CONDITIONING's ``reference_latents`` (ReferenceLatent nodes), checked to be FLUX.2
    latents the sampler runs with Klein's index method."""
    method = options.get("reference_latents_method")
    if method not in NATIVE_METHODS:
        raise ValueError(f"{NODE}: conditioning has reference_latents_method '{method}' (set by "
                         f"FluxKontextMultiReferenceLatentMethod); Klein runs references with the index method "
                         f"only: set it to index or remove that node.")
    refs = []
    for n, latent in enumerate(options.get("reference_latents") or [], start=1):
        if not isinstance(latent, torch.Tensor) or latent.ndim != 4 or latent.shape[:2] != (1, channels):
            shape = list(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ValueError(f"{NODE}: conditioning's reference latent {n} (from ReferenceLatent) must be one "
                             f"FLUX.2 latent [1, {channels}, h, w] (VAE Encode with the FLUX.2 VAE, or Flux2 VAE "
                             f"Encode, of one image), got {shape}.")
        refs.append(latent)
    return refs


def text_inputs(conditioning: KleinConditioning | list, negative: list | None,
                channels: int) -> tuple[KleinConditioning, bool, list[torch.Tensor]]:
    """The sampler's text inputs as (the pack's conditioning, whether it has a negative, the native
    reference latents). ``conditioning`` is KLEIN_COND or a native CONDITIONING; ``negative`` a native
    CONDITIONING that replaces the negative."""
    refs: list[torch.Tensor] = []
    if isinstance(conditioning, KleinConditioning):
        cond, has_negative = conditioning, True
    else:
        positive, options = _native_entry(conditioning, "conditioning")
        check_options(options, "conditioning")
        refs = native_references(options, channels)
        source = options.get(NATIVE_ENCODER_KEY) or NATIVE_SOURCE
        width = positive.shape[-1]
        cond = KleinConditioning(positive, positive, str(source), width,
                                 encoder_name(width // 3) if source != NATIVE_SOURCE else f"text width {width}")
        has_negative = False
    if negative is not None:
        neg, neg_options = _native_entry(negative, "negative")
        check_options(neg_options, "negative")
        if neg.shape[-1] != cond.text_dim:
            raise ValueError(f"{NODE}: negative (text width {neg.shape[-1]}) and conditioning (text width "
                             f"{cond.text_dim}) come from different encoders; encode both with the same "
                             f"{ENCODER_NODE} (its positive and negative outputs).")
        # A negative prompt was written (a distilled model says it ignores it): as our encoder marked
        # it; another encoder's, unless ConditioningZeroOut made it zeros
        written = bool(neg_options.get(NATIVE_WRITTEN_KEY, True)) and bool(neg.detach().abs().amax() > 0)
        cond, has_negative = dataclasses.replace(cond, negative=neg, has_negative=written), True
    return cond, has_negative, refs


def init_from_latent(latent: dict | None, mask: torch.Tensor | None, denoise: float, channels: int,
                     as_reference: bool) -> InitLatents | None:
    """The sampler's optional latent / mask / denoise / latent_as_reference inputs as klein_core
    InitLatents (None: from noise)."""
    if latent is None:
        if mask is not None:
            raise ValueError(f"{NODE}: mask needs latent: connect the image to inpaint through Flux2 VAE Encode "
                             f"to latent.")
        if denoise < 1:
            logger.warning("%s: denoise %.2f is used only with a latent input; sampling from noise", NODE, denoise)
        return None
    samples = flux2_samples(latent, channels, NODE, "latent", " (Flux2 VAE Encode)")
    # Set Latent Noise Mask puts the mask into the latent ([B, 1, H, W] or [B, H, W], 1 = repaint, the
    # same meaning as the mask input): ComfyUI's own samplers inpaint with it, so this one does too.
    noise_mask = latent.get("noise_mask")
    where = "mask"
    if noise_mask is not None:
        if mask is not None:
            logger.warning("%s: both the mask input and the latent's noise_mask (Set Latent Noise Mask) are "
                           "given; inpainting with the mask input", NODE)
        elif not isinstance(noise_mask, torch.Tensor) or noise_mask.ndim not in (2, 3, 4):
            raise ValueError(f"{NODE}: latent's noise_mask must be a MASK tensor (Set Latent Noise Mask), got "
                             f"{type(noise_mask).__name__}.")
        else:
            mask, where = noise_mask.reshape(-1, *noise_mask.shape[-2:]), "latent's noise_mask (Set Latent Noise Mask)"
    lat_mask = None
    if mask is not None:
        try:
            lat_mask = comfy_mask_to_latents(mask, samples.shape[-2], samples.shape[-1])
        except ValueError as exc:
            raise ValueError(f"{NODE}: {where}: {exc}.") from exc
    if not isinstance(denoise, (int, float)) or not math.isfinite(denoise) or not 0 < denoise <= 1:
        raise ValueError(f"{NODE}: denoise must be a number from 0.01 to 1, got {denoise!r}.")
    return InitLatents(samples.float(), float(denoise), lat_mask, as_reference=bool(as_reference))


def check_batches(init: InitLatents | None, batch_size: int) -> None:
    """Refuse, by input name and with the fix, a latent or mask batch that does not fit batch_size
    (one image for every output, or one for all); the engine's own check knows no node inputs."""
    if init is None:
        return
    b = init.latents.shape[0]
    if b == 0:  # an empty batch from upstream: no batch_size fits it (the widget's minimum is 1)
        raise ValueError(f"{NODE}: latent holds no image (an empty batch, {list(init.latents.shape)}); give a "
                         "latent of at least one image.")
    if init.mask is not None and init.mask.shape[0] == 0:
        raise ValueError(f"{NODE}: mask holds no mask (an empty batch); give one mask for all images, or none.")
    if b not in (1, batch_size):
        raise ValueError(f"{NODE}: latent holds {b} images but batch_size is {batch_size}: set batch_size to {b} "
                         f"(one output image from each), or give a latent of one image.")
    if init.mask is not None and init.mask.shape[0] not in (1, batch_size):
        raise ValueError(f"{NODE}: mask holds {init.mask.shape[0]} masks for {batch_size} output image(s): give "
                         f"one mask for all, or one per output image (batch_size {init.mask.shape[0]}).")


#: The largest ``batch_index`` followed (EmptyLatentImage's batch_size maximum): its noise is drawn for
#: every image up to it, as ComfyUI's RandomNoise does.
MAX_BATCH_INDEX = 4095


def batch_noise(latent: dict | None, seed: int, batch_size: int, grid: tuple[int, int]) -> torch.Tensor | None:
    """The starting noise ``[batch_size, 128, h, w]`` a latent's ``batch_index`` asks for (Latent From
    Batch, Repeat Latent Batch, Latent Batch set it), else None (the seed's noise for images
    0..batch_size-1). Image ``i`` gets the noise of image ``batch_index[i]`` of a batch drawn with
    ``seed``, as ComfyUI's RandomNoise and KSampler give it: an image taken out of a batch is sampled
    again with its own noise. One index for several images: they follow it (index, index + 1, ...)."""
    idx = latent.get("batch_index") if isinstance(latent, dict) else None
    if idx is None:
        return None
    if not isinstance(idx, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx) \
            or not idx or min(idx) < 0 or max(idx) > MAX_BATCH_INDEX:
        raise ValueError(f"{NODE}: latent's batch_index must be a list of image numbers from 0 to "
                         f"{MAX_BATCH_INDEX} (as Latent From Batch sets it), got {str(idx)[:80]}.")
    if len(idx) == batch_size:
        inds = list(idx)
    elif len(idx) == 1:
        inds = [idx[0] + k for k in range(batch_size)]
    else:
        raise ValueError(f"{NODE}: latent's batch_index numbers {len(idx)} images but {batch_size} are made.")
    if inds == list(range(batch_size)):
        return make_noise(seed, batch_size, 128, *grid)
    # drawn one image at a time, as ComfyUI's prepare_noise: the same values as one draw of the whole
    # batch, keeping only the images asked for
    g = torch.Generator(device="cpu").manual_seed(seed)
    wanted, kept = set(inds), {}
    for i in range(max(inds) + 1):
        one = torch.randn((1, 128, *grid), generator=g, dtype=torch.float32)
        if i in wanted:
            kept[i] = one
    return torch.cat([kept[i] for i in inds])


def settings(width: int, height: int, steps: int, guidance: float, seed: int, batch_size: int) -> kc.Settings:
    """The node's widgets as klein_core settings (0 = the model's default, or the first reference's size)."""
    return kc.Settings(width or None, height or None, steps or None, guidance or None, seed, batch_size)


def _guidance_problem(guidance: object) -> str | None:
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
            or not 0 <= guidance <= 20:
        return f"{NODE}: guidance must be a finite number from 0 to 20, got {guidance!r}."
    return None


class KleinSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinSampler",
            display_name=NODE,
            category="Klein/sampling",
            description="Generates FLUX.2 Klein latents (Euler flow sampler, BFL's schedule). Distilled "
                        "models run without CFG; base models use CFG with the negative prompt when "
                        "guidance > 1.",
            inputs=[
                KleinModelType.Input("model", tooltip="From Klein Model Loader."),
                io.MultiType.Input(KleinCondType.Input("conditioning", tooltip=(
                    "From Qwen3 Layer-Concat Encoder (its conditioning, or its positive CONDITIONING, also "
                    "through ReferenceLatent nodes, whose references follow the stacker's), or CLIPTextEncode "
                    "with the flux2 CLIP; the encoder must match the model (Qwen3-4B for 4B, Qwen3-8B for "
                    "9B).")), types=[io.Conditioning]),
                KleinRefsType.Input("references", optional=True,
                                    tooltip="Reference images to edit from or combine (Klein Reference "
                                            "Stacker)."),
                io.Int.Input("width", default=0, min=0, max=MAX_SIDE, step=16,
                             tooltip="Output width in pixels (multiple of 16). 0 = the first reference's "
                                     "width, or 1024 without references."),
                io.Int.Input("height", default=0, min=0, max=MAX_SIDE, step=16,
                             tooltip="Output height in pixels (multiple of 16). 0 = the first reference's "
                                     "height, or 1024 without references. At most 4 megapixels in total."),
                io.Int.Input("steps", default=0, min=0, max=1000,
                             tooltip="Sampling steps. 0 = model default: 4 (distilled) or 50 (base)."),
                io.Float.Input("guidance", default=0.0, min=0.0, max=20.0, step=0.1, round=0.01,
                               tooltip="CFG scale for base models (uses the negative prompt when > 1). 0 = "
                                       "model default: 4.0 (base); distilled models always run at 1.0."),
                io.Int.Input("seed", default=0, min=0, max=MAX_SEED, control_after_generate=True,
                             tooltip="Noise seed (drawn on the CPU like ComfyUI's RandomNoise, so a seed "
                                     "gives the same image on any device)."),
                io.Int.Input("batch_size", default=1, min=1, max=64,
                             tooltip="Images per run, with noise drawn together from the seed."),
                io.Latent.Input("latent", optional=True, tooltip=(
                    "Image-to-image / inpainting: the image to start from (Flux2 VAE Encode). The output "
                    "takes its size (leave width and height at 0).")),
                io.Mask.Input("mask", optional=True, tooltip=(
                    "Inpainting: white = repaint, black = keep (LoadImage's mask, the mask editor, Pad "
                    "Image for Outpainting, Klein Inpaint Crop). Needs latent.")),
                io.Float.Input("denoise", default=1.0, min=0.01, max=1.0, step=0.01, optional=True, tooltip=(
                    "With latent: how much of the schedule runs; steps - steps x denoise steps are skipped, "
                    "rounded down (diffusers' rule): at 4 steps 0.75 runs 3 and 0.5 runs 2, while anything "
                    "above 0.75 runs all 4 from noise, as 1 does. 1 = repaint fully (inpainting); 0.5-0.75 = "
                    "keep the composition (image-to-image). Ignored without latent.")),
                io.Boolean.Input("latent_as_reference", default=True, optional=True, tooltip=(
                    "With latent: the image also joins as the first reference, as Klein's inpainting "
                    "(diffusers) does; it keeps colours and details. Off = the image only seeds the noise.")),
                io.Combo.Input("reference_mode", options=list(REFERENCE_MODES), default="auto", optional=True,
                               tooltip=(
                    "How references take part. auto = kv for Klein 9B-KV models, else joint. joint = in the "
                    "sequence at the current timestep (BFL, diffusers). timestep zero = in the sequence, "
                    "modulated as at timestep 0 (ComfyUI's index_timestep_zero). kv = their keys/values "
                    "computed once per edit and reused by every step (and by the next run with the same "
                    "references).")),
                io.Conditioning.Input("negative", optional=True, tooltip=(
                    "A native CONDITIONING negative (the encoder's negative output, CLIPTextEncode, "
                    "ConditioningZeroOut) for CFG with base models; replaces the conditioning's own. Needed "
                    "for CFG when conditioning is a native CONDITIONING.")),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="FLUX.2 latents [B, 128, H/16, W/16] "
                                                                     "(ComfyUI's Flux2 layout).")],
        )

    @classmethod
    def validate_inputs(cls, guidance: float | None = 0.0) -> bool | str:
        # ComfyUI's own min/max check lets NaN through (every comparison with NaN is False). Naming
        # only `guidance` here makes the host skip its default check for this input alone (a
        # **kwargs signature would disable it for every input), so the range is checked here too.
        # A linked guidance (a primitive node's output) is None here: checked when the node runs.
        return True if guidance is None else _guidance_problem(guidance) or True

    @classmethod
    @notices.reported
    def execute(cls, model: KleinModel, conditioning: KleinConditioning | list, width: int = 0, height: int = 0,
                steps: int = 0, guidance: float = 0.0, seed: int = 0, batch_size: int = 1,
                references: KleinReferences | None = None, latent: dict | None = None,
                mask: torch.Tensor | None = None, denoise: float = 1.0,
                latent_as_reference: bool = True, reference_mode: str = "auto",
                negative: list | None = None) -> io.NodeOutput:
        check_widget(NODE, "reference_mode", reference_mode, REFERENCE_MODES)
        if (problem := _guidance_problem(guidance)) is not None:  # a linked value was not checked when queued
            raise ValueError(problem)
        conditioning, has_negative, native_refs = text_inputs(conditioning, negative, model.config.in_channels)
        refs = [r.latent for r in references.items] if references is not None else []
        refs += native_refs  # ReferenceLatent's references follow the stacker's
        init = init_from_latent(latent, mask, denoise, model.config.in_channels, latent_as_reference)
        if init is not None and (width or height):
            raise ValueError(f"{NODE}: width/height: the output takes the size of latent "
                             f"({init.latents.shape[-1] * 16}x{init.latents.shape[-2] * 16}); set both to 0.")
        size_from = init.latents if init is not None else (refs[0] if refs else None)
        source = None
        if size_from is not None:
            what = "latent" if init is not None else "reference 1"
            source = f"{what} ({size_from.shape[-1] * 16}x{size_from.shape[-2] * 16} px)"
        try:
            run = resolve(settings(width, height, steps, guidance, seed, batch_size), model.kind,
                          (size_from.shape[-1] * 16, size_from.shape[-2] * 16)
                          if size_from is not None else None, size_from=source, size_fixed=init is not None)
        except ValueError as exc:
            if width or height:
                raise ValueError(f"{NODE}: width/height: {exc} Set both to 0 to use the first reference's size "
                                 f"(1024x1024 without references).") from exc
            # Both 0: the size came from an image, which the message names with the fix.
            hint = (" (Flux2 VAE Encode's size 'fit 1 megapixel' scales the picture it encodes down)"
                    if init is not None and "too large" in str(exc) else "")
            raise ValueError(f"{NODE}: width/height: {exc}{hint}") from exc
        if run.cfg and not has_negative:
            raise ValueError(f"{NODE}: guidance {run.guidance:g} on a base model needs a negative: connect "
                             f"negative ({ENCODER_NODE}'s negative output, or CLIPTextEncode with an empty "
                             f"prompt), or use {ENCODER_NODE}'s conditioning output.")
        cond = kc.Conditioning(conditioning.positive, conditioning.negative if run.cfg else None)
        check_batches(init, run.batch_size)
        # before the model loads: a bad batch_index costs no load
        noise = batch_noise(latent, run.seed, run.batch_size, (run.height // 16, run.width // 16)) \
            if init is not None else None
        try:  # the engine's one check, before the model is loaded: a mismatch costs no load
            check_denoise_inputs(model.config, model.kind, cond, refs, run, init=init,
                                 negative_prompt=conditioning.has_negative)
        except TextWidthMismatch as exc:
            raise ValueError(str(encoder_mismatch(model, conditioning, exc))) from None  # as ComfyUI shows it
        except ValueError as exc:  # the engine's words, with the node in front (ComfyUI shows only the message)
            raise ValueError(f"{NODE}: {exc}.") from exc
        engine = open_engine(NODE, {"transformer": ("model", model.ref)}, kind=model.kind, device=host.torch_device(),
                             memory=model.memory, prompt_cache=None, ref_mode=REFERENCE_MODES[reference_mode],
                             kv_cache=cache.kv, speed=model.speed)
        logger.info("%s: %s %dx%d, %d steps, guidance %.2f, seed %d, batch %d, %d reference(s) (%s)", NODE,
                    model.kind, run.width, run.height, run.steps, run.guidance, run.seed, run.batch_size,
                    len(with_init_reference(refs, init)), engine.ref_mode)
        kv_hits = cache.kv.hits
        total = steps_to_run(run.steps, init.strength) if init is not None else run.steps
        latents, _ = engine.denoise(cond, refs, run, callback=StepReporter(total, host.torch_device()), init=init,
                                    noise=noise)
        if cache.kv.hits > kv_hits:
            logger.info("%s: reference keys/values reused from the previous run (reference pass skipped)", NODE)
        return io.NodeOutput({"samples": host.to_intermediate(latents, torch.float32)})
