"""Training with the frozen blocks streamed (BlockOffloader, hooks off, each block copied in for its
forward and again for the backward pass's recomputation) on the tiny random transformer, on the
CPU: the offloader's CPU-to-CPU copies run the same code as on CUDA, without streams."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from klein_core.memory.placement import BlockOffloader
from klein_core.quant.fp8 import FP8Linear, quantize_model_
from klein_core.testing.tiny import tiny_transformer
from klein_core.train.adapters import LoRASet, gradient_checkpointing, preset
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

TEXT_DIM = 96


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _samples(refs: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g) * 0.5, torch.randn(1, 3, TEXT_DIM, generator=g),
                        tuple(torch.randn(1, 128, 2, 2, generator=g) for _ in range(refs))) for _ in range(4)]


def _run(stream: bool, *, refs: int = 0, fp8: bool = False, steps: int = 3, checkpointing: bool = True):
    model = tiny_transformer()
    if fp8:
        quantize_model_(model)
    streamer = BlockOffloader(model, "cpu", prefetch=1).attach(hooks=False) if stream else None
    lora = LoRASet(model, preset("full", rank=4), seed=1)
    cfg = TrainConfig(steps=steps, learning_rate=1e-2, batch_size=2, seed=3, gradient_checkpointing=checkpointing)
    tr = Trainer(model, lora, _samples(refs), cfg, streamer=streamer)
    tr.train()
    return tr, {k: v.detach().clone() for k, v in lora.state_dict().items()}, streamer


@pytest.mark.parametrize("refs,fp8", [(0, False), (2, False), (0, True)], ids=["text", "edit", "fp8"])
def test_streamed_training_equals_resident_bit_for_bit(refs, fp8):
    resident, w_res, _ = _run(False, refs=refs, fp8=fp8)
    streamed, w_str, streamer = _run(True, refs=refs, fp8=fp8)
    assert streamed.losses == resident.losses
    for (k, a), b in zip(w_res.items(), w_str.values()):
        assert torch.equal(a, b), k
    n = len(streamer.blocks)  # 3 blocks: every step loads each twice (forward, then recompute)
    assert streamer.stats.loads == 2 * n * 3
    assert streamer.stats.max_resident <= 2


def test_no_block_computes_with_its_home_weights():
    model = tiny_transformer()
    streamer = BlockOffloader(model, "cpu", prefetch=1).attach(hooks=False)
    homes = {s.home.data_ptr() for slots in streamer._slots for s in slots}
    lora = LoRASet(model, preset("full", rank=4), seed=1)
    seen: list[tuple[str, bool]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, FP8Linear)) and "blocks" in name:
            mod.register_forward_pre_hook(
                lambda m, a, name=name: seen.append((name, m.weight.data_ptr() in homes)))
    tr = Trainer(model, lora, _samples(), TrainConfig(steps=1, batch_size=2, gradient_checkpointing=True),
                 streamer=streamer)
    tr.train()
    per_pass = sum(1 for name, mod in model.named_modules()
                   if isinstance(mod, (nn.Linear, FP8Linear)) and "blocks" in name)
    assert len(seen) == 2 * per_pass  # forward and the backward pass's recomputation
    assert not any(home for _, home in seen)
    # between steps every block is back on its home tensors
    assert all(s.owner._parameters[s.name].data_ptr() == s.home.data_ptr()
               for slots in streamer._slots for s in slots if s.is_param)


def test_streaming_checkpoints_even_when_checkpointing_is_off():
    _, w_off, streamer = _run(True, checkpointing=False, steps=2)
    _, w_on, _ = _run(False, checkpointing=True, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(w_off.values(), w_on.values()))
    assert streamer.stats.loads == 2 * len(streamer.blocks) * 2


def test_streamer_over_other_blocks_is_refused():
    model, other = tiny_transformer(), tiny_transformer()
    streamer = BlockOffloader(other, "cpu").attach(hooks=False)
    with pytest.raises(ValueError, match="does not stream this model's blocks"):
        gradient_checkpointing(model, streamer=streamer)


def test_run_needs_attach():
    streamer = BlockOffloader(tiny_transformer(), "cpu")
    with pytest.raises(RuntimeError, match="attach"):
        streamer.run(0, lambda: None)


def test_sample_images_stream_the_blocks_too(tmp_path):
    from klein_core.pipeline.engine import Engine
    from klein_core.pipeline.request import Conditioning
    from klein_core.testing.tiny import tiny_vae
    from klein_core.train.samples import CheckpointSampler

    model = tiny_transformer()
    streamer = BlockOffloader(model, "cpu", prefetch=1).attach(hooks=False)
    homes = {s.home.data_ptr() for slots in streamer._slots for s in slots}
    lora = LoRASet(model, preset("full", rank=4), seed=1)
    cfg = TrainConfig(steps=1, batch_size=2, sample_prompts=("a",), sample_steps=2, sample_size=(64, 64))
    g = torch.Generator().manual_seed(1)
    # the engine streams the blocks itself (memory "blocks"), from where the training streamer keeps them
    engine = Engine(model, None, tiny_vae(), kind="base", memory="blocks", prompt_cache=None)
    sampler = CheckpointSampler.from_config(engine, cfg, conditioning=Conditioning(
        torch.randn(1, 3, TEXT_DIM, generator=g), torch.randn(1, 3, TEXT_DIM, generator=g)))
    tr = Trainer(model, lora, _samples(), cfg, output_dir=tmp_path, sampler=sampler, streamer=streamer)
    seen: list[bool] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and "blocks" in name:
            mod.register_forward_pre_hook(lambda m, a: seen.append(m.weight.data_ptr() in homes))
    paths = tr.sample_images()
    assert paths and paths[0].is_file()
    assert seen and not any(seen)  # every block linear ran on a streamed copy
    # afterwards the blocks are back on the training streamer's CPU homes, and training goes on exactly
    assert all(s.owner._parameters[s.name].data_ptr() == s.home.data_ptr()
               for slots in streamer._slots for s in slots if s.is_param)
    tr.train()
    assert len(tr.losses) == 1
