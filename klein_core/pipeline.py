"""Text-to-image and multi-reference editing: the entry point shared by the nodes, CLI and scripts."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from .offload import StagePlacer
from .planner import MemoryPlan, MemoryRequest, plan_for
from .refs import PUBLISHED_REFERENCE_LIMIT, prepare_reference_image, reference_size
from .sampling import StepCallback, denoise, get_schedule, make_noise, reference_tokens
from .tokenizer import MAX_LENGTH, tokenize_prompts
from .transformer import TEXT_ENCODER_FOR_WIDTH, Flux2Transformer
from .vae_tiling import decode_tiled, encode_tiled

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 1024
MIN_SIDE = 64
MAX_PIXELS = 4 * 1024 * 1024  # 4 megapixels (BFL's published limit)
DISTILLED_DEFAULTS = {"steps": 4, "guidance": 1.0}
BASE_DEFAULTS = {"steps": 50, "guidance": 4.0}


def guess_model_kind(name: str) -> Literal["distilled", "base"]:
    """Pick sampler defaults from a file name ("...-base-..." -> base). Weights cannot tell."""
    return "base" if "base" in name.lower() else "distilled"


def check_compatible(transformer: Flux2Transformer, text_encoder: Any | None = None, vae: Any | None = None) -> None:
    """Raise ValueError, before any compute, if the components do not belong together."""
    tc = transformer.config
    if text_encoder is not None and text_encoder.config.text_dim != tc.context_dim:
        want = TEXT_ENCODER_FOR_WIDTH.get(tc.context_dim, f"an encoder with text width {tc.context_dim}")
        raise ValueError(
            f"The text encoder ({text_encoder.config.variant}, text width {text_encoder.config.text_dim}) does "
            f"not fit the {tc.variant} transformer (text width {tc.context_dim}): use {want}."
        )
    if vae is not None and vae.config.latent_channels != tc.in_channels:
        raise ValueError(
            f"The VAE ({vae.config.variant}, {vae.config.latent_channels} latent channels) does not fit the "
            f"{tc.variant} transformer ({tc.in_channels} channels): use the FLUX.2 VAE (flux2-vae.safetensors)."
        )


# ---------------------------------------------------------------------------------------------
# Prompt-embedding cache


class PromptCache:
    """Bounded LRU of prompt embeddings per (encoder, prompt, max_length).

    Entries hold a weak reference to their encoder, so a freed or reloaded encoder never serves
    stale embeddings. Bounded by entry count and by bytes.
    """

    def __init__(self, max_entries: int = 32, max_bytes: int = 1 << 30) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def _lookup(self, encoder: Any, prompt: str, max_length: int) -> torch.Tensor | None:
        key = (id(encoder), prompt, max_length)
        hit = self._data.get(key)
        if hit is None or hit[0]() is not encoder:
            return None
        self._data.move_to_end(key)
        return hit[1]

    def _store(self, encoder: Any, prompt: str, max_length: int, emb: torch.Tensor) -> None:
        self._data[(id(encoder), prompt, max_length)] = (weakref.ref(encoder), emb)
        total = sum(t.numel() * t.element_size() for _, t in self._data.values())
        while self._data and (len(self._data) > self.max_entries or total > self.max_bytes):
            _, (_, old) = self._data.popitem(last=False)
            total -= old.numel() * old.element_size()

    def encode(self, encoder: Any, prompts: Sequence[str], max_length: int = MAX_LENGTH) -> torch.Tensor:
        """Embeddings ``[len(prompts), max_length, text_dim]``; only unseen prompts are encoded."""
        with self._lock:
            found = {p: self._lookup(encoder, p, max_length) for p in prompts}
        todo = [p for p, e in found.items() if e is None]
        self.hits += len(prompts) - len([p for p in prompts if found[p] is None])
        if todo:
            self.misses += len(todo)
            ids, mask = tokenize_prompts(todo, max_length=max_length)
            embs = encoder.encode(ids, mask)
            with self._lock:
                for p, e in zip(todo, embs):
                    found[p] = e[None]
                    self._store(encoder, p, max_length, e[None])
        return torch.cat([found[p] for p in prompts])  # type: ignore[misc]


default_prompt_cache = PromptCache()


def encode_prompts(
    text_encoder: Any, prompts: Sequence[str], *, cache: PromptCache | None = default_prompt_cache,
    max_length: int = MAX_LENGTH,
) -> torch.Tensor:
    """Tokenize and encode prompts: ``[len(prompts), max_length, text_dim]``, cached by default."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings; wrap a single prompt as [prompt]")
    if cache is None:
        ids, mask = tokenize_prompts(list(prompts), max_length=max_length)
        return text_encoder.encode(ids, mask)
    return cache.encode(text_encoder, list(prompts), max_length)


# ---------------------------------------------------------------------------------------------
# Sizes


def resolve_size(
    width: int | None, height: int | None, first_reference: tuple[int, int] | None, multiple: int = 16
) -> tuple[int, int]:
    """Output (width, height): given values, else the first reference's size, else 1024x1024.

    Values that are not multiples of ``multiple`` are rounded down with a warning; sizes under
    64 px a side or above 4 megapixels are refused.
    """
    default_w, default_h = first_reference or (DEFAULT_SIZE, DEFAULT_SIZE)
    w = default_w if width is None else width
    h = default_h if height is None else height
    for name, v in (("width", w), ("height", h)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an integer number of pixels, got {v!r}")
    rw, rh = w // multiple * multiple, h // multiple * multiple
    if (rw, rh) != (w, h):
        logger.warning("Size %dx%d is not a multiple of %d; using %dx%d", w, h, multiple, rw, rh)
    if rw < MIN_SIDE or rh < MIN_SIDE:
        raise ValueError(f"Output size {w}x{h} is too small: both sides must be at least {MIN_SIDE} px.")
    if rw * rh > MAX_PIXELS:
        raise ValueError(
            f"Output size {w}x{h} is {rw * rh / 1e6:.1f} megapixels; FLUX.2 Klein supports at most 4 "
            f"megapixels (e.g. 2048x2048)."
        )
    return rw, rh


# ---------------------------------------------------------------------------------------------
# Entry point


@dataclass
class GenerationResult:
    """What :func:`generate` returns. ``latents`` are normalised ``[B, 128, H/16, W/16]``."""

    latents: torch.Tensor
    images: list[Image.Image] | None
    pixels: torch.Tensor | None  # [B, 3, H, W] in [0, 1] (float32, CPU) when decoded
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    reference_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) in pixels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_pil(pixels: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` in [0, 1] -> PIL images (rounded to 8 bits like diffusers)."""
    arr = (pixels.permute(0, 2, 3, 1).float().cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


def encode_references(
    vae: Any, images: Sequence[Image.Image | torch.Tensor], *, tile: int | None = None
) -> list[torch.Tensor]:
    """VAE-encode each reference once: a list of normalised latents ``[1, 128, h, w]``.

    PIL images are preprocessed with :func:`prepare_reference_image`; tensors must already be
    ``[1, 3, H, W]`` in [-1, 1] with H and W multiples of 16.
    """
    out = []
    for i, img in enumerate(images):
        px = prepare_reference_image(img, vae.config.downscale) if isinstance(img, Image.Image) else img
        if not isinstance(px, torch.Tensor) or px.ndim != 4 or px.shape[0] != 1:
            raise ValueError(f"reference {i + 1}: expected a PIL image or a [1, 3, H, W] tensor")
        # tile: latent positions per tile side (the plan's vae_tile); pixels are 16x that
        out.append(encode_tiled(vae, px, tile=16 * tile, overlap=4 * tile) if tile else vae.encode(px))
    return out


def generate(
    transformer: Flux2Transformer,
    text_encoder: Any | None = None,
    vae: Any | None = None,
    *,
    prompt: str | Sequence[str] = "",
    negative_prompt: str = "",
    prompt_embeds: torch.Tensor | None = None,
    negative_embeds: torch.Tensor | None = None,
    references: Sequence[Image.Image | torch.Tensor] = (),
    reference_latents: Sequence[torch.Tensor] = (),
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    batch_size: int = 1,
    distilled: bool = True,
    noise: torch.Tensor | None = None,
    callback: StepCallback | None = None,
    output: Literal["pil", "latent"] = "pil",
    cache: PromptCache | None = default_prompt_cache,
    memory: str | MemoryPlan | None = None,
    device: torch.device | str | None = None,
) -> GenerationResult:
    """Generate images with FLUX.2 Klein.

    Args:
        transformer, text_encoder, vae: loaded components (``load_transformer`` etc.). The text
            encoder is optional when ``prompt_embeds`` are given; the VAE is needed to encode
            ``references`` and to decode unless ``output="latent"``.
        prompt: one prompt or a list; each gets ``batch_size`` images (seeds drawn together).
        negative_prompt: used only by base models with ``guidance > 1`` (classifier-free guidance).
        prompt_embeds / negative_embeds: ``[P, L, text_dim]`` embeddings instead of prompts.
        references: PIL images (or prepared ``[1, 3, H, W]`` tensors) to edit from / combine.
        reference_latents: already encoded references ``[1, 128, h, w]`` (encoded once, reused).
        width, height: output size in pixels; default from the first reference, else 1024.
        steps, guidance: default 4 / 1.0 (distilled) or 50 / 4.0 (base).
        seed: 0..2^64-1; noise is drawn on the CPU in float32 like ComfyUI's RandomNoise.
        distilled: the caller's choice of model kind (weights cannot tell; see ``guess_model_kind``).
        noise: explicit starting latents ``[B, 128, H/16, W/16]`` instead of seeded noise.
        callback: ``callback(step, total, latents)`` after each step; return False to cancel
            (raises :class:`GenerationCancelled`); exceptions it raises propagate.
        output: "pil" decodes to images; "latent" returns latents only.
        memory: None runs every component where it is. "auto" plans placement for the free memory
            of ``device`` (:mod:`klein_core.planner`); "resident", "swap", "blocks" or "minimum"
            force one; a :class:`MemoryPlan` is used as given. Offloaded components should be
            loaded on the CPU (``offload.pin_memory_`` makes their copies fast).
        device: the compute device when ``memory`` is set (default: CUDA when available).
    Returns:
        :class:`GenerationResult` with latents, images/pixels (if decoded) and per-stage timings.
    """
    timings: dict[str, float] = {}
    check_compatible(transformer, text_encoder, vae)
    defaults = DISTILLED_DEFAULTS if distilled else BASE_DEFAULTS
    steps = defaults["steps"] if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    guidance = float(defaults["guidance"] if guidance is None else guidance)
    if not math.isfinite(guidance) or guidance < 0:
        raise ValueError(f"guidance must be a finite number >= 0, got {guidance}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    use_cfg = not distilled and guidance > 1.0
    if distilled and guidance != 1.0:
        logger.warning("guidance %.2f is ignored: distilled Klein models run without CFG", guidance)
    if distilled and (negative_prompt or negative_embeds is not None):
        logger.warning("the negative prompt is ignored: distilled Klein models run without CFG")
    plan: MemoryPlan | None = None
    placer: StagePlacer | None = None
    if memory is None:
        device = transformer.device
    else:
        default = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device if device is not None else default)
        if isinstance(memory, MemoryPlan):
            plan = memory
        else:
            n_prompts = len(prompt) if not isinstance(prompt, str) else 1
            n_images = n_prompts if prompt_embeds is None else prompt_embeds.shape[0]
            request = _memory_request(
                vae, references, reference_latents, width, height, noise,
                batch=n_images * batch_size, cfg=use_cfg, encode_text=prompt_embeds is None,
                decode=output != "latent",
            )
            plan = plan_for(request, transformer, text_encoder, vae, device=device, mode=memory)
        if not plan.fits:
            raise KleinOutOfMemory(f"This request does not fit the GPU memory, refused before running: {plan.reason}.")
        components = {"transformer": transformer, "text_encoder": text_encoder, "vae": vae}
        placer = StagePlacer(device, {k: m for k, m in components.items() if m is not None},
                             dict(plan.placements), prefetch=plan.prefetch)

    def stage(name: str, module: Any) -> contextlib.AbstractContextManager:
        if placer is None or module is None:
            return contextlib.nullcontext(module)
        return placer.stage(name)

    vae_tile = plan.vae_tile if plan is not None else None

    # 1. Text
    t0 = time.perf_counter()
    if prompt_embeds is None:
        if text_encoder is None:
            raise ValueError("pass a text_encoder, or prompt_embeds")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("prompt list is empty")
        with stage("text_encoder", text_encoder) as te:
            prompt_embeds = encode_prompts(te, prompts, cache=cache)
    if use_cfg and negative_embeds is None:
        if text_encoder is None:
            raise ValueError("CFG needs a text_encoder for the negative prompt, or negative_embeds")
        with stage("text_encoder", text_encoder) as te:
            negative_embeds = encode_prompts(te, [negative_prompt], cache=cache)
    n_prompts = prompt_embeds.shape[0]
    txt = prompt_embeds.repeat_interleave(batch_size, dim=0)
    neg = None
    if use_cfg:
        assert negative_embeds is not None
        neg = negative_embeds.expand(n_prompts, -1, -1) if negative_embeds.shape[0] == 1 else negative_embeds
        neg = neg.repeat_interleave(batch_size, dim=0)
    _sync(device)
    timings["text"] = time.perf_counter() - t0

    # 2. References (each VAE-encoded once for the whole run)
    t0 = time.perf_counter()
    ref_lat = list(reference_latents)
    if references:
        if vae is None:
            raise ValueError("references need a vae to encode them")
        with stage("vae", vae) as v:
            ref_lat += encode_references(v, references, tile=vae_tile)
    if len(ref_lat) > PUBLISHED_REFERENCE_LIMIT:
        logger.warning("%d references: Klein is published for at most %d", len(ref_lat), PUBLISHED_REFERENCE_LIMIT)
    down = vae.config.downscale if vae is not None else 16
    ref_sizes = [(lat.shape[-1] * down, lat.shape[-2] * down) for lat in ref_lat]
    refs = reference_tokens(ref_lat)
    _sync(device)
    timings["references"] = time.perf_counter() - t0

    # 3. Size, noise, schedule
    if noise is not None:
        if noise.ndim != 4 or noise.shape[1] != transformer.config.in_channels:
            raise ValueError(f"noise must be [B, {transformer.config.in_channels}, h, w], got {list(noise.shape)}")
        w_px, h_px = noise.shape[-1] * down, noise.shape[-2] * down
        if noise.shape[0] != txt.shape[0]:
            raise ValueError(f"noise batch {noise.shape[0]} != prompts x batch_size = {txt.shape[0]}")
    else:
        w_px, h_px = resolve_size(width, height, ref_sizes[0] if ref_sizes else None, down)
        noise = make_noise(seed, txt.shape[0], transformer.config.in_channels, h_px // down, w_px // down)
    sigmas = get_schedule(steps, noise.shape[-1] * noise.shape[-2])

    # 4. Denoise
    t0 = time.perf_counter()
    with _explain_oom("denoising", device, w_px, h_px, txt.shape[0] * (2 if use_cfg else 1), len(ref_lat)):
        with stage("transformer", transformer) as tr:
            latents = denoise(tr, noise, txt, sigmas, neg_txt=neg, guidance=guidance, refs=refs,
                              callback=callback)
    _sync(device)
    timings["denoise"] = time.perf_counter() - t0
    _check_finite(latents, transformer)
    result = GenerationResult(latents, None, None, w_px, h_px, steps, guidance, seed, timings, ref_sizes)
    if output == "latent":
        return result
    if vae is None:
        raise ValueError("decoding needs a vae (or pass output='latent')")

    # 5. Decode
    t0 = time.perf_counter()
    with _explain_oom("VAE decoding", device, w_px, h_px, latents.shape[0], len(ref_lat)):
        with stage("vae", vae) as v:
            result.pixels = decode_to_pixels(v, latents, tile=vae_tile)
    result.images = to_pil(result.pixels)
    timings["decode"] = time.perf_counter() - t0
    return result


class KleinOutOfMemory(RuntimeError):
    """The GPU ran out of memory; the message says which setting to lower. Memory was freed."""


@contextlib.contextmanager
def _explain_oom(stage: str, device: torch.device, w: int, h: int, batch: int, n_refs: int):
    try:
        yield
    except torch.OutOfMemoryError as exc:
        # Drop the traceback's frames (they pin activations) before emptying the cache.
        del exc
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hints = [f"a lower resolution than {w}x{h}"]
        if batch > 1:
            hints.append(f"a smaller batch (now {batch} images per step including CFG)")
        if n_refs:
            hints.append(f"fewer or smaller references (now {n_refs})")
        hints.append("a lower-memory mode (offload the text encoder or transformer blocks, tiled VAE)")
        raise KleinOutOfMemory(
            f"Out of GPU memory while {stage}; the memory was released. Try " + ", or ".join(hints) + "."
        ) from None


def _check_finite(latents: torch.Tensor, transformer: Flux2Transformer) -> None:
    # One reduction after the loop (not per step, which would sync the host every step).
    if not bool(torch.isfinite(latents).all()):
        dtype = transformer.dtype
        cause = ("fp16 overflow: load the transformer in bf16 or fp32" if dtype == torch.float16
                 else "corrupt or mismatched weights, or an extreme guidance value")
        raise FloatingPointError(f"The sampler produced NaN/Inf latents (transformer in {dtype}); likely cause: {cause}.")


def decode_to_pixels(vae: Any, latents: torch.Tensor, *, tile: int | None = None) -> torch.Tensor:
    """Decode normalised latents ``[B, 128, h, w]`` to pixels ``[B, 3, 16h, 16w]`` in [0, 1] (CPU fp32).

    ``tile``: decode in overlapping tiles of this many latent positions (see ``vae_tiling``).
    """
    px = decode_tiled(vae, latents, tile=tile, overlap=tile // 4) if tile else vae.decode(latents)
    return (px.float() / 2 + 0.5).clamp(0, 1).cpu()


def _memory_request(
    vae: Any, references: Sequence[Image.Image | torch.Tensor],
    reference_latents: Sequence[torch.Tensor], width: int | None, height: int | None, noise: torch.Tensor | None,
    *, batch: int, cfg: bool, encode_text: bool, decode: bool,
) -> MemoryRequest:
    """What the planner needs to know, worked out before anything runs (sizes as generate resolves them)."""
    down = vae.config.downscale if vae is not None else 16
    refs = [(lat.shape[-1] * down, lat.shape[-2] * down) for lat in reference_latents]
    for img in references:
        if isinstance(img, Image.Image):
            refs.append(reference_size(img.width, img.height, down))
        else:
            refs.append((img.shape[-1], img.shape[-2]))
    if noise is not None:
        w, h = noise.shape[-1] * down, noise.shape[-2] * down
    else:
        w, h = resolve_size(width, height, refs[0] if refs else None, down)
    return MemoryRequest(w, h, references=tuple(refs), batch=batch, cfg=cfg, encode_text=encode_text, decode=decode)
