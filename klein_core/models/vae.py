"""The FLUX.2 autoencoder (BFL ``AutoEncoder`` / diffusers ``AutoencoderKLFlux2``), encoder and decoder.

Names follow BFL's ``flux2-vae.safetensors`` layout, with the quant convs inside the encoder and
decoder (``encoder.quant_conv``, ``decoder.post_quant_conv``). :mod:`klein_core.files.vae_layout`
also reads diffusers files (``flux2-vae.safetensors`` as ComfyUI ships it, Hugging Face ``vae/``
folders) and BFL files with the quant convs at the top level.

:meth:`Flux2VAE.encode` / :meth:`Flux2VAE.decode` include the 2x2 patchify of the 32-channel latent
to 128 channels and the BatchNorm normalisation (stored statistics, eps 1e-4), so they speak the
transformer's ``[B, 128, H/16, W/16]`` latent directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..transfer import to_device

NORM_GROUPS = 32
NORM_EPS = 1e-6
BN_EPS = 1e-4
PATCH = 2  # the 2x2 patchify between the autoencoder latent and the transformer latent


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class VAEConfig:
    """Shape of a FLUX.2 autoencoder, inferred from its weights (:func:`klein_core.files.vae_layout.vae_config`).

    ``block_channels[i]`` is the width of encoder level ``i`` (BFL ``ch * ch_mult[i]``, diffusers
    ``block_out_channels``); ``decoder_block_channels`` the same for the decoder, which differs
    in the small-decoder variant. Each encoder level has ``num_res_blocks`` ResNet blocks, each
    decoder level one more.
    """

    in_channels: int = 3
    out_channels: int = 3
    block_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_channels: tuple[int, ...] = (128, 256, 512, 512)
    num_res_blocks: int = 2
    z_channels: int = 32
    mid_attention: bool = True
    norm_groups: int = NORM_GROUPS
    norm_eps: float = NORM_EPS
    bn_eps: float = BN_EPS

    def __post_init__(self) -> None:
        if not self.block_channels or len(self.block_channels) != len(self.decoder_block_channels):
            raise ValueError(
                f"VAE encoder and decoder need the same number of levels (>= 1), got "
                f"{list(self.block_channels)} and {list(self.decoder_block_channels)}."
            )
        if self.num_res_blocks < 1 or self.z_channels < 1:
            raise ValueError(f"VAE: bad num_res_blocks {self.num_res_blocks} / z_channels {self.z_channels}.")
        bad = [c for c in (*self.block_channels, *self.decoder_block_channels) if c % self.norm_groups]
        if bad:
            raise ValueError(
                f"VAE channel widths {bad} are not multiples of the {self.norm_groups} GroupNorm groups."
            )

    @property
    def ch(self) -> int:
        """Encoder base width (BFL ``ch``)."""
        return self.block_channels[0]

    @property
    def decoder_ch(self) -> int:
        """Decoder base width (128 for the full decoder, 96 for the small one)."""
        return self.decoder_block_channels[0]

    @property
    def latent_channels(self) -> int:
        """Channels of the patchified, normalised latent the transformer sees (128)."""
        return self.z_channels * PATCH * PATCH

    @property
    def downscale(self) -> int:
        """Pixels per latent position along each axis, patchify included (16)."""
        return 2 ** (len(self.block_channels) - 1) * PATCH

    @property
    def variant(self) -> str:
        if self.decoder_block_channels == self.block_channels:
            return "FLUX.2 VAE"
        if all(d <= e for d, e in zip(self.decoder_block_channels, self.block_channels)):
            return "FLUX.2 VAE (small decoder)"
        return "FLUX.2 VAE (custom decoder)"


# ---------------------------------------------------------------------------------------------
# Building blocks (BFL names)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm, then SiLU when ``silu`` (every VAE norm but the attention block's).

    The parameters are ``nn.GroupNorm``'s (``weight``, ``bias``), so files load unchanged. ``fused``
    is None on the plain path; :func:`klein_core.accel.enable_fast_vae` sets it to a callable
    ``(norm, x) -> y or None`` that computes both steps in one kernel where it can (None: the plain
    steps run). Input and output ``[B, C, H, W]``; a fused output may be channels-last.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float, silu: bool) -> None:
        super().__init__(num_groups, num_channels, eps=eps, affine=True)
        self.silu = silu
        self.fused: Callable[[GroupNormAct, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused(self, x)
            if y is not None:
                return y
        y = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return F.silu(y) if self.silu else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, silu={self.silu}"


def _norm(channels: int, cfg: VAEConfig, silu: bool = True) -> GroupNormAct:
    return GroupNormAct(cfg.norm_groups, channels, cfg.norm_eps, silu)


class _ResnetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, cfg: VAEConfig) -> None:
        super().__init__()
        self.norm1 = _norm(in_ch, cfg)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = _norm(out_ch, cfg)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.norm1(x))  # the norms include the SiLU
        h = self.conv2(self.norm2(h))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class _AttnBlock(nn.Module):
    """Single-head self-attention over all positions, with 1x1-conv projections."""

    def __init__(self, channels: int, cfg: VAEConfig) -> None:
        super().__init__()
        self.norm = _norm(channels, cfg, silu=False)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        hn = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, 1, HW, C), channels innermost
            # SDPA's memory-efficient kernels (CUDA) and its CPU flash kernel need the channels innermost:
            # from NCHW (the plain path) the transposed view sent SDPA to its math path, which holds the
            # HW x HW scores twice: 32 GiB for a 2048² decode (a 37.8 GB peak on an H200), and on the
            # CPU twice the attention's time (8.6 against 4.6 s at 1024²). Channels-last inputs (the
            # fast paths) are laid out so already: the copy is then a no-op.
            return t.reshape(b, 1, c, h * w).transpose(-1, -2).contiguous()

        out = F.scaled_dot_product_attention(tokens(self.q(hn)), tokens(self.k(hn)), tokens(self.v(hn)))
        out = out.transpose(-1, -2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class _Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Asymmetric padding (right/bottom only) is what the weights were trained with.
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block.{j}`` ResNets, then an optional down/upsample."""

    def __init__(
        self, in_ch: int, out_ch: int, n_blocks: int, resample: nn.Module | None, name: str, cfg: VAEConfig
    ) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            _ResnetBlock(in_ch if j == 0 else out_ch, out_ch, cfg) for j in range(n_blocks)
        )
        if resample is not None:
            self.add_module(name, resample)
        self._resample_name = name if resample is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.block:
            x = blk(x)
        if self._resample_name is not None:
            x = getattr(self, self._resample_name)(x)
        return x


class _Mid(nn.Module):
    def __init__(self, channels: int, cfg: VAEConfig) -> None:
        super().__init__()
        self.block_1 = _ResnetBlock(channels, channels, cfg)
        self.attn_1 = _AttnBlock(channels, cfg) if cfg.mid_attention else None
        self.block_2 = _ResnetBlock(channels, channels, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block_1(x)
        if self.attn_1 is not None:
            x = self.attn_1(x)
        return self.block_2(x)


class _Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        chans = cfg.block_channels
        n = len(chans)
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self.down = nn.ModuleList(
            _Level(chans[max(i - 1, 0)], chans[i], cfg.num_res_blocks,
                   _Downsample(chans[i]) if i != n - 1 else None, "downsample", cfg)
            for i in range(n)
        )
        self.mid = _Mid(chans[-1], cfg)
        self.norm_out = _norm(chans[-1], cfg)
        # conv_out gives mean || logvar; quant_conv mixes them (BFL keeps it inside the encoder).
        self.conv_out = nn.Conv2d(chans[-1], 2 * cfg.z_channels, 3, padding=1)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.z_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        h = self.conv_out(self.norm_out(h))  # norm_out includes the SiLU
        return self.quant_conv(h)  # (B, 2z, H/8, W/8) moments


class _Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        chans = cfg.decoder_block_channels
        n = len(chans)
        self.post_quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, 1)
        self.conv_in = nn.Conv2d(cfg.z_channels, chans[-1], 3, padding=1)
        self.mid = _Mid(chans[-1], cfg)
        # up.{b} is the level at resolution b (up.0 is the full-resolution one) and runs last.
        self.up = nn.ModuleList(
            _Level(chans[min(b + 1, n - 1)], chans[b], cfg.num_res_blocks + 1,
                   _Upsample(chans[b]) if b != 0 else None, "upsample", cfg)
            for b in range(n)
        )
        self.norm_out = _norm(chans[0], cfg)
        self.conv_out = nn.Conv2d(chans[0], cfg.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(self.post_quant_conv(z))
        h = self.mid(h)
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(self.norm_out(h))  # norm_out includes the SiLU


class _LatentBatchNorm(nn.Module):
    """The running statistics of the (non-affine, eval-only) BatchNorm over the 128-channel latent.

    Only the two persistent buffers exist, so a file without ``num_batches_tracked`` loads.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels, dtype=torch.float32))
        self.register_buffer("running_var", torch.ones(channels, dtype=torch.float32))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _LatentBatchNorm:
        # vae.to(bfloat16) would round the statistics for good (the loaders keep them float32): they
        # follow the device and stay float32, so a converted VAE decodes as a VAE loaded in that dtype.
        def keep_float32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        return super()._apply(keep_float32, recurse)


# ---------------------------------------------------------------------------------------------
# Patchify and the model


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """2x2 space-to-channel: ``[B, C, H, W] -> [B, 4C, H/2, W/2]``.

    Output channel ``c*4 + pi*2 + pj`` holds input channel ``c`` at row offset ``pi`` and column
    offset ``pj`` (einops ``b c (i pi) (j pj) -> b (c pi pj) i j``). H and W must be even.
    """
    if latents.ndim != 4 or latents.shape[-2] % PATCH or latents.shape[-1] % PATCH:
        raise ValueError(f"patchify expects [B, C, H, W] with even H and W, got {list(latents.shape)}.")
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    return x.permute(0, 1, 3, 5, 2, 4).reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, 4C, h, w] -> [B, C, 2h, 2w]``."""
    if latents.ndim != 4 or latents.shape[1] % (PATCH * PATCH):
        raise ValueError(
            f"unpatchify expects [B, 4C, h, w] with channels a multiple of 4, got {list(latents.shape)}."
        )
    b, c4, h, w = latents.shape
    c = c4 // (PATCH * PATCH)
    x = latents.reshape(b, c, PATCH, PATCH, h, w)
    return x.permute(0, 1, 4, 2, 5, 3).reshape(b, c, h * PATCH, w * PATCH)


class Flux2VAE(nn.Module):
    """The FLUX.2 autoencoder with its latent patchify and BatchNorm normalisation.

    Build it with :func:`load_vae`. Parameters live under ``encoder.*``, ``decoder.*`` and
    ``bn.*`` (BFL names); the BatchNorm statistics stay float32 whatever the model dtype.
    """

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = _Encoder(config)
        self.decoder = _Decoder(config)
        self.bn = _LatentBatchNorm(config.latent_channels)
        self.decode_channels_last = False  # see set_decode_format

    @property
    def device(self) -> torch.device:
        return self.encoder.conv_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the convolutions (the BatchNorm statistics are always float32)."""
        return self.encoder.conv_in.weight.dtype

    @property
    def decoder_dtype(self) -> torch.dtype:
        """The dtype :meth:`decode` runs in (the model dtype unless :meth:`set_decode_format` changed it)."""
        return self.decoder.conv_in.weight.dtype

    def set_decode_format(self, *, dtype: torch.dtype | None = None, channels_last: bool = False) -> None:
        """Optional fast decode (off by default): the decoder in ``dtype`` and/or channels-last.

        ``dtype`` (e.g. ``torch.bfloat16``) converts the decoder's weights; None keeps them.
        ``channels_last`` stores conv weights and runs activations in NHWC memory order, the layout
        of cuDNN's tensor-core convolutions. The encoder and the float32 BatchNorm statistics are
        untouched, and the maths is the same (only rounding changes with the dtype).
        """
        if dtype is not None:
            if not dtype.is_floating_point:
                raise ValueError(f"set_decode_format: dtype must be a floating dtype, got {dtype}.")
            self.decoder.to(dtype=dtype)
        self.decoder.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        self.decode_channels_last = channels_last

    def _bn_stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.bn.running_mean.to(device=device, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.sqrt(self.bn.running_var.to(device=device, dtype=torch.float32) + self.config.bn_eps)
        return mean, std.view(1, -1, 1, 1)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode images to normalised transformer latents.

        Args:
            pixels: ``[B, 3, H, W]`` floats in [-1, 1]; H and W multiples of ``config.downscale``
                (16). Moved to the model's device and dtype.

        Returns:
            ``[B, 128, H/16, W/16]`` in the model dtype: the posterior mean (nothing is sampled),
            patchified and BatchNorm-normalised (the normalisation is computed in float32).
        """
        cfg = self.config
        if pixels.ndim != 4 or pixels.shape[1] != cfg.in_channels:
            raise ValueError(
                f"VAE encode expects pixels [B, {cfg.in_channels}, H, W], got {list(pixels.shape)}."
            )
        if not pixels.is_floating_point():
            raise ValueError(f"VAE encode expects float pixels in [-1, 1], got dtype {pixels.dtype}.")
        h, w = pixels.shape[-2:]
        if h % cfg.downscale or w % cfg.downscale:
            raise ValueError(
                f"VAE encode needs height and width that are multiples of {cfg.downscale}, got {h}x{w} "
                f"(H x W); crop or resize the image first."
            )
        x = to_device(pixels, self.device, self.dtype)
        moments = self.encoder(x)
        mean = moments[:, : cfg.z_channels]  # the mode of the posterior; logvar is not used
        p = patchify(mean).float()
        bn_mean, bn_std = self._bn_stats(p.device)
        return ((p - bn_mean) / bn_std).to(self.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode normalised transformer latents to images.

        Args:
            latents: ``[B, 128, h, w]`` as produced by :meth:`encode` or the sampler.

        Returns:
            ``[B, 3, 16h, 16w]`` in the decoder's dtype (the model dtype unless
            :meth:`set_decode_format` changed it), about in [-1, 1] and *not* clamped.
        """
        cfg = self.config
        if latents.ndim != 4 or latents.shape[1] != cfg.latent_channels:
            raise ValueError(
                f"VAE decode expects latents [B, {cfg.latent_channels}, h, w], got {list(latents.shape)}."
            )
        # De-normalise in float32 before rounding to the model dtype once.
        p = latents.to(device=self.device, dtype=torch.float32)
        bn_mean, bn_std = self._bn_stats(p.device)
        z = unpatchify(p * bn_std + bn_mean).to(self.decoder_dtype)
        if self.decode_channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        return self.decoder(z)


__all__ = ["BN_EPS", "Flux2VAE", "GroupNormAct", "PATCH", "VAEConfig", "patchify", "unpatchify"]
