"""The VAE's side of a run as functions: references encoded once, latents decoded to pixels, and the
pixel sizes worked out before encoding (for the memory plan and the size rules)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from ..checks import Checks
from ..memory import tiling
from ..transfer import to_host
from .images import oriented_size, reference_pixels, reference_size
from .request import as_list, as_reference


def overflow_cause(dtype: torch.dtype) -> str:
    return ("fp16 overflow: load the model in bf16 or fp32" if dtype == torch.float16
            else "an extreme guidance value, or weights that overflow in this dtype")


def text_overflow_cause(dtype: torch.dtype) -> str:
    """:func:`overflow_cause` for the text encoder's output ``dtype`` (its activations' when
    ``TextOptions.activations`` is set): fp32 activations cure an fp16 overflow without loading it again."""
    if dtype == torch.float16:
        return ("fp16 overflow in the text encoder's activations: compute them in fp32 "
                "(TextOptions(activations=torch.float32) in Python, --text-precision fp32 for klein-generate "
                "and python -m klein_core batch/serve, precision 'fp32 activations' on the encoder node), "
                "or in a bf16 or fp32 model's own dtype")
    return overflow_cause(dtype)


def decode_to_pixels(vae: Any, latents: torch.Tensor, *, tile: int | None = None, clamp: bool = True,
                     host: bool = True) -> torch.Tensor:
    """Decode normalised latents ``[B, 128, h, w]`` to pixels ``[B, 3, 16h, 16w]`` in [0, 1] (fp32).

    ``tile``: decode in overlapping tiles of this many latent positions (see ``memory.tiling``);
    ``clamp=False`` keeps values outside [0, 1] (and NaN) for checking; ``host``: on the CPU
    (through page-locked memory), else where the VAE decoded them.
    """
    px = tiling.decode(vae, latents, tile).float() / 2 + 0.5
    if clamp:
        px = px.clamp(0, 1)  # where it was decoded (a GPU's threads)
    return to_host(px)[0] if host else px


#: How far outside [-1, 1] tensor pixels may reach before they are refused as given in another range
#: (0..255 most often): far enough for a resampling filter's overshoot and for ComfyUI images over 1
#: (HDR loaders, unclamped maths), which ComfyUI's own VAE Encode takes.
PIXEL_BOUND = 16.0
PIXEL_HINT = "8-bit values: x.float() / 127.5 - 1; a [0, 1] image: x * 2 - 1"


def encode_references(
    vae: Any, images: Sequence[Image.Image | torch.Tensor], *, tile: int | None = None, first: int = 1,
    checks: Checks | None = None,
) -> list[torch.Tensor]:
    """VAE-encode each reference once: a list of normalised latents ``[1, 128, h, w]``.

    PIL images are preprocessed as :func:`~klein_core.pipeline.images.prepare_reference_image` says, on the
    VAE's device (:func:`~klein_core.pipeline.images.reference_pixels`); tensors
    must already be ``[1, 3, H, W]`` in [-1, 1] with H and W multiples of 16. ``tile``: encode in
    tiles of this many latent positions; ``first``: the number of the first image in messages;
    ``checks``: a run's :class:`~klein_core.checks.Checks` (default: each check read at once).
    """
    check = checks or Checks()
    out = []
    for n, img in enumerate(as_list(images, "references"), start=first):
        img = as_reference(img, n)
        picture = isinstance(img, Image.Image)
        if picture:
            try:  # made where the VAE is (reference_pixels: the host does no float work for a GPU)
                px = reference_pixels(img, vae.config.downscale, getattr(vae, "device", None))
            except (OSError, SyntaxError) as exc:  # PIL reads lazily: a truncated or corrupt file fails here
                raise ValueError(f"reference {n}: cannot read the image ({exc}); the file is truncated or "
                                 "corrupt.") from None
            except ValueError as exc:
                raise ValueError(f"reference {n}: {exc}") from None
        else:
            px = img
        if not isinstance(px, torch.Tensor) or px.ndim != 4 or px.shape[0] != 1 or px.shape[1] != 3:
            got = list(px.shape) if isinstance(px, torch.Tensor) else type(px).__name__
            raise ValueError(f"reference {n}: expected a PIL image or a [1, 3, H, W] tensor, got {got}")
        down = vae.config.downscale
        if px.shape[-1] % down or px.shape[-2] % down:
            raise ValueError(f"reference {n}: a tensor reference needs height and width that are multiples of "
                             f"{down}, got {px.shape[-2]}x{px.shape[-1]} (H x W); crop it, or give the picture "
                             "as a PIL image (it is then cropped to fit)")
        if not px.is_floating_point():
            raise TypeError(f"reference {n}: a tensor reference holds float pixels in [-1, 1], got {px.dtype} "
                            f"({PIXEL_HINT})")
        if not picture:  # a picture's pixels lie in [-1, 1] by construction
            check.require_finite(px, f"reference {n}")
            check.require_within(px, f"reference {n}", PIXEL_BOUND,
                                 f"a tensor reference holds pixels in [-1, 1] ({PIXEL_HINT})")
        latent = tiling.encode(vae, px, tile)
        check.check_output(latent, f"The VAE encoder (reference {n})", vae, overflow_cause(vae.dtype))
        out.append(latent)
    return out


def reference_pixel_sizes(images: Sequence[Image.Image | torch.Tensor], latents: Sequence[torch.Tensor] = (),
                          downscale: int = 16) -> list[tuple[int, int]]:
    """(width, height) each reference will have, worked out before encoding: latents first, then images."""
    sizes = [(lat.shape[-1] * downscale, lat.shape[-2] * downscale) for lat in latents]
    for img in images:
        if isinstance(img, Image.Image):
            sizes.append(reference_size(*oriented_size(img), downscale))
        else:
            sizes.append((img.shape[-1], img.shape[-2]))
    return sizes


def size_source(what: str, image: Image.Image | torch.Tensor, downscale: int = 1) -> str:
    """``what`` with the image's own size, for an error that names it: ``"reference 1 (1x1 px)"``.
    ``downscale``: pixels per position of a tensor (16 for latents, 1 for pixels)."""
    if isinstance(image, Image.Image):
        w, h = oriented_size(image)
    elif isinstance(image, torch.Tensor) and image.ndim >= 2:
        w, h = image.shape[-1] * downscale, image.shape[-2] * downscale
    else:  # not an image: refused elsewhere, by its type
        return what
    return f"{what} ({w}x{h} px)"


__all__ = ["decode_to_pixels", "encode_references", "overflow_cause", "reference_pixel_sizes", "size_source",
           "text_overflow_cause"]
