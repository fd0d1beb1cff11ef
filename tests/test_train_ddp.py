"""Data-parallel LoRA training: 2 processes on the CPU (gloo), each with half of every global batch,
end with the LoRA weights and losses of one process that takes the whole global batch."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from klein_core.testing import TINY_4B, tiny_text_encoder, tiny_transformer
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

WORLD, PER_PROCESS, STEPS = 2, 1, 5


def _samples() -> list[TrainSample]:
    """Two aspect buckets (3 and 2 samples): with a global batch of 2 each epoch has a 1-sample batch,
    which the second process sits out."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 2)] * 3 + [(2, 3)] * 2
    return [TrainSample(torch.randn(1, 128, h, w, generator=g), torch.randn(1, 4, 96, generator=g))
            for h, w in shapes]


def _lora(model: torch.nn.Module) -> LoRASet:
    return LoRASet(model, dataclasses.replace(preset("full", rank=2), dtype=torch.float64), seed=5)


def _token_samples() -> list[TrainSample]:
    """The same buckets with tokens instead of prompt embeddings (a text-encoder LoRA encodes them)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, 6, dtype=torch.long)
    return [TrainSample(s.latents, None, tokens=(torch.randint(0, 1000, (1, 6), generator=g), mask))
            for s in _samples()]


def _train(batch_size: int, text_encoder: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    # float64: the only difference left between the runs is the summation order of the gradients
    model = tiny_transformer(TINY_4B, seed=1).double()
    lora = _lora(model)
    cfg = TrainConfig(steps=STEPS, learning_rate=1e-2, batch_size=batch_size, seed=7, gradient_checkpointing=False)
    te = text_lora = None
    if text_encoder:
        te = tiny_text_encoder(TINY_4B, seed=2).double()
        text_lora = LoRASet(te, dataclasses.replace(text_encoder_preset(rank=2), dtype=torch.float64), seed=6)
    trainer = Trainer(model, lora, _token_samples() if text_encoder else _samples(), cfg, text_encoder=te,
                      text_lora=text_lora)
    trainer.train()
    trainer.close()
    weights = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    if text_lora is not None:
        weights.update({f"te.{k}": v.detach().clone() for k, v in text_lora.state_dict().items()})
    return weights, list(trainer.losses)


def _worker(rank: int, world: int, folder: str, text_encoder: bool = False) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        weights, losses = _train(PER_PROCESS, text_encoder)
        torch.save({"weights": weights, "losses": losses}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(WORLD, str(folder)), nprocs=WORLD, join=True)
    ddp = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _train(WORLD * PER_PROCESS)
    finally:
        torch.set_num_threads(n)
    return ddp, single


def test_ddp_equals_one_process_with_the_global_batch(runs, parity):
    ddp, (weights, losses) = runs
    assert not dist.is_initialized()
    for r in range(1, WORLD):  # every process holds the same LoRA
        for k, v in ddp[0]["weights"].items():
            assert torch.equal(v, ddp[r]["weights"][k]), (r, k)
    assert ddp[0]["weights"].keys() == weights.keys() and len(weights) > 0
    diff = max((ddp[0]["weights"][k] - v).abs().max().item() for k, v in weights.items())
    parity(f"LoRA after {STEPS} steps: 2-process DDP (gloo) vs 1 process, same global batch", diff)
    start = _lora(tiny_transformer(TINY_4B, seed=1).double()).state_dict()
    moved = max((v - start[k]).abs().max().item() for k, v in weights.items())
    assert moved > 1e-3, moved  # the LoRA did train
    assert diff <= 1e-12, diff
    assert len(ddp[0]["losses"]) == len(losses) == STEPS
    # the loss is computed in float32 (flow_loss), so the two sums of it differ by float32 rounding
    assert max(abs(a - b) for a, b in zip(ddp[0]["losses"], losses, strict=True)) <= 1e-6


def test_ddp_with_a_text_encoder_lora_equals_one_process(tmp_path, parity):
    mp.spawn(_worker, args=(WORLD, str(tmp_path), True), nprocs=WORLD, join=True)
    ddp = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights, losses = _train(WORLD * PER_PROCESS, text_encoder=True)
    finally:
        torch.set_num_threads(n)
    te_keys = [k for k in weights if k.startswith("te.")]
    assert te_keys and ddp[0]["weights"].keys() == weights.keys()
    for k, v in ddp[0]["weights"].items():
        assert torch.equal(v, ddp[1]["weights"][k]), k
    diff = max((ddp[0]["weights"][k] - v).abs().max().item() for k, v in weights.items())
    parity(f"LoRA + text-encoder LoRA after {STEPS} steps: 2-process DDP (gloo) vs 1 process", diff)
    assert diff <= 1e-12
    assert max(weights[k].abs().max().item() for k in te_keys if ".up" in k) > 0  # the text encoder's LoRA trained
    assert ddp[0]["losses"] == pytest.approx(losses, abs=1e-12)
