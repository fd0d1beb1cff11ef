"""The rectified-flow training objective (diffusers' Flux2/Klein LoRA scripts, SD3 paper §3).

For clean latents ``x0`` and noise ``n`` ``[B, C, h, w]``: ``u`` per sample from the weighting
scheme's density (uniform, ``logit_normal``, ``mode``); ``sigma`` = the table ``(N..1)/N`` (N = 1000)
at ``floor(u N)``, optionally shifted (default shift 1, as diffusers' Klein scripts); input
``(1 - sigma) x0 + sigma n`` at timestep ``sigma``; target ``n - x0``; loss
``mean_b(mean(w(sigma) (pred - target)^2))`` in float32, ``w`` = 1, ``sigma^-2`` or cosmap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

WEIGHTING_SCHEMES: tuple[str, ...] = ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap")


@dataclass(frozen=True)
class ObjectiveConfig:
    """How sigmas are drawn and the loss weighted (diffusers' ``--weighting_scheme`` and friends)."""

    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 1.0
    num_train_timesteps: int = 1000

    def __post_init__(self) -> None:
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {WEIGHTING_SCHEMES}, got {self.weighting_scheme!r}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be a positive number, got {self.shift}")
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be positive, got {self.num_train_timesteps}")
        if not self.logit_std > 0:
            raise ValueError(f"logit_std must be positive, got {self.logit_std}")


def sample_density(cfg: ObjectiveConfig, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``u`` ``[batch]`` float32 in [0, 1) from the weighting scheme's density (CPU)."""
    if cfg.weighting_scheme == "logit_normal":
        u = torch.normal(mean=cfg.logit_mean, std=cfg.logit_std, size=(batch,), generator=generator,
                         dtype=torch.float32)  # the draws do not follow a script's default dtype
        return torch.sigmoid(u)
    u = torch.rand(size=(batch,), generator=generator, dtype=torch.float32)
    if cfg.weighting_scheme == "mode":
        u = 1 - u - cfg.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def sigma_table(cfg: ObjectiveConfig) -> torch.Tensor:
    """The training schedule ``[N]`` float32, from 1 down to 1/N (shifted when ``shift != 1``)."""
    n = cfg.num_train_timesteps
    steps = torch.linspace(1, n, n, dtype=torch.float32).flip(0)
    sigmas = steps / n
    if cfg.shift != 1.0:
        sigmas = cfg.shift * sigmas / (1 + (cfg.shift - 1) * sigmas)
    return sigmas


def sigmas_for(cfg: ObjectiveConfig, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas, timesteps)`` ``[B]`` float32 for densities ``u [B]``: the noise level used to mix the
    input, and what the model is told (``(sigma * N) / N``, as the training scripts round-trip it)."""
    table = sigma_table(cfg)
    n = cfg.num_train_timesteps
    idx = (u.float() * n).long().clamp(0, n - 1)
    sigmas = table[idx]
    return sigmas, (sigmas * n) / n


def loss_weighting(cfg: ObjectiveConfig, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights (same shape as ``sigmas``), float32."""
    if cfg.weighting_scheme == "sigma_sqrt":
        return (sigmas ** -2.0).float()
    if cfg.weighting_scheme == "cosmap":
        return (2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))).float()
    return torch.ones_like(sigmas, dtype=torch.float32)


def noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise`` in ``x0``'s dtype; ``sigmas [B]`` broadcast per sample."""
    s = sigmas.to(device=x0.device, dtype=x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return ((1.0 - s) * x0 + s * noise.to(x0.dtype)).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target ``noise - x0``."""
    return noise - x0


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per_sample)``: the weighted squared error averaged per sample ``[B]``, then over the
    batch; float32. ``weighting [B]``."""
    w = weighting.to(device=pred.device, dtype=torch.float32).reshape(-1, *([1] * (pred.ndim - 1)))
    per_sample = torch.mean((w * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return per_sample.mean(), per_sample
