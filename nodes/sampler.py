"""Klein Sampler: text (+ references) -> FLUX.2 latents, with progress, previews and Cancel."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
from comfy_api.latest import io

import klein_core as kc
from klein_core import catalog
from klein_core.pipeline import BASE_DEFAULTS, DISTILLED_DEFAULTS
from klein_core.sampling import MAX_SEED
from klein_core.transformer import TEXT_ENCODER_FOR_WIDTH

from . import host
from .common import errors_named
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
MAX_SIDE = 4096  # widget limit; the pixel count is limited to 4 megapixels (e.g. 2048x2048)


def check_encoder_fits(model: KleinModel, cond: KleinConditioning) -> None:
    """Refuse, before any compute, embeddings whose width the transformer cannot take; name the fix."""
    want = model.config.context_dim
    if cond.text_dim == want:
        return
    files = {n: host.full_path("text_encoders", n) for n in host.filename_list("text_encoders")}
    names = {Path(p): n for n, p in files.items() if p}
    fits = sorted(names[p] for p in catalog.matching_text_encoders(want, list(names)))
    fix = (f"set text_encoder in {ENCODER_NODE} to {' or '.join(fits)}" if fits else
           f"put {TEXT_ENCODER_FOR_WIDTH.get(want, f'a Qwen3 encoder with hidden size {want // 3}')} into "
           f"models/text_encoders and select it in {ENCODER_NODE}")
    raise ValueError(f"{NODE}: the conditioning was encoded with {cond.encoder_name} ({cond.variant}, "
                     f"text width {cond.text_dim}), but the model {model.name} ({model.config.variant}) "
                     f"needs text width {want}: {fix}.")


def memory_plan(model: KleinModel, transformer: torch.nn.Module, device: torch.device, width: int, height: int,
                refs: tuple, batch: int, cfg: bool) -> kc.MemoryPlan:
    """The transformer's placement for this run (klein_core.planner), from the loader's memory mode."""
    request = kc.MemoryRequest(width, height, references=tuple((r.width, r.height) for r in refs), batch=batch,
                               cfg=cfg, encode_text=False, decode=False)
    # Off CUDA there is no memory to plan: a forced mode is honoured, "auto" keeps everything resident.
    free = None if device.type == "cuda" else 1 << 50
    return kc.plan_for(request, transformer, device=device, mode=model.memory, free_bytes=free)


def placed(plan: kc.MemoryPlan, transformer: torch.nn.Module, device: torch.device) -> contextlib.AbstractContextManager:
    """Context in which the transformer runs on ``device`` as planned (blocks streamed, or moved in)."""
    where = plan.placements.get("transformer", "resident")
    if where == "blocks":
        return kc.BlockOffloader(transformer, device, prefetch=plan.prefetch)
    if where == "staged" or any(p.device != device for p in transformer.parameters()):
        return kc.on_device(transformer, device)
    return contextlib.nullcontext()


def output_size(width: int, height: int, refs: tuple) -> tuple[int, int]:
    """0 = from the first reference, else 1024; multiples of 16, at least 64 px, at most 4 megapixels."""
    first = (refs[0].width, refs[0].height) if refs else None
    try:
        return kc.resolve_size(width or None, height or None, first)
    except ValueError as exc:
        raise ValueError(f"{NODE}: width/height: {exc} Set both to 0 to use the first reference's size "
                         f"(1024x1024 without references).") from exc


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
                KleinCondType.Input("conditioning", tooltip=(
                    "From Qwen3 Layer-Concat Encoder; the encoder must match the model (Qwen3-4B for 4B, "
                    "Qwen3-8B for 9B).")),
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
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="FLUX.2 latents [B, 128, H/16, W/16] "
                                                                     "(ComfyUI's Flux2 layout).")],
        )

    @classmethod
    def validate_inputs(cls, guidance: float = 0.0) -> bool | str:
        # ComfyUI's own min/max check lets NaN through (every comparison with NaN is False). Naming
        # only `guidance` here makes the host skip its default check for this input alone (a
        # **kwargs signature would disable it for every input), so the range is checked here too.
        if not isinstance(guidance, (int, float)) or not math.isfinite(guidance) or not 0 <= guidance <= 20:
            return f"{NODE}: guidance must be a finite number from 0 to 20, got {guidance!r}."
        return True

    @classmethod
    def execute(cls, model: KleinModel, conditioning: KleinConditioning, width: int = 0, height: int = 0,
                steps: int = 0, guidance: float = 0.0, seed: int = 0, batch_size: int = 1,
                references: KleinReferences | None = None) -> io.NodeOutput:
        check_encoder_fits(model, conditioning)
        refs = references.items if references is not None else ()
        w, h = output_size(width, height, refs)
        defaults = DISTILLED_DEFAULTS if model.kind == "distilled" else BASE_DEFAULTS
        steps, guidance = steps or defaults["steps"], guidance or defaults["guidance"]
        logger.info("%s: %s %dx%d, %d steps, guidance %.2f, seed %d, batch %d, %d reference(s)", NODE,
                    model.kind, w, h, steps, guidance, seed, batch_size, len(refs))
        with errors_named(NODE, "model", model.name):
            transformer = model.ref.get()
        device = host.torch_device()
        cfg = model.kind == "base" and guidance > 1
        plan = memory_plan(model, transformer, device, w, h, refs, batch_size, cfg)
        logger.info("%s: memory mode %s -> %s", NODE, model.memory, plan.reason)
        if not plan.fits:
            raise kc.KleinOutOfMemory(f"{NODE}: refused before running, this request does not fit the GPU "
                                      f"memory: {plan.reason}. Lower width/height, use fewer references or "
                                      "a smaller batch, or set memory_mode to blocks/minimum.")
        with placed(plan, transformer, device):
            result = kc.generate(
                transformer, prompt_embeds=conditioning.positive,
                negative_embeds=conditioning.negative if model.kind == "base" else None,
                reference_latents=[r.latent for r in refs], width=w, height=h, steps=steps, guidance=guidance,
                seed=seed, batch_size=batch_size, distilled=model.kind == "distilled",
                callback=StepReporter(steps, w, h), output="latent", cache=None,
            )
        return io.NodeOutput({"samples": result.latents.to(host.intermediate_device(), torch.float32)})
