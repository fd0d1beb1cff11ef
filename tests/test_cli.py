"""The klein-generate command line: --demo, real files, and one-line errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras import require
from PIL import Image

import klein_core
from klein_core import cli
from klein_core.testing import write_tiny_model_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return d, write_tiny_model_files(d)


def test_demo_runs_as_module(tmp_path):
    out = tmp_path / "demo.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "klein_core", "generate", "--demo", "--prompt", "a fox",
                           "--out", str(out)], check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "denoise" in proc.stdout  # stdout: the summary with per-stage times
    assert proc.stderr.count("will be noise") == 1 and "--demo" not in proc.stdout  # the demo's note, once
    assert "4/4" in proc.stderr  # progress bar
    img = Image.open(out)
    assert img.size == (256, 256)
    params = json.loads(img.text["parameters"])
    assert params["prompt"] == "a fox" and params["steps"] == 4 and params["demo"] is True
    env = params["environment"]  # what ran: the same seed differs across torch versions and GPUs
    assert env["klein_core"] == klein_core.__version__ and env["torch"] == torch.__version__
    assert env["device"] == "cpu" and env["fast_paths"].startswith("fast (cpu torch.float32: attention=plain"), env


def test_models_dir_run_picks_fitting_encoder(models, tmp_path, capsys):
    d, _ = models
    out = tmp_path / "x.png"
    rc = cli.main(["--models-dir", str(d), "--model", "flux-2-klein-9b.safetensors", "--prompt", "hi",
                   "--width", "96", "--height", "64", "--steps", "2", "--seed", "3", "--batch", "2",
                   "--out", str(out), "-q"])
    assert rc == 0
    files = sorted(tmp_path.glob("x_*.png"))
    assert [f.name for f in files] == ["x_00.png", "x_01.png"]
    meta = json.loads(Image.open(files[1]).text["parameters"])
    assert meta["text_encoder"] == "qwen_3_8b.safetensors" and meta["batch_index"] == 1
    assert meta["width"] == 96 and meta["seed"] == 3


def test_explicit_files_with_reference_and_base(models, tmp_path):
    _, p = models
    ref = tmp_path / "ref.png"
    Image.new("RGB", (112, 80), (200, 30, 30)).save(ref)
    out = tmp_path / "edit.png"
    rc = cli.main(["--transformer", str(p["klein_base_4b"]), "--text-encoder", str(p["qwen_4b"]), "--vae",
                   str(p["vae"]), "--prompt", "night", "--negative-prompt", "blurry", "--ref", str(ref),
                   "--steps", "2", "--out", str(out), "-q"])
    assert rc == 0
    img = Image.open(out)
    meta = json.loads(img.text["parameters"])
    assert img.size == (112, 80)  # from the reference
    assert meta["model_kind"] == "base" and meta["guidance"] == 4.0  # base picked from the file name


def test_errors_are_one_line(models, tmp_path, capsys):
    _, p = models
    rc = cli.main(["--transformer", str(p["klein_9b"]), "--text-encoder", str(p["qwen_4b"]), "--vae",
                   str(p["vae"]), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0
    assert "qwen_3_4b.safetensors" in err and "use qwen_3_8b.safetensors" in err
    rc = cli.main(["--transformer", str(tmp_path / "missing.safetensors"), "--text-encoder", str(p["qwen_4b"]),
                   "--vae", str(p["vae"])])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"error: file not found: {tmp_path / 'missing.safetensors'}"
    rc = cli.main(["--prompt", "x"])
    assert rc == 2 and "--models-dir" in capsys.readouterr().err
    rc = cli.main(["--demo", "--width", "40", "--height", "64"])
    assert rc == 2 and "too small" in capsys.readouterr().err
    (tmp_path / "m.ckpt").write_bytes(b"\x80\x02junk")
    rc = cli.main(["--transformer", str(tmp_path / "m.ckpt"), "--text-encoder", str(p["qwen_4b"]),
                   "--vae", str(p["vae"])])
    assert rc == 2 and "never unpickles" in capsys.readouterr().err


def test_help_lists_the_options_and_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for option in ("--prompt", "--models-dir", "--width", "--seed", "--out", "--device"):
        assert option in out
    assert "(default: klein.png)" in out and "0..2^64-1 (default: 0)" in out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])  # the command's name is optional, not required
    assert capsys.readouterr().out == out


def test_device_and_size_errors_are_one_line_before_loading(models, monkeypatch, capsys):
    _, p = models
    import klein_core.files.loaders as loading

    def never(*a, **k):
        raise AssertionError("a model was loaded before the request was checked")

    for name in ("load_transformer", "load_text_encoder", "load_vae"):
        monkeypatch.setattr(loading, name, never)
    files = ["--transformer", str(p["klein_4b"]), "--text-encoder", str(p["qwen_4b"]), "--vae", str(p["vae"])]
    for extra, words in ((["--width", "100000"], "at most 4 megapixels"), (["--width", "30"], "too small"),
                         (["--steps", "0"], "--steps must be"), (["--seed", "-1"], "--seed must be"),
                         (["--guidance", "nan"], "--guidance must be"), (["--guidance", "-2"], "--guidance must be"),
                         (["--device", "cuda" if not torch.cuda.is_available() else "bogus"], "device")):
        rc = cli.main([*files, *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and words in err, err
        assert "not a multiple" not in err  # one message, not a warning contradicting it


def test_odd_size_warned_once_and_demo_noted_once(tmp_path, capsys, caplog):
    """--width/--height not multiples of 16: one warning (the CLI's check), not one more per engine stage
    that resolves the size again; the demo's note once, on stderr, with stdout kept for the result."""
    out = tmp_path / "odd.png"
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        assert cli.main(["generate", "--demo", "--width", "100", "--height", "100", "--out", str(out), "-q"]) == 0
    warned = [r.getMessage() for r in caplog.records if "not a multiple of 16" in r.getMessage()]
    assert warned == ["Size 100x100 is not a multiple of 16; using 96x96"]
    assert Image.open(out).size == (96, 96)
    assert json.loads(Image.open(out).text["parameters"])["width"] == 96
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and captured.out.startswith("1 image(s) 96x96")
    assert captured.err.count("will be noise") == 1 and "--demo" not in captured.out


def test_an_existing_output_is_named_before_it_is_replaced(tmp_path, caplog):
    """Was a bug: ``--out`` (default ``klein.png``) replaced an existing picture without a word, so a
    second run with the default name lost the first one's image silently. It is named at the start."""
    out = tmp_path / "same.png"
    args = ["generate", "--demo", "--width", "64", "--height", "64", "--steps", "1", "--out", str(out), "-q"]
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        assert cli.main(args) == 0
    assert not [r for r in caplog.records if "replaces" in r.getMessage()]  # nothing was there
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        assert cli.main([*args, "--seed", "1"]) == 0
    assert [r.getMessage() for r in caplog.records if "replaces" in r.getMessage()] == [
        f"--out: {out} exists; this run replaces it when it ends"]
    assert json.loads(Image.open(out).text["parameters"])["seed"] == 1  # replaced, as said


def test_a_picture_given_as_a_model_says_so(models, tmp_path, capsys):
    """Not "download it again": what the file is, and what is expected, before any model loads."""
    _, p = models
    photo = tmp_path / "photo.jpg"
    Image.new("RGB", (64, 48), (10, 120, 40)).save(photo)
    files = {"--transformer": str(p["klein_4b"]), "--text-encoder": str(p["qwen_4b"]), "--vae": str(p["vae"])}
    for flag, component in (("--transformer", "transformer"), ("--text-encoder", "text encoder"),
                            ("--vae", "VAE")):
        args = [a for k, v in {**files, flag: str(photo)}.items() for a in (k, v)]
        assert cli.main([*args, "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"error: {photo}: this is a JPEG image"), err
        assert "not a safetensors or GGUF file" in err and f"The {component} must be a" in err, err
        assert "download" not in err.lower()
    md = tmp_path / "models"
    (md / "diffusion_models").mkdir(parents=True)
    (md / "diffusion_models" / "photo.jpg").write_bytes(photo.read_bytes())
    assert cli.main(["--models-dir", str(md), "--model", "photo.jpg", "--vae", str(p["vae"]), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "this is a JPEG image" in err and "text width" not in err, err


def test_demo_keeps_a_given_side(tmp_path):
    out = tmp_path / "d.png"
    assert cli.main(["--demo", "--width", "320", "--out", str(out), "-q"]) == 0
    assert Image.open(out).size == (320, 256)


def test_demo_image_to_image_takes_the_pictures_size(tmp_path):
    """--demo with --image: the demo's 256 px default must not count as a size the user gave."""
    Image.new("RGB", (96, 80), (20, 140, 60)).save(tmp_path / "photo.png")
    out = tmp_path / "i2i.png"
    assert cli.main(["--demo", "--image", str(tmp_path / "photo.png"), "--strength", "0.5", "--out", str(out),
                     "-q"]) == 0
    assert Image.open(out).size == (96, 80)


def test_empty_models_folder_and_unrelated_file_say_what_to_do(tmp_path, models, capsys):
    (tmp_path / "diffusion_models").mkdir()
    assert cli.main(["--models-dir", str(tmp_path)]) == 2
    assert "put the Klein transformer (e.g. flux-2-klein-4b.safetensors) there" in capsys.readouterr().err
    assert cli.main(["--models-dir", str(tmp_path), "--model", "x.safetensors"]) == 2
    assert "has no .safetensors files at all" in capsys.readouterr().err
    from safetensors.torch import save_file

    save_file({"foo.weight": torch.zeros(2, 2)}, tmp_path / "unrelated.safetensors")
    _, p = models
    assert cli.main(["--transformer", str(tmp_path / "unrelated.safetensors"), "--text-encoder", str(p["qwen_4b"]),
                     "--vae", str(p["vae"])]) == 2
    err = capsys.readouterr().err
    assert "does not recognise (first tensors: 'foo.weight')" in err and "Pick a Klein transformer file" in err


def test_prompt_cache_skips_the_text_encoder_on_the_second_run(models, tmp_path, monkeypatch, capsys):
    import klein_core.files.loaders as loading

    _, p = models
    loads = []
    real = loading.load_text_encoder
    monkeypatch.setattr(loading, "load_text_encoder", lambda *a, **k: (loads.append(a[0]), real(*a, **k))[1])
    base = ["--transformer", str(p["klein_base_4b"]), "--text-encoder", str(p["qwen_4b"]), "--vae", str(p["vae"]),
            "--prompt", "a lighthouse", "--negative-prompt", "fog", "--width", "64", "--height", "64",
            "--steps", "2", "--seed", "5", "--prompt-cache", str(tmp_path / "pc"), "--max-tokens", "whole",
            "--text-precision", "fp32"]
    assert cli.main([*base, "--out", str(tmp_path / "a.png")]) == 0
    assert len(loads) == 1
    assert cli.main([*base, "--out", str(tmp_path / "b.png")]) == 0
    assert len(loads) == 1, "the text encoder was loaded although both prompts were cached"
    assert "not loaded" in capsys.readouterr().err
    a, b = Image.open(tmp_path / "a.png"), Image.open(tmp_path / "b.png")
    assert a.tobytes() == b.tobytes()
    assert json.loads(b.text["parameters"])["max_tokens"] == "whole"
    # another option is another cache entry: the encoder is needed again
    assert cli.main([*base[:-2], "--out", str(tmp_path / "c.png")]) == 0
    assert len(loads) == 2


def test_inpaint_outpaint_and_img2img_from_the_command_line(models, tmp_path, capsys):
    import numpy as np

    _, p = models
    files = ["--transformer", str(p["klein_4b"]), "--text-encoder", str(p["qwen_4b"]), "--vae", str(p["vae"]),
             "--prompt", "a door", "--steps", "2", "-q"]
    rgb = np.random.default_rng(0).integers(0, 256, (72, 100, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "photo.png")
    mask = np.zeros((72, 100), dtype=np.uint8)
    mask[10:40, 20:60] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    assert cli.main([*files, "--image", str(tmp_path / "photo.png"), "--mask", str(tmp_path / "mask.png"),
                     "--out", str(tmp_path / "inpaint.png")]) == 0
    out = np.asarray(Image.open(tmp_path / "inpaint.png"))
    assert out.shape == rgb.shape and np.array_equal(out[mask == 0], rgb[mask == 0])
    assert cli.main([*files, "--image", str(tmp_path / "photo.png"), "--outpaint", "0,0,32,16",
                     "--out", str(tmp_path / "outpaint.png")]) == 0
    out = np.asarray(Image.open(tmp_path / "outpaint.png"))
    assert out.shape == (88, 132, 3) and np.array_equal(out[:72, :100], rgb)
    assert cli.main([*files, "--image", str(tmp_path / "photo.png"), "--strength", "0.5",
                     "--out", str(tmp_path / "i2i.png")]) == 0
    assert Image.open(tmp_path / "i2i.png").size == (96, 64)  # resized to multiples of 16
    meta = json.loads(Image.open(tmp_path / "i2i.png").text["parameters"])
    assert meta["strength"] == 0.5 and meta["image"].endswith("photo.png")
    capsys.readouterr()
    assert cli.main([*files, "--mask", str(tmp_path / "mask.png")]) == 2
    assert "--mask needs --image" in capsys.readouterr().err
    assert cli.main([*files, "--image", str(tmp_path / "photo.png"), "--width", "64"]) == 2
    assert "takes the picture's size" in capsys.readouterr().err


def test_kv_file_runs_in_kv_mode(models, tmp_path):
    _, p = models
    ref = tmp_path / "ref.png"
    Image.new("RGB", (96, 64), (20, 90, 160)).save(ref)
    out = tmp_path / "kv.png"
    rc = cli.main(["--transformer", str(p["klein_9b_kv"]), "--text-encoder", str(p["qwen_8b"]), "--vae",
                   str(p["vae"]), "--prompt", "x", "--ref", str(ref), "--steps", "2", "--out", str(out), "-q"])
    assert rc == 0
    meta = json.loads(Image.open(out).text["parameters"])
    assert meta["ref_mode"] == "kv" and meta["model_kind"] == "kv" and meta["guidance"] == 1.0


def test_gguf_and_quantize_from_the_command_line(models, tmp_path):
    require("gguf")
    from gguf_files import write_tiny_gguf_transformer

    _, p = models
    gguf_file = write_tiny_gguf_transformer(tmp_path / "flux-2-klein-4b-Q8_0.gguf")
    for extra in (["--transformer", str(gguf_file)], ["--transformer", str(p["klein_4b"]), "--quantize", "q4"]):
        out = tmp_path / "g.png"
        rc = cli.main([*extra, "--text-encoder", str(p["qwen_4b"]), "--vae", str(p["vae"]), "--prompt", "x",
                       "--width", "64", "--height", "64", "--steps", "1", "--out", str(out), "-q"])
        assert rc == 0 and Image.open(out).size == (64, 64)


def test_step_cache_from_the_command_line(tmp_path, capsys):
    """--step-cache: opt-in; 0 never skips (the same bytes as without it), a huge threshold skips
    every step it may (not the first two nor the last), alone it takes 0.08; what it did is in the
    summary and in each image's parameters; a bad threshold is refused before anything loads."""
    def run(name, *extra):
        out = tmp_path / f"{name}.png"
        rc = cli.main(["--demo", "--base", "--steps", "6", "--prompt", "a fox", "--width", "64", "--height", "64",
                       "--out", str(out), *extra])
        assert rc == 0
        img = Image.open(out)
        return img.tobytes(), json.loads(img.text["parameters"]), capsys.readouterr().err

    exact, meta, err = run("exact")
    assert meta["step_cache"] is None and "step cache" not in err
    same, meta, err = run("zero", "--step-cache", "0")
    assert same == exact and meta["step_cache"]["skipped"] == 0 and meta["step_cache"]["forwards"] == 6
    skipped, meta, err = run("huge", "--step-cache", "1e9")
    assert meta["step_cache"]["patterns"] == ["CCSSSC"] and meta["step_cache"]["skipped"] == 3
    assert skipped != exact
    assert "step cache (threshold 1e+09): 3 of 6 forwards skipped" in err and "approximate" in err
    _, meta, _ = run("default", "--step-cache")
    assert meta["step_cache"]["threshold"] == 0.08 and meta["step_cache"]["warmup"] == 2
    out = tmp_path / "distilled.png"
    assert cli.main(["--demo", "--prompt", "a fox", "--width", "64", "--height", "64", "--step-cache", "0.1",
                     "--out", str(out)]) == 0
    assert "meant for base models" in capsys.readouterr().err
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--demo", "--step-cache", bad, "--out", str(tmp_path / "bad.png")])
        assert exc.value.code == 2
        assert "is not a threshold" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()


def test_vae_tile_from_the_command_line(tmp_path, capsys):
    """--vae-tile: auto (default) decodes a 512x512 demo image whole on the CPU, 16 in tiles of 16 latents
    (other pixels), none whole (the same bytes as auto); each PNG records the setting and the tiles that
    ran; a bad value is refused before anything loads."""
    def run(name, *extra):
        out = tmp_path / f"{name}.png"
        assert cli.main(["--demo", "--prompt", "a fox", "--width", "512", "--height", "512", "--steps", "2",
                         "--out", str(out), "-q", *extra]) == 0
        img = Image.open(out)
        meta = json.loads(img.text["parameters"])
        return img.tobytes(), meta["vae_tile"], meta["decode_tiles"]

    auto = run("auto")
    assert auto[1:] == ("auto", [None])
    tiled = run("tiled", "--vae-tile", "16")
    assert tiled[1:] == (16, [16]) and tiled[0] != auto[0]
    whole = run("whole", "--vae-tile", "none")
    assert whole[1:] == ("none", [None]) and whole[0] == auto[0]
    capsys.readouterr()
    for bad in ("48", "whole", "-16"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--demo", "--vae-tile", bad, "--out", str(tmp_path / "bad.png")])
        assert exc.value.code == 2 and "is not a VAE tile" in capsys.readouterr().err
    assert not (tmp_path / "bad.png").exists()


def test_trim_padding_from_the_command_line(tmp_path, monkeypatch):
    """--trim-padding: the transformer gets the prompt's tokens rounded up to 64, not 512, and the
    PNG's parameters say so; without it they say null."""
    from klein_core.models.transformer import Flux2Transformer

    seen: list[int] = []
    real = Flux2Transformer.forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs["txt"].shape[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Flux2Transformer, "forward", spy)
    for flag, length, recorded in (([], 512, None), (["--trim-padding"], 64, 64)):
        seen.clear()
        out = tmp_path / f"trim{len(flag)}.png"
        assert cli.main(["--demo", "--prompt", "a fox", "--width", "64", "--height", "64", "--steps", "2",
                         "--out", str(out), "-q", *flag]) == 0
        assert set(seen) == {length}
        assert json.loads(Image.open(out).text["parameters"])["trim_padding"] == recorded
