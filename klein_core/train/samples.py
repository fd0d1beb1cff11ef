"""Sample images at checkpoints: fixed prompts, a fixed seed, the model being trained with its LoRA
attached, through :class:`klein_core.pipeline.engine.Engine` (the base model: CFG by default).

The prompt embeddings (and the negative prompt's, for CFG) are encoded once, when the sampler is
made, so the text encoder can be freed for training; the VAE stays to decode the samples.
:class:`~klein_core.train.trainer.Trainer` calls the sampler with the LoRA in eval mode under
``torch.no_grad()`` and restores the RNG state afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..files.atomic import atomic_path
from ..pipeline.engine import Engine
from ..pipeline.request import Conditioning, GenerationRequest, Settings, resolve
from .trainer import TrainConfig


class CheckpointSampler:
    """``sampler(folder, step)`` writes ``folder/sample-<i>.png`` for prompt ``i`` (0-based) and returns
    the paths. ``engine`` needs the transformer being trained (or None now, set ``engine.transformer``
    before the first call), the VAE and, when this is made, a text encoder (unless
    ``conditioning`` is given: positive ``[P, L, D]``, negative ``[1, L, D]`` for CFG). ``reencode``:
    encode the prompts at every call instead (the text encoder, with a LoRA being trained, stays)."""

    def __init__(self, engine: Engine, prompts: Sequence[str], *, steps: int = 20, seed: int = 0,
                 guidance: float | None = None, size: tuple[int, int] = (512, 512), negative_prompt: str = "",
                 conditioning: Conditioning | None = None, reencode: bool = False) -> None:
        prompts = tuple(prompts)
        if not prompts:
            raise ValueError("sample images need at least one prompt")
        self.engine, self.prompts = engine, prompts
        self.settings = Settings(width=int(size[0]), height=int(size[1]), steps=int(steps), guidance=guidance,
                                 seed=int(seed))
        cfg = resolve(self.settings, engine.kind, multiple=engine.downscale, warn=False).cfg
        self.reencode = reencode
        self.negative_prompt = negative_prompt if cfg else None
        self.positive, self.negative = torch.empty(0), None
        if reencode:  # a text-encoder LoRA is being trained: the prompts are encoded at every call
            if engine.text_encoder is None:
                raise ValueError("sample images with a trained text encoder need the text encoder")
            return
        if conditioning is None:
            if engine.text_encoder is None:
                raise ValueError("sample images need the text encoder once (to encode the prompts) or conditioning")
            with torch.no_grad():
                conditioning = engine.encode_prompts(list(prompts), negative_prompt if cfg else None)
        if len(conditioning) != len(prompts):
            raise ValueError(f"{len(prompts)} sample prompt(s) but {len(conditioning)} embedding(s)")
        if cfg and conditioning.negative is None:
            raise ValueError("CFG sampling needs the negative prompt's embedding")
        self.positive = conditioning.positive.detach()
        self.negative = conditioning.negative.detach() if cfg and conditioning.negative is not None else None

    @classmethod
    def from_config(cls, engine: Engine, config: TrainConfig, **kw: object) -> CheckpointSampler:
        return cls(engine, config.sample_prompts, steps=config.sample_steps, seed=config.sample_seed,
                   guidance=config.sample_guidance, size=config.sample_size, **kw)  # type: ignore[arg-type]

    def _step(self, step: int, total: int, latents: torch.Tensor) -> None:
        if self.engine.check_cancel is not None:  # the host's cancel, between denoising steps
            self.engine.check_cancel()

    def __call__(self, folder: Path, step: int) -> list[Path]:
        if self.engine.transformer is None:
            raise RuntimeError("the sampler's engine has no transformer")
        folder = Path(folder)
        paths = []
        if self.reencode:
            encoded = self.engine.encode_prompts(list(self.prompts), self.negative_prompt)
            self.positive, self.negative = encoded.positive.detach(), encoded.negative
        for i in range(len(self.prompts)):
            cond = Conditioning(self.positive[i:i + 1], self.negative)
            result = self.engine.generate(GenerationRequest(conditioning=cond, settings=self.settings),
                                          callback=self._step)
            assert result.images is not None
            path = folder / f"sample-{i}.png"
            with atomic_path(path) as tmp:
                result.images[0].save(tmp, format="PNG")
            paths.append(path)
        return paths
