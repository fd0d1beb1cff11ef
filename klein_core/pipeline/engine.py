"""The engine: loaded components, their memory plan, the prompt cache, and one method per stage.

Stages: :meth:`Engine.encode_prompts` (prompts -> :class:`Conditioning`), :meth:`Engine.encode_references`
(images -> latents, each once), :meth:`Engine.denoise` (noise -> latents, :mod:`klein_core.pipeline.sampling`)
and :meth:`Engine.decode` (latents -> pixels). :meth:`Engine.generate` runs them for one
:class:`~klein_core.pipeline.request.GenerationRequest` under one memory plan; :func:`generate` is the
keyword front. The engine alone places components (:class:`~klein_core.memory.placement.StagePlacer`).

:meth:`Engine.generate` makes the host wait for the device once, when the images come to the host:
its finiteness checks wait in a :class:`~klein_core.checks.Checks` until then, and its stage
timings are CUDA events. Each wait between stages used to leave the GPU idle while the host
prepared the next stage. A stage method called alone checks at once, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from ..accel.speed import apply_speed, check_speed
from ..accel.text_graph import graphed_forward
from ..checks import Checks
from ..errors import KleinOutOfMemory
from ..memory import tiling
from ..memory.placement import StagePlacer
from ..memory.planner import MODES, MakeRoom, MemoryPlan, MemoryRequest, check_vae_tile, plan_for
from ..memory.tiling import TILE_SIDES
from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..models.vae import Flux2VAE
from ..transfer import HostCopies, to_device
from .images import PUBLISHED_REFERENCE_LIMIT, _to_rgb_array, pil_images, queue_to_host
from .inpaint import InitImage, InpaintInputs, prepare_inpaint, resize_mask_to_latents, steps_to_run, stitch
from .inputs import InitLatents, check_compatible, check_denoise_inputs, with_init_reference
from .oom import explain_oom, is_out_of_memory, release_failed_attempt
from .prompts import (
    DiskPromptCache,
    PromptCache,
    TextOptions,
    default_prompt_cache,
    encode_prompts,
    loaded_encoder_identity,
    warn_cuts,
)
from .reference_kv import ReferenceKVCache, default_kv_cache, weights_state
from .request import (
    MODEL_KINDS,
    Conditioning,
    GenerationRequest,
    ModelKind,
    Resolved,
    Settings,
    as_device,
    as_list,
    as_prompts,
    as_reference,
    check_tensor,
    guess_model_kind,
    reference_mode,
    resolve,
)
from .sampling import StepCallback, denoise, get_schedule, make_noise, reference_tokens
from .vae_io import (
    PIXEL_BOUND,
    PIXEL_HINT,
    decode_to_pixels,
    encode_references,
    overflow_cause,
    reference_pixel_sizes,
    size_source,
    text_overflow_cause,
)

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """What a generation returns. ``latents`` are normalised ``[B, 128, H/16, W/16]``."""

    latents: torch.Tensor
    images: list[Image.Image] | None
    # [B, 3, H, W] in [0, 1] (float32, CPU) when decoded; an inpaint stitched back into its picture: that
    # of the returned images (their 8-bit levels, at the original size)
    pixels: torch.Tensor | None
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    reference_sizes: list[tuple[int, int]] = field(default_factory=list)  # (width, height) in pixels
    # Per decoded image, the tile side (latent positions) its decode ran in, or None if it was decoded
    # whole (a latent no larger than one tile is decoded whole). Tiling is not exact: see Engine's vae_tile.
    decode_tiles: list[int | None] = field(default_factory=list)


def _on_grid(sizes: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sizes rounded up to the planner's 16-pixel grid (test VAEs with fewer levels give other
    multiples; the estimate only needs the token counts)."""
    return tuple((max(16, -(-w // 16) * 16), max(16, -(-h // 16) * 16)) for w, h in sizes)


def memory_request(width: int, height: int, references: Sequence[tuple[int, int]] = (),
                   encoded: Sequence[tuple[int, int]] = (), **kw: Any) -> MemoryRequest:
    """A :class:`MemoryRequest` with every size on the planner's 16-pixel grid."""
    (width, height), *sizes = _on_grid([(width, height), *references, *encoded])
    refs, more = sizes[:len(references)], sizes[len(references):]
    return MemoryRequest(width, height, references=tuple(refs), encoded=tuple(more), **kw)


def _check_callback(callback: object) -> None:
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be a function (step, total, latents) or None, got {type(callback).__name__}")


class Engine:
    """Loaded Klein components and what runs them: the one seam between the nodes, the CLI and the
    stages. Each stage method plans memory once per call (or takes the ``plan`` of a caller that
    runs several stages); :meth:`generate` plans once for all four.

    Args:
        transformer, text_encoder, vae: loaded components; any may be absent, and a stage that
            needs a missing one says so.
        kind: ``"distilled"`` (4 steps, no CFG), ``"base"`` (50 steps, CFG 4) or ``"kv"`` (Klein
            9B-KV: distilled, references in KV mode); None: from the transformer's file or folder
            (:func:`~klein_core.pipeline.request.guess_model_kind`), else distilled. Weights cannot tell.
        device: the compute device (default: where the transformer, else the first component, is).
        memory: ``"auto"`` plans placement for the free memory of ``device`` per call (all
            resident off CUDA); ``"resident"``, ``"swap"``, ``"blocks"`` or ``"minimum"`` force
            one; a :class:`~klein_core.memory.planner.MemoryPlan` is used as given. Components
            meant to be offloaded should be loaded on the CPU (pinned: ``pin_memory_``).
        vae_tile: ``"auto"`` (default) lets the plan encode and decode in tiles where memory is short;
            None never tiles (weights move, or the request is refused, first); a side of
            :data:`~klein_core.memory.tiling.TILE_SIDES` (latent positions) always tiles. Tiling is not
            exact, so a pinned tile gives the same pixels on any GPU; the tiles that ran are in
            :attr:`GenerationResult.decode_tiles`. Ignored when ``memory`` is a ``MemoryPlan``.
        prompt_cache: a :class:`~klein_core.pipeline.prompts.PromptCache` (None: no caching).
        text: how prompts are encoded (:class:`~klein_core.pipeline.prompts.TextOptions`).
        ref_mode: how references take part (``klein_core.pipeline.sampling.REFERENCE_MODES``): "joint"
            (Klein 4B/9B), "timestep_zero" (ComfyUI's index_timestep_zero) or "kv" (Klein 9B-KV:
            reference keys/values computed once); None: "kv" for kind "kv", else "joint".
        kv_cache: where KV-mode reference keys/values are kept across runs
            (:class:`~klein_core.pipeline.reference_kv.ReferenceKVCache`; None: computed anew every run).
        speed: put the transformer, the VAE and the text encoder on one of
            :data:`klein_core.accel.SPEEDS` ("fast", "compile", "plain") before anything runs; None
            (default) leaves them as they are.
        make_room: the host's hook ``make_room(nbytes, device)``, called once per plan before the free
            memory is measured (:func:`~klein_core.memory.planner.plan_for`), so the host can unload
            its own models; ComfyUI's nodes pass one.
        check_cancel: called before each image a VAE stage encodes or decodes; raises to stop (the
            denoising steps report through their ``callback``).
    """

    def __init__(
        self,
        transformer: Flux2Transformer | None = None,
        text_encoder: Qwen3TextEncoder | None = None,
        vae: Flux2VAE | None = None,
        *,
        kind: ModelKind | None = None,
        device: torch.device | str | None = None,
        memory: str | MemoryPlan | None = "auto",
        vae_tile: int | str | None = "auto",
        prompt_cache: PromptCache | None = default_prompt_cache,
        text: TextOptions = TextOptions(),
        ref_mode: str | None = None,
        kv_cache: ReferenceKVCache | None = default_kv_cache,
        speed: str | None = None,
        make_room: MakeRoom | None = None,
        check_cancel: Callable[[], object] | None = None,
    ) -> None:
        memory = "auto" if memory is None else memory
        if speed is not None:
            check_speed(speed)
        if not isinstance(memory, MemoryPlan) and memory not in MODES:
            raise ValueError(f"memory must be one of {MODES} or a MemoryPlan, got {memory!r}")
        vae_tile = check_vae_tile(vae_tile)
        if kind is not None and kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {MODEL_KINDS} or None, got {kind!r}")
        check_compatible(transformer, text_encoder, vae)
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.vae = vae
        self.kind: ModelKind = kind or guess_model_kind(getattr(transformer, "source", ""))
        device = as_device(device)
        if device is None:
            first = next((m for m in (transformer, text_encoder, vae) if m is not None), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device
        # Pixels per latent position (16 for the FLUX.2 VAE; tiny test VAEs may have fewer levels).
        self.downscale = vae.config.downscale if vae is not None else 16
        self.memory = memory
        self.vae_tile = vae_tile
        if isinstance(prompt_cache, DiskPromptCache):  # a disk cache alone: kept behind an in-memory one
            prompt_cache = PromptCache(disk=prompt_cache)
        if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
            raise TypeError(f"prompt_cache (cache= of generate) must be a PromptCache, a DiskPromptCache or None, got "
                            f"{type(prompt_cache).__name__}")
        self.prompt_cache = prompt_cache
        if not isinstance(text, TextOptions):
            raise TypeError(f"text must be a TextOptions, got {type(text).__name__}")
        self.text = text
        self.ref_mode = reference_mode(self.kind, ref_mode)  # the explicit mode wins; else from the kind
        if kv_cache is not None and not isinstance(kv_cache, ReferenceKVCache):
            raise TypeError(f"kv_cache must be a ReferenceKVCache or None, got {type(kv_cache).__name__}")
        for name, hook in (("make_room", make_room), ("check_cancel", check_cancel)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be a function or None, got {type(hook).__name__}")
        self.kv_cache = kv_cache
        self.make_room = make_room
        self.check_cancel = check_cancel
        self._local = threading.local()  # per thread: the components its enclosing stages placed (_stage)
        if speed is not None:  # after every check: bad arguments leave the models untouched
            apply_speed(transformer, vae, speed, text_encoder)

    # -- memory ---------------------------------------------------------------------------------

    def plan(self, request: MemoryRequest) -> MemoryPlan:
        """The placement for ``request`` (refusing, before anything runs, one that cannot fit)."""
        if isinstance(self.memory, MemoryPlan):
            plan = self.memory
        else:
            plan = plan_for(request, self.transformer, self.text_encoder, self.vae, device=self.device,
                            mode=self.memory, make_room=self.make_room, vae_tile=self.vae_tile)
            reason = plan.reason if plan.reason.startswith(plan.name) else f"{plan.name} ({plan.reason})"
            logger.info("memory mode %s -> %s", self.memory, reason)
        if not plan.fits:
            raise KleinOutOfMemory(f"This request does not fit the GPU memory, refused before running: {plan.reason}.")
        return plan

    @property
    def _placed(self) -> dict[str, Any]:
        """The components this thread's enclosing stages placed (another thread's are not its own)."""
        placed = getattr(self._local, "placed", None)
        if placed is None:
            placed = self._local.placed = {}
        return placed

    @contextlib.contextmanager
    def _stage(self, component: str, plan: MemoryPlan) -> Iterator[Any]:
        if component in self._placed:  # inside a stage that placed it already (one VAE copy for two steps)
            yield self._placed[component]
            return
        module = getattr(self, component)
        if module is None:
            raise ValueError(f"this stage needs a {component.replace('_', ' ')}; none was given")
        placer = StagePlacer(self.device, {component: module}, dict(plan.placements), prefetch=plan.prefetch)
        with _stage_lock(module):  # where the model is can be asked only once no other stage has it placed
            graphs = graphed_forward(module)
            # A text encoder copied in (or streamed) for this stage only runs without its CUDA graphs:
            # the plan does not count their memory, and its weights leave again after the stage.
            staged = graphs is not None and not placer.in_place(component)
            suspend = graphs.suspended() if staged else contextlib.nullcontext()  # type: ignore[union-attr]
            with suspend, placer.stage(component) as placed:
                self._placed[component] = placed
                try:
                    yield placed
                finally:
                    del self._placed[component]

    def _text_bytes(self) -> dict[str, int]:
        """The planner's ``text_activation_bytes`` when the text encoder computes in a dtype of its own
        (ComfyUI's float32: :data:`~klein_core.pipeline.prompts.COMFYUI_TEXT`)."""
        dtype = self.text.activations
        return {} if dtype is None else {"text_activation_bytes": dtype.itemsize}

    def _next_image(self) -> None:
        if self.check_cancel is not None:
            self.check_cancel()

    # -- stages ---------------------------------------------------------------------------------

    def _text_groups(self, prompts: Sequence[str], negative_prompt: str | None) -> tuple[list[list[str]], int]:
        """The batches the texts are encoded in, and how many positive prompts there are."""
        prompts = list(as_prompts(prompts))
        if not prompts:
            raise ValueError("prompt list is empty")
        if negative_prompt is not None and not isinstance(negative_prompt, str):
            raise TypeError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
        # Cut at 512 without trimming: one batch for both, every text 512 long. Whole prompts (ComfyUI's
        # way) and trimmed padding: the negative has its own length, so that a negative prompt (which a
        # distilled model, or guidance 1, never uses) cannot change the prompts' embeddings.
        if (self.text.truncate and self.text.trim is None) or negative_prompt is None:
            return [prompts + ([negative_prompt] if negative_prompt is not None else [])], len(prompts)
        return [prompts, [negative_prompt]], len(prompts)

    def _group_options(self, groups: list[list[str]]) -> list[TextOptions]:
        """Each group's text options. Under trimmed padding the negative prompt, encoded on its own, is
        padded at least to its prompts' length, so that CFG runs the two as one batch when it is no
        longer than they are (the prompts' length never depends on the negative)."""
        if len(groups) == 2 and self.text.truncate and self.text.trim is not None:
            prompts_length = self.text.length(groups[0])
            if self.text.length(groups[1]) < prompts_length:
                return [self.text, dataclasses.replace(self.text, trim=prompts_length)]
        return [self.text] * len(groups)

    @staticmethod
    def _labels(group: list[str], n: int, first: int) -> list[str | None]:
        """The texts' names in a cut-prompt warning: the negative prompt by that name (the group's texts
        from ``first`` on are the caller's prompts, ``n`` of them, then the negative)."""
        return [None if first + i < n else "negative prompt" for i in range(len(group))]

    def _text_width(self) -> int | None:
        """The embeddings' width, when a loaded component says it (cache entries are checked against it)."""
        if self.text_encoder is not None:
            return self.text_encoder.config.text_dim
        return self.transformer.config.context_dim if self.transformer is not None else None

    @staticmethod
    def _conditioning(embeds: list[torch.Tensor], n: int, negative: bool) -> Conditioning:
        if len(embeds) == 2:
            return Conditioning(embeds[0], embeds[1])
        return Conditioning(embeds[0][:n], embeds[0][n:] if negative else None)

    def cached_prompts(self, prompts: Sequence[str], negative_prompt: str | None = None, *,
                       identity: str | None = None) -> Conditioning | None:
        """Stage 1 from the prompt cache alone: the embeddings if every text is cached (in memory or
        on disk), else None. ``identity`` names the encoder (:func:`~klein_core.pipeline.prompts.encoder_identity`
        of its file, dtype and this device), so the encoder need not be loaded; default: the
        engine's text encoder's. The embeddings are on the device of the entries the encoder made,
        or on the CPU when all were read from disk."""
        cache = self.prompt_cache
        if identity is None and self.text_encoder is not None:
            identity = loaded_encoder_identity(self.text_encoder, self.device)
        if cache is None or identity is None:
            return None
        groups, n = self._text_groups(prompts, negative_prompt)
        firsts, options = self._firsts(groups), self._group_options(groups)
        embeds = [cache.cached(identity, g, o, width=self._text_width(), warn=False) for g, o in zip(groups, options)]
        if any(e is None for e in embeds):
            return None
        for g, o, first in zip(groups, options, firsts):  # said once the whole run is served (else encode_prompts)
            warn_cuts(g, o, o.length(g), self._labels(g, n, first))
        return self._conditioning(embeds, n, negative_prompt is not None)  # type: ignore[arg-type]

    @staticmethod
    def _firsts(groups: list[list[str]]) -> list[int]:
        """Where each group starts in the list of all texts (the prompts, then the negative)."""
        firsts, at = [], 0
        for g in groups:
            firsts.append(at)
            at += len(g)
        return firsts

    def encode_prompts(self, prompts: Sequence[str], negative_prompt: str | None = None, *,
                       plan: MemoryPlan | None = None, checks: Checks | None = None) -> Conditioning:
        """Stage 1: embeddings ``[len(prompts), L, text_dim]`` (and the negative's, if given).

        ``L`` is 512, or with ``TextOptions(max_tokens=None)`` the longest prompt's token count
        (at least 512; the negative prompt then has its own length), or with ``trim`` the longest
        prompt's rounded up (the negative its own, at least the prompts'). Cached prompts are not
        encoded again, and when every one is cached the encoder is not even placed.
        ``checks`` (every stage method takes it): a run's :class:`~klein_core.checks.Checks`, which
        may queue the finiteness checks for its caller to resolve; default: checked before returning."""
        groups, n = self._text_groups(prompts, negative_prompt)
        labels = [self._labels(g, n, first) for g, first in zip(groups, self._firsts(groups))]
        options = self._group_options(groups)
        cache = self.prompt_cache
        identity = loaded_encoder_identity(self.text_encoder, self.device) if self.text_encoder is not None else None
        embeds = [cache.cached(identity, g, o, width=self._text_width(), labels=lab) if cache is not None
                  else None for g, o, lab in zip(groups, options, labels)]
        if any(e is None for e in embeds):  # the encoder is placed only when something is not cached
            if plan is None:
                texts = [t for g in groups for t in g]
                plan = self.plan(memory_request(1024, 1024, batch=max(map(len, groups)), denoise=False,
                                                decode=False, text_length=self.text.length(texts),
                                                **self._text_bytes()))
            # An encoder without a file identity is cached by its weights where they live, taken
            # before the stage (the placed copies are new every run: the cache would never hit).
            home = (weights_state(self.text_encoder) if cache is not None and identity is None
                    and self.text_encoder is not None else None)  # (none: the stage says it is missing)
            with explain_oom("encoding the prompts", self.device, batch=sum(map(len, groups))):
                with self._stage("text_encoder", plan) as te:
                    check = checks or Checks()
                    embeds = [e if e is not None else
                              encode_prompts(te, g, cache=cache, options=o, identity=identity, checks=check,
                                             weights=home, labels=lab)
                              for e, g, o, lab in zip(embeds, groups, options, labels)]
                    for emb in embeds:
                        check.check_output(emb, "The text encoder", te, text_overflow_cause(emb.dtype))
        return self._conditioning([to_device(e, self.device) for e in embeds], n, negative_prompt is not None)  # type: ignore[union-attr]

    def encode_references(self, images: Sequence[Image.Image | torch.Tensor], *,
                          plan: MemoryPlan | None = None, first: int = 1,
                          checks: Checks | None = None) -> list[torch.Tensor]:
        """Stage 2: each reference VAE-encoded once, ``[1, 128, h, w]`` per image. ``first``: the
        number of the first image in messages (``reference 3`` when two came before)."""
        images = [as_reference(img, first + i) for i, img in enumerate(as_list(images, "references"))]
        if not images:
            return []
        if plan is None:
            sizes = reference_pixel_sizes(images, (), self.downscale)
            plan = self.plan(memory_request(1024, 1024, sizes, encode_text=False, denoise=False, decode=False))
        out = []
        with explain_oom("encoding the references", self.device, n_refs=len(images)):
            with self._stage("vae", plan) as vae:
                for i, image in enumerate(images):
                    self._next_image()
                    out += encode_references(vae, [image], tile=plan.vae_tile, first=first + i, checks=checks)
        return out

    def encode_pixels(self, pixels: torch.Tensor, *, plan: MemoryPlan | None = None,
                      checks: Checks | None = None) -> torch.Tensor:
        """VAE-encode images ``[B, 3, H, W]`` in [-1, 1] (H, W multiples of 16) to normalised latents
        ``[B, 128, H/16, W/16]``, one image at a time, tiled as the plan says."""
        if isinstance(pixels, Image.Image):
            raise TypeError("the pixels to encode must be a [B, 3, H, W] tensor in [-1, 1], got a PIL image: "
                            "encode pictures with encode_references")
        check_tensor(pixels, "the pixels to encode", 4)
        if 0 in pixels.shape:  # an empty batch, or an image with a side of 0 (torch's own error names nothing)
            raise ValueError(f"the pixels to encode must be [B, 3, H, W] with B, H, W >= 1, got {list(pixels.shape)}")
        h, w = pixels.shape[-2:]
        if plan is None:
            plan = self.plan(memory_request(1024, 1024, encoded=[(w, h)], encode_text=False, denoise=False,
                                            decode=False))
        check = checks or Checks()
        check.require_finite(pixels, "the pixels to encode")
        check.require_within(pixels, "the pixels to encode", PIXEL_BOUND, f"they must lie in [-1, 1] ({PIXEL_HINT})")
        latents = []
        with explain_oom("encoding the image", self.device, w, h):
            with self._stage("vae", plan) as vae:
                for i in range(len(pixels)):
                    self._next_image()
                    latents.append(tiling.encode(vae, pixels[i : i + 1], plan.vae_tile))
                out = torch.cat(latents)
                check.check_output(out, "The VAE encoder", vae, overflow_cause(vae.dtype))
        return out

    def schedule(self, run: Resolved) -> torch.Tensor:
        """The sigmas ``[steps + 1]`` a run with these settings follows (for previews and progress)."""
        return get_schedule(run.steps, (run.width // self.downscale) * (run.height // self.downscale))

    def check_inputs(
        self,
        conditioning: Conditioning,
        references: Sequence[torch.Tensor] = (),
        settings: Settings | Resolved = Settings(),
        *,
        noise: torch.Tensor | None = None,
        init: InitLatents | None = None,
        negative_prompt: bool = False,
        checks: Checks | None = None,
    ) -> Resolved:
        """Every check of a denoising request, once, before any compute (see :func:`check_denoise_inputs`);
        returns the resolved settings (this engine's model-kind defaults and size rules applied)."""
        tr = self.transformer
        if tr is None:
            raise ValueError("denoising needs a transformer; none was given")
        if init is not None and not isinstance(init, InitLatents):
            raise TypeError(f"init must be InitLatents, got {type(init).__name__}")
        if not isinstance(conditioning, Conditioning):
            raise TypeError(f"conditioning must be a Conditioning (encode_prompts gives one; kc.Conditioning(positive, "
                            f"negative) wraps embeddings), got {type(conditioning).__name__}")
        if not isinstance(settings, (Settings, Resolved)):
            raise TypeError(f"settings must be a kc.Settings(width, height, steps, guidance, seed, batch_size), got "
                            f"{type(settings).__name__}")
        for i, ref in enumerate(references):
            if not isinstance(ref, torch.Tensor):
                raise TypeError(f"reference latent {i + 1} must be an encoded [1, 128, h, w] tensor, got "
                                f"{type(ref).__name__}: encode pictures with encode_references first")
        if isinstance(settings, Resolved):
            run = settings
        elif init is not None:
            check_tensor(init.latents, "the init image latents", 4, tr.config.in_channels)
            size = (init.latents.shape[-1] * self.downscale, init.latents.shape[-2] * self.downscale)
            run = resolve(settings, self.kind, size, multiple=self.downscale,
                          size_from=f"the init image latents ({size[0]}x{size[1]} px)", size_fixed=True)
        elif noise is not None and noise.ndim == 4:  # the noise's grid sets the size, as an init image's does
            size = (noise.shape[-1] * self.downscale, noise.shape[-2] * self.downscale)
            run = resolve(settings, self.kind, size, multiple=self.downscale,
                          size_from=f"the given noise ({size[0]}x{size[1]} px)", size_fixed=True)
        else:
            first = reference_pixel_sizes((), references[:1], self.downscale)[0] if references else None
            run = resolve(settings, self.kind, first, multiple=self.downscale,
                          size_from=size_source("reference latent 1", references[0], self.downscale)
                          if references else None)
        check_denoise_inputs(tr.config, self.kind, conditioning, references, run, noise=noise, init=init,
                             negative_prompt=negative_prompt, downscale=self.downscale, checks=checks)
        return run

    @torch.no_grad()  # inference: inputs that require grad (the caller's embeddings) must not record a graph
    def denoise(
        self,
        conditioning: Conditioning,
        references: Sequence[torch.Tensor] = (),
        settings: Settings | Resolved = Settings(),
        *,
        noise: torch.Tensor | None = None,
        callback: StepCallback | None = None,
        plan: MemoryPlan | None = None,
        init: InitLatents | None = None,
        negative_prompt: bool = False,
        ref_mode: str | None = None,
        checks: Checks | None = None,
    ) -> tuple[torch.Tensor, Resolved]:
        """Stage 3: latents ``[P * batch, 128, H/16, W/16]`` from the prompts' embeddings and the
        encoded references; returns them with the resolved settings.

        ``noise``: explicit starting latents (then the size comes from them); else seeded noise.
        ``callback(step, total, latents)`` after each step; return False to cancel.
        ``init``: image-to-image / inpainting (:class:`InitLatents`): the size comes from its
        latents; the first ``int(steps - steps * strength)`` steps are skipped (diffusers' rule).
        ``negative_prompt``: a negative prompt was given but not encoded (said once if unused).
        ``ref_mode``: this call's reference mode (None: the engine's).
        Everything is checked first, once (:meth:`check_inputs`); with a deferring ``checks`` the
        checks of device tensors are queued on it instead (see :meth:`encode_prompts`).
        """
        references = as_list(references, "reference_latents")
        _check_callback(callback)
        mode = self.ref_mode if ref_mode is None else reference_mode(self.kind, ref_mode)
        with torch.profiler.record_function("klein.check_inputs"):
            run = self.check_inputs(conditioning, references, settings, noise=noise, init=init,
                                    negative_prompt=negative_prompt, checks=checks)
        if init is not None and init.as_reference and init.latents.shape[0] > 1:
            logger.warning("the init image joins the references only as a single image; the %d images given only "
                           "seed the noise", init.latents.shape[0])
        references = with_init_reference(references, init)
        tr = self.transformer
        assert tr is not None  # check_inputs refused otherwise
        prompt = conditioning.positive
        down = self.downscale
        n_images = prompt.shape[0] * run.batch_size
        with explain_oom("preparing the batch", self.device, run.width, run.height, n_images, len(references)):
            txt = prompt.repeat_interleave(run.batch_size, dim=0)
            neg = None
            if run.cfg:
                negative = conditioning.negative
                neg = negative.expand(prompt.shape[0], -1, -1) if negative.shape[0] == 1 else negative
                neg = neg.repeat_interleave(run.batch_size, dim=0)
        width, height = run.width, run.height
        if noise is not None:
            width, height = noise.shape[-1] * down, noise.shape[-2] * down
        if len(references) > PUBLISHED_REFERENCE_LIMIT:
            logger.warning("%d references: Klein is published for at most %d", len(references),
                           PUBLISHED_REFERENCE_LIMIT)
        if plan is None:
            sizes = reference_pixel_sizes((), references, down)
            plan = self.plan(memory_request(width, height, sizes, batch=txt.shape[0], cfg=run.cfg,
                                            encode_text=False, decode=False, reference_kv=mode == "kv",
                                            per_token_modulation=mode == "timestep_zero" and bool(sizes),
                                            # a longer negative runs as its own pass, at its length
                                            text_length=max(t.shape[1] for t in (txt, neg) if t is not None)))
        with explain_oom("denoising", self.device, width, height, txt.shape[0] * (2 if run.cfg else 1),
                         len(references)):
            if noise is None:
                noise = make_noise(run.seed, txt.shape[0], tr.config.in_channels, height // down, width // down)
            refs = reference_tokens(list(references))
            sigmas = get_schedule(run.steps, noise.shape[-1] * noise.shape[-2])  # = self.schedule(run) for seeded noise
            image = mask = None
            if init is not None:
                runs = steps_to_run(run.steps, init.strength)
                if runs == run.steps and init.strength < 1:
                    # diffusers' rule rounds the skipped steps down: at 4 steps any strength above 0.75
                    # skips none. The image then seeds nothing: a warning when it is not a reference
                    # either (it is unused), else a note (diffusers' default 0.8 at 4 steps does this).
                    joins = bool(with_init_reference([], init))
                    most = math.floor((run.steps - 1) / run.steps * 1e6) / 1e6  # down: it must skip one
                    advice = f"Use {most:g} or less, or more steps," if run.steps > 1 else "Use more steps"
                    logger.log(logging.INFO if joins else logging.WARNING,
                               "strength (denoise) %g at %d steps skips no step (int(%d - %d x %g) = 0 of the schedule "
                               "are skipped): sampling starts from pure noise, as at 1%s. %s to start from the "
                               "image", init.strength, run.steps, run.steps, run.steps, init.strength,
                               "; the image joins as a reference only" if joins else ", and the image is not used",
                               advice)
                sigmas = sigmas[run.steps - runs:]  # >= 1 step for strength > 0
                image, mask = init.latents, init.mask
            # The weights as they live between runs: a stage may copy them to the device anew each run.
            home = weights_state(tr) if refs is not None and mode == "kv" and self.kv_cache is not None else None
            with self._stage("transformer", plan) as model:
                ref_kv = None
                if refs is not None and mode == "kv":  # once per run, or from an earlier run
                    ref_kv = (self.kv_cache.get(model, refs, weights=home) if self.kv_cache is not None
                              else model.reference_kv(refs.tokens, refs.ids))
                latents = denoise(model, noise, txt, sigmas, neg_txt=neg, guidance=run.guidance, refs=refs,
                                  callback=callback, image=image, mask=mask, ref_mode=mode, ref_kv=ref_kv)
        with torch.profiler.record_function("klein.check_output"):
            (checks or Checks()).check_output(latents, "The sampler", tr, overflow_cause(tr.dtype))
        return latents, run

    def decode(self, latents: torch.Tensor, *, plan: MemoryPlan | None = None,
               checks: Checks | None = None, channels_last: bool = False) -> torch.Tensor:
        """Stage 4: pixels ``[B, 3, H, W]`` in [0, 1] (CPU float32) from latents ``[B, 128, h, w]``,
        one image at a time, tiled as the plan says; if the device still runs out of memory, smaller
        tiles are tried in turn. ``channels_last``: ``[B, H, W, 3]`` instead (ComfyUI's IMAGE),
        laid out so where the image was decoded, not by the host after the copy."""
        return self._decode(latents, plan, images=False, checks=checks, channels_last=channels_last)[0]

    def _decode(self, latents: torch.Tensor, plan: MemoryPlan | None, *, images: bool,
                checks: Checks | None = None, channels_last: bool = False,
                ) -> tuple[torch.Tensor, list[Image.Image], list[int | None]]:
        """:meth:`decode`, and with ``images`` the PIL images too, and each image's decode tile
        (:attr:`GenerationResult.decode_tiles`): each image is checked, clamped
        and (for the PIL images) rounded to 8 bits where it was decoded, so the host only receives
        the results, through page-locked memory (:mod:`klein_core.transfer`). Each image's copies are
        queued as it is decoded and the host waits once, after the last: the GPU decodes the next
        image of a batch while the host would otherwise wait for the copy of the one before."""
        check_tensor(latents, "the latents to decode", 4)
        if 0 in latents.shape:  # an empty batch, or a side of 0 (torch's own error names nothing)
            raise ValueError(f"the latents to decode must be [B, 128, h, w] with B, h, w >= 1, got "
                             f"{list(latents.shape)}")
        down = self.downscale
        width, height = latents.shape[-1] * down, latents.shape[-2] * down
        if plan is None:
            plan = self.plan(memory_request(width, height, encode_text=False, denoise=False))
        check = checks or Checks()
        check.require_finite(latents, "the latents to decode")
        frames, eight_bit, copies, tiles = [], [], HostCopies(), []
        with explain_oom("VAE decoding", self.device, width, height):
            with self._stage("vae", plan) as vae:
                tile = plan.vae_tile
                for i in range(latents.shape[0]):
                    self._next_image()
                    pixels, tile = self._decode_one(vae, latents[i : i + 1], tile, check)
                    tiles.append(tiling.decode_tile(tile, *latents.shape[-2:]))
                    if images:
                        pixels, arr = queue_to_host(pixels, copies)
                        eight_bit.append(arr)
                    else:
                        if channels_last:
                            pixels = pixels.permute(0, 2, 3, 1).contiguous()
                        (pixels,) = copies.add(pixels)
                    frames.append(pixels)
                copies.wait()
        pictures = [pic for arr in eight_bit for pic in pil_images(arr)]
        # one image (the usual case): no 12 MB host copy at 1024x1024 on the way out
        return (frames[0] if len(frames) == 1 else torch.cat(frames)), pictures, tiles

    def _decode_one(self, vae: Any, latents: torch.Tensor, tile: int | None,
                    check: Checks) -> tuple[torch.Tensor, int | None]:
        """One image decoded, and the tile size that worked (kept for the next image)."""
        # Only sides that tile these latents: one at least their size decodes them whole, the very
        # decode that just ran out of memory (it was retried as "tiles of 64" at 1024²).
        h, w = latents.shape[-2:]
        tile = tiling.decode_tile(tile, h, w)
        tiles = [tile] + [t for t in TILE_SIDES if t < max(h, w) and (tile is None or t < tile)]
        for i, tile in enumerate(tiles):
            try:
                pixels = decode_to_pixels(vae, latents, tile=tile, clamp=False, host=False)
                check.check_output(pixels, "The VAE decoder", vae, overflow_cause(vae.decoder_dtype))
                return pixels.clamp(0, 1), tile
            except RuntimeError as exc:
                if not is_out_of_memory(exc) or i == len(tiles) - 1:
                    raise
                release_failed_attempt(exc, self.device)
                del exc
                logger.warning("out of GPU memory decoding %s; retrying in tiles of %d latents",
                               "whole" if tile is None else f"in tiles of {tile}", tiles[i + 1])
        raise AssertionError("unreachable")

    # -- composition ----------------------------------------------------------------------------

    def memory_request(self, request: GenerationRequest, *, init: InpaintInputs | None = None) -> MemoryRequest:
        """What the planner needs to know about ``request``, worked out before anything runs
        (``init``: its init image, prepared)."""
        sizes = reference_pixel_sizes(request.references, request.reference_latents, self.downscale)
        first = sizes[0] if sizes else None
        size_from, size_fixed = None, False
        if request.reference_latents:
            size_from = size_source("reference latent 1", request.reference_latents[0], self.downscale)
        elif request.references:
            size_from = size_source("reference 1", request.references[0])
        if init is None and request.noise is not None and request.noise.ndim == 4:  # its grid sets the size
            first = (request.noise.shape[-1] * self.downscale, request.noise.shape[-2] * self.downscale)
            size_from, size_fixed = f"the given noise ({first[0]}x{first[1]} px)", True
        if init is not None:  # the image sets the size, and (as a reference) joins the sequence
            first = init.size
            size_from, size_fixed = size_source("the init image", init.original), True
            sizes = ([init.size] if request.init.as_reference else []) + sizes  # type: ignore[union-attr]
        run = resolve(request.settings, self.kind, first, multiple=self.downscale, warn=False, size_from=size_from,
                      size_fixed=size_fixed)
        cond = request.conditioning
        if cond is not None:
            text_length = max(e.shape[1] for e in (cond.positive, cond.negative) if e is not None)
            if run.cfg and cond.negative is None:  # the negative prompt is encoded, at its own length
                text_length = max(text_length, self.text.length([request.negative_prompt]))
        else:
            text_length = self.text.length([*request.prompts, *([request.negative_prompt] if run.cfg else [])])
        mode = self.ref_mode if request.ref_mode is None else reference_mode(self.kind, request.ref_mode)
        prompts = len(request.prompts) if cond is None else 0
        negative = run.cfg and (cond is None or cond.negative is None)
        # Texts encoded at once (_text_groups): the prompts and the negative in one batch when they are
        # cut to one length, else each group alone.
        text_batch = max(1, prompts + 1 if negative and (self.text.truncate or not prompts) else prompts)
        as_reference = request.init is not None and request.init.as_reference
        encoded = [init.size] if init is not None and not as_reference else []
        return memory_request(run.width, run.height, sizes, batch=len(request.prompts) * run.batch_size,
                              cfg=run.cfg, encode_text=cond is None or negative,
                              decode=request.output != "latent", reference_kv=mode == "kv",
                              text_length=text_length, text_batch=text_batch, encoded=encoded,
                              per_token_modulation=mode == "timestep_zero" and bool(sizes),
                              **self._text_bytes())

    def generate(self, request: GenerationRequest, *, callback: StepCallback | None = None) -> GenerationResult:
        """Run the four stages for ``request`` under one memory plan; stages whose result the request
        carries (``conditioning``, ``reference_latents``) are skipped. ``callback(step, total,
        latents)`` after each denoising step; return False to cancel."""
        return self._generate(request, callback)

    def _generate(self, request: GenerationRequest, callback: StepCallback | None,
                  speed: str | None = None) -> GenerationResult:
        """:meth:`generate`; ``speed``: switched to once the request has passed every check before the
        stages (:func:`generate`'s ``speed=``: a refused call leaves the models as they were)."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        _check_callback(callback)  # before any stage runs
        cond = request.conditioning
        if cond is None and self.text_encoder is None:
            raise ValueError("pass a text_encoder, or prompt embeddings (conditioning)")
        if (request.references or request.init is not None) and self.vae is None:
            raise ValueError(f"{'references' if request.references else 'an init image'} need a vae to encode them")
        init, prepared = request.init, None
        if init is not None:
            prepared = prepare_inpaint(init.image, init.mask, crop_padding=init.crop_padding, multiple=self.downscale)
        memory = self.memory_request(request, init=prepared)
        if cond is not None and memory.cfg and cond.negative is None and self.text_encoder is None:
            raise ValueError("CFG needs a text_encoder for the negative prompt, or a negative embedding")
        plan = self.plan(memory)
        if speed is not None:
            apply_speed(self.transformer, self.vae, speed, self.text_encoder)
        # read once, when the result is on the host (the module's docstring); if the run fails, what it
        # finished and proved finite is still kept (the prompt cache's new embeddings: Checks.settle)
        with Checks(defer=True) as checks:
            clock = StageClock(self.device)
            with clock.stage("text"):
                if cond is None:
                    negative = request.negative_prompt if memory.cfg else None
                    cond = self.encode_prompts(request.prompts, negative, plan=plan, checks=checks)
                elif memory.cfg and cond.negative is None:
                    cond = Conditioning(cond.positive, self.encode_prompts([request.negative_prompt], plan=plan,
                                                                           checks=checks).positive)
            # References and an init image are encoded in one placement of the VAE (copied in once
            # when the plan stages it).
            both = bool(request.references) and init is not None and prepared is not None
            with clock.stage("references"), (self._stage("vae", plan) if both else contextlib.nullcontext()):
                given = list(request.reference_latents)
                refs = given + self.encode_references(request.references, plan=plan, first=len(given) + 1,
                                                      checks=checks)
                start = None
                if init is not None and prepared is not None:
                    image_latents = self.encode_pixels(prepared.pixels, plan=plan, checks=checks)
                    h, w = image_latents.shape[-2:]
                    mask = resize_mask_to_latents(prepared.mask, h, w) if prepared.mask is not None else None
                    start = InitLatents(image_latents, init.resolved_strength, mask, as_reference=init.as_reference)
            unused_negative = bool(request.negative_prompt.strip()) and request.conditioning is None and not memory.cfg
            with clock.stage("denoise"):
                latents, run = self.denoise(cond, refs, request.settings, noise=request.noise, callback=callback,
                                            plan=plan, init=start, negative_prompt=unused_negative,
                                            ref_mode=request.ref_mode, checks=checks)
            ref_sizes = reference_pixel_sizes((), with_init_reference(refs, start), self.downscale)
            width, height = latents.shape[-1] * self.downscale, latents.shape[-2] * self.downscale
            result = GenerationResult(latents, None, None, width, height, run.steps, run.guidance, run.seed, {},
                                      ref_sizes)
            if request.output == "latent":
                checks.resolve()
                result.timings = clock.read()
                return result
            with clock.stage("decode"):
                result.pixels, result.images, result.decode_tiles = self._decode(latents, plan, images=True,
                                                                                checks=checks)
                checks.resolve()  # the images are on the host: the flags are ready, no GPU time is lost
                if prepared is not None and init is not None and (
                        prepared.box is not None or (prepared.original_mask is not None and init.composite)):
                    # back into the picture: the crop resized into its box; only masked pixels changed
                    result.images = [stitch(prepared.original, img, prepared.box, prepared.original_mask,
                                            feather=init.feather, keep_unmasked=init.composite, fitted=True)
                                     for img in result.images]
                    result.width, result.height = result.images[0].size
                    # the float form of what is returned (as everywhere else): the stitched pictures at the
                    # original size, 8-bit levels, not the generation at its processing size
                    result.pixels = torch.from_numpy(
                        np.stack([_to_rgb_array(img) for img in result.images])).permute(0, 3, 1, 2).contiguous()
        result.timings = clock.read()
        return result


# One stage at a time per model, across threads and engines: placing a model for a stage moves its
# tensors (copied in, streamed), so a second thread staging it meanwhile would compute with weights the
# first one takes away. Weakly keyed: nothing is kept alive. Held only around one component's stage,
# and stages of different components never nest, so two threads cannot wait on each other.
_stage_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_stage_locks_guard = threading.Lock()


def _stage_lock(module: Any) -> threading.RLock:
    with _stage_locks_guard:
        lock = _stage_locks.get(module)
        if lock is None:
            lock = _stage_locks[module] = threading.RLock()
        return lock


class StageClock:
    """The seconds each stage of a run took (``GenerationResult.timings``), without a wait between stages.

    On CUDA a stage's time runs from an event recorded on the device's current stream when the
    stage begins to one recorded when it ends: the device's time for it (the work queued before it
    excluded; the device idling while the host prepares it included). :meth:`read` waits for the
    last event, once the run's result is on the host. Elsewhere it is the host's clock (the CPU
    computes as the host calls). Each stage is also a ``klein.<name>`` range for torch.profiler
    (benchmarks/profile_run.py places the GPU's idle gaps by them; without a profiler running a
    range costs about a microsecond).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: dict[str, float | tuple[Any, Any]] = {}

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"klein.{name}"):
            if self.device.type == "cuda":
                start = self._event()
                yield
                self._marks[name] = (start, self._event())
            else:
                t0 = time.perf_counter()
                yield
                self._marks[name] = time.perf_counter() - t0

    def read(self) -> dict[str, float]:
        """Seconds per stage, in the order the stages ran."""
        out = {}
        for name, mark in self._marks.items():
            if isinstance(mark, tuple):
                start, end = mark
                if not end.query():  # done already when the run's result came to the host: no wait
                    end.synchronize()
                out[name] = start.elapsed_time(end) / 1000.0
            else:
                out[name] = mark
        return out


def generate(
    transformer: Flux2Transformer,
    text_encoder: Qwen3TextEncoder | None = None,
    vae: Flux2VAE | None = None,
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
    kind: ModelKind | None = None,
    noise: torch.Tensor | None = None,
    callback: StepCallback | None = None,
    output: Literal["pil", "latent"] = "pil",
    cache: PromptCache | None = default_prompt_cache,
    memory: str | MemoryPlan = "auto",
    device: torch.device | str | None = None,
    text: TextOptions = TextOptions(),
    vae_tile: int | str | None = "auto",
    image: Image.Image | None = None,
    mask: Any = None,
    strength: float | None = None,
    image_as_reference: bool = True,
    mask_crop_padding: int | None = None,
    composite: bool = True,
    feather: int = 0,
    ref_mode: str | None = None,
    kv_cache: ReferenceKVCache | None = default_kv_cache,
    speed: str | None = None,
) -> GenerationResult:
    """Generate images with FLUX.2 Klein: an :class:`Engine` and a :class:`GenerationRequest` built
    from keyword arguments, then :meth:`Engine.generate`.

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
        kind: "distilled", "base" or "kv" (Klein 9B-KV); None (default) reads it from the
            transformer's file name or diffusers folder, else distilled. Weights cannot tell.
        noise: explicit starting latents ``[B, 128, H/16, W/16]`` instead of seeded noise.
        callback: ``callback(step, total, latents)`` after each step; return False to cancel
            (raises :class:`~klein_core.errors.GenerationCancelled`); exceptions it raises propagate.
        output: "pil" decodes to images; "latent" returns latents only.
        cache, memory, device, text, vae_tile, ref_mode, kv_cache, speed: see :class:`Engine`.
        image, mask, strength, image_as_reference, mask_crop_padding, composite, feather:
            image-to-image (``image``, ``strength``) and inpainting (with ``mask``: white =
            repaint); see :class:`~klein_core.pipeline.inpaint.InitImage`. The size comes from the image.
    Returns:
        :class:`GenerationResult` with latents, images/pixels (if decoded) and per-stage timings.
    """
    if negative_embeds is not None and prompt_embeds is None:
        raise ValueError("negative_embeds needs prompt_embeds (the embeddings it pairs with): give both, or "
                         "negative_prompt= with prompt=")
    conditioning = None
    if prompt_embeds is not None:
        conditioning = Conditioning(prompt_embeds, negative_embeds)
    init = None
    if image is not None:
        init = InitImage(image, mask, strength, image_as_reference, mask_crop_padding, composite, feather)
    else:
        given = [name for name, unset in (("mask", mask is None), ("strength", strength is None),
                                          ("mask_crop_padding", mask_crop_padding is None), ("feather", feather == 0),
                                          ("image_as_reference", image_as_reference is True),
                                          ("composite", composite is True)) if not unset]
        if given:
            raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} an image to start from "
                             "(image=)")
    request = GenerationRequest(
        as_prompts(prompt) if conditioning is None or prompt else "", negative_prompt,
        tuple(as_list(references, "references")), Settings(width, height, steps, guidance, seed, batch_size),
        output, init, conditioning, tuple(as_list(reference_latents, "reference_latents")), noise, ref_mode)
    engine = Engine(transformer, text_encoder, vae, kind=kind, device=device, memory=memory, vae_tile=vae_tile,
                    prompt_cache=cache, text=text, kv_cache=kv_cache)
    # speed= switches the models' fast paths in place: only once every check of the request has passed
    return engine._generate(request, callback, None if speed is None else check_speed(speed))


__all__ = ["Engine", "GenerationResult", "generate", "memory_request"]
