"""Per-step progress for the host: interrupt check, progress bar and a cheap latent->RGB preview."""

from __future__ import annotations

import torch
from PIL import Image

from . import host

# Used only if the host has no Flux2 latent format: channel 0/1/2 of the un-patchified latents.
_FALLBACK_RGB = (torch.eye(32, 3) * 0.5, torch.zeros(3))


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """``[B, 128, h, w]`` -> ``[B, 32, 2h, 2w]`` (the inverse of the VAE's 2x2 patchify)."""
    b, _, h, w = latents.shape
    return latents.reshape(b, 32, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, 32, 2 * h, 2 * w)


def latent_preview(latents: torch.Tensor) -> Image.Image:
    """RGB preview of the first latent ``[B, 128, h, w]`` at 2x the latent grid (a fixed linear map)."""
    factors, bias = host.flux2_latent_rgb() or _FALLBACK_RGB
    x = unpatchify(latents[:1].float().cpu())[0]
    rgb = torch.einsum("chw,cr->hwr", x, factors) + bias
    arr = ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8).numpy()
    return Image.fromarray(arr)


class StepReporter:
    """The step callback given to ``klein_core.Engine.denoise`` for one run.

    Each step: stop if Cancel was pressed (within one step), then one progress update. With previews
    on, the preview shows the step's estimate of the clean image (``x - sigma * v``, which the engine
    hands over as ``denoised``), never the noisy latents: through ComfyUI's own previewer (TAEF2 where
    the host has it and the user chose it, else latent->RGB), or the pack's latent->RGB map.
    """

    def __init__(self, total: int, device: torch.device):
        self.bar = host.progress_bar(total)
        self.preview = None
        if host.previews_enabled():
            self.preview = host.latent_previewer(device) or self._own_preview
        # klein_core passes denoised= to a callback that asks for it, computing it each step: only
        # a preview shows it.
        self.wants_denoised = self.preview is not None

    @staticmethod
    def _own_preview(x0: torch.Tensor) -> tuple:
        return ("JPEG", latent_preview(x0), host.preview_size())

    def __call__(self, step: int, total: int, latents: torch.Tensor, denoised: torch.Tensor | None = None) -> None:
        host.check_interrupt()
        preview = None
        if self.preview is not None:
            preview = self.preview((denoised if denoised is not None else latents)[:1].float())
        self.bar.update_absolute(step, total, preview)
