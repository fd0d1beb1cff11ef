"""The pack's socket types and the small immutable values they carry between nodes.

Values are frozen: ComfyUI caches node outputs and hands the same object to later runs, so no node
may change what it received (a chained Reference Stacker builds a new stack).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_api.latest import io

import klein_core as kc

from .cache import ModelRef

KleinModelType = io.Custom("KLEIN_MODEL")
KleinVAEType = io.Custom("KLEIN_VAE")
KleinCondType = io.Custom("KLEIN_COND")
KleinRefsType = io.Custom("KLEIN_REFS")


@dataclass(frozen=True)
class KleinModel:
    """A Klein transformer: where to load it, its sampler defaults ("distilled" or "base") and sizes."""

    ref: ModelRef
    kind: str
    config: kc.TransformerConfig
    memory: str = "auto"  # klein_core memory mode: auto, resident, swap, blocks, minimum
    speed: str = "fast"  # klein_core.accel speed: fast, compile, plain

    @property
    def name(self) -> str:
        return self.ref.name

    def __str__(self) -> str:  # ComfyUI shows inputs to API clients with str(): file names only
        return f"{self.ref} as a {self.kind} model, memory {self.memory}, speed {self.speed}"


@dataclass(frozen=True)
class KleinVAE:
    ref: ModelRef
    config: kc.VAEConfig
    speed: str = "fast"  # "compile" compiles its decoder (the encoder stays eager); "plain": the plain VAE

    @property
    def name(self) -> str:
        return self.ref.name

    def __str__(self) -> str:
        return str(self.ref)


@dataclass(frozen=True)
class KleinConditioning:
    """Prompt and negative-prompt embeddings ``[1, L, text_dim]`` (L = 512, or longer for whole
    prompts; the two may differ) and the encoder that made them."""

    positive: torch.Tensor
    negative: torch.Tensor
    encoder_name: str
    text_dim: int
    variant: str
    has_negative: bool = False  # a negative prompt was written (distilled models ignore it: say so)

    def __str__(self) -> str:  # what API clients see of it in an error's inputs
        return (f"conditioning from {self.encoder_name}: prompt {self.positive.shape[1]} tokens, negative "
                f"{self.negative.shape[1]} tokens")


@dataclass(frozen=True)
class Reference:
    """One VAE-encoded reference ``[1, 128, h, w]``, its pixel size and the size it was made from."""

    latent: torch.Tensor
    width: int
    height: int
    source_width: int
    source_height: int

    def describe(self, number: int) -> str:
        return f"ref {number}: {self.width}x{self.height} (from {self.source_width}x{self.source_height})"


@dataclass(frozen=True)
class KleinReferences:
    items: tuple[Reference, ...] = ()

    def describe(self) -> str:
        return "\n".join(r.describe(i) for i, r in enumerate(self.items, start=1))

    def __str__(self) -> str:
        return f"{len(self.items)} reference(s): " + "; ".join(r.describe(i) for i, r in enumerate(self.items, 1))
