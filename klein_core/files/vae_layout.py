"""FLUX.2 VAE checkpoint layouts: diffusers (``AutoencoderKLFlux2``), BFL, and BFL names with
top-level quant convs; all planned into the model's BFL names, with the config read from shapes."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping

import torch

from ..models.vae import VAEConfig
from .identify import what_is
from .key_map import KeyMap, Op, Reshape, build_key_map
from .opening import open_weights
from .source import WeightSource

logger = logging.getLogger(__name__)

# Prefixes under which a VAE may sit in a bigger checkpoint (ComfyUI/SD "first_stage_model.").
_CONTAINER_PREFIXES = ("first_stage_model.", "vae.")
_BFL, _BFL_TOP, _DIFFUSERS = "BFL", "BFL with top-level quant convs", "diffusers"


def open_vae_source(source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike) -> WeightSource:
    src = open_weights(source, component="VAE", subfolder="vae")
    if "encoder.conv_in.weight" not in src and "decoder.conv_in.weight" not in src:
        for prefix in _CONTAINER_PREFIXES:
            if f"{prefix}encoder.conv_in.weight" in src:
                logger.info("%s: using the VAE tensors under '%s'", src.name, prefix)
                return src.strip_prefix(prefix)
    return src


def _not_flux2(src: WeightSource, what: str | None = None) -> ValueError:
    return ValueError(
        f"{src.name}: not a FLUX.2 VAE. Expected the FLUX.2 autoencoder (a 32-channel latent plus the "
        f"'bn.running_mean' / 'bn.running_var' statistics of its 128-channel latent BatchNorm, as in "
        f"flux2-vae.safetensors); this file seems to be {what or what_is(src.keys(), src.shape).sentence('vae')}."
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


def prepare_vae(src: WeightSource) -> tuple[WeightSource, KeyMap, VAEConfig, str]:
    layout = _layout(src)
    rename = _diffusers_rename(src) if layout == _DIFFUSERS else _bfl_rename(src)
    ignore = lambda k: k == "bn.num_batches_tracked"  # noqa: E731
    # two names for one tensor (e.g. 'quant_conv.weight' and 'encoder.quant_conv.weight') are
    # refused by build_key_map, naming both
    plan = build_key_map(src, rename, ignore=ignore)
    shapes = {name: op.shape(src) for name, op in plan.ops.items()}
    cfg = _infer_config(src, layout, shapes)
    logger.debug("%s: %s, %s layout, %s", src.name, cfg.variant, layout, cfg)
    return src, plan, cfg, layout




def vae_config(source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike) -> VAEConfig:
    """The config of a FLUX.2 VAE from tensor shapes only (no data is read; meta tensors work).

    Accepts anything :func:`klein_core.load_vae` accepts. Raises ValueError when the weights are not
    a FLUX.2 VAE, saying what they seem to be.
    """
    return prepare_vae(open_vae_source(source))[2]
