"""The FLUX.2 autoencoder (BFL ``AutoEncoder`` / diffusers ``AutoencoderKLFlux2``), encoder and decoder.

Module and parameter names follow BFL's ``flux2-vae.safetensors`` layout, with the quant convs
inside the encoder/decoder (``encoder.quant_conv``, ``decoder.post_quant_conv``) as BFL builds
them. Files are accepted in three layouts:

* diffusers (``AutoencoderKLFlux2``): ``encoder.down_blocks.{i}.resnets.{j}...``, 2-D attention
  Linears, ``decoder.up_blocks`` in reverse order. This is the layout of ``flux2-vae.safetensors`` as
  ComfyUI distributes it (F32) and of the Hugging Face repos' ``vae/`` folder (a single file, or a
  repo root with a ``vae/`` subfolder);
* BFL (``flux2`` ``AutoEncoder``, e.g. FLUX.2-dev's ``ae.safetensors``): ``encoder.down.{i}.block.{j}...``,
  ``encoder.quant_conv``, ``decoder.post_quant_conv``;
* BFL names with the quant convs at the top level (``quant_conv``, ``post_quant_conv``), as older
  conversions write them.

The 32-channel latent of the autoencoder is 2x2-patchified to 128 channels and normalised with
the stored BatchNorm statistics (eps 1e-4); :meth:`Flux2VAE.encode` / :meth:`Flux2VAE.decode`
include both steps, so they speak the transformer's ``[B, 128, H/16, W/16]`` latent directly.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .weights import LoadPlan, Op, Reshape, WeightSource, build_plan, materialize, open_weights

logger = logging.getLogger(__name__)

# Fixed by the architecture, not readable from the weights (the real config uses these).
NORM_GROUPS = 32
NORM_EPS = 1e-6
BN_EPS = 1e-4
PATCH = 2  # the 2x2 patchify between the autoencoder latent and the transformer latent

# Prefixes under which a VAE may sit in a bigger checkpoint (ComfyUI/SD "first_stage_model.").
_CONTAINER_PREFIXES = ("first_stage_model.", "vae.")

_BFL, _BFL_TOP, _DIFFUSERS = "BFL", "BFL with top-level quant convs", "diffusers"


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class VAEConfig:
    """Shape of a FLUX.2 autoencoder, inferred from its weights by :meth:`from_source`.

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

    @classmethod
    def from_source(
        cls, source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike
    ) -> VAEConfig:
        """Infer the config from tensor shapes only (no data is read; meta tensors work).

        Accepts anything :func:`load_vae` accepts. Raises ValueError when the weights are not a
        FLUX.2 VAE, saying what they seem to be.
        """
        return _prepare(_open(source))[2]


# ---------------------------------------------------------------------------------------------
# Building blocks (BFL names)


def _norm(channels: int, cfg: VAEConfig) -> nn.GroupNorm:
    return nn.GroupNorm(cfg.norm_groups, channels, eps=cfg.norm_eps, affine=True)


class _ResnetBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, cfg: VAEConfig) -> None:
        super().__init__()
        self.norm1 = _norm(in_ch, cfg)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = _norm(out_ch, cfg)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class _AttnBlock(nn.Module):
    """Single-head self-attention over all positions, with 1x1-conv projections."""

    def __init__(self, channels: int, cfg: VAEConfig) -> None:
        super().__init__()
        self.norm = _norm(channels, cfg)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        hn = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, 1, HW, C)
            return t.reshape(b, 1, c, h * w).transpose(-1, -2)

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
        h = self.conv_out(F.silu(self.norm_out(h)))
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
        return self.conv_out(F.silu(self.norm_out(h)))


class _LatentBatchNorm(nn.Module):
    """The running statistics of the (non-affine, eval-only) BatchNorm over the 128-channel latent.

    Only the two persistent buffers exist, so a file without ``num_batches_tracked`` loads.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels, dtype=torch.float32))
        self.register_buffer("running_var", torch.ones(channels, dtype=torch.float32))


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
        x = pixels.to(device=self.device, dtype=self.dtype)
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


# ---------------------------------------------------------------------------------------------
# Loading: layout detection, key mapping, config inference


def _open(source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike) -> WeightSource:
    src = open_weights(source, component="VAE", subfolder="vae")
    if "encoder.conv_in.weight" not in src and "decoder.conv_in.weight" not in src:
        for prefix in _CONTAINER_PREFIXES:
            if f"{prefix}encoder.conv_in.weight" in src:
                logger.info("%s: using the VAE tensors under '%s'", src.name, prefix)
                return src.strip_prefix(prefix)
    return src


def _describe(src: WeightSource) -> str:
    """A short guess at what a non-FLUX.2-VAE source is, for error messages."""
    keys = src.keys()

    def has(*parts: str) -> bool:
        return any(p in k for k in keys for p in parts)

    if has("lora_A", "lora_B", "lora_down", "lora_up", ".alpha"):
        return "a LoRA"
    if has("double_blocks.", "single_blocks.", "transformer_blocks.", "x_embedder", "img_in.", "time_in."):
        return "a diffusion transformer (FLUX / DiT weights)"
    if has("embed_tokens", "self_attn.", "encoder.block.0.layer", "text_model.", "shared.weight"):
        return "a text encoder (Qwen3 / T5 / CLIP weights)"
    conv = "decoder.conv_in.weight" if "decoder.conv_in.weight" in src else "encoder.conv_in.weight"
    if conv not in src:
        if has("encoder.layers.", "decoder.layers."):
            return "a tiny autoencoder (TAESD-style), not the full FLUX.2 VAE"
        return f"an unknown model (first tensors: {', '.join(keys[:3])})"
    if len(src.shape(conv)) != 4:
        return "a video (3-D) VAE"
    if "decoder.conv_in.weight" not in src:
        return "a VAE encoder without its decoder"
    if "encoder.conv_in.weight" not in src:
        return "a VAE decoder without its encoder"
    z = src.shape("decoder.conv_in.weight")[1]
    if "bn.running_mean" not in src:
        if z == 16:
            return "a FLUX.1 / SD3 16-channel VAE: use flux2-vae.safetensors"
        if z == 4:
            return "an SD 1.x / SDXL 4-channel VAE: use flux2-vae.safetensors"
        return f"a {z}-channel VAE without FLUX.2's latent BatchNorm ('bn.running_mean')"
    return f"a {z}-channel VAE with a {list(src.shape('bn.running_mean'))} BatchNorm"


def _not_flux2(src: WeightSource, what: str | None = None) -> ValueError:
    return ValueError(
        f"{src.name}: not a FLUX.2 VAE. Expected the FLUX.2 autoencoder (a 32-channel latent plus the "
        f"'bn.running_mean' / 'bn.running_var' statistics of its 128-channel latent BatchNorm, as in "
        f"flux2-vae.safetensors); this file seems to be {what or _describe(src)}."
    )


def _layout(src: WeightSource) -> str:
    if "encoder.down.0.block.0.conv1.weight" in src:
        return _BFL_TOP if "quant_conv.weight" in src else _BFL
    if "encoder.down_blocks.0.resnets.0.conv1.weight" in src:
        return _DIFFUSERS
    raise _not_flux2(src)


def _as_conv1x1(src: WeightSource, key: str) -> str | Op:
    # diffusers stores the mid-attention projections as Linear (C, C); the model has 1x1 convs.
    shape = src.shape(key)
    return Reshape(key, (*shape, 1, 1)) if len(shape) == 2 else key


_RESNET_SUB = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2",
               "conv_shortcut": "nin_shortcut"}
_ATTN_SUB = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _bfl_rename(src: WeightSource) -> Callable[[str], str | tuple[str, Op] | None]:
    def rename(key: str) -> str | tuple[str, Op] | None:
        if key.startswith("quant_conv."):  # top-level quant convs
            return "encoder." + key
        if key.startswith("post_quant_conv."):
            return "decoder." + key
        if re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(q|k|v|proj_out)\.weight", key):
            op = _as_conv1x1(src, key)
            return key if isinstance(op, str) else (key, op)
        return key

    return rename


def _diffusers_rename(src: WeightSource) -> Callable[[str], str | tuple[str, Op] | None]:
    ups = [int(m.group(1)) for k in src.keys() if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k))]
    n_up = max(ups) + 1 if ups else 0

    def resnet(rest: str) -> str | None:
        m = re.fullmatch(r"(norm1|conv1|norm2|conv2|conv_shortcut)\.(weight|bias)", rest)
        return f"{_RESNET_SUB[m.group(1)]}.{m.group(2)}" if m else None

    def rename(key: str) -> str | tuple[str, Op] | None:
        if key.startswith(("quant_conv.", "bn.")):
            return "encoder." + key if key.startswith("quant_conv.") else key
        if key.startswith("post_quant_conv."):
            return "decoder." + key
        m = re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out|conv_norm_out)\.(weight|bias)", key)
        if m:
            return f"{m.group(1)}.{'norm_out' if m.group(2) == 'conv_norm_out' else m.group(2)}.{m.group(3)}"
        m = re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.([01])\.(.+)", key)
        if m and (sub := resnet(m.group(3))):
            return f"{m.group(1)}.mid.block_{int(m.group(2)) + 1}.{sub}"
        m = re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)"
                         r"\.(weight|bias)", key)
        if m:
            name = f"{m.group(1)}.mid.attn_1.{_ATTN_SUB[m.group(2)]}.{m.group(3)}"
            if m.group(3) == "weight" and m.group(2) != "group_norm":
                op = _as_conv1x1(src, key)
                return name if isinstance(op, str) else (name, op)
            return name
        m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key)
        if m and (sub := resnet(m.group(3))):
            return f"encoder.down.{m.group(1)}.block.{m.group(2)}.{sub}"
        m = re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(weight|bias)", key)
        if m:
            return f"encoder.down.{m.group(1)}.downsample.conv.{m.group(2)}"
        # diffusers runs up_blocks from low to high resolution; BFL indexes up.{b} by resolution.
        m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key)
        if m and (sub := resnet(m.group(3))):
            return f"decoder.up.{n_up - 1 - int(m.group(1))}.block.{m.group(2)}.{sub}"
        m = re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(weight|bias)", key)
        if m:
            return f"decoder.up.{n_up - 1 - int(m.group(1))}.upsample.conv.{m.group(2)}"
        return None

    return rename


def _count(shapes: Mapping[str, tuple[int, ...]], pattern: str) -> int:
    idx = [int(m.group(1)) for k in shapes if (m := re.match(pattern, k))]
    return max(idx) + 1 if idx else 0


def _infer_config(src: WeightSource, layout: str, shapes: Mapping[str, tuple[int, ...]]) -> VAEConfig:
    def need(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ValueError(
                f"{src.name}: the FLUX.2 VAE tensor '{name}' (BFL name; this file is in the {layout} "
                f"layout) is missing; the file is incomplete or not a FLUX.2 VAE."
            )
        return shapes[name]

    n_down = _count(shapes, r"encoder\.down\.(\d+)\.")
    n_up = _count(shapes, r"decoder\.up\.(\d+)\.")
    blocks = _count(shapes, r"encoder\.down\.0\.block\.(\d+)\.")
    conv_in = need("encoder.conv_in.weight")
    z2 = need("encoder.conv_out.weight")[0]
    z = need("decoder.conv_in.weight")[1]
    if z2 != 2 * z:
        raise _not_flux2(src, f"an autoencoder whose encoder ({z2 // 2}) and decoder ({z}) latents differ")
    if "bn.running_mean" not in shapes:
        raise _not_flux2(src)
    bn = shapes["bn.running_mean"]
    if bn != (4 * z,):
        raise _not_flux2(src, f"a {z}-channel VAE with a {list(bn)} latent BatchNorm (expected [{4 * z}])")
    try:
        return VAEConfig(
            in_channels=conv_in[1],
            out_channels=need("decoder.conv_out.weight")[0],
            block_channels=tuple(need(f"encoder.down.{i}.block.0.conv1.weight")[0] for i in range(n_down)),
            decoder_block_channels=tuple(
                need(f"decoder.up.{b}.block.0.conv1.weight")[0] for b in range(n_up)
            ),
            num_res_blocks=blocks,
            z_channels=z,
            mid_attention="encoder.mid.attn_1.q.weight" in shapes,
        )
    except ValueError as exc:
        raise ValueError(f"{src.name}: {exc}") from None


def _prepare(src: WeightSource) -> tuple[WeightSource, LoadPlan, VAEConfig, str]:
    layout = _layout(src)
    rename = _diffusers_rename(src) if layout == _DIFFUSERS else _bfl_rename(src)
    ignore = lambda k: k == "bn.num_batches_tracked"  # noqa: E731
    owner: dict[str, str] = {}
    for key in src.keys():
        target = None if ignore(key) else rename(key)
        name = target if isinstance(target, str) else (target[0] if target else None)
        if name is not None and name in owner:
            # e.g. both 'quant_conv.weight' and 'encoder.quant_conv.weight': refuse to guess.
            raise ValueError(f"{src.name}: '{owner[name]}' and '{key}' are the same VAE tensor; "
                             "keep only one of them.")
        if name is not None:
            owner[name] = key
    plan = build_plan(src, rename, ignore=ignore)
    shapes = {name: op.shape(src) for name, op in plan.ops.items()}
    cfg = _infer_config(src, layout, shapes)
    logger.debug("%s: %s, %s layout, %s", src.name, cfg.variant, layout, cfg)
    return src, plan, cfg, layout


def load_vae(
    source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Flux2VAE:
    """Load a FLUX.2 VAE from a file, a folder (or a diffusers repo root), or a state dict.

    Args:
        source: ``flux2-vae.safetensors`` (diffusers names, as ComfyUI ships it), BFL's ``ae.safetensors``, a diffusers
            ``diffusion_pytorch_model.safetensors``, a folder holding one (or a repo root with a
            ``vae/`` subfolder), or an in-memory state dict in any of these layouts.
        device: where to put the weights (default CPU).
        dtype: compute dtype (default: the stored dtype of the weights). The BatchNorm statistics
            are kept in float32.

    Raises:
        ValueError: the weights are not a FLUX.2 VAE (the message says what they seem to be), or
            tensors are missing or misshaped (the message names the file and the first keys).
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"load_vae: dtype must be a floating dtype, got {dtype}.")
    src, plan, cfg, layout = _prepare(_open(source))
    if dtype is None:
        # One compute dtype for every conv, even if the file mixes them.
        dtype = src.dtype(plan.ops["encoder.conv_in.weight"].sources()[0])
    try:
        model = materialize(
            lambda: Flux2VAE(cfg), plan, src, component=cfg.variant, device=device, dtype=dtype,
            keep_fp32=lambda name: name.startswith("bn."),
        )
    except ValueError as exc:
        if layout != _DIFFUSERS:
            raise
        raise ValueError(f"{exc} (Tensor names are given in the BFL layout; this file uses the "
                         "diffusers layout.)") from None
    assert isinstance(model, Flux2VAE)
    n = sum(p.numel() for p in model.parameters())
    logger.info("%s (%s layout): %.2fM parameters, %s", cfg.variant, layout, n / 1e6, dtype)
    return model


__all__ = ["VAEConfig", "Flux2VAE", "load_vae", "patchify", "unpatchify", "BN_EPS"]
