"""Training a LoRA on the text encoder alongside the transformer's (tiny random models, CPU): the
token path equals the cached-embedding path before training, the saved file's text-encoder part
loads through load_lora with the trained effect (diffusers and Kohya names) and diffusers still
reads the transformer part, and a whole job trains it, streamed or not, with resume checks."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image
from safetensors.torch import load_file
from train_files import tiny_training_files

from klein_core.files.loaders import load_text_encoder
from klein_core.lora import TEXT_ENCODER, apply_loras, load_lora
from klein_core.pipeline.tokenizer import tokenize_prompts
from klein_core.testing.tiny import tiny_transformer
from klein_core.train.adapters import LoRASet, preset, text_encoder_preset
from klein_core.train.cli import add_train_args, run_train
from klein_core.train.save import save_lora
from klein_core.train.trainer import TrainConfig, Trainer, TrainSample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("te_lora")
    paths, data = tiny_training_files(root)
    return root, paths, data


CAPTIONS = ("a red square", "a blue circle on grass")


def _tokens(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tokenize_prompts([caption], max_length=512)


def _setup(paths, *, rank: int = 4):
    te = load_text_encoder(paths["qwen_4b"], dtype=torch.float32)
    model = tiny_transformer()
    assert model.config.context_dim == te.config.text_dim
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(1, 128, 2, 2, generator=g) * 0.5 for _ in CAPTIONS]
    with torch.no_grad():
        cached = [te.encode(*_tokens(c)) for c in CAPTIONS]
    lora = LoRASet(model, preset("style", rank=rank), seed=1)
    text_lora = LoRASet(te, text_encoder_preset(rank=rank), seed=2)
    return te, model, latents, cached, lora, text_lora


def test_before_training_the_token_path_equals_the_cached_embeddings(files):
    _, paths, _ = files
    te, model, latents, cached, lora, text_lora = _setup(paths)
    cfg = TrainConfig(steps=1, batch_size=2, seed=3, gradient_checkpointing=True)
    with_te = Trainer(model, lora, [TrainSample(x, None, tokens=_tokens(c)) for x, c in zip(latents, CAPTIONS)], cfg,
                      text_encoder=te, text_lora=text_lora)
    loss_te = with_te.train_step()  # B starts at 0: the text-encoder LoRA adds nothing yet
    ups = [layer.up.grad for _, layer in text_lora.items()]
    assert all(g is not None and g.abs().sum() > 0 for g in ups)  # the gradient reaches the text encoder
    with_te.close()
    _, model2, _, _, lora2, _ = _setup(paths)
    cached_run = Trainer(model2, lora2, [TrainSample(x, t) for x, t in zip(latents, cached)], cfg)
    assert cached_run.train_step() == loss_te


def test_refused_mixes():
    model = tiny_transformer()
    lora = LoRASet(model, preset("style", rank=2))
    plain = [TrainSample(torch.zeros(1, 128, 2, 2), torch.zeros(1, 3, 96))]
    tokens = [TrainSample(torch.zeros(1, 128, 2, 2), None, tokens=_tokens("x"))]
    with pytest.raises(ValueError, match="needs the samples' tokens"):
        Trainer(model, lora, plain, TrainConfig(steps=1), text_encoder=torch.nn.Linear(1, 1),  # type: ignore[arg-type]
                text_lora=lora)
    with pytest.raises(ValueError, match="need a text-encoder LoRA to encode them"):
        Trainer(model, lora, tokens, TrainConfig(steps=1))
    with pytest.raises(ValueError, match="needs its prompt embeddings"):
        TrainSample(torch.zeros(1, 128, 2, 2), None)
    with pytest.raises(ValueError, match="text_encoder_lr must be a positive number"):
        TrainConfig(text_encoder_lr=0.0)


@pytest.mark.parametrize("fmt", ["diffusers", "kohya", "comfyui"])
def test_saved_text_encoder_lora_loads_with_the_trained_effect(files, tmp_path, fmt):
    _, paths, _ = files
    te, model, latents, _, lora, text_lora = _setup(paths)
    cfg = TrainConfig(steps=6, learning_rate=5e-2, batch_size=2, seed=3, text_encoder_lr=2e-2)
    tr = Trainer(model, lora, [TrainSample(x, None, tokens=_tokens(c)) for x, c in zip(latents, CAPTIONS)], cfg,
                 text_encoder=te, text_lora=text_lora)
    tr.train()
    assert [g["lr"] for g in tr.optimizer.param_groups] == [5e-2, 2e-2]
    ids, mask = tokenize_prompts(list(CAPTIONS), max_length=512)
    trained = te.encode(ids, mask)  # the hooks are attached until close()
    tr.close()
    plain = te.encode(ids, mask)
    assert (trained - plain).abs().max().item() > 1e-3  # the text encoder's LoRA learned something
    path = save_lora(tmp_path / "l.safetensors", lora, fmt=fmt, text_lora=text_lora)
    keys = load_file(str(path)).keys()
    prefix = {"diffusers": "text_encoder.model.layers.", "kohya": "lora_te_model_layers_",
              "comfyui": "text_encoders.qwen3_4b.transformer.model.layers."}[fmt]
    te_keys = [k for k in keys if k.startswith(prefix)]
    assert len(te_keys) == len(text_lora.names()) * (3 if fmt == "kohya" else 2)
    loaded = load_lora(path)
    assert not loaded.skipped and loaded.targets == ("transformer", "text_encoder")
    assert sum(p.component == TEXT_ENCODER for p in loaded.patches) == len(text_lora.names())
    fresh = load_text_encoder(paths["qwen_4b"], dtype=torch.float32)
    apply_loras(fresh, [(loaded, 1.0)])
    assert (fresh.encode(ids, mask) - trained).abs().max().item() <= 1e-5


def test_diffusers_reads_the_transformer_part_of_a_file_with_a_text_encoder_lora(files, tmp_path):
    diffusers = require("diffusers")
    _, paths, _ = files
    _, _, _, _, lora, text_lora = _setup(paths)
    with torch.no_grad():
        for layer in [*lora.layers.values(), *text_lora.layers.values()]:
            layer.up.normal_()
    path = save_lora(tmp_path / "both.safetensors", lora, text_lora=text_lora)
    alone = save_lora(tmp_path / "alone.safetensors", lora)
    sd, meta = diffusers.Flux2KleinPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    sd_alone = diffusers.Flux2KleinPipeline.lora_state_dict(str(alone))
    assert {k: v for k, v in sd.items() if k.startswith("transformer.")}.keys() == sd_alone.keys()
    assert all(torch.equal(sd[k], sd_alone[k]) for k in sd_alone)
    cfg = tiny_transformer().config  # the same sizes in diffusers' model: the adapter loads, the TE part is left
    dm = diffusers.Flux2Transformer2DModel(
        in_channels=128, num_layers=cfg.depth, num_single_layers=cfg.depth_single,
        attention_head_dim=cfg.hidden_size // cfg.num_heads, num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.context_dim, mlp_ratio=cfg.mlp_hidden / cfg.hidden_size,
        axes_dims_rope=cfg.axes_dim, timestep_guidance_channels=256, guidance_embeds=False)
    dm.load_lora_adapter(sd, prefix="transformer", adapter_name="both", metadata=meta)
    loaded = {n for n, _ in dm.named_parameters() if "lora_" in n}
    assert len(loaded) == len(sd_alone)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


def _cli(files, out, *extra):
    root, paths, data = files
    return run_train(_args(
        "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
        "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", "2", "--resolution", "32",
        "--rank", "2", "--device", "cpu", "--lr", "1e-2", "--cache-dir", str(root / "cache"), *extra))


def test_job_trains_a_text_encoder_lora_streamed_or_not(files, tmp_path):
    outs = {}
    for memory in ("resident", "blocks"):
        out = tmp_path / memory / "l.safetensors"
        assert _cli(files, out, "--text-encoder-rank", "2", "--memory", memory, "--checkpoint-every", "2",
                    "--sample-prompt", "a square", "--sample-steps", "2", "--sample-size", "64", "64") == 0
        sample = out.parent / "l-checkpoints" / "checkpoint-2" / "sample-0.png"
        outs[memory] = (load_file(str(out)), np.array(Image.open(sample)))
    (res, img_res), (blk, img_blk) = outs["resident"], outs["blocks"]
    te_keys = [k for k in res if k.startswith("text_encoder.")]
    assert te_keys and any(res[k].abs().sum() > 0 for k in te_keys if "lora_B" in k)  # it trained
    assert res.keys() == blk.keys() and all(torch.equal(res[k], blk[k]) for k in res)
    assert np.array_equal(img_res, img_blk)
    loaded = load_lora(tmp_path / "resident" / "l.safetensors")
    assert "text_encoder" in loaded.targets and not loaded.skipped


def test_resume_refuses_a_checkpoint_without_the_text_encoder_lora(files, tmp_path, capsys):
    out = tmp_path / "a" / "l.safetensors"
    assert _cli(files, out, "--checkpoint-every", "1") == 0
    capsys.readouterr()
    assert _cli(files, tmp_path / "b" / "l.safetensors", "--text-encoder-rank", "2",
                "--resume", str(out.parent / "l-checkpoints" / "checkpoint-1")) == 2
    err = capsys.readouterr().err
    assert "this checkpoint has no text-encoder LoRA and this run trains one; resume with the same" in err
    assert not (tmp_path / "b" / "l.safetensors").exists()


def test_resume_with_a_text_encoder_lora_is_bit_exact(files, tmp_path):
    _, paths, _ = files
    cfg = TrainConfig(steps=4, learning_rate=5e-2, batch_size=2, seed=3, text_encoder_lr=2e-2)

    def trainer():
        te, model, latents, _, lora, text_lora = _setup(paths, rank=2)
        samples = [TrainSample(x, None, tokens=_tokens(c)) for x, c in zip(latents, CAPTIONS)]
        return lora, text_lora, Trainer(model, lora, samples, cfg, text_encoder=te, text_lora=text_lora,
                                        output_dir=tmp_path)

    lora_a, te_a, full = trainer()
    full.train()
    _, _, first = trainer()
    first.train(until=2)
    folder = first.save_checkpoint()
    lora_b, te_b, second = trainer()
    second.resume(folder)
    second.train()
    assert second.losses == full.losses
    for a, b in ((lora_a, lora_b), (te_a, te_b)):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), k


def test_resume_with_another_rank_says_what_to_match(files, tmp_path):
    _, paths, _ = files
    _, model, latents, cached, lora, _ = _setup(paths, rank=2)
    cfg = TrainConfig(steps=2, batch_size=2, seed=3)
    tr = Trainer(model, lora, [TrainSample(x, t) for x, t in zip(latents, cached)], cfg, output_dir=tmp_path)
    tr.train(until=1)
    folder = tr.save_checkpoint()
    _, model2, _, _, lora4, _ = _setup(paths, rank=4)
    other = Trainer(model2, lora4, [TrainSample(x, t) for x, t in zip(latents, cached)], cfg)
    with pytest.raises(ValueError, match=r"this checkpoint's LoRA does not fit this run .* resume with the preset, "
                                         r"rank, targets and text-encoder rank it was trained with"):
        other.resume(folder)


def test_job_trains_on_a_gguf_base_and_on_a_gguf_text_encoder(files, tmp_path):
    """QLoRA-style: a Q8_0 GGUF base (and GGUF encoder with a text-encoder LoRA), streamed or not."""
    from gguf_files import write_tiny_gguf_qwen, write_tiny_gguf_transformer

    base = write_tiny_gguf_transformer(tmp_path / "flux-2-klein-base-4b-Q8_0.gguf")
    te = write_tiny_gguf_qwen(tmp_path / "qwen_3_4b-Q8_0.gguf")
    _, paths, data = files
    outs = {}
    for memory in ("resident", "blocks"):
        out = tmp_path / memory / "l.safetensors"
        assert run_train(_args(
            "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(te), "--transformer", str(base),
            "--output", str(out), "--steps", "2", "--resolution", "32", "--rank", "2", "--device", "cpu",
            "--lr", "1e-2", "--cache-dir", str(tmp_path / "cache"), "--text-encoder-rank", "2",
            "--memory", memory)) == 0
        outs[memory] = load_file(str(out))
    res, blk = outs["resident"], outs["blocks"]
    assert any(k.startswith("text_encoder.") for k in res) and any(k.startswith("transformer.") for k in res)
    assert any(res[k].abs().sum() > 0 for k in res if "lora_B" in k)
    assert res.keys() == blk.keys() and all(torch.equal(res[k], blk[k]) for k in res)
    assert not load_lora(tmp_path / "resident" / "l.safetensors").skipped
