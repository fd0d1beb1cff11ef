"""Pictures in and out: reference-image preprocessing (the diffusers / BFL Klein rules, SPEC §5.1)
and pixels -> PIL images."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from PIL import Image, ImageOps

from ..transfer import HostCopies, to_device, to_host

logger = logging.getLogger(__name__)

MAX_REFERENCE_AREA = 1024 * 1024  # larger references are scaled down to about 1 megapixel
MIN_REFERENCE_SIDE = 64
MAX_ASPECT_RATIO = 8
PUBLISHED_REFERENCE_LIMIT = 4  # BFL: Klein 4B/9B support up to 4 references


def refuse_bomb(image: Image.Image) -> None:
    """Raise :class:`PIL.Image.DecompressionBombError` when ``image`` (opened, not yet loaded) is over
    PIL's limit, ``Image.MAX_IMAGE_PIXELS``, where PIL itself only warns up to twice the limit.

    Checked on the size rather than by turning the warning into an error: a warnings filter is
    process-wide, so one set in one thread (a Serve replica parses requests in several) would be
    lost, or left in place, by another's."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = image.width * image.height
    if limit is not None and pixels > limit:
        raise Image.DecompressionBombError(f"Image size ({pixels} pixels) exceeds limit of {limit} pixels, "
                                           "could be decompression bomb DOS attack.")


def reference_size(width: int, height: int, multiple: int = 16) -> tuple[int, int]:
    """The (width, height) a ``width x height`` reference becomes: scaled to at most 1 MP, then
    cropped down to multiples of ``multiple``."""
    if width * height > MAX_REFERENCE_AREA:
        s = math.sqrt(MAX_REFERENCE_AREA / (width * height))
        width, height = int(width * s), int(height * s)
    return width // multiple * multiple, height // multiple * multiple


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of ``image`` once its EXIF orientation is applied (5-8 are quarter turns)."""
    try:
        orientation = image.getexif().get(0x0112, 1)
    except (OSError, ValueError, SyntaxError, TypeError):  # unreadable EXIF: the pixels are taken as stored
        orientation = 1
    return (image.height, image.width) if orientation in (5, 6, 7, 8) else (image.width, image.height)


def prepare_reference_image(image: Image.Image, multiple: int = 16) -> torch.Tensor:
    """Preprocess a reference image for VAE encoding: ``Tensor[1, 3, H, W]`` in [-1, 1], float32.

    LANCZOS down-scaling to at most 1024x1024 pixels of area when larger (before RGB conversion,
    like diffusers, for RGB, grey and 16-bit pictures; palette and alpha pictures are converted to
    RGB first), then a centre crop to multiples of ``multiple`` (16 for the FLUX.2 VAE).
    Grayscale, palette, RGBA (alpha dropped), 16-bit and float images are converted to 8-bit RGB;
    the EXIF orientation of photos is applied first.
    """
    image, peak = _fitted_reference(image, multiple)
    return _as_pixels(_to_rgb_array(image, peak))


def reference_pixels(image: Image.Image, multiple: int = 16, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`prepare_reference_image` made on ``device`` (default: the CPU): the same values and
    strides. For a GPU (any device but the CPU) an 8-bit picture crosses as its 8-bit levels, a
    quarter of the float pixels' bytes, and becomes float there (:func:`_pixels_from_levels`), so the
    host does no float work while the GPU idles: on a 2-core AMD EPYC a 1024² reference took 14-27 ms
    of host time to prepare and check as floats (the checks are not needed: a picture's values lie in
    [-1, 1] by construction), 3 ms as levels. On the CPU the float work is the same work either way."""
    image, peak = _fitted_reference(image, multiple)
    device = torch.device("cpu") if device is None else torch.device(device)
    if image.mode in _HIGH_BIT_MODES or device.type == "cpu":
        return to_device(_as_pixels(_to_rgb_array(image, peak)), device)
    return _pixels_from_levels(image, device)


def _pixels_from_levels(image: Image.Image, device: torch.device) -> torch.Tensor:
    """An 8-bit picture (converted to RGB) as ``[1, 3, H, W]`` float32 in [-1, 1] on ``device``: its
    levels copied there, then mapped through a table of the 256 values computed on the host as
    :func:`prepare_reference_image` computes them (bit for bit its pixels, whatever the device's
    arithmetic), with its strides."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    levels = to_device(torch.from_numpy(np.array(image, dtype=np.uint8)), device)  # [H, W, 3]
    table = to_device(_as_pixels(np.arange(256, dtype=np.float32)[:, None, None] / 255.0).flatten(), device)
    return table[levels.int()].permute(2, 0, 1)[None]


def _as_pixels(rgb: np.ndarray) -> torch.Tensor:
    """float32 ``[H, W, 3]`` in [0, 1] -> ``[1, 3, H, W]`` in [-1, 1] (channels-last strides, as made)."""
    return torch.from_numpy(rgb).permute(2, 0, 1)[None] * 2.0 - 1.0


def _fitted_reference(image: Image.Image, multiple: int) -> tuple[Image.Image, float | None]:
    """``image`` upright, scaled and cropped as :func:`prepare_reference_image` says, and the white
    level of a 16-bit, 32-bit or float picture (:func:`levels_peak`; None for 8-bit ones)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"reference must be a PIL.Image, got {type(image).__name__}")
    # Phone photos store their orientation in EXIF; honour it, as diffusers' load_image and ComfyUI's
    # LoadImage do (an image already upright is returned unchanged).
    image = ImageOps.exif_transpose(image)
    w, h = image.size
    if w < MIN_REFERENCE_SIDE or h < MIN_REFERENCE_SIDE:
        raise ValueError(f"reference image is {w}x{h}; both sides must be at least {MIN_REFERENCE_SIDE} px")
    if max(w / h, h / w) > MAX_ASPECT_RATIO:
        raise ValueError(f"reference image is {w}x{h}; the aspect ratio must be at most {MAX_ASPECT_RATIO}:1")
    # The white level of a 16/32-bit or float picture is judged on its pixels as given: LANCZOS
    # overshoots at edges, so a 0..1 picture read after resizing could look like a 0..255 one (and
    # come out almost black) or like one with negative values (and be refused).
    peak = levels_peak(image)
    if w * h > MAX_REFERENCE_AREA:
        if image.mode not in _HIGH_BIT_MODES and image.mode not in ("RGB", "L"):
            # Pillow resizes palette pictures with NEAREST whatever is asked, and pictures with alpha
            # premultiplied (transparent pixels turn black): converted first, they are scaled as the
            # RGB pixels a picture of 1 MP or less gives (diffusers resizes first, with these effects).
            image = image.convert("RGB")
        new_w, new_h = reference_size(w, h, 1)
        image = image.resize((new_w, new_h), Image.Resampling.LANCZOS)
        w, h = new_w, new_h
    tw, th = w // multiple * multiple, h // multiple * multiple
    left, top = (w - tw) // 2, (h - th) // 2
    return image.crop((left, top, left + tw, top + th)), peak


_HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def levels_mode(image: Image.Image) -> bool:
    """Whether ``image`` is a 16-bit, 32-bit or float picture, whose white level :func:`levels_peak` finds."""
    return image.mode in _HIGH_BIT_MODES


def levels_peak(image: Image.Image) -> float | None:
    """The value full white has in a 16-bit, 32-bit or float picture (None for 8-bit modes): I;16
    65535; I 255, or 65535 when a value is above 255; F 1, 255 or 65535, the smallest that holds every
    value (NaN, infinite or negative values are refused). Judge it before resizing (see
    :func:`prepare_reference_image`)."""
    if not levels_mode(image):
        return None
    if image.mode.startswith("I;16"):
        return 65535.0
    a = np.asarray(image, dtype=np.float32)
    if image.mode == "I":
        return 65535.0 if a.size and a.max() > 255 else 255.0
    # float images come in 0..1, 0..255 or 0..65535: scale by the range in use
    if not np.isfinite(a).all():
        raise ValueError("the reference image (a float 'F' image) has NaN or infinite pixel values")
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    peak = next((p for p in (1.0, 255.0, 65535.0) if hi <= p), None)
    if lo < 0 or peak is None:
        raise ValueError(f"the reference image (a float 'F' image) has values from {lo:g} to {hi:g}; "
                         "expected 0..1, 0..255 or 0..65535")
    return peak


def _to_rgb_array(image: Image.Image, peak: float | None = None) -> np.ndarray:
    """8-bit RGB as float32 [H, W, 3] in [0, 1]; 16-bit, 32-bit and float modes are divided by
    ``peak`` (default: :func:`levels_peak` of ``image``; give the one of the picture before it was
    resized) and clipped, not read as 8-bit."""
    if image.mode in _HIGH_BIT_MODES:
        if peak is None:
            peak = levels_peak(image)
        a = np.asarray(image, dtype=np.float32)
        if not np.isfinite(a).all():
            raise ValueError(f"the image (mode {image.mode}) has NaN or infinite pixel values")
        a = np.clip(a / peak, 0.0, 1.0)  # resampling overshoot at edges is clipped, as 8-bit resizing clips
        return np.repeat(a[..., None], 3, axis=-1).astype(np.float32)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.float32) / 255.0


def high_bit_to_rgb8(image: Image.Image) -> Image.Image:
    """A 16-bit, 32-bit or float picture as 8-bit RGB, scaled by its white level (:func:`levels_peak`);
    other pictures are returned as they are. PIL's own ``convert("RGB")`` clips such pictures at 255
    (a 16-bit photo comes out white), so pictures that are composited or padded go through this."""
    peak = levels_peak(image)
    if peak is None:
        return image
    grey = np.round(np.clip(np.asarray(image, dtype=np.float32) / peak, 0.0, 1.0) * 255).astype(np.uint8)
    return Image.fromarray(np.repeat(grey[..., None], 3, axis=-1), "RGB")


def _rounded(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0, 1] -> uint8 ``[B, H, W, 3]``, where the pixels are (a GPU's threads);
    the same float32 product and round-half-to-even as numpy's, so the bytes equal diffusers'."""
    return (pixels.float() * 255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def to_pil(pixels: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` in [0, 1] -> PIL images (rounded to 8 bits like diffusers). Only the 8-bit
    image crosses to the host, through page-locked memory (:func:`klein_core.transfer.to_host`)."""
    (arr,) = to_host(_rounded(pixels))
    return pil_images(arr)


def pil_images(arr: torch.Tensor) -> list[Image.Image]:
    """uint8 ``[B, H, W, 3]`` on the host -> B PIL images."""
    return [Image.fromarray(a) for a in arr.numpy()]


def queue_to_host(pixels: torch.Tensor, copies: HostCopies) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixels`` ``[B, 3, H, W]`` in [0, 1], queued to the host in ``copies``: as float32, and rounded
    to uint8 ``[B, H, W, 3]`` where they are (for :func:`pil_images`). Read both after ``copies.wait()``."""
    pixels = pixels.float()
    host_pixels, arr = copies.add(pixels, _rounded(pixels))
    return host_pixels, arr


def to_pil_and_host(pixels: torch.Tensor) -> tuple[list[Image.Image], torch.Tensor]:
    """PIL images of ``pixels`` ``[B, 3, H, W]`` in [0, 1], and the pixels on the CPU (float32):
    both copies queued, then one wait."""
    copies = HostCopies()
    host_pixels, arr = queue_to_host(pixels, copies)
    copies.wait()
    return pil_images(arr), host_pixels
