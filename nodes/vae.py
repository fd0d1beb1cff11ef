"""Flux2 VAE Decode / Encode: between ComfyUI's LATENT (FLUX.2 layout) and IMAGE."""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

from klein_core.pipeline.inpaint import processing_size

from . import host, notices
from .common import check_widget, flux2_samples, open_engine, resize_image
from .types import KleinVAE, KleinVAEType

logger = logging.getLogger(__name__)

DECODE_NODE = "Flux2 VAE Decode"
ENCODE_NODE = "Flux2 VAE Encode"
SIZES = ("crop to 16", "fit 1 megapixel")


def center_crop(pixels: torch.Tensor, multiple: int) -> torch.Tensor:
    """Crop ``[B, H, W, C]`` to multiples of ``multiple``, centred (like ComfyUI's VAE Encode)."""
    h, w = pixels.shape[1] // multiple * multiple, pixels.shape[2] // multiple * multiple
    top, left = (pixels.shape[1] - h) // 2, (pixels.shape[2] - w) // 2
    return pixels[:, top:top + h, left:left + w]


class KleinVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinVAEDecode",
            display_name=DECODE_NODE,
            category="Klein/latent",
            description="Decodes FLUX.2 latents (128 channels) to images with the FLUX.2 VAE.",
            inputs=[
                io.Latent.Input("samples",
                                tooltip="FLUX.2 latents [B, 128, H/16, W/16], e.g. from Klein Sampler."),
                KleinVAEType.Input("vae", tooltip="The FLUX.2 VAE from Klein Model Loader."),
            ],
            outputs=[io.Image.Output(display_name="image", tooltip="Images [B, H, W, 3] in 0..1.")],
        )

    @classmethod
    @notices.reported
    def execute(cls, samples: dict, vae: KleinVAE) -> io.NodeOutput:
        latents = flux2_samples(samples, vae.config.latent_channels, DECODE_NODE, "samples",
                                " (connect Klein Sampler or another FLUX.2 latent; SD, SDXL and FLUX.1 latents "
                                "need their own VAE and VAE Decode)")
        engine = open_engine(DECODE_NODE, {"vae": ("vae", vae.ref)}, speed=vae.speed)
        image = engine.decode(latents).permute(0, 2, 3, 1).contiguous()  # one image at a time, tiled if short
        return io.NodeOutput(image.to(host.intermediate_device()))


class KleinVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KleinVAEEncode",
            display_name=ENCODE_NODE,
            category="Klein/latent",
            description="Encodes images to FLUX.2 latents with the FLUX.2 VAE (centre-cropped to multiples "
                        "of 16).",
            inputs=[
                io.Image.Input("pixels", tooltip="Images [B, H, W, C] in 0..1; alpha is dropped."),
                KleinVAEType.Input("vae", tooltip="The FLUX.2 VAE from Klein Model Loader."),
                io.Combo.Input("size", options=list(SIZES), default=SIZES[0], optional=True, tooltip=(
                    "crop to 16 = centre-crop to multiples of 16 (ComfyUI's VAE Encode). fit 1 megapixel = "
                    "scale larger images down to about 1 megapixel and resize the sides to multiples of 16, "
                    "as diffusers prepares an image for image-to-image (Klein's preferred size).")),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="FLUX.2 latents [B, 128, H/16, W/16].")],
        )

    @classmethod
    @notices.reported
    def execute(cls, pixels: torch.Tensor, vae: KleinVAE, size: str = "crop to 16") -> io.NodeOutput:
        down = vae.config.downscale
        if pixels.ndim != 4 or pixels.shape[1] < down or pixels.shape[2] < down:
            raise ValueError(f"{ENCODE_NODE}: pixels must be an IMAGE [batch, height, width, channels] of at "
                             f"least {down}x{down} pixels, got shape {list(pixels.shape)}.")
        check_widget(ENCODE_NODE, "size", size, SIZES)
        if size == SIZES[1]:
            w, h = processing_size(pixels.shape[2], pixels.shape[1], down)
            px = resize_image(pixels, w, h)
        else:
            px = center_crop(pixels, down)
        rgb = px[..., :3] if px.shape[-1] >= 3 else px[..., :1].expand(*px.shape[:-1], 3)  # gray -> RGB
        engine = open_engine(ENCODE_NODE, {"vae": ("vae", vae.ref)}, speed=vae.speed)
        latents = engine.encode_pixels(rgb.permute(0, 3, 1, 2).float() * 2 - 1)
        return io.NodeOutput({"samples": latents.to(host.intermediate_device(), torch.float32)})
