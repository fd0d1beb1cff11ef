"""Training options on the tiny random Klein transformer: reference dropout, the 8-bit optimizer's
error, sample images at checkpoints (training unchanged by them) and an fp8 base."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image
from quant_layers import random_nvfp4_layer
from train_files import eval_loss, one_thread, tiny_training_files  # noqa: F401 (an autouse fixture)

from klein_core.pipeline.engine import Engine
from klein_core.pipeline.request import Conditioning
from klein_core.quant.fp8 import FP8Linear, quantize_model_
from klein_core.testing.tiny import tiny_transformer, tiny_vae
from klein_core.train.adapters import LoRASet, preset
from klein_core.train.samples import CheckpointSampler
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

TEXT_DIM = 96  # the tiny transformer's context width


def _samples(n: int = 4, refs: int = 0, seed: int = 0) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g) * 0.5, torch.randn(1, 3, TEXT_DIM, generator=g),
                        tuple(torch.randn(1, 128, 2, 2, generator=g) for _ in range(refs))) for _ in range(n)]


def _no_refs(samples: list[TrainSample]) -> list[TrainSample]:
    return [TrainSample(s.latents, s.text) for s in samples]


def _trainer(samples, cfg, model=None, tmp=None, sampler=None):
    model = model if model is not None else tiny_transformer()
    lora = LoRASet(model, preset("style", rank=4), seed=1)
    return model, lora, Trainer(model, lora, samples, cfg, output_dir=tmp, sampler=sampler)


def _grads(tr: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in tr.params]


# -- reference dropout ------------------------------------------------------------------------

def test_reference_dropout_one_trains_as_without_references():
    edit = _samples(2, refs=2)
    cfg = TrainConfig(steps=2, learning_rate=1e-2, batch_size=2, seed=3, gradient_checkpointing=False)
    *_, dropped = _trainer(edit, TrainConfig(**{**cfg.__dict__, "reference_dropout": 1.0}))
    *_, plain = _trainer(_no_refs(edit), cfg)
    *_, kept = _trainer(edit, cfg)  # dropout 0: the references stay
    for _ in range(2):  # two steps: the second starts from the weights the first one changed
        a, b, c = dropped.train_step(), plain.train_step(), kept.train_step()
        assert a == b and a != c
        for ga, gb, gc in zip(_grads(dropped), _grads(plain), _grads(kept)):
            assert torch.equal(ga, gb)
        assert any(not torch.equal(ga, gc) for ga, gc in zip(_grads(dropped), _grads(kept)))
    assert dropped._batch(0)[0].references == () and len(kept._batch(0)[0].references) == 2


def test_reference_dropout_draw_is_keyed_by_step_and_resumes_exactly(tmp_path):
    edit = _samples(2, refs=1)
    cfg = TrainConfig(steps=6, learning_rate=1e-2, batch_size=2, seed=5, gradient_checkpointing=False,
                      reference_dropout=0.5)
    _, lora_full, full = _trainer(edit, cfg)
    pattern = [len(full._batch(s)[0].references) for s in range(6)]
    assert pattern == [1, 1, 0, 0, 0, 1]  # seed 5: a mix (both after the resume), the same for every trainer
    full.train()
    _, _, first = _trainer(edit, cfg, tmp=tmp_path)
    first.train(until=3)
    folder = first.save_checkpoint()
    _, lora_b, second = _trainer(edit, cfg)
    assert [len(second._batch(s)[0].references) for s in range(6)] == pattern
    second.resume(folder)
    second.train()
    assert second.losses == full.losses
    for (k, a), b in zip(lora_full.state_dict().items(), lora_b.state_dict().values()):
        assert torch.equal(a, b), k


# -- 8-bit optimizer --------------------------------------------------------------------------

def test_adamw8bit_without_bitsandbytes_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when it is not installed
    with pytest.raises(RuntimeError, match=r"optimizer 'adamw8bit' needs bitsandbytes \(pip install bitsandbytes\); "
                                           r"use optimizer 'adamw' without it"):
        _trainer(_samples(2), TrainConfig(steps=2, optimizer="adamw8bit"))


def _rank32(cfg: TrainConfig) -> tuple[LoRASet, Trainer]:
    # rank 32: 8 of the 16 factor tensors reach bitsandbytes' 4096-element minimum for 8-bit states
    model = tiny_transformer()
    lora = LoRASet(model, preset("style", rank=32), seed=1)
    return lora, Trainer(model, lora, _samples(4), cfg)


def _weights(lora: LoRASet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lora.state_dict().items()}


def test_adamw8bit_tracks_adamw_within_its_quantisation_error():
    require("bitsandbytes")
    base = {"steps": 30, "learning_rate": 1e-2, "batch_size": 2, "seed": 2, "gradient_checkpointing": False}
    lora32, fp32 = _rank32(TrainConfig(**base))
    lora8, q8 = _rank32(TrainConfig(**base, optimizer="adamw8bit"))
    lora_ctl, ctl = _rank32(TrainConfig(**{**base, "learning_rate": 1.2e-2}))  # control: a 20% larger step
    start = _weights(lora32)
    assert torch.equal(torch.cat([v.flatten() for v in start.values()]),
                       torch.cat([v.flatten() for v in _weights(lora8).values()]))
    for tr in (fp32, q8, ctl):
        tr.train()
    names = list(start)
    eight = [n for n, p in zip(names, q8.params) if q8.optimizer.state[p]["state1"].dtype == torch.uint8]
    assert len(eight) == 8 and all(q8.optimizer.state[p]["state2"].dtype == torch.uint8
                                   for n, p in zip(names, q8.params) if n in eight)

    def rel(a: dict, b: dict) -> float:  # distance between two runs' weights over the fp32 run's update
        num = sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in eight) ** 0.5
        return num / sum(float(((a[k] - start[k]).double() ** 2).sum()) for k in eight) ** 0.5

    w32, w8, wctl = _weights(lora32), _weights(lora8), _weights(lora_ctl)
    # measured: 2.2e-2 after 30 steps (the 8-bit states' blockwise quantisation); the control: 0.38
    assert 1e-3 < rel(w32, w8) < 0.06
    assert rel(w32, wctl) > 0.2
    assert max(abs(a - b) for a, b in zip(fp32.losses, q8.losses)) < 1e-3


def test_adamw8bit_checkpoint_resumes_bit_exactly(tmp_path):
    require("bitsandbytes")
    cfg = TrainConfig(steps=6, learning_rate=1e-2, batch_size=2, seed=4, gradient_checkpointing=False,
                      optimizer="adamw8bit")
    lora_full, full = _rank32(cfg)
    full.train()
    _, first = _rank32(cfg)
    first.output_dir = tmp_path
    first.train(until=3)
    folder = first.save_checkpoint()
    lora_b, second = _rank32(cfg)
    second.resume(folder)
    assert any(s["state1"].dtype == torch.uint8 for s in second.optimizer.state.values())
    second.train()
    assert second.losses == full.losses
    for (k, a), b in zip(_weights(lora_full).items(), _weights(lora_b).values()):
        assert torch.equal(a, b), k


# -- sample images at checkpoints -------------------------------------------------------------

def _cond(n: int) -> Conditioning:
    g = torch.Generator().manual_seed(11)
    return Conditioning(torch.randn(n, 4, TEXT_DIM, generator=g), torch.randn(1, 4, TEXT_DIM, generator=g))


def _pixels(path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path).convert("RGB")))


def test_samples_at_checkpoints_leave_training_unchanged(tmp_path):
    cfg = TrainConfig(steps=4, learning_rate=5e-2, batch_size=2, seed=2, checkpoint_every=2,
                      gradient_checkpointing=True, sample_prompts=("a", "b"), sample_steps=3,
                      sample_size=(64, 64), sample_seed=7)
    _, lora_ref, ref = _trainer(_samples(), cfg)  # no sampler: same config, no images
    ref.train()
    model = tiny_transformer()
    engine = Engine(model, None, tiny_vae(), kind="base", memory="resident", prompt_cache=None)
    sampler = CheckpointSampler.from_config(engine, cfg, conditioning=_cond(2))
    assert sampler.negative is not None  # the base model's default: CFG
    calls = []

    def spy(folder, step):
        calls.append((step, lora.training, torch.is_grad_enabled()))
        return sampler(folder, step)
    _, lora, tr = _trainer(_samples(), cfg, model=model, tmp=tmp_path, sampler=spy)
    tr.train()
    assert calls == [(2, False, False), (4, False, False)] and lora.training
    assert tr.losses == ref.losses
    for (k, a), b in zip(lora_ref.state_dict().items(), lora.state_dict().values()):
        assert torch.equal(a, b), k
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert names == ["checkpoint-2/sample-0.png", "checkpoint-2/sample-1.png", "checkpoint-2/trainer_state.safetensors",
                     "checkpoint-4/sample-0.png", "checkpoint-4/sample-1.png", "checkpoint-4/trainer_state.safetensors"]
    px = {n: _pixels(tmp_path / n) for n in names if n.endswith(".png")}
    assert Image.open(tmp_path / "checkpoint-2/sample-0.png").size == (64, 64)
    # the LoRA learned between the checkpoints: the same prompt and seed give another image
    assert not torch.equal(px["checkpoint-2/sample-0.png"], px["checkpoint-4/sample-0.png"])
    assert not torch.equal(px["checkpoint-2/sample-0.png"], px["checkpoint-2/sample-1.png"])
    # sampling again at the same weights gives the same image (fixed seed)
    (tmp_path / "again").mkdir()
    again = sampler(tmp_path / "again", 4)
    assert torch.equal(_pixels(again[0]), px["checkpoint-4/sample-0.png"])


def test_sample_every_n_steps_without_checkpoints(tmp_path):
    cfg = TrainConfig(steps=3, learning_rate=1e-2, batch_size=2, seed=0, sample_prompts=("x",), sample_every=3,
                      sample_steps=1, sample_size=(64, 64), gradient_checkpointing=False)
    model = tiny_transformer()
    engine = Engine(model, None, tiny_vae(), kind="base", memory="resident", prompt_cache=None)
    sampler = CheckpointSampler.from_config(engine, cfg, conditioning=_cond(1))
    *_, tr = _trainer(_samples(2), cfg, model=model, tmp=tmp_path, sampler=sampler)
    tr.train()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "checkpoint-3/sample-0.png"]
    assert tr.sample_paths == [tmp_path / "checkpoint-3" / "sample-0.png"]


def test_sample_options_are_checked():
    with pytest.raises(ValueError, match="sample_every must be >= 0 and sample_steps >= 1, got -1 and 20"):
        TrainConfig(sample_every=-1)
    engine = Engine(tiny_transformer(), None, tiny_vae(), kind="base", memory="resident", prompt_cache=None)
    with pytest.raises(ValueError, match="sample images need the text encoder once"):
        CheckpointSampler(engine, ["a"])
    with pytest.raises(ValueError, match="sample images need at least one prompt"):
        CheckpointSampler(engine, [], conditioning=_cond(1))


# -- fp8 base ---------------------------------------------------------------------------------

def test_lora_hook_on_fp8_linear_adds_its_delta():
    model = tiny_transformer()
    quantize_model_(model)
    layer = model.get_submodule("double_blocks.0.img_attn.qkv")
    assert isinstance(layer, FP8Linear)
    lora = LoRASet(model, preset("style", rank=4), seed=1)
    assert lora.names() == ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj",
                            "double_blocks.0.txt_attn.qkv", "double_blocks.0.txt_attn.proj",
                            "double_blocks.0.img_mlp.0", "double_blocks.0.img_mlp.2",
                            "double_blocks.0.txt_mlp.0", "double_blocks.0.txt_mlp.2"]
    with torch.no_grad():
        lora.layer("double_blocks.0.img_attn.qkv").up.normal_(0, 0.1)
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = layer(x)
        lora.attach(model)
        with_lora = layer(x)
        lora.detach()
        assert torch.equal(layer(x), base)
    delta = x @ lora.layer("double_blocks.0.img_attn.qkv").delta().T
    torch.testing.assert_close(with_lora - base, delta, rtol=1e-5, atol=1e-5)
    assert (with_lora - base).abs().max() > 1e-2


def _fp8_run(steps: int, matmul: str | None = None):
    """A tiny transformer with its 12 block linears in fp8 (``matmul`` forced on them if given), and a
    trainer over 4 samples: ``(model, samples, lora, trainer, eval loss before training)``."""
    model = tiny_transformer()
    done = quantize_model_(model)
    assert len(done) == 12 and all(isinstance(model.get_submodule(n), FP8Linear) for n in done)
    if matmul is not None:
        for n in done:
            model.get_submodule(n).matmul = matmul
    samples = _samples(4, seed=8)
    cfg = TrainConfig(steps=steps, learning_rate=5e-2, batch_size=2, seed=1, weight_decay=0.0,
                      gradient_checkpointing=True)
    _, lora, tr = _trainer(samples, cfg, model=model)
    return model, samples, lora, tr, eval_loss(model, samples)


def test_fp8_base_trains_the_lora_only_and_lowers_the_loss():
    model, samples, lora, tr, before = _fp8_run(40)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    tr.train_step()
    tr.train_step()  # the second step: B moved off 0, so A's gradients are non-zero too
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.params)
    assert all(p.grad is None for p in model.parameters())
    assert all(not p.requires_grad for p in model.parameters())
    tr.train()
    after = eval_loss(model, samples)
    tr.close()
    for k, v in model.state_dict().items():  # the fp8 base is untouched
        assert torch.equal(v, frozen[k]), k
    assert lora.layer("double_blocks.0.img_attn.qkv").up.dtype == torch.float32
    assert after < 0.95 * before, (before, after)  # measured 1.5682 -> 1.4446 (-7.9%; fp32 base: -7.8%)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matmul_has_a_backward_through_the_upcast_weight(dtype):
    """torch._scaled_mm has no derivative: with a gradient to pass to x (a LoRA below this layer), the
    fp8 matmul's backward multiplies by the upcast weight, exactly the upcast path's gradient."""
    torch.manual_seed(0)
    layer = FP8Linear.from_linear(torch.nn.Linear(64, 192))
    x = torch.randn(5, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(5, 192, dtype=dtype)
    layer.matmul = "scaled_mm"
    y_fp8 = layer(x)
    y_fp8.backward(grad)
    g_fp8, x.grad = x.grad.clone(), None
    layer.matmul = "upcast"
    y_up = layer(x)
    y_up.backward(grad)
    assert not torch.equal(y_fp8, y_up)  # the forward did take the fp8 matmul (activations quantised)
    assert torch.equal(g_fp8, x.grad)
    with torch.no_grad():  # no gradient wanted: the plain fp8 matmul, no autograd node
        layer.matmul = "scaled_mm"
        assert layer(x).grad_fn is None


def test_fp8_base_with_the_fp8_matmul_trains():
    """The path an H100 takes for widening fp8 layers (forced here): training runs and lowers the loss."""
    model, samples, _, tr, before = _fp8_run(20, matmul="scaled_mm")
    tr.train()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.params)
    assert eval_loss(model, samples) < 0.97 * before


# -- GGUF and NVFP4 bases (QLoRA-style: the frozen quantised layers, the LoRA on top) ----------

def _quantise_blocks(model, make) -> list[str]:
    from klein_core.models.layers import replace_module
    from klein_core.quant.fp8 import block_linear_names

    names = block_linear_names(model)
    for name in names:
        replace_module(model, name, make(model.get_submodule(name)))
    return names


@pytest.mark.parametrize("base", ["Q8_0", "Q4_0", "nvfp4"])
def test_quantised_base_trains_the_lora_only_and_lowers_the_loss(base, monkeypatch):
    from klein_core.quant import nvfp4
    from klein_core.quant.ggml import GGMLLinear, GGMLType

    model = tiny_transformer()
    if base == "nvfp4":
        native_calls: list[bool] = []

        def native(layer, x, bias, kitchen):  # like the fp4 kernel: no backward (its output has no graph)
            native_calls.append(torch.is_grad_enabled() and x.requires_grad)
            with torch.no_grad():
                return torch.nn.functional.linear(x, layer.dequantized(x.dtype), bias)

        monkeypatch.setattr(nvfp4, "native_unavailable", lambda device: None)
        monkeypatch.setattr(nvfp4, "native_linear", native)
        monkeypatch.setattr(nvfp4, "_kitchen", lambda: None)
        monkeypatch.setattr(nvfp4, "_NATIVE_DTYPES", (*nvfp4._NATIVE_DTYPES, torch.float32))  # the tiny model's
        names = _quantise_blocks(model, lambda lin: random_nvfp4_layer(lin, 0.02, seed=lin.out_features))
        kind = nvfp4.NVFP4Linear
    else:
        names = _quantise_blocks(model, lambda lin: GGMLLinear.from_linear(lin, GGMLType[base]))
        kind = GGMLLinear
    assert len(names) == 12 and all(isinstance(model.get_submodule(n), kind) for n in names)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    samples = _samples(4, seed=8)
    cfg = TrainConfig(steps=30, learning_rate=5e-2, batch_size=2, seed=1, weight_decay=0.0,
                      gradient_checkpointing=True)
    _, lora, tr = _trainer(samples, cfg, model=model)
    assert len(lora.names()) == 8  # the style preset's linears, all quantised here
    before = eval_loss(model, samples)
    tr.train_step()
    tr.train_step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.params)
    assert all(not p.requires_grad for p in model.parameters())
    tr.train()
    after = eval_loss(model, samples)
    tr.close()
    for k, v in model.state_dict().items():  # the quantised base is untouched
        assert torch.equal(v, frozen[k]), k
    assert after < 0.97 * before, (before, after)
    if base == "nvfp4":  # evaluation (no gradient) took the fp4 matmul; training never did
        assert native_calls and not any(native_calls)


# -- through the CLI: fp8 base and sample images ----------------------------------------------

def test_cli_fp8_base_with_sample_images(tmp_path, monkeypatch):
    import argparse

    import klein_core.train.job as job_module
    from klein_core.lora import load_lora
    from klein_core.train.cli import add_train_args, run_train

    paths, data = tiny_training_files(tmp_path)
    p = argparse.ArgumentParser()
    add_train_args(p)
    out = tmp_path / "out" / "l.safetensors"
    args = p.parse_args(["--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
                         "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", "2",
                         "--resolution", "32", "--rank", "2", "--device", "cpu", "--quantize", "fp8",
                         "--checkpoint-every", "2", "--sample-prompt", "a cat", "--sample-prompt", "a dog",
                         "--sample-steps", "2", "--sample-size", "64", "64", "--lr", "1e-2"])
    seen = []

    class Spy(Trainer):
        def __init__(self, model, *a, **kw):
            seen.append((sorted(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Linear")),
                         kw["sampler"]))
            super().__init__(model, *a, **kw)
    monkeypatch.setattr(job_module, "Trainer", Spy)
    assert run_train(args) == 0
    (linears, sampler), = seen
    assert linears.count("FP8Linear") == 12 and isinstance(sampler, CheckpointSampler)
    folder = tmp_path / "out" / "l-checkpoints" / "checkpoint-2"
    assert sorted(f.name for f in folder.iterdir()) == ["sample-0.png", "sample-1.png", "trainer_state.safetensors"]
    assert Image.open(folder / "sample-1.png").size == (64, 64)
    lora = load_lora(out)
    assert lora.metadata["klein.steps"] == "2" and set(lora.ranks.values()) == {2}


# -- keeping checkpoints ------------------------------------------------------------------------

def test_keep_checkpoints_deletes_older_states_and_keeps_sample_folders(tmp_path):
    from klein_core.train.trainer import CHECKPOINT_FILE, latest_checkpoint

    cfg = TrainConfig(steps=5, learning_rate=1e-2, batch_size=2, seed=1, gradient_checkpointing=False,
                      checkpoint_every=1, keep_checkpoints=2)
    (tmp_path / "checkpoint-9").mkdir()  # a stale higher-numbered folder without a state: left alone
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "sample-0.png").write_bytes(b"x")  # sample images stay
    *_, tr = _trainer(_samples(2), cfg, tmp=tmp_path)
    tr.train()
    states = sorted(p.parent.name for p in tmp_path.glob(f"checkpoint-*/{CHECKPOINT_FILE}"))
    assert states == ["checkpoint-4", "checkpoint-5"]
    assert (tmp_path / "checkpoint-1" / "sample-0.png").is_file() and (tmp_path / "checkpoint-9").is_dir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
    *_, again = _trainer(_samples(2), TrainConfig(**{**cfg.__dict__, "steps": 6}), tmp=tmp_path)
    again.resume(latest_checkpoint(tmp_path, 6))
    again.train()
    assert again.step == 6 and len(again.losses) == 6
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 0"):
        TrainConfig(keep_checkpoints=-1)
