"""A short LoRA run on a tiny model: the loss goes down, resume is bit-exact, and the saved LoRA
loads through ``klein_core.load_lora`` (diffusers and Kohya names) and in diffusers with the effect
it had in training."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from extras import require
from safetensors import safe_open
from tiny_reference import CTX, tiny_diffusers_transformer
from train_files import eval_loss, one_thread  # noqa: F401 (an autouse fixture)

from klein_core.files.loaders import load_transformer
from klein_core.lora import apply_loras, load_lora
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.train.adapters import LoRASet, preset
from klein_core.train.save import save_lora
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

diffusers = require("diffusers")
require("peft")

CFG = TrainConfig(steps=50, learning_rate=1e-2, batch_size=2, seed=4, gradient_checkpointing=True,
                  weight_decay=0.0)


@pytest.fixture(scope="module")
def base():
    dm = tiny_diffusers_transformer(seed=2)
    return dm, {k: v.contiguous() for k, v in dm.state_dict().items()}


def _samples(n: int = 8) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randn(1, 8, 2, 3, generator=g) * 0.5, torch.randn(1, 4, CTX, generator=g))
            for _ in range(n)]


def _trainer(dsd, samples, cfg=CFG, tmp=None):
    model = load_transformer(dsd)
    lora = LoRASet(model, preset("style", rank=4), seed=1)
    return model, lora, Trainer(model, lora, samples, cfg, output_dir=tmp)


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    _, dsd = base
    samples = _samples()
    model, lora, tr = _trainer(dsd, samples)
    before = eval_loss(model, samples)  # LoRA attached, B = 0: the base model's loss
    tr.train()
    after = eval_loss(model, samples)
    tr.close()
    return model, lora, samples, before, after, tr


def test_short_run_lowers_the_loss(trained, parity):
    _, _, _, before, after, tr = trained
    assert tr.step == 50 and len(tr.losses) == 50
    parity("train 50 steps: eval loss drop (fraction)", 1 - after / before)
    assert after < 0.8 * before, (before, after)


def test_resume_is_bit_exact(base, trained, tmp_path):
    _, dsd = base
    _, lora_full, samples, _, _, _ = trained
    _, _lora_a, tr_a = _trainer(dsd, samples, tmp=tmp_path)
    tr_a.train(until=20)
    folder = tr_a.save_checkpoint()
    tr_a.close()
    assert folder.name == "checkpoint-20"
    _, lora_b, tr_b = _trainer(dsd, samples)
    tr_b.resume(folder)
    assert tr_b.step == 20
    tr_b.train()
    tr_b.close()
    for (k, a), b in zip(lora_full.state_dict().items(), lora_b.state_dict().values()):
        assert torch.equal(a, b), k


def test_checkpoints_every_n_steps(base, tmp_path):
    _, dsd = base
    cfg = TrainConfig(steps=6, learning_rate=1e-3, batch_size=2, seed=0, checkpoint_every=3,
                      gradient_checkpointing=False)
    _, _, tr = _trainer(dsd, _samples(4), cfg, tmp_path)
    tr.train()
    tr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-6"]


def _inputs():
    g = torch.Generator().manual_seed(8)
    ids = position_ids(3, 4)
    return (torch.randn(1, 12, 8, generator=g), ids, torch.randn(1, 5, CTX, generator=g), text_position_ids(5),
            torch.tensor([0.6]))


def _run(model):
    img, ids, txt, tids, t = _inputs()
    with torch.no_grad():
        return model(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)


@pytest.mark.parametrize("fmt", ["diffusers", "kohya", "comfyui"])
def test_saved_lora_loads_with_the_trained_effect(base, trained, tmp_path, fmt, parity):
    dm, dsd = base
    model, lora, *_ = trained
    lora.attach(model)
    want = _run(model)
    lora.detach()
    plain = _run(model)
    assert (want - plain).abs().max().item() > 1e-2  # the LoRA learned something visible
    path = save_lora(tmp_path / f"{fmt}.safetensors", lora, fmt=fmt,
                     metadata={"base_model": "tiny-diffusers-seed2", "steps": 50, "dataset_hash": "abc"})
    loaded = load_lora(path)
    # 2 double blocks x (6 q/k/v + 6 others); ComfyUI and Kohya names keep each fused qkv as one pair
    assert not loaded.skipped and len(loaded.patches) == (24 if fmt == "diffusers" else 16)
    fresh = load_transformer(dsd)
    apply_loras(fresh, [(loaded, 1.0)])
    diff = parity(f"trained LoRA ({fmt} names) via load_lora vs training", (_run(fresh) - want).abs().max().item())
    assert diff <= 1e-5
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["klein.base_model"] == "tiny-diffusers-seed2" and meta["klein.steps"] == "50"
    assert meta["klein.dataset_hash"] == "abc"
    assert json.loads(meta["klein.targets"])["double"]["rank"] == 4
    assert set(json.loads(meta["klein.ranks"]).values()) == {4}
    sd, dmeta = diffusers.Flux2KleinPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    ref = copy.deepcopy(dm)
    ref.load_lora_adapter(sd, prefix="transformer", adapter_name="trained", metadata=dmeta)
    img, ids, txt, tids, t = _inputs()
    with torch.no_grad():
        out = ref(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                  return_dict=False)[0]
    diff = parity(f"trained LoRA ({fmt} names) in diffusers load_lora_adapter vs training",
                  (out - want).abs().max().item())
    assert diff <= 1e-4
