"""A denoising request's inputs checked once, at the boundary (as diffusers' ``check_inputs``): the
components together, the embeddings, references, init image, mask and noise. What passes is trusted
below (:mod:`klein_core.pipeline.sampling`, the transformer)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import Checks
from ..models.qwen3 import Qwen3Config
from ..models.transformer import TransformerConfig
from ..models.vae import VAEConfig
from ..models.variants import check_text_width
from .inpaint import check_strength
from .request import Conditioning, ModelKind, Resolved, check_size, check_tensor

logger = logging.getLogger(__name__)


_COMPONENTS = (("transformer", TransformerConfig, "kc.load_transformer"),
               ("text_encoder", Qwen3Config, "kc.load_text_encoder"), ("vae", VAEConfig, "kc.load_vae"))


def check_compatible(transformer: Any | None, text_encoder: Any | None = None, vae: Any | None = None) -> None:
    """Raise, before any compute, a TypeError for a component of the wrong kind (another component,
    a file path) and a ValueError if the components do not belong together."""
    for (name, config_type, loader), module in zip(_COMPONENTS, (transformer, text_encoder, vae), strict=True):
        # By the config: a compiled or LoRA'd copy keeps its module's config.
        if module is not None and not isinstance(getattr(module, "config", None), config_type):
            got = (f"the path {os.fspath(module)!r}" if isinstance(module, (str, os.PathLike))
                   else f"a {type(module).__name__}")
            raise TypeError(f"{name} must be a loaded {name.replace('_', ' ')} ({loader}(path)), got {got}. The "
                            "components go in the order transformer, text_encoder, vae.")
    if transformer is None:
        return
    tc = transformer.config
    if text_encoder is not None:
        te = text_encoder.config
        check_text_width(te.text_dim, tc.context_dim, encoded_by=f"The text encoder ({te.variant})",
                         model=f"the {tc.variant} transformer")
    if vae is not None and vae.config.latent_channels != tc.in_channels:
        raise ValueError(
            f"The VAE ({vae.config.variant}, {vae.config.latent_channels} latent channels) does not fit the "
            f"{tc.variant} transformer ({tc.in_channels} channels): use the FLUX.2 VAE (flux2-vae.safetensors)."
        )


@dataclass(frozen=True)
class InitLatents:
    """Where denoising starts: the clean latents of an image ``[1 or B, 128, h, w]`` (normalised, as
    the VAE encoder gives them), the strength (the share of the schedule that runs, in (0, 1]),
    optionally which latent positions to repaint, ``mask`` ``[1 or B, 1, h, w]`` in [0, 1], and
    whether a single image also joins the sequence as the first reference (time offset 10, as
    diffusers' Klein inpaint pipeline)."""

    latents: torch.Tensor
    strength: float = 1.0
    mask: torch.Tensor | None = None
    as_reference: bool = False


def with_init_reference(references: Sequence[torch.Tensor], init: InitLatents | None) -> list[torch.Tensor]:
    """The references a run uses: the init image's latents first when it joins as a reference (a
    single image only; a batch of init images only seeds the noise)."""
    if init is not None and init.as_reference and init.latents.shape[0] == 1:
        return [init.latents, *references]
    return list(references)


UNUSED_NEGATIVE = "the negative prompt is not used"


def check_denoise_inputs(
    config: TransformerConfig,
    kind: ModelKind,
    conditioning: Conditioning,
    references: Sequence[torch.Tensor],
    run: Resolved,
    *,
    noise: torch.Tensor | None = None,
    init: InitLatents | None = None,
    negative_prompt: bool = False,
    downscale: int = 16,
    checks: Checks | None = None,
) -> None:
    """Every check of a denoising request, in one place, before any compute (diffusers'
    ``check_inputs``): the embeddings' text width and finiteness, the references, the init image and
    its mask, the noise, and the one notice that a negative prompt goes unused. Needs only the
    transformer's config, so a host can refuse a request before loading the weights. What passes is
    trusted below (:mod:`klein_core.pipeline.sampling`, the transformer).

    ``negative_prompt``: a negative prompt was given but not encoded (the notice is the same as for
    a given negative embedding that the run does not use). A text width that does not fit raises
    :class:`~klein_core.models.variants.TextWidthMismatch` (a ValueError), which a caller may restate.
    ``checks``: a run's :class:`~klein_core.checks.Checks` that may queue the finiteness checks of
    device tensors (default: read at once).
    """
    check = checks or Checks()
    channels = config.in_channels
    n_images = conditioning.positive.shape[0] * run.batch_size
    if init is not None:
        check_tensor(init.latents, "the init image latents", 4, channels)
        check.require_finite(init.latents, "the init image latents")
        check_strength(init.strength)
        b = init.latents.shape[0]
        if b not in (1, n_images):
            raise ValueError(f"the init image batch {b} must be 1 or prompts x batch_size = {n_images}")
        if init.mask is not None:
            check_tensor(init.mask, "the inpaint mask", 4, 1)
            check.require_finite(init.mask, "the inpaint mask")
            low, high = float(init.mask.min()), float(init.mask.max())
            if low < 0 or high > 1:  # a blend weight outside [0, 1] would extrapolate, not blend
                raise ValueError(f"the inpaint mask must lie in [0, 1] (1 = repaint), got values from {low:g} to "
                                 f"{high:g}")
            if init.mask.shape[-2:] != init.latents.shape[-2:] or init.mask.shape[0] not in (1, n_images):
                raise ValueError(f"the inpaint mask {list(init.mask.shape)} must be [1 or {n_images}, 1, h, w] on "
                                 f"the latent grid of the image {list(init.latents.shape)}")
        size = (init.latents.shape[-1] * downscale, init.latents.shape[-2] * downscale)
        if (run.width, run.height) != size:
            raise ValueError(f"the output size comes from the init image ({size[0]}x{size[1]}); got width/height "
                             f"{run.width}x{run.height}: leave them unset (0 in ComfyUI)")
    check_text_width(conditioning.positive.shape[-1], config.context_dim, encoded_by="The prompt embedding",
                     model=f"the {config.variant} transformer")
    check.require_finite(conditioning.positive, "the prompt embeddings")
    if conditioning.negative is not None:
        check_text_width(conditioning.negative.shape[-1], config.context_dim,
                         encoded_by="The negative prompt embedding", model=f"the {config.variant} transformer")
        check.require_finite(conditioning.negative, "the negative prompt embeddings")
    for i, ref in enumerate(with_init_reference(references, init)):
        check_tensor(ref, f"reference latent {i + 1}", 4, channels)
        check.require_finite(ref, f"reference latent {i + 1}")
    if (negative_prompt or conditioning.negative is not None) and not run.cfg:
        why = (f"guidance {run.guidance:g} is not above 1" if kind == "base" else
               "distilled Klein models run without CFG (for a base model: model_kind base on the loader node, "
               "--base in the CLI, kind='base' in Python)")
        logger.warning("%s: %s", UNUSED_NEGATIVE, why)
    if run.cfg and conditioning.negative is None:
        raise ValueError("CFG (a base model with guidance > 1) needs a negative prompt embedding")
    negative = conditioning.negative
    if run.cfg and negative is not None and negative.shape[0] not in (1, conditioning.positive.shape[0]):
        # Pairing is by prompt (one negative for all, or one per prompt); any other count used to
        # reach the sampler and fail there, after planning and loading, with the counts multiplied
        # by batch_size.
        raise ValueError(f"{negative.shape[0]} negative prompt embeddings for "
                         f"{conditioning.positive.shape[0]} prompt(s): give one, or one per prompt")
    if noise is not None:
        check_tensor(noise, "the given noise", 4, channels)
        check.require_finite(noise, "the given noise")
        if noise.shape[0] != n_images:
            raise ValueError(f"noise batch {noise.shape[0]} != prompts x batch_size = {n_images}")
        if init is None:
            # Given noise sets the output size (the sampler follows its grid), so the size rules
            # apply to it: without this a 1x1 grid (16 px) or a 10-megapixel one ran unchecked.
            size = (noise.shape[-1] * downscale, noise.shape[-2] * downscale)
            check_size(*size, multiple=downscale, warn=False)
            if (run.width, run.height) != size:  # else the run said one size and made another
                raise ValueError(f"the output size comes from the given noise ({size[0]}x{size[1]}); got "
                                 f"width/height {run.width}x{run.height}: leave them unset")
        if init is not None and noise.shape[-2:] != init.latents.shape[-2:]:
            raise ValueError(f"the given noise {list(noise.shape)} does not match the init image latents "
                             f"{list(init.latents.shape)}")


__all__ = ["UNUSED_NEGATIVE", "InitLatents", "check_compatible", "check_denoise_inputs", "with_init_reference"]
