"""What a generation asks for, and the rules that turn it into concrete numbers.

:class:`GenerationRequest` is the frozen description of one run (prompts, references, size,
sampler settings, output). :func:`resolve` applies the model kind's defaults (distilled: 4 steps
without CFG; base: 50 steps, CFG 4) and the size rules (the first reference's size or 1024,
multiples of 16, 64 px to 4 megapixels) in one place for the engine, the nodes and the CLI.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from PIL import Image

from .inpaint import InitImage
from .sampling import MAX_SEED, REFERENCE_MODES

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 1024
MIN_SIDE = 64
MAX_PIXELS = 4 * 1024 * 1024  # 4 megapixels (BFL's published limit)
MAX_STEPS = 10_000  # far beyond any schedule Klein uses (4 distilled, 20-50 base); a typo guard
DISTILLED_DEFAULTS = {"steps": 4, "guidance": 1.0}
BASE_DEFAULTS = {"steps": 50, "guidance": 4.0}
ModelKind = Literal["distilled", "base", "kv"]
# "kv": Klein 9B-KV, distilled (4 steps, no CFG) and run with stored reference keys/values.
MODEL_KINDS: tuple[str, ...] = ("distilled", "base", "kv")
_KV_NAME = re.compile(r"(?:^|[-_. ])kv(?:$|[-_. ])", re.IGNORECASE)
_BASE_NAME = re.compile(r"(?:^|[-_. ])base(?:$|[-_. ])", re.IGNORECASE)
# diffusers' pipeline class for Klein 9B-KV, as a repo's model_index.json names it ("_class_name").
_KV_PIPELINES = ("Flux2KleinKVPipeline",)
_MODEL_INDEX_MAX_BYTES = 1 << 20  # a real model_index.json is under 1 KB
OUTPUTS: tuple[str, ...] = ("pil", "latent")


def guess_model_kind(source: str | os.PathLike) -> ModelKind:
    """The model kind of a transformer file or folder, from what lies there (the weights cannot tell).

    In order: a diffusers repo's ``model_index.json`` (``Flux2KleinKVPipeline`` -> kv, ``"is_distilled":
    false`` -> base); the file name ("-kv-" as a word -> kv, "base" -> base); a diffusers repo folder's
    name (also the Hugging Face cache's ``models--black-forest-labs--FLUX.2-klein-9b-kv``) by the same
    words; else distilled. Reads no weights, at most one small JSON file; never raises for an odd path.
    """
    text = str(os.fspath(source) if isinstance(source, os.PathLike) else source).rstrip("/\\")
    root = _diffusers_root(text)
    if root is not None:
        kind = _kind_from_model_index(root)
        if kind is not None:
            return kind
    stem = os.path.basename(text)
    for ext in (".safetensors", ".sft", ".gguf"):
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
    if _KV_NAME.search(stem):
        return "kv"
    if "base" in stem.lower():
        return "base"
    if root is not None:
        repo = _repo_name(root)
        if _KV_NAME.search(repo):
            return "kv"
        if _BASE_NAME.search(repo):
            return "base"
    return "distilled"


def _diffusers_root(path: str) -> str | None:
    """The repo folder when ``path`` is a diffusers transformer (``<repo>/transformer`` or a file in
    it) or a folder holding ``model_index.json``; else None."""
    parent = os.path.dirname(path)
    if os.path.basename(path) == "transformer":
        return parent or None
    if os.path.basename(parent) == "transformer":
        return os.path.dirname(parent) or None
    try:
        if os.path.isfile(os.path.join(path, "model_index.json")):
            return path
    except (OSError, ValueError):
        pass
    return None


def _repo_name(root: str) -> str:
    """The repo's name: its folder's, or in the Hugging Face cache (``models--org--name/snapshots/<hash>``)
    the name the cache folder carries."""
    name = os.path.basename(root)
    up = os.path.dirname(root)
    if os.path.basename(up) == "snapshots":
        name = os.path.basename(os.path.dirname(up))
    return name.split("--")[-1] if name.startswith("models--") else name


def _kind_from_model_index(root: str) -> ModelKind | None:
    """What ``<root>/model_index.json`` says about the kind, or None (absent, unreadable, silent)."""
    path = os.path.join(root, "model_index.json")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MODEL_INDEX_MAX_BYTES:  # never a FIFO: no hang
            return None
        with open(path, "rb") as fh:
            index = json.loads(fh.read(_MODEL_INDEX_MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: bad JSON or UTF-8, NUL in the path
        return None
    if not isinstance(index, dict):
        return None
    if index.get("_class_name") in _KV_PIPELINES:
        return "kv"
    distilled = index.get("is_distilled")  # Flux2KleinPipeline's config flag (default false)
    if isinstance(distilled, bool):
        return "distilled" if distilled else "base"
    return None


def reference_mode(kind: str, ref_mode: str | None = None) -> str:
    """How references take part (``sampling.REFERENCE_MODES``): ``ref_mode`` when given, else "kv" for
    Klein 9B-KV (kind "kv") and "joint" for the others."""
    if ref_mode is not None and ref_mode not in REFERENCE_MODES:
        raise ValueError(f"ref_mode must be one of {REFERENCE_MODES} or None, got {ref_mode!r}")
    return ref_mode or ("kv" if kind == "kv" else "joint")


def _megapixels(pixels: int) -> str:
    """``pixels`` in megapixels with one decimal (rounded half up), exact for any integer."""
    tenths = (pixels + 50_000) // 100_000
    return f"{tenths // 10}.{tenths % 10}"


def check_size(width: int, height: int, *, multiple: int = 16, warn: bool = True) -> tuple[int, int]:
    """``(width, height)`` rounded down to multiples of ``multiple`` (with a warning unless ``warn``
    is False); refuses sizes under 64 px a side or over 4 megapixels, judging the size that will be
    used (after rounding)."""
    for name, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an integer number of pixels, got {v!r}")
    rw, rh = width // multiple * multiple, height // multiple * multiple
    if rw < MIN_SIDE or rh < MIN_SIDE:
        raise ValueError(f"Output size {width}x{height} is too small: both sides must be at least {MIN_SIDE} px.")
    if rw * rh > MAX_PIXELS:
        raise ValueError(
            # integer arithmetic: a side of 10**308 would overflow a float division (OverflowError)
            f"Output size {width}x{height} is {_megapixels(rw * rh)} megapixels; FLUX.2 Klein supports at most 4 "
            f"megapixels (e.g. 2048x2048)."
        )
    if warn and (rw, rh) != (width, height):
        logger.warning("Size %dx%d is not a multiple of %d; using %dx%d", width, height, multiple, rw, rh)
    return rw, rh


def resolve_size(
    width: int | None, height: int | None, first_reference: tuple[int, int] | None, multiple: int = 16,
    *, warn: bool = True, size_from: str | None = None, size_fixed: bool = False,
) -> tuple[int, int]:
    """Output (width, height): given values, else the first reference's size, else 1024x1024.

    Values that are not multiples of ``multiple`` are rounded down with a warning; sizes under
    64 px a side or above 4 megapixels are refused. ``size_from`` names the image ``first_reference``
    is the size of, with its own size (``"reference 1 (1x1 px)"``, ``"the init image (64x20000
    px)"``): a side taken from it that is refused names that image, not "Output size".
    ``size_fixed``: the output must keep that image's size (an init image, given noise), so the
    refusal does not offer width and height as the fix.
    """
    default_w, default_h = first_reference or (DEFAULT_SIZE, DEFAULT_SIZE)
    w, h = default_w if width is None else width, default_h if height is None else height
    if size_from is not None and first_reference is not None:
        _check_inherited(w if width is None else None, h if height is None else None, w, h, size_from, multiple,
                         size_fixed)
    return check_size(w, h, multiple=multiple, warn=warn)


def _check_inherited(width: int | None, height: int | None, w: object, h: object, size_from: str,
                     multiple: int, fixed: bool = False) -> None:
    """Refuse, naming ``size_from``, a side taken from an image (``width`` / ``height``, None where
    given explicitly) that is too small once rounded down to ``multiple``, or an output over 4
    megapixels that such a side makes. ``fixed``: the output must keep that image's size (an init
    image, given noise, a sampler's latent), so width and height are not offered as the fix."""
    small = [name for name, v in (("width", width), ("height", height))
             if isinstance(v, int) and v // multiple * multiple < MIN_SIDE]
    if small:
        sides = " and ".join(small)
        raise ValueError(
            f"{size_from} is too small to set the output size: it gives an output {sides} under {MIN_SIDE} px "
            f"({w}x{h}). Use a larger image{'' if fixed else ', or give width and height explicitly'}.")
    inherited = [name for name, v in (("width", width), ("height", height)) if v is not None]
    # Both sides from the image: one side given may be the cause itself (check_size names the output).
    if len(inherited) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in (w, h)):
        area = w // multiple * multiple * (h // multiple * multiple)  # type: ignore[operator]
        if area > MAX_PIXELS:
            raise ValueError(
                f"{size_from} is too large to set the output size: {w}x{h} is {_megapixels(area)} megapixels "
                f"(the output's {' and '.join(inherited)} taken from it); FLUX.2 Klein supports at most 4. "
                + ("Use a smaller image." if fixed else
                   "Give width and height explicitly (e.g. 2048x2048 at most), or use a smaller image."))


@dataclass(frozen=True)
class Settings:
    """Sampler settings as given; None means the model kind's default (and the size: the first
    reference's, else 1024)."""

    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int = 0
    batch_size: int = 1

    def __post_init__(self) -> None:
        # numpy scalars (an np.arange sweep, rng.integers) as the Python numbers they are; every value
        # is judged by resolve().
        for name in ("width", "height", "steps", "seed", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        if isinstance(self.guidance, numbers.Real) and not isinstance(self.guidance, (bool, int, float)):
            object.__setattr__(self, "guidance", float(self.guidance))


@dataclass(frozen=True)
class Resolved:
    """Concrete settings for one run: every default applied and every value checked; ``guidance`` is
    the one that runs (1 for distilled models, whatever was asked)."""

    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    batch_size: int
    cfg: bool  # classifier-free guidance runs (base model and guidance > 1)


def resolve(settings: Settings, kind: ModelKind, first_reference: tuple[int, int] | None = None,
            *, multiple: int = 16, warn: bool = True, size_from: str | None = None,
            size_fixed: bool = False) -> Resolved:
    """Apply the defaults of ``kind`` and the size rules to ``settings``; raise ValueError (or
    TypeError for a wrong type) naming the bad value. ``warn=False`` keeps the notices (guidance
    ignored, size rounded) for the resolution that runs, when the same settings are resolved twice.
    ``size_from``: the image ``first_reference`` is the size of, named if it is too small (see
    :func:`resolve_size`); ``size_fixed``: the output must keep that image's size."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {kind!r}")
    defaults = BASE_DEFAULTS if kind == "base" else DISTILLED_DEFAULTS
    steps = defaults["steps"] if settings.steps is None else settings.steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer from 1 to {MAX_STEPS}, got {steps!r}")
    raw = defaults["guidance"] if settings.guidance is None else settings.guidance
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise TypeError(f"guidance must be a number, got {raw!r}")
    guidance = float(raw)
    if not math.isfinite(guidance) or guidance < 0:
        raise ValueError(f"guidance must be a finite number >= 0, got {guidance}")
    batch = settings.batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch!r}")
    seed = settings.seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2^64-1], got {seed}")
    if warn and kind != "base" and guidance != 1.0:
        logger.warning("guidance %.2f is ignored: distilled Klein models run without CFG", guidance)
    width, height = resolve_size(settings.width, settings.height, first_reference, multiple, warn=warn,
                                 size_from=size_from, size_fixed=size_fixed)
    # What runs: a distilled model runs without CFG whatever was asked (said above), so the result and
    # the PNG's parameters say 1, not the guidance given.
    ran = guidance if kind == "base" else 1.0
    return Resolved(width, height, steps, ran, seed, batch, kind == "base" and guidance > 1.0)


@dataclass(frozen=True)
class Conditioning:
    """Prompt embeddings ``positive [P, L, text_dim]`` and, for CFG, ``negative [1 or P, L, text_dim]``."""

    positive: torch.Tensor
    negative: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.positive.shape[0])

    def __post_init__(self) -> None:
        check_tensor(self.positive, "the prompt embeddings", 3)
        if self.negative is not None:
            check_tensor(self.negative, "the negative prompt embeddings", 3)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as a user describes it: the one way into :meth:`klein_core.pipeline.engine.Engine.generate`.

    ``prompt``: one or several (``settings.batch_size`` images each); may be empty with ``conditioning``.
    ``negative_prompt``: for base models with guidance > 1. ``references``: PIL images (or ``[1, 3, H, W]``
    tensors in [-1, 1]); ``reference_latents``: ``[1, 128, h, w]`` each, placed before ``references``.
    ``output``: "pil" or "latent". ``init``: :class:`~klein_core.pipeline.inpaint.InitImage`.
    ``conditioning``: embeddings instead of prompts (a base model with CFG and no negative embedding still
    encodes ``negative_prompt``). ``noise``: ``[P * batch, 128, H/16, W/16]`` instead of seeded noise.
    ``ref_mode``: "joint", "timestep_zero" or "kv" for this request (None: the engine's).
    """

    prompt: str | tuple[str, ...] = ""
    negative_prompt: str = ""
    references: tuple[Image.Image | torch.Tensor, ...] = ()
    settings: Settings = Settings()
    output: Literal["pil", "latent"] = "pil"
    init: InitImage | None = None  # image-to-image / inpainting: where denoising starts
    conditioning: Conditioning | None = None
    reference_latents: tuple[torch.Tensor, ...] = ()
    noise: torch.Tensor | None = None
    ref_mode: str | None = None

    def __post_init__(self) -> None:
        if self.conditioning is not None and not isinstance(self.conditioning, Conditioning):
            raise TypeError(f"conditioning must be a Conditioning, got {type(self.conditioning).__name__}")
        if not isinstance(self.settings, (Settings, Resolved)):
            raise TypeError(f"settings must be a Settings(width, height, steps, guidance, seed, batch_size), got "
                            f"{type(self.settings).__name__}")
        prompts = self.prompts
        if not prompts:
            raise ValueError("prompt list is empty")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise TypeError(f"prompt {i + 1} must be a str, got {type(p).__name__}")
        if self.conditioning is not None and self.prompt not in ("", ()) and len(prompts) != len(self.conditioning):
            raise ValueError(f"{len(prompts)} prompt(s) but {len(self.conditioning)} prompt embedding(s) in "
                             "conditioning: leave prompt empty when giving embeddings")
        if not isinstance(self.negative_prompt, str):
            raise TypeError(f"negative_prompt must be a str, got {type(self.negative_prompt).__name__}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")
        if self.init is not None and not isinstance(self.init, InitImage):
            raise TypeError(f"init must be an InitImage, got {type(self.init).__name__}")
        # references as given (paths opened once, here); anything else is refused by its number
        object.__setattr__(self, "references", tuple(
            as_reference(r, i + 1) for i, r in enumerate(as_list(self.references, "references"))))
        if not isinstance(self.reference_latents, tuple):
            raise TypeError(f"reference_latents must be a tuple of tensors, got {type(self.reference_latents).__name__}")
        for i, lat in enumerate(self.reference_latents):
            check_tensor(lat, f"reference latent {i + 1}", 4)
        if self.noise is not None:
            check_tensor(self.noise, "the given noise", 4)
        if self.ref_mode is not None and self.ref_mode not in REFERENCE_MODES:
            raise ValueError(f"ref_mode must be one of {REFERENCE_MODES} or None, got {self.ref_mode!r}")

    @property
    def prompts(self) -> tuple[str, ...]:
        """The prompts; with ``conditioning`` and no prompt, one empty prompt per embedding."""
        if self.conditioning is not None and self.prompt in ("", ()):
            return ("",) * len(self.conditioning)
        return (self.prompt,) if isinstance(self.prompt, str) else tuple(self.prompt)


def as_device(device: torch.device | str | int | None) -> torch.device | None:
    """A torch device from a device, its name ("cuda", "cuda:1", "cpu", "mps") or a CUDA index,
    checked to exist here (a CPU-only torch refuses "cuda" with the fix, not an assertion). A bare "cuda"
    comes back with the current device's index (:func:`indexed_device`)."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        d = device
    elif isinstance(device, str):
        try:
            d = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device {device!r} is not a device name torch knows (e.g. 'cuda', 'cuda:1', 'cpu', "
                             "'mps')") from None
    elif isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        d = torch.device("cuda", device)
    else:
        raise TypeError(f"device must be a torch.device, a name such as 'cuda' or 'cpu', or a CUDA index; got "
                        f"{device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(d)!r} needs CUDA, but this torch {torch.__version__} has no CUDA device (a "
                         "CPU-only build, or no GPU/driver). Install a CUDA build of torch (README: Quick start) "
                         "or use device 'cpu'.")
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' needs Apple silicon and a torch built with MPS; use 'cpu'.")
    return indexed_device(d)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its CUDA index named: "cuda" alone is the current CUDA device (asked now), so it
    becomes e.g. "cuda:0". Calls that need an index (``torch.cuda.set_device``,
    ``set_per_process_memory_fraction``) refuse a bare "cuda", and caches keyed by device would hold
    "cuda" and "cuda:0" apart. Other devices are returned as they are."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def check_tensor(x: object, what: str, ndim: int, channels: int | None = None) -> torch.Tensor:
    """``x`` as a tensor of ``ndim`` dimensions (and ``channels`` in dim 1 if given), or a clear error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor, got {type(x).__name__}")
    if x.ndim != ndim or (channels is not None and x.shape[1] != channels):
        want = f"{ndim} dimensions" + (f" with {channels} channels in dim 1" if channels is not None else "")
        raise ValueError(f"{what} must have {want}, got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a float tensor, got {x.dtype}")
    return x


def as_reference(item: object, index: int) -> Image.Image | torch.Tensor:
    """A reference as given: a PIL image, a prepared ``[1, 3, H, W]`` tensor, or a path to an image."""
    if isinstance(item, torch.Tensor) and item.ndim >= 2 and 0 in item.shape[-2:]:
        # refused here, before its size could become the output's ("give width and height" would not help)
        raise ValueError(f"reference {index}: the tensor has a side of 0 pixels ({item.shape[-2]}x{item.shape[-1]}, "
                         "H x W)")
    if isinstance(item, (Image.Image, torch.Tensor)):
        return item
    if isinstance(item, (str, os.PathLike)):
        try:
            return Image.open(item)
        except Image.DecompressionBombError as exc:  # not an OSError: it escaped unnamed
            raise ValueError(f"reference {index}: {item!s} is too large to read safely ({exc}).") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"reference {index}: cannot open {item!s} as an image ({exc}).") from None
    raise TypeError(f"reference {index} must be a PIL image, a [1, 3, H, W] tensor or an image path, "
                    f"got {type(item).__name__}")


def as_list(items: object, what: str) -> list:
    """A list argument (a list or tuple) as a list; a single item or anything else is refused."""
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{what} must be a list, got {type(items).__name__}; wrap a single item as [item]")
    return list(items)


def as_prompts(prompt: str | Sequence[str]) -> tuple[str, ...]:
    """A prompt argument (one string or a sequence of them) as a tuple."""
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
    return tuple(prompt)


__all__ = [
    "BASE_DEFAULTS", "DEFAULT_SIZE", "DISTILLED_DEFAULTS", "MAX_PIXELS", "MIN_SIDE", "MODEL_KINDS", "OUTPUTS",
    "Conditioning", "GenerationRequest", "ModelKind", "Resolved", "Settings", "as_device", "as_list", "as_prompts", "as_reference",
    "check_size", "check_tensor", "guess_model_kind", "indexed_device",
    "resolve", "resolve_size",
]
