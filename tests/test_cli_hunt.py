"""The command line against the Python API: the PNG's parameters reproduce the image, and the
transformer it runs is the one asked for (--model, the default pick from --models-dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from train_files import nonzero_lora

from klein_core import cli
from klein_core.files.loaders import load_text_encoder, load_transformer, load_vae
from klein_core.pipeline.engine import generate
from klein_core.testing import write_tiny_model_files

SIZE = ["--width", "64", "--height", "64", "--steps", "2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return d, write_tiny_model_files(d)


def _load(tr, te, vae, quantize=None):
    return (load_transformer(tr, device="cpu", dtype=torch.float32, quantize=quantize),
            load_text_encoder(te, device="cpu", dtype=torch.float32), load_vae(vae, device="cpu", dtype=torch.float32))


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _params(path: Path) -> dict:
    return json.loads(Image.open(path).text["parameters"])


def _pictures(tmp_path):
    rng = np.random.RandomState(3)
    img, mask = tmp_path / "img.png", tmp_path / "mask.png"
    Image.fromarray(rng.randint(0, 255, (64, 64, 3), np.uint8)).save(img)
    m = np.zeros((64, 64), np.uint8)
    m[8:40, 8:40] = 255
    Image.fromarray(m).save(mask)
    return img, mask


def test_parameters_reproduce_an_inpaint_with_its_options(models, tmp_path):
    d, p = models
    img, mask = _pictures(tmp_path)
    out = tmp_path / "o.png"
    rc = cli.main(["--models-dir", str(d), "--prompt", "a vase", "--image", str(img), "--mask", str(mask),
                   "--steps", "2", "--crop-padding", "8", "--feather", "3", "--no-composite", "--out", str(out), "-q"])
    assert rc == 0
    meta = _params(out)
    assert (meta["crop_padding"], meta["feather"], meta["composite"], meta["strength"]) == (8, 3, False, 1.0)
    # the API, fed only what the parameters say, makes the same picture
    tr, te, vae = _load(p["klein_4b"], p["qwen_4b"], p["vae"])
    res = generate(tr, te, vae, prompt=meta["prompt"], image=Image.open(meta["image"]), mask=Image.open(meta["mask"]),
                   steps=meta["steps"], seed=meta["seed"], strength=meta["strength"],
                   mask_crop_padding=meta["crop_padding"], feather=meta["feather"], composite=meta["composite"])
    assert np.array_equal(_pixels(out), np.asarray(res.images[0]))


def test_parameters_give_the_default_strength_that_ran(models, tmp_path):
    d, _ = models
    img, _ = _pictures(tmp_path)
    rc = cli.main(["--models-dir", str(d), "--prompt", "x", "--image", str(img), "--steps", "1",
                   "--out", str(tmp_path / "a.png"), "-q"])
    assert rc == 0 and _params(tmp_path / "a.png")["strength"] == 0.8  # image to image: the engine's default
    rc = cli.main(["--models-dir", str(d), "--prompt", "x", "--image", str(img), "--outpaint", "16,0,0,0",
                   "--steps", "1", "--out", str(tmp_path / "b.png"), "-q"])
    assert rc == 0 and _params(tmp_path / "b.png")["strength"] == 1.0  # outpaint's mask: the inpaint default


def test_parameters_name_quantize_dtype_and_batch(models, tmp_path):
    d, p = models
    out = tmp_path / "q.png"
    rc = cli.main(["--models-dir", str(d), "--prompt", "x", "--quantize", "q4", "--batch", "2", "--seed", "9",
                   *SIZE, "--out", str(out), "-q"])
    assert rc == 0
    files = [tmp_path / "q_00.png", tmp_path / "q_01.png"]
    meta = _params(files[1])
    assert (meta["quantize"], meta["dtype"], meta["batch"], meta["batch_index"]) == ("q4", "float32", 2, 1)
    tr, te, vae = _load(p["klein_4b"], p["qwen_4b"], p["vae"], quantize=meta["quantize"])
    res = generate(tr, te, vae, prompt="x", width=64, height=64, steps=2, seed=meta["seed"], batch_size=meta["batch"])
    assert all(np.array_equal(_pixels(f), np.asarray(i)) for f, i in zip(files, res.images))


def test_parameters_keep_a_lora_strength_exactly(models, tmp_path):
    from klein_core.lora import apply_loras, load_lora
    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    d, p = models
    tr, te, vae = _load(p["klein_4b"], p["qwen_4b"], p["vae"])
    lora = nonzero_lora(tr, preset("full", rank=2))
    path = save_lora(tmp_path / "style.safetensors", lora, fmt="comfyui")
    strength = 0.123456789
    out = tmp_path / "l.png"
    rc = cli.main(["--models-dir", str(d), "--prompt", "x", *SIZE, "--lora", f"{path}:{strength!r}",
                   "--out", str(out), "-q"])
    assert rc == 0
    name, _, kept = _params(out)["loras"][0].rpartition(":")
    assert name == "style.safetensors" and float(kept) == strength
    apply_loras((tr, te), [(load_lora(path), float(kept))], mode="merge")
    res = generate(tr, te, vae, prompt="x", width=64, height=64, steps=2)
    assert np.array_equal(_pixels(out), np.asarray(res.images[0]))


def test_default_transformer_skips_files_that_are_not_transformers(models, tmp_path):
    d, p = models
    md = tmp_path / "models"
    for sub in ("text_encoders", "vae"):
        shutil.copytree(d / sub, md / sub)
    (md / "diffusion_models").mkdir()
    shutil.copy(p["klein_4b"], md / "diffusion_models" / p["klein_4b"].name)
    shutil.copy(p["vae"], md / "diffusion_models" / "ae.safetensors")  # sorts first; a VAE, not a transformer
    out = tmp_path / "o.png"
    rc = cli.main(["--models-dir", str(md), "--prompt", "x", *SIZE, "--out", str(out), "-q"])
    assert rc == 0
    assert _params(out)["transformer"] == "flux-2-klein-4b.safetensors"
    res = generate(*_load(p["klein_4b"], p["qwen_4b"], p["vae"]), prompt="x", width=64, height=64, steps=2)
    assert np.array_equal(_pixels(out), np.asarray(res.images[0]))


def test_a_folder_without_a_transformer_is_named_in_one_line(models, tmp_path, capsys):
    d, p = models
    md = tmp_path / "models"
    shutil.copytree(d / "vae", md / "vae")
    shutil.copytree(d / "text_encoders", md / "text_encoders")
    (md / "diffusion_models").mkdir()
    shutil.copy(p["vae"], md / "diffusion_models" / "ae.safetensors")
    rc = cli.main(["--models-dir", str(md), "--prompt", "x", *SIZE, "--out", str(tmp_path / "o.png"), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "no transformer" in err and "ae.safetensors" in err


@pytest.mark.parametrize("how", ["files", "transformer_and_models_dir"])
def test_model_is_not_ignored(models, tmp_path, capsys, how):
    d, p = models
    files = ["--transformer", str(p["klein_4b"])]
    files += (["--text-encoder", str(p["qwen_4b"]), "--vae", str(p["vae"])] if how == "files"
              else ["--models-dir", str(d)])
    out = tmp_path / "o.png"
    rc = cli.main([*files, "--model", "flux-2-klein-9b.safetensors", "--prompt", "x", *SIZE, "--out", str(out), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--model" in err and err.count("\n") == 0
    assert not out.exists()  # no image from a transformer other than the one named
