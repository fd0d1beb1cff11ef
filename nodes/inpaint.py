"""Klein Inpaint Crop / Klein Inpaint Stitch: crop-and-stitch for a small mask on a large image.

What ComfyUI's core lacks: the crop around the mask at a size the model likes, and the paste back
with a feathered edge that leaves every unmasked pixel as it was. Everything else (padding for
outpainting, mask editing, compositing) uses ComfyUI's own nodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from comfy_api.latest import io

from klein_core.pipeline.inpaint import composite_pixels, crop_region, crop_size, feather_mask, feather_radius

from . import host, notices
from .common import resize_image

logger = logging.getLogger(__name__)

CROP_NODE = "Klein Inpaint Crop"
STITCH_NODE = "Klein Inpaint Stitch"
KleinStitchType = io.Custom("KLEIN_STITCH")


@dataclass(frozen=True)
class StitchInfo:
    """Where a crop came from: the full image ``[1, H, W, C]``, its mask ``[H, W]`` and the box."""

    original: torch.Tensor
    mask: torch.Tensor
    box: tuple[int, int, int, int]

    def __str__(self) -> str:
        x1, y1, x2, y2 = self.box
        return f"crop {x2 - x1}x{y2 - y1} at ({x1}, {y1}) of a {self.original.shape[2]}x{self.original.shape[1]} image"


def _rgb(images: torch.Tensor) -> torch.Tensor:
    """IMAGE ``[B, H, W, C]`` as float32 RGB: alpha dropped, a grey image (1 channel, or grey + alpha)
    repeated to three channels, as Flux2 VAE Encode and Klein Reference Stacker read one. The crop
    and the stitch must agree on three channels, or pasting an RGB painted crop into a grey
    original fails."""
    images = images.float()
    if images.shape[-1] >= 3:
        return images[..., :3]
    return images[..., :1].expand(*images.shape[:-1], 3)


def _feather(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """``feather_mask`` at the largest radius up to ``radius`` that erases no painted region
    (:func:`~klein_core.pipeline.inpaint.feather_radius`), said once when lowered."""
    r = feather_radius(mask, radius)
    if r != radius:
        logger.warning("%s: feather %d would erase part of the mask (a spot or stroke narrower than the "
                       "feather); feather %d used instead", STITCH_NODE, radius, r)
    return feather_mask(mask, r)


def _one_mask(mask: torch.Tensor, image: torch.Tensor, node: str) -> torch.Tensor:
    if mask.ndim == 3 and mask.shape[0] == 0:
        raise ValueError(f"{node}: the mask holds no frame (an empty batch); connect a mask of the image's size.")
    m = mask if mask.ndim == 2 else mask[0]
    if mask.ndim == 3 and mask.shape[0] > 1:
        logger.warning("%s: the mask has %d frames; the first is used", node, mask.shape[0])
    if m.shape == (64, 64) and not m.any():
        # LoadImage's MASK output for a picture without alpha: an empty 64x64 placeholder
        raise ValueError(f"{node}: the mask is empty (the picture has no mask: LoadImage gives a blank 64x64 one); "
                         f"paint the area in ComfyUI's mask editor (right-click the Load Image node) or "
                         f"connect a mask of the image's size.")
    if m.shape != image.shape[1:3]:
        raise ValueError(f"{node}: the mask is {m.shape[1]}x{m.shape[0]} but the image is {image.shape[2]}x"
                         f"{image.shape[1]}; use a mask of the image's size (LoadImage's own mask, or Upscale "
                         f"Image on the mask).")
    m = m.float()
    if m.numel() and (not torch.isfinite(m).all() or m.min() < 0 or m.max() > 1):
        found = "NaN/inf" if not torch.isfinite(m).all() else f"{float(m.min()):g}..{float(m.max()):g}"
        raise ValueError(f"{node}: the mask's values must lie within 0..1 (1 = repaint, 0 = keep); got {found}. "
                         f"Fix the node that made the mask (a MASK is 0..1).")
    return m


class KleinInpaintCrop(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinInpaintCrop",
            display_name=CROP_NODE,
            category="Klein/inpaint",
            description="Crops the region around the mask (plus padding, at the image's aspect ratio) and "
                        "scales it to a size Klein likes, so a small mask on a large image is painted in "
                        "detail. Connect its stitch output to Klein Inpaint Stitch.",
            inputs=[
                io.Image.Input("image", tooltip="The full image (one frame)."),
                io.Mask.Input("mask", tooltip="White = repaint: LoadImage's mask (transparent pixels), the "
                                              "mask editor, Pad Image for Outpainting, or any mask node."),
                io.Int.Input("padding", default=32, min=0, max=4096, tooltip=(
                    "Pixels of context kept around the mask (the model sees them to match the scene).")),
                io.Float.Input("megapixels", default=1.0, min=0.0625, max=4.0, step=0.0625, tooltip=(
                    "Size the crop is painted at (Klein works best near 1 megapixel); sides are "
                    "multiples of 16.")),
            ],
            outputs=[
                io.Image.Output(display_name="image", tooltip="The crop, scaled, for Flux2 VAE Encode."),
                io.Mask.Output(display_name="mask", tooltip="The crop's mask, for Klein Sampler."),
                KleinStitchType.Output(display_name="stitch", tooltip="Where the crop goes back (Klein Inpaint "
                                                                      "Stitch)."),
            ],
        )

    @classmethod
    @notices.reported
    def execute(cls, image: torch.Tensor, mask: torch.Tensor, padding: int = 32,
                megapixels: float = 1.0) -> io.NodeOutput:
        if image.ndim != 4:
            raise ValueError(f"{CROP_NODE}: image must be an IMAGE [batch, height, width, channels], got "
                             f"{list(image.shape)}.")
        if image.shape[0] != 1:
            raise ValueError(f"{CROP_NODE}: the image has {image.shape[0]} frames; crop-and-stitch takes one "
                             + ("(split the batch first)." if image.shape[0] else "(an empty batch: connect an image)."))
        m = _one_mask(mask, image, CROP_NODE)
        try:
            box = crop_region(m, image.shape[2], image.shape[1], int(padding))
            tw, th = crop_size(box, float(megapixels))
        except ValueError as exc:
            raise ValueError(f"{CROP_NODE}: {exc}.") from exc
        x1, y1, x2, y2 = box
        crop = resize_image(_rgb(image[:, y1:y2, x1:x2]), tw, th)
        crop_mask = F.interpolate(m[None, None, y1:y2, x1:x2], size=(th, tw), mode="bilinear")[0].clamp(0, 1)
        logger.info("%s: %dx%d region at (%d, %d) painted at %dx%d", CROP_NODE, x2 - x1, y2 - y1, x1, y1, tw, th)
        info = StitchInfo(host.to_intermediate(image[:1]), host.to_intermediate(m), box)
        return io.NodeOutput(crop, crop_mask, info)


class KleinInpaintStitch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinInpaintStitch",
            display_name=STITCH_NODE,
            category="Klein/inpaint",
            description="Puts the painted crop back into the full image. With composite on, only masked "
                        "pixels change: every other pixel is the original's, exactly.",
            inputs=[
                KleinStitchType.Input("stitch", tooltip="From Klein Inpaint Crop."),
                io.Image.Input("image", tooltip="The painted crop (Flux2 VAE Decode); every frame is stitched."),
                io.Int.Input("feather", default=8, min=0, max=256, tooltip=(
                    "Soften the seam over this many pixels, inside the mask only.")),
                io.Boolean.Input("composite", default=True, tooltip=(
                    "On: only masked pixels change. Off: the whole crop region is replaced.")),
            ],
            outputs=[io.Image.Output(display_name="image", tooltip="The full image with the painted region.")],
        )

    @classmethod
    @notices.reported
    def execute(cls, stitch: StitchInfo, image: torch.Tensor, feather: int = 8, composite: bool = True) -> io.NodeOutput:
        if not isinstance(stitch, StitchInfo):
            raise TypeError(f"{STITCH_NODE}: stitch must come from {CROP_NODE}.")
        if image.ndim != 4:
            raise ValueError(f"{STITCH_NODE}: image must be an IMAGE [batch, height, width, channels], got "
                             f"{list(image.shape)}.")
        x1, y1, x2, y2 = stitch.box
        original = _rgb(stitch.original)
        patch = resize_image(_rgb(image).to(original.device), x2 - x1, y2 - y1)
        canvas = original.expand(image.shape[0], -1, -1, -1).clone()
        canvas[:, y1:y2, x1:x2] = patch
        if composite:
            mask = _feather(stitch.mask.float(), int(feather))
            canvas = composite_pixels(original.expand_as(canvas), canvas, mask)
        return io.NodeOutput(host.to_intermediate(canvas))
