"""Tiny model files and a two-image captioned dataset, as the training CLI and job read them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from klein_core.testing import write_tiny_model_files


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for a test module (import it there): the training tests' tiny matrices only
    contend for threads on a shared 2-core machine (10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def nonzero_lora(model, config, *, seed: int = 1, up_seed: int = 4, scale: float = 0.5):
    """A ``LoRASet`` over ``model`` for ``config`` (an ``AdapterConfig``, e.g. ``preset("full", rank=2)``)
    with random up matrices (a fresh LoRA's are zero: it would change nothing). Its hooks are never
    attached, so ``model`` is unchanged."""
    from klein_core.train.adapters import LoRASet

    lora = LoRASet(model, config, seed=seed)
    g = torch.Generator().manual_seed(up_seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.up.copy_(torch.randn(layer.up.shape, generator=g) * scale)
    return lora


def tiny_training_files(root: Path) -> tuple[dict[str, Path], Path]:
    """``(model paths, dataset folder)`` under ``root``: fp32 tiny models (``write_tiny_model_files``)
    and ``data/`` with two 32x32 images, each with a ``.txt`` caption."""
    paths = write_tiny_model_files(root / "models", dtype=torch.float32)
    data = root / "data"
    data.mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (i * 90, 40, 10)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"a red square {i}")
    return paths, data


def eval_loss(model, samples) -> float:
    """The mean loss of ``samples`` (TrainSample with prompt embeddings) on fixed noise and sigmas
    (0.2..0.8 over the samples): deterministic, for before/after comparisons of a training run."""
    from klein_core.train.objective import ObjectiveConfig
    from klein_core.train.step import StepNoise, TrainBatch, compute_loss

    g = torch.Generator().manual_seed(99)
    total = 0.0
    with torch.no_grad():
        for i, s in enumerate(samples):
            sig = torch.tensor([0.2 + 0.6 * i / (len(samples) - 1)])
            rnd = StepNoise(torch.randn(s.latents.shape, generator=g), sig, sig)
            total += compute_loss(model, TrainBatch(s.latents, s.text), rnd, ObjectiveConfig())[0].item()
    return total / len(samples)
