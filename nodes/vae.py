"""Flux2 VAE Decode / Encode: between ComfyUI's LATENT (FLUX.2 layout) and IMAGE, through the pack's
KLEIN_VAE or ComfyUI's own VAE (VAELoader's FLUX.2 VAE)."""

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
FLUX2_GEOMETRY = (128, 16)  # latent channels, pixels per latent position
VAE_TOOLTIP = ("The FLUX.2 VAE: Klein Model Loader's vae, or ComfyUI's VAE from Load VAE (VAELoader) with "
               "flux2-vae.safetensors.")


def vae_input(tooltip: str = VAE_TOOLTIP) -> io.MultiType.Input:
    """The ``vae`` socket of the pack's VAE nodes: KLEIN_VAE or ComfyUI's VAE."""
    return io.MultiType.Input(KleinVAEType.Input("vae", tooltip=tooltip), types=[io.Vae])


def is_native(vae: object, node: str) -> bool:
    """False for the pack's KLEIN_VAE; True for ComfyUI's own VAE, refused (naming ``node`` and
    VAELoader) unless it is the FLUX.2 VAE."""
    if isinstance(vae, KleinVAE):
        return False
    if not host.is_native_vae(vae):
        raise ValueError(f"{node}: vae must be the FLUX.2 VAE (KLEIN_VAE or VAE), got {type(vae).__name__}.")
    channels, ratio = host.native_vae_geometry(vae)
    if (channels, ratio) != FLUX2_GEOMETRY:
        raise ValueError(f"{node}: vae is a ComfyUI VAE with {channels} latent channels and {ratio} pixels per "
                         f"latent (from Load VAE or a checkpoint loader), not the FLUX.2 VAE ({FLUX2_GEOMETRY[0]} "
                         f"channels, {FLUX2_GEOMETRY[1]} pixels): pick flux2-vae.safetensors in Load VAE, or "
                         f"connect Klein Model Loader's vae.")
    return True


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
                vae_input(),
            ],
            outputs=[io.Image.Output(display_name="image", tooltip="Images [B, H, W, 3] in 0..1.")],
        )

    @classmethod
    @notices.reported
    def execute(cls, samples: dict, vae: KleinVAE | object) -> io.NodeOutput:
        native = is_native(vae, DECODE_NODE)
        latents = flux2_samples(samples, FLUX2_GEOMETRY[0] if native else vae.config.latent_channels, DECODE_NODE,
                                "samples", " (connect Klein Sampler or another FLUX.2 latent; SD, SDXL and FLUX.1 "
                                "latents need their own VAE and VAE Decode)")
        if native:
            image = host.native_vae_decode(vae, latents)
            return io.NodeOutput(host.to_intermediate(image))
        engine = open_engine(DECODE_NODE, {"vae": ("vae", vae.ref)}, speed=vae.speed)
        # One image at a time, tiled if short; laid out as IMAGE on the device (a 12 MB strided copy
        # on the host otherwise, at 1024x1024).
        image = engine.decode(latents, channels_last=True)
        return io.NodeOutput(host.to_intermediate(image))


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
                vae_input(),
                io.Combo.Input("size", options=list(SIZES), default=SIZES[0], optional=True, tooltip=(
                    "crop to 16 = centre-crop to multiples of 16 (ComfyUI's VAE Encode). fit 1 megapixel = "
                    "scale larger images down to about 1 megapixel and resize the sides to multiples of 16, "
                    "as diffusers prepares an image for image-to-image (Klein's preferred size).")),
            ],
            outputs=[io.Latent.Output(display_name="latent", tooltip="FLUX.2 latents [B, 128, H/16, W/16].")],
        )

    @classmethod
    @notices.reported
    def execute(cls, pixels: torch.Tensor, vae: KleinVAE | object, size: str = "crop to 16") -> io.NodeOutput:
        native = is_native(vae, ENCODE_NODE)
        down = FLUX2_GEOMETRY[1] if native else vae.config.downscale
        if pixels.ndim != 4 or pixels.shape[1] < down or pixels.shape[2] < down:
            raise ValueError(f"{ENCODE_NODE}: pixels must be an IMAGE [batch, height, width, channels] of at "
                             f"least {down}x{down} pixels, got shape {list(pixels.shape)}.")
        check_widget(ENCODE_NODE, "size", size, SIZES)
        if size == SIZES[1]:
            w, h = processing_size(pixels.shape[2], pixels.shape[1], down)
            if w < down or h < down:
                # A very elongated picture over 1 megapixel: scaled down, its short side rounds to 0
                # and the resize would fail with torch's own message.
                raise ValueError(f"{ENCODE_NODE}: a {pixels.shape[2]}x{pixels.shape[1]} image scaled to 1 "
                                 f"megapixel has a side under {down} pixels; use size 'crop to 16', or crop "
                                 f"the image to a less elongated shape first.")
            px = resize_image(pixels, w, h)
        else:
            px = center_crop(pixels, down)
        rgb = px[..., :3] if px.shape[-1] >= 3 else px[..., :1].expand(*px.shape[:-1], 3)  # gray -> RGB
        if native:
            latents = host.native_vae_encode(vae, rgb.float())
            return io.NodeOutput({"samples": host.to_intermediate(latents, torch.float32)})
        engine = open_engine(ENCODE_NODE, {"vae": ("vae", vae.ref)}, speed=vae.speed)
        latents = engine.encode_pixels(rgb.permute(0, 3, 1, 2).float() * 2 - 1)
        return io.NodeOutput({"samples": host.to_intermediate(latents, torch.float32)})
