"""One training forward: noisy tokens (+ reference tokens, as inference joins them) through the
transformer, the velocity loss on the noisy tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..pipeline.sampling import REF_TIME_OFFSET, pack, position_ids, text_position_ids, unpack
from .objective import ObjectiveConfig, flow_loss, loss_weighting, noisy_input, velocity_target


@dataclass(frozen=True)
class TrainBatch:
    """One batch of cached inputs with one shape: ``latents [B, C, h, w]`` (normalised, patchified
    VAE latents, the model's 128 channels), ``text [B, L, D]`` prompt embeddings and per reference
    index ``references[i] [B, C, h_i, w_i]`` (edit pairs; empty for text-to-image)."""

    latents: torch.Tensor
    text: torch.Tensor
    references: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        b = self.latents.shape[0]
        if self.latents.ndim != 4 or self.text.ndim != 3 or self.text.shape[0] != b:
            raise ValueError(f"batch shapes do not fit: latents {list(self.latents.shape)}, text {list(self.text.shape)}")
        for i, r in enumerate(self.references):
            if r.ndim != 4 or r.shape[0] != b or r.shape[1] != self.latents.shape[1]:
                raise ValueError(f"reference {i + 1}: expected [{b}, {self.latents.shape[1]}, h, w], got {list(r.shape)}")


@dataclass(frozen=True)
class StepNoise:
    """The randomness of one step: ``noise`` like the latents, ``sigmas`` and the model
    ``timesteps`` ``[B]`` float32 (:func:`klein_core.train.objective.sigmas_for`)."""

    noise: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor


def sequence_inputs(batch: TrainBatch, noisy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(img tokens [B, n + R, C], img_ids [n + R, 4])``: the noisy tokens, then reference ``i`` at
    RoPE time ``10 * (i + 1)``, exactly as the sampler joins references ("joint" mode)."""
    _, _, h, w = noisy.shape
    toks, ids = [pack(noisy)], [position_ids(h, w)]
    for i, ref in enumerate(batch.references):
        toks.append(pack(ref.to(noisy.dtype)))
        ids.append(position_ids(ref.shape[2], ref.shape[3], t=REF_TIME_OFFSET * (i + 1)))
    return torch.cat(toks, dim=1), torch.cat(ids)


def encode_text(text_encoder: Qwen3TextEncoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Prompt embeddings ``[B, L, 3 * hidden]`` from token ids and mask ``[B, L]``, differentiable
    w.r.t. a LoRA attached to the text encoder: the same computation as
    :meth:`~klein_core.models.qwen3.Qwen3TextEncoder.encode` (model dtype), without its ``no_grad``."""
    device = text_encoder.embed_tokens.weight.device
    return text_encoder(input_ids.to(device=device, dtype=torch.long), attention_mask.to(device))


def compute_loss(model: Flux2Transformer, batch: TrainBatch, rnd: StepNoise, cfg: ObjectiveConfig,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, per_sample [B])`` of one batch (float32, differentiable w.r.t. any attached LoRA)."""
    device, dtype = model.device, model.dtype
    x0 = batch.latents.to(device=device, dtype=dtype)
    noise = rnd.noise.to(device=device, dtype=dtype)
    _, _, h, w = x0.shape
    noisy = noisy_input(x0, noise, rnd.sigmas.to(device))
    img, img_ids = sequence_inputs(TrainBatch(x0, batch.text, tuple(r.to(device) for r in batch.references)), noisy)
    txt = batch.text.to(device=device, dtype=dtype)
    pred = model(img=img, img_ids=img_ids, txt=txt, txt_ids=text_position_ids(txt.shape[1]),
                 timesteps=rnd.timesteps.to(device))[:, : h * w]
    pred = unpack(pred, h, w)
    return flow_loss(pred, velocity_target(x0, noise), loss_weighting(cfg, rnd.sigmas.to(device)))


