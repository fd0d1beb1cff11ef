"""Image-to-image, inpainting and outpainting: the image and mask prepared as diffusers'
``Flux2KleinInpaintPipeline`` prepares them, the crop around a small mask, the stitch back into the
full image, and the final composite that keeps every unmasked pixel exactly.

Masks follow ComfyUI and diffusers: 1 (white) = repaint, 0 (black) = keep; grey values blend in the
composite and are binarised (at 0.5) for the sampler, as diffusers does.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .images import MAX_REFERENCE_AREA, MIN_REFERENCE_SIDE, _to_rgb_array, high_bit_to_rgb8, reference_size

logger = logging.getLogger(__name__)

MaskInput = Image.Image | torch.Tensor | np.ndarray

# diffusers' Flux2KleinInpaintPipeline defaults to 0.8 for every call; a mask usually means "paint
# this area anew", so with a mask the default is a full repaint.
DEFAULT_STRENGTH_IMAGE_TO_IMAGE = 0.8
DEFAULT_STRENGTH_INPAINT = 1.0


def processing_size(width: int, height: int, multiple: int = 16) -> tuple[int, int]:
    """The size an init image is generated at: scaled to at most 1 megapixel (``int`` of each side,
    as diffusers), then each side rounded down to a multiple of ``multiple`` (by resizing, not
    cropping: the image keeps its content edge to edge). The numbers are a reference's
    (:func:`~klein_core.pipeline.images.reference_size`)."""
    return reference_size(width, height, multiple)


# The largest canvas outpaint makes (PIL's own decompression-bomb limit is 89 megapixels for reading).
MAX_CANVAS_PIXELS = 256 * 10**6


def steps_to_run(steps: int, strength: float) -> int:
    """How many of ``steps`` an image-to-image run at ``strength`` takes (diffusers' get_timesteps:
    the schedule of ``steps`` is computed whole and its first ``int(steps - steps * strength)`` are
    skipped; 4 steps at strength 0.6 run 3)."""
    init = min(steps * strength, steps)
    return steps - int(max(steps - init, 0))


def check_strength(strength: float) -> float:
    """``strength`` as a float in (0, 1] (numpy numbers too), or a ValueError naming it."""
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not math.isfinite(strength) \
            or not 0 < strength <= 1:
        raise ValueError(f"strength (denoise) must be a number in (0, 1], got {strength!r}")
    return float(strength)


# ----- masks ----------------------------------------------------------------------------------------


def _range(a: np.ndarray) -> str:
    return "NaN" if np.isnan(a).any() else f"{float(np.min(a)):g}..{float(np.max(a)):g}"


def _pil_levels(mask: Image.Image) -> np.ndarray | None:
    """The 0..1 values of a PIL mask that ``convert("L")`` would misread, else None (convert it)."""
    if mask.mode == "F" or mask.mode.startswith("I"):
        a = np.asarray(mask, dtype=np.float64)
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 65535 or (mask.mode == "F" and a.max() > 255):
            limit = "0..1 (or 0..255)" if mask.mode == "F" else "0..65535"
            raise ValueError(f"mask (a mode {mask.mode} image) must hold values within {limit}; got {_range(a)}")
        if mask.mode.startswith("I;16"):
            scale = 65535.0
        else:
            scale = 1.0 if a.max() <= 1 else 255.0 if a.max() <= 255 else 65535.0
        return (a / scale).astype(np.float32)
    if mask.mode in ("RGBA", "LA", "PA"):
        colour, alpha = np.asarray(mask.convert("L")), np.asarray(mask.getchannel("A"))
        if colour.min() == colour.max() and alpha.min() != alpha.max():
            logger.warning("the %s mask's colour is uniform and only its alpha varies: the alpha is used, "
                           "transparent = repaint (as ComfyUI reads a mask from alpha)", mask.mode)
            return 1 - alpha.astype(np.float32) / 255.0
    return None


def _pil_grey(mask: Image.Image) -> tuple[Image.Image, bool]:
    """``(the mask in mode L, whether that is plain convert("L"))``."""
    levels = _pil_levels(mask)
    if levels is not None:
        return Image.fromarray(np.round(levels * 255).astype(np.uint8), "L"), False
    try:
        return mask.convert("L"), True
    except (ValueError, OSError) as exc:
        raise ValueError(f"mask: a mode {mask.mode} image cannot be read as a grey mask ({exc})") from None


def mask_array(mask: MaskInput) -> np.ndarray:
    """A mask as float32 ``[H, W]`` in [0, 1]: a PIL image, or a tensor / array ``[H, W]``,
    ``[1, H, W]`` or ``[1, 1, H, W]`` already in [0, 1] (else ValueError naming the range found).

    PIL: 8-bit modes are converted to L (/255, as diffusers). Float (F) and 32-bit (I) masks whose
    values all lie in 0..1 are 0..1 masks, else 0..255 (I: else 0..65535); 16-bit (I;16) are /65535.
    An RGBA/LA mask of one colour whose alpha alone varies is read from alpha as ComfyUI does
    (transparent = repaint), with a warning; diffusers would ignore the alpha.
    """
    if isinstance(mask, Image.Image):
        levels = _pil_levels(mask)
        return levels if levels is not None else np.asarray(_pil_grey(mask)[0], dtype=np.float32) / 255.0
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().float().cpu().numpy()
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"mask must be a PIL image, a tensor or an array, got {type(mask).__name__}")
    if mask.dtype == object or not (np.issubdtype(mask.dtype, np.number) or mask.dtype == bool):
        raise TypeError(f"mask must hold numbers, got an array of {mask.dtype}")
    a = np.asarray(mask, dtype=np.float32)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2:
        raise ValueError(f"mask must be one [H, W] mask, got shape {list(np.shape(mask))}")
    if a.size == 0:
        raise ValueError(f"mask is empty (shape {list(np.shape(mask))})")
    if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
        raise ValueError(f"mask values must be finite and within 0..1 (1 = repaint, 0 = keep); got {_range(a)}")
    return a


def mask_image(mask: MaskInput) -> Image.Image:
    """The mask as an 8-bit grey PIL image (see :func:`mask_array` for how PIL modes are read)."""
    if isinstance(mask, Image.Image):
        return _pil_grey(mask)[0]
    return Image.fromarray(np.round(mask_array(mask) * 255).astype(np.uint8), "L")


def _grow(lo: int, hi: int, diff: int, limit: int) -> tuple[int, int]:
    """``[lo, hi)`` grown by ``diff`` (half on each side), shifted back inside ``[0, limit)`` and
    clipped, in diffusers' order of steps."""
    lo, hi = lo - diff // 2, hi + diff - diff // 2
    if hi >= limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def crop_region(mask: MaskInput, width: int, height: int, pad: int = 0) -> tuple[int, int, int, int]:
    """``(x1, y1, x2, y2)``: the smallest box around every non-zero mask pixel, grown by ``pad`` on
    each side and then to the aspect ratio of ``width x height`` (diffusers' get_crop_region, so
    ``padding_mask_crop`` crops the same region). Raises for an empty mask."""
    m = np.asarray(mask_image(mask))
    h, w = m.shape
    cols, rows = np.flatnonzero(m.any(axis=0)), np.flatnonzero(m.any(axis=1))
    if cols.size == 0:
        raise ValueError("the mask is empty (all black): there is nothing to repaint")
    x1, y1 = max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0)
    x2, y2 = min(int(cols[-1]) + 1 + pad, w), min(int(rows[-1]) + 1 + pad, h)
    if (x2 - x1) / (y2 - y1) > width / height:  # too wide: grow the height
        y1, y2 = _grow(y1, y2, int((x2 - x1) / (width / height) - (y2 - y1)), h)
    else:
        x1, x2 = _grow(x1, x2, int((y2 - y1) * (width / height) - (x2 - x1)), w)
    return x1, y1, x2, y2


def _fill_size(image_w: int, image_h: int, width: int, height: int) -> tuple[int, int]:
    """The size an ``image_w x image_h`` picture takes inside ``width x height`` in :func:`_resize_fill`
    (its aspect kept; centred, the rest filled)."""
    ratio, src_ratio = width / height, image_w / image_h
    src_w = width if ratio < src_ratio else image_w * height // image_h
    src_h = height if ratio >= src_ratio else image_h * width // image_w
    return src_w, src_h


def _resize_fill(image: Image.Image, width: int, height: int) -> Image.Image:
    """Fit ``image`` inside ``width x height`` keeping its aspect, centred, the borders filled by
    stretching its edge rows/columns (diffusers' ``resize_mode="fill"``; RGB out, as there)."""
    ratio, src_ratio = width / height, image.width / image.height
    src_w, src_h = _fill_size(image.width, image.height, width, height)
    resized = image.resize((src_w, src_h), Image.Resampling.LANCZOS)
    out = Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio:
        fill = height // 2 - src_h // 2
        if fill > 0:
            out.paste(resized.resize((width, fill), box=(0, 0, width, 0)), box=(0, 0))
            out.paste(resized.resize((width, fill), box=(0, resized.height, width, resized.height)),
                      box=(0, fill + src_h))
    elif ratio > src_ratio:
        fill = width // 2 - src_w // 2
        if fill > 0:
            out.paste(resized.resize((fill, height), box=(0, 0, 0, height)), box=(0, 0))
            out.paste(resized.resize((fill, height), box=(resized.width, 0, resized.width, height)),
                      box=(fill + src_w, 0))
    return out


def _resized(image: Image.Image, width: int, height: int, box: tuple[int, int, int, int] | None) -> Image.Image:
    if box is not None:
        return _resize_fill(image.crop(box), width, height)
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.LANCZOS)


# ----- what a request asks for ----------------------------------------------------------------------


@dataclass(frozen=True)
class InitImage:
    """Start from an image (image-to-image), optionally repainting a masked part (inpainting, outpainting).

    Args:
        image: the start picture, whose size the output keeps (at most 1 MP, sides multiples of 16).
        mask: white (1) = repaint, black (0) = keep; PIL or ``[H, W]`` in 0..1 (resized to the image).
        strength: share of the schedule that runs, in (0, 1]; default 1.0 with a mask, else 0.8.
        as_reference: the image also joins as the first reference (time offset 10), as diffusers does.
        crop_padding: inpaint only a crop around the mask grown by this many pixels, stitched back.
        composite: keep every unmasked pixel exactly, at the original size (default; needs a mask).
        feather: with ``composite``, soften the seam over this many pixels inside the mask.
    """

    image: Image.Image
    mask: MaskInput | None = None
    strength: float | None = None
    as_reference: bool = True
    crop_padding: int | None = None
    composite: bool = True
    feather: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.image, Image.Image):
            raise TypeError(f"image must be a PIL.Image, got {type(self.image).__name__}")
        if self.strength is not None:  # kept as the float it is (a numpy number too)
            object.__setattr__(self, "strength", check_strength(self.strength))
        if isinstance(self.feather, bool) or not isinstance(self.feather, numbers.Integral) or self.feather < 0:
            raise ValueError(f"feather must be a whole number of pixels >= 0, got {self.feather!r}")
        object.__setattr__(self, "feather", int(self.feather))
        # generate()'s names beside InitImage's: a caller of generate() finds the argument it gave
        for name, alias in (("as_reference", "image_as_reference"), ("composite", "composite")):
            value = getattr(self, name)
            label = name if name == alias else f"{name} ({alias} of generate)"
            # "false", "no" or [False] would read as True: True or False only (numpy's too), or 0 / 1
            if not (isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1))):
                raise TypeError(f"{label} must be True or False, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, bool(value))
        pad = self.crop_padding
        where = "(mask_crop_padding of generate, --crop-padding of the CLI)"
        if pad is not None:
            if isinstance(pad, (bool, np.bool_)) or not isinstance(pad, numbers.Integral) or pad < 0:
                raise ValueError(f"crop_padding must be a whole number of pixels >= 0, got {pad!r} {where}")
            if self.mask is None:
                raise ValueError(f"crop_padding needs a mask: it crops the region around the mask {where}")
            object.__setattr__(self, "crop_padding", int(pad))
        if self.mask is not None and not isinstance(self.mask, Image.Image):
            mask_array(self.mask)  # a tensor / array mask out of 0..1 is refused here, before any work

    @property
    def resolved_strength(self) -> float:
        if self.strength is not None:
            return float(self.strength)
        return DEFAULT_STRENGTH_INPAINT if self.mask is not None else DEFAULT_STRENGTH_IMAGE_TO_IMAGE


# ----- the prepared inputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InpaintInputs:
    """An init image (and mask) ready for the sampler, and what the stitch-back needs.

    ``pixels`` ``[1, 3, H, W]`` in [-1, 1] at the processing size; ``mask`` ``[1, 1, H, W]`` in {0, 1}
    (binarised) or None; ``box`` the crop in ``original`` coordinates (None: the whole image);
    ``original`` the image as given (EXIF-upright, full size) and ``original_mask`` its mask as an
    8-bit image, for the stitch and the composite.
    """

    pixels: torch.Tensor
    mask: torch.Tensor | None
    box: tuple[int, int, int, int] | None
    original: Image.Image
    original_mask: Image.Image | None

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.shape[-1], self.pixels.shape[-2]


def prepare_inpaint(image: Image.Image, mask: MaskInput | None = None, *, crop_padding: int | None = None,
                    multiple: int = 16) -> InpaintInputs:
    """Prepare an image (and mask) for image-to-image or inpainting, as diffusers'
    ``Flux2KleinInpaintPipeline`` does: larger than 1 megapixel -> scaled down; each side resized
    down to a multiple of ``multiple``; with ``crop_padding``, only the region around the mask
    (grown by that many pixels, at the image's aspect ratio) is cropped and fitted to that size.
    The mask is resized the same way and binarised at 0.5.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"image must be a PIL.Image, got {type(image).__name__}")
    if crop_padding is not None:
        if mask is None:
            raise ValueError("crop_padding needs a mask: it crops the region around the mask")
        if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or crop_padding < 0:
            raise ValueError(f"crop_padding must be a whole number of pixels >= 0, got {crop_padding!r}")
    # 16-bit, 32-bit and float pictures become 8-bit RGB first, by their white level: resizing,
    # cropping and the final composite (PIL's convert("RGB") clips them at 255: white) then all see
    # the picture's real levels.
    image = high_bit_to_rgb8(ImageOps.exif_transpose(image))
    if image.mode not in ("RGB", "L"):
        # Pillow resizes palette pictures with NEAREST whatever is asked, and pictures with alpha
        # premultiplied (transparent pixels turn black, at some sizes only): as RGB they are scaled as
        # their pixels (the composite keeps those colours too). diffusers resizes first, with these effects.
        image = image.convert("RGB")
    w, h = image.size
    if w < MIN_REFERENCE_SIDE or h < MIN_REFERENCE_SIDE:
        raise ValueError(f"the image is {w}x{h}; both sides must be at least {MIN_REFERENCE_SIDE} px")
    width, height = processing_size(w, h, multiple)
    m_img, plain = _pil_grey(mask) if isinstance(mask, Image.Image) else (
        None if mask is None else mask_image(mask), False)
    box = None
    original, work = image, image
    if crop_padding is None and w * h > MAX_REFERENCE_AREA:  # diffusers' 1-megapixel step, sides int()
        work = image.resize(reference_size(w, h, 1), Image.Resampling.LANCZOS)
    if m_img is not None:
        if crop_padding is not None:
            if m_img.size != image.size:
                raise ValueError(f"the mask is {m_img.width}x{m_img.height} but the image is {image.width}x"
                                 f"{image.height}; with crop_padding both must be the same size")
            box = crop_region(m_img, width, height, crop_padding)
        elif not np.asarray(m_img).any():
            raise ValueError("the mask is empty (all black): there is nothing to repaint; for image-to-image "
                             "give no mask")
    pixels = torch.from_numpy(_to_rgb_array(_resized(work, width, height, box))).permute(2, 0, 1)[None] * 2 - 1
    mask_px = None
    if m_img is not None:
        # diffusers resizes the mask as given, then converts it to grey (masks convert("L") misreads:
        # their grey version)
        source = mask if plain else m_img
        m = np.asarray(_resized(source, width, height, box).convert("L"), dtype=np.float32) / 255.0
        mask_px = torch.from_numpy((m >= 0.5).astype(np.float32))[None, None]
        if not mask_px.any():
            # The sampler repaints only where the mask is at least 0.5: a mask all below that (faint grey,
            # or a few pixels lost when fitted to the processing size) would leave the picture as it was,
            # silently. ComfyUI's path (comfy_mask_to_latents) refuses it the same way.
            raise ValueError(f"the mask is empty once binarised at 0.5 for the {width}x{height} processing size "
                             f"(its brightest value is {int(np.asarray(m_img).max())}/255): nothing would be "
                             "repainted. Paint the area to repaint white (at least 128/255), or make it larger")
    return InpaintInputs(pixels, mask_px, box, original, m_img)


def resize_mask_to_latents(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A pixel mask ``[B, 1, H, W]`` on the latent grid ``[B, 1, height, width]`` (bilinear, as
    diffusers: edge positions get fractions)."""
    return F.interpolate(mask.float(), size=(height, width), mode="bilinear")


def comfy_mask_to_latents(mask: torch.Tensor, height: int, width: int, downscale: int = 16) -> torch.Tensor:
    """A pixel mask (ComfyUI MASK ``[B, H, W]`` or ``[H, W]``, 1 = repaint) for latents of
    ``height x width`` positions: resized to the latents' pixel size if needed, binarised at 0.5,
    then onto the latent grid as diffusers does. Returns ``[B, 1, height, width]``."""
    m = mask.detach().float()
    if m.ndim == 2:
        m = m[None]
    if m.ndim != 3:
        raise ValueError(f"mask must be [batch, height, width] or [height, width], got {list(mask.shape)}")
    if m.numel() == 0:
        raise ValueError(f"mask is empty (shape {list(mask.shape)})")
    if not torch.isfinite(m).all() or m.min() < 0 or m.max() > 1:
        raise ValueError("mask values must be finite and within 0..1 (1 = repaint, 0 = keep); got "
                         f"{_range(m.cpu().numpy())}")
    m = m[:, None]
    size = (height * downscale, width * downscale)
    if tuple(m.shape[-2:]) != size:
        m = F.interpolate(m, size=size, mode="bilinear")
    binary = (m >= 0.5).float()
    if not binary.any():
        raise ValueError("the mask is empty (all black): there is nothing to repaint")
    return resize_mask_to_latents(binary, height, width)


# ----- back into the picture -----------------------------------------------------------------------


def feather_mask(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """A float mask ``[..., H, W]`` in [0, 1] with its edge softened inwards over about ``radius``
    pixels: where the mask is 0 it stays exactly 0 (unmasked pixels are never touched); inside, it
    ramps up from the edge."""
    if radius <= 0:
        return mask
    sigma = radius / 2
    half = max(1, math.ceil(3 * sigma))
    x = torch.arange(-half, half + 1, dtype=torch.float32)
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k = (k / k.sum()).to(mask.device)
    flat = mask.float().reshape(-1, 1, *mask.shape[-2:])
    blurred = F.conv2d(F.pad(flat, (half, half, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    blurred = F.conv2d(F.pad(blurred, (0, 0, half, half), mode="replicate"), k.view(1, 1, -1, 1))
    # The blur spills outwards; 2b - 1 is 0 at the edge and 1 well inside, and the minimum keeps it
    # inside the mask.
    return torch.minimum(flat, (2 * blurred - 1).clamp(0, 1)).reshape(mask.shape)


def _within(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """Whether each pixel of ``mask`` ``[H, W]`` (bool) has a set pixel within ``radius`` pixels (a
    square window). Box sums by cumulative sums: the cost does not grow with the radius."""
    x = mask.float()
    for dim in (0, 1):
        n = x.shape[dim]
        c = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x.cumsum(dim)], dim)
        idx = torch.arange(n, device=x.device)
        hi = (idx + radius + 1).clamp(max=n)
        lo = (idx - radius).clamp(min=0)
        x = (c.index_select(dim, hi) - c.index_select(dim, lo) > 0).float()
    return x > 0


def feather_radius(mask: torch.Tensor, radius: int) -> int:
    """``radius``, halved until feathering ``mask`` ``[H, W]`` erases no painted region (0 at worst).

    Feathering keeps ``2 * blur - 1`` inside the mask: a region narrower than about 1.2x the radius
    (a 6x6 spot or a 5 px stroke at radius 8) ends up 0 everywhere, and a composite would silently
    keep the original there. Each painted pixel (mask >= 0.5, what the sampler repaints) must lie
    within the radius of a pixel that feathering the painted area keeps at >= 0.5. The check is on
    the painted area, not on the mask's grey levels, so an already soft edge keeps its radius."""
    painted = mask >= 0.5
    r = radius
    while r > 0 and painted.any():
        if _within(feather_mask(painted.float(), r) >= 0.5, r)[painted].all():
            break
        r //= 2
    return max(r, 0)


def composite_pixels(original: torch.Tensor, generated: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``generated`` under the mask, ``original`` elsewhere; channels last ``[..., H, W, C]``, mask
    ``[..., H, W]`` in [0, 1]. Where the mask is 0 the result is ``original`` bit for bit."""
    m = mask.to(original.dtype)[..., None]
    blended = original * (1 - m) + generated.to(original.dtype) * m
    return torch.where(m == 0, original, blended)


def composite(original: Image.Image, generated: Image.Image, mask: MaskInput, feather: int = 0) -> Image.Image:
    """``generated`` where the mask is white, ``original`` where it is black, blended in between:
    every pixel under a black mask is the original's, bit for bit. ``original`` is taken upright (its
    EXIF orientation); ``generated`` (and the mask, read as :func:`crop_for_inpaint` reads it) are
    resized to the original's size first if they differ."""
    return _composite(ImageOps.exif_transpose(original), generated, mask, feather)


def _composite(original: Image.Image, generated: Image.Image, mask: MaskInput, feather: int) -> Image.Image:
    """:func:`composite` of an ``original`` already upright (transposed once: Pillow 10 left an XMP
    orientation behind, which a second transpose applied again)."""
    original = high_bit_to_rgb8(original).convert("RGB")  # a 16-bit original: its levels, not white
    if generated.size != original.size:
        generated = generated.resize(original.size, Image.Resampling.LANCZOS)
    mask = mask_image(mask)  # read as crop_for_inpaint reads it (float, alpha-only and tensor masks)
    if mask.size != original.size:
        # BILINEAR, not LANCZOS: LANCZOS rings, changing pixels a few px outside a resized mask
        mask = mask.resize(original.size, Image.Resampling.BILINEAR)
    m = torch.from_numpy(np.asarray(mask.convert("L"), dtype=np.float32) / 255.0)
    radius = feather_radius(m, feather)
    if radius != feather:
        logger.warning("feather %d would erase part of the mask (a spot or stroke narrower than the feather); "
                       "feather %d used instead", feather, radius)
    m = feather_mask(m, radius)
    a = torch.from_numpy(np.asarray(original, dtype=np.float32))
    b = torch.from_numpy(np.asarray(generated.convert("RGB"), dtype=np.float32))
    return Image.fromarray(composite_pixels(a, b, m).round().clamp(0, 255).to(torch.uint8).numpy(), "RGB")


def stitch(original: Image.Image, generated: Image.Image, box: tuple[int, int, int, int] | None,
           mask: MaskInput | None, *, feather: int = 0, keep_unmasked: bool = True,
           fitted: bool = False) -> Image.Image:
    """Put a generated crop back: resized to ``box`` in ``original``, then (``keep_unmasked``)
    composited so that only the masked pixels change. ``box`` None: ``generated`` is the whole picture.
    ``fitted``: the crop was fitted into the generated size keeping its aspect, the rest filled
    (:func:`prepare_inpaint`, the engine's crop): only the crop's own region goes back. Without it the
    whole generated picture is the crop, stretched (:func:`crop_for_inpaint`'s).

    (diffusers' own ``padding_mask_crop`` overlay for Klein centre-crops the generated image to the
    box size instead of resizing it, which misplaces the content; this resizes it.)
    """
    original = ImageOps.exif_transpose(original)  # upright, as the crop was taken (a no-op once applied)
    if box is None:
        canvas = generated
    else:
        x1, y1, x2, y2 = _check_box(box, original.size)
        canvas = high_bit_to_rgb8(original).convert("RGB")  # a copy; a 16-bit original keeps its levels
        region = generated.convert("RGB")
        if fitted:
            # Fitted keeping its aspect (_resize_fill), with filled bands where a box clipped by the
            # picture's border has another aspect: only the crop's own region goes back into the box,
            # not the bands (they squeezed and shifted it by several px).
            gw, gh = generated.size
            src_w, src_h = _fill_size(x2 - x1, y2 - y1, gw, gh)
            left, top = gw // 2 - src_w // 2, gh // 2 - src_h // 2
            region = region.crop((left, top, left + src_w, top + src_h))
        canvas.paste(region.resize((x2 - x1, y2 - y1), Image.Resampling.LANCZOS), (x1, y1))
    if keep_unmasked and mask is not None:
        return _composite(original, canvas, mask, feather)
    return canvas.convert("RGB") if canvas.size == original.size else canvas.resize(original.size,
                                                                                      Image.Resampling.LANCZOS)


def _check_box(box: object, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """``box`` as ``(x1, y1, x2, y2)`` inside an image of ``size``, with x1 < x2 and y1 < y2; else a
    ValueError naming it."""
    try:
        x1, y1, x2, y2 = (int(v) for v in box)  # type: ignore[union-attr]
        ok = all(float(v) == int(v) for v in box)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"stitch: box must be four whole numbers (x1, y1, x2, y2), got {box!r}") from None
    if not ok or not (0 <= x1 < x2 <= size[0] and 0 <= y1 < y2 <= size[1]):
        raise ValueError(f"stitch: box {box!r} must satisfy 0 <= x1 < x2 <= {size[0]} and 0 <= y1 < y2 <= {size[1]} "
                         f"(the original's size)")
    return x1, y1, x2, y2


def outpaint(image: Image.Image, left: int = 0, top: int = 0, right: int = 0, bottom: int = 0, *,
             feather: int = 0) -> tuple[Image.Image, Image.Image]:
    """The image on a larger canvas and the mask of the new area (white), for inpainting.

    The new area is filled with the image's edge pixels stretched outwards (a better start for the
    sampler than a flat colour); ``feather`` also marks that many pixels of the image's own edge,
    ramping down, so the seam is repainted softly.
    """
    for name, v in (("left", left), ("top", top), ("right", right), ("bottom", bottom), ("feather", feather)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a whole number of pixels >= 0, got {v!r}")
    if not left + top + right + bottom:
        raise ValueError("outpaint needs at least one side to grow (left, top, right or bottom > 0)")
    image = high_bit_to_rgb8(ImageOps.exif_transpose(image)).convert("RGB")  # 16-bit: not clipped to white
    w, h = image.size
    cw, ch = w + left + right, h + top + bottom
    if cw * ch > MAX_CANVAS_PIXELS:
        raise ValueError(f"outpaint would make a {cw}x{ch} canvas ({cw * ch / 1e6:,.0f} megapixels); at most "
                         f"{MAX_CANVAS_PIXELS // 10**6} megapixels (the generated area is cropped around the mask "
                         "and scaled to about 1 megapixel anyway)")
    arr = np.pad(np.asarray(image), ((top, bottom), (left, right), (0, 0)), mode="edge")
    mask = np.full(arr.shape[:2], 255, dtype=np.float32)
    inner = np.zeros((h, w), dtype=np.float32)
    if feather:
        yy, xx = np.mgrid[0:h, 0:w]
        dist = np.full((h, w), np.inf, dtype=np.float32)
        for grows, d in ((left, xx), (right, w - 1 - xx), (top, yy), (bottom, h - 1 - yy)):
            if grows:
                dist = np.minimum(dist, d)
        inner = np.where(dist < feather, (1 - dist / feather) ** 2 * 255, 0)
    mask[top:top + h, left:left + w] = inner
    return Image.fromarray(arr), Image.fromarray(np.round(mask).astype(np.uint8), "L")


def crop_size(box: tuple[int, int, int, int], megapixels: float = 1.0, multiple: int = 16) -> tuple[int, int]:
    """The size a crop ``box`` is generated at: scaled (up or down) to about ``megapixels``, each side
    a multiple of ``multiple``."""
    if not 0.0625 <= megapixels <= 4:
        raise ValueError(f"megapixels must be from 0.0625 to 4, got {megapixels}")
    bw, bh = box[2] - box[0], box[3] - box[1]
    s = math.sqrt(megapixels * 1024 * 1024 / (bw * bh))
    return max(multiple, int(bw * s) // multiple * multiple), max(multiple, int(bh * s) // multiple * multiple)


def crop_for_inpaint(image: Image.Image, mask: MaskInput, *, padding: int = 32, megapixels: float = 1.0,
                     multiple: int = 16) -> tuple[Image.Image, Image.Image, tuple[int, int, int, int]]:
    """Crop-and-stitch, first half: the region around the mask (grown by ``padding`` pixels, at the
    image's aspect ratio) cut out of the full-size ``image`` and resized to about ``megapixels``
    (sides multiples of ``multiple``), with its mask. Returns ``(crop, crop_mask, box)``; after
    generating, :func:`stitch` puts the result back with ``box``.
    """
    image = ImageOps.exif_transpose(image)
    m = mask_image(mask)
    if m.size != image.size:
        raise ValueError(f"the mask is {m.width}x{m.height} but the image is {image.width}x{image.height}")
    box = crop_region(m, image.width, image.height, padding)
    tw, th = crop_size(box, megapixels, multiple)
    crop = high_bit_to_rgb8(image).crop(box).convert("RGB").resize((tw, th), Image.Resampling.LANCZOS)
    crop_mask = m.crop(box).resize((tw, th), Image.Resampling.LANCZOS)
    return crop, crop_mask, box


__all__ = [
    "DEFAULT_STRENGTH_IMAGE_TO_IMAGE",
    "DEFAULT_STRENGTH_INPAINT",
    "InitImage",
    "InpaintInputs",
    "check_strength",
    "comfy_mask_to_latents",
    "composite",
    "composite_pixels",
    "crop_for_inpaint",
    "crop_region",
    "crop_size",
    "feather_mask",
    "feather_radius",
    "mask_array",
    "mask_image",
    "outpaint",
    "prepare_inpaint",
    "processing_size",
    "resize_mask_to_latents",
    "steps_to_run",
    "stitch",
]
