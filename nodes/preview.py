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
    """The ``callback(step, total, latents)`` given to ``klein_core.Engine.denoise`` for one run.

    Each step: stop if Cancel was pressed (within one step), then one progress update; with previews
    on, the preview shows the predicted clean image ``x - sigma * v``, where the velocity ``v`` comes
    from the last two steps' latents.
    """

    def __init__(self, sigmas: torch.Tensor):
        """``sigmas``: the run's schedule ``[steps + 1]`` (``klein_core.Engine.schedule``)."""
        self.bar = host.progress_bar(len(sigmas) - 1)
        previews = host.previews_enabled()
        self.sigmas = sigmas.tolist() if previews else None
        self.previous: torch.Tensor | None = None
        self.max_size = host.preview_size() if previews else 0

    def __call__(self, step: int, total: int, latents: torch.Tensor) -> None:
        host.check_interrupt()
        preview = None
        if self.sigmas is not None:
            x = latents[:1].float()
            x0 = x
            if self.previous is not None:
                v = (x - self.previous) / (self.sigmas[step] - self.sigmas[step - 1])
                x0 = x - self.sigmas[step] * v
            self.previous = x
            preview = ("JPEG", latent_preview(x0), self.max_size)
        self.bar.update_absolute(step, total, preview)
