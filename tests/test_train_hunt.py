"""Regressions of the training hunt: images read as they are seen (EXIF orientation, 16-bit greys)
with their old cache entries not reused, captions with a byte-order mark or not in UTF-8, macOS
resource forks, what the scan does not use said, thin-image buckets within their area, LoRA ranks,
alphas and target patterns checked, a NaN step kept out of the LoRA, resume refusing a checkpoint of
other settings, data or a later step, the CLI refusing unknown or wrong TOML options, and the trainer
node's fingerprint of a JSONL dataset following its images."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image
from train_files import one_thread, tiny_training_files  # noqa: F401 (an autouse fixture)

from klein_core.testing.tiny import tiny_transformer
from klein_core.train import LoRASet, TrainConfig, Trainer, TrainSample, preset
from klein_core.train import cli as train_cli
from klein_core.train.cli import add_train_args, run_train
from klein_core.train.data import (
    DatasetError,
    Encoders,
    TensorCache,
    bucket_size,
    build_samples,
    content_hash,
    load_pixels,
    scan_dataset,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


def _rotated_photo(path, orientation=6):
    """A 64x32 JPEG (left half blue, right half red) whose EXIF says: turn it a quarter (orientation 6:
    seen 32 wide and 64 high, the blue half on top)."""
    im = Image.new("RGB", (64, 32), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 32, 32))
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(path, exif=exif, quality=100)
    return path


def _pixel_encoders(seen):
    """Encoders whose 'latents' are the pixels they were given (recorded in ``seen``)."""
    def image(px):
        seen.append(px)
        return px
    return Encoders(image, lambda c: torch.zeros(1, 2, 4), "vae:test", "te:test")


# ----- data ---------------------------------------------------------------------------------------


def test_an_exif_rotated_photo_trains_upright(tmp_path):
    _rotated_photo(tmp_path / "a.jpg")
    (tmp_path / "a.txt").write_text("a photo")
    seen = []
    build_samples(scan_dataset(tmp_path), _pixel_encoders(seen), tmp_path / "cache", area=32 * 64)
    (px,) = seen
    assert tuple(px.shape) == (1, 3, 64, 32)  # the bucket of the image as seen: portrait
    assert px[0, 2, :32].mean() > 0.9 and px[0, 0, 32:].mean() > 0.9  # blue on top, red below


def test_a_16_bit_grey_png_keeps_its_level(tmp_path):
    Image.fromarray(np.full((32, 32), 16384, dtype=np.uint16)).save(tmp_path / "g.png")  # a quarter grey
    with Image.open(tmp_path / "g.png") as im:
        assert im.mode == "I;16"
    px = load_pixels(tmp_path / "g.png", (32, 32))
    assert abs(px.mean().item() - (round(16384 / 65535 * 255) / 127.5 - 1)) < 1e-6  # not clipped to white


def test_a_float_tiff_in_0_to_1_keeps_its_level(tmp_path):
    """A float ('F') picture in 0..1 is read by its white level, as inference reads references;
    Pillow's convert("RGB") would give it values 0 and 1 out of 255: nearly black."""
    Image.fromarray(np.full((32, 32), 0.75, dtype=np.float32), "F").save(tmp_path / "f.tiff")
    with Image.open(tmp_path / "f.tiff") as im:
        assert im.mode == "F"
        px = load_pixels(tmp_path / "f.tiff", (32, 32))
    assert abs(px.mean().item() - (round(0.75 * 255) / 127.5 - 1)) < 1e-6


def test_an_old_cache_entry_of_a_rotated_photo_is_not_reused(tmp_path):
    """A square photo's bucket does not change with its orientation: the latents cached by a version
    that read it sideways (same file, same size key) must be rebuilt, not reused."""
    im = Image.new("RGB", (32, 32), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 16, 32))
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(tmp_path / "a.jpg", exif=exif, quality=100)
    (tmp_path / "a.txt").write_text("x")
    old = TensorCache(tmp_path / "cache" / "latents", "vae:test")
    old.get(content_hash(tmp_path / "a.jpg"), (32, 32), lambda: torch.full((1, 3, 32, 32), 7.0))
    seen = []
    (sample,) = build_samples(scan_dataset(tmp_path), _pixel_encoders(seen), tmp_path / "cache", area=32 * 32)
    assert len(seen) == 1 and not torch.equal(sample.latents, torch.full((1, 3, 32, 32), 7.0))


def test_captions_and_jsonl_with_a_byte_order_mark(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("\ufeffa cat\r\n".encode())  # as Windows Notepad saves UTF-8
    assert scan_dataset(tmp_path).items[0].caption == "a cat"
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(("\ufeff" + json.dumps({"image": "a.png", "caption": "a dog"}) + "\r\n").encode())
    assert [i.caption for i in scan_dataset(rows).items] == ["a dog"]


def test_a_caption_not_in_utf8_is_named(tmp_path):
    for name in ("a", "b"):
        Image.new("RGB", (32, 32)).save(tmp_path / f"{name}.png")
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes("café crème".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"caption file\(s\) are not UTF-8 text: b\.txt .*save them as UTF-8"):
        scan_dataset(tmp_path)


def test_macos_resource_forks_are_not_images(tmp_path):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "._a.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")  # AppleDouble
    scan = scan_dataset(tmp_path)
    assert [i.image.name for i in scan.items] == ["a.png"] and scan.skipped == {}


def test_what_the_scan_does_not_use_is_said(tmp_path, caplog):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("x")
    Image.new("RGB", (32, 32)).save(tmp_path / "b.tiff")  # not a training format
    (tmp_path / "b.txt").write_text("y")
    (tmp_path / "more").mkdir()
    (tmp_path / "empty.png").write_bytes((tmp_path / "a.png").read_bytes())
    (tmp_path / "empty.txt").write_text(" \n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"image": "a.png", "caption": "c"}) + "\n"
                    + json.dumps({"image": "a.png", "caption": "c", "reference": ["b.png"]}) + "\n")
    with caplog.at_level(logging.WARNING, logger="klein_core.train.data"):
        scan_dataset(tmp_path)
        scan_dataset(rows)
    text = caplog.text
    assert "b.txt" in text and "no image beside them" in text
    assert "subfolders are not read" in text and "more" in text
    assert "empty.txt" in text and "empty caption" in text
    assert "'reference' (first on line 2)" in text


def test_a_thin_image_bucket_stays_within_its_area():
    for w, h, area in ((100_000, 10, 1024 * 1024), (10, 100_000, 1024 * 1024), (4000, 10, 64 * 64)):
        bw, bh = bucket_size(w, h, area)
        assert bw * bh <= area and bw % 16 == 0 and bh % 16 == 0 and min(bw, bh) == 16


# ----- adapters -----------------------------------------------------------------------------------


def test_rank_zero_and_a_non_positive_alpha_are_refused():
    for kw in ({"rank": 0}, {"rank": -2}, {"rank": 0, "patterns": ["x"]}):
        with pytest.raises(ValueError, match="rank must be 1 or more"):
            preset("style", kw["rank"], patterns=kw.get("patterns", ()))
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        preset("style", 4, 0.0)


def test_target_patterns_that_match_nothing_or_do_not_compile_are_refused():
    model = tiny_transformer().float()
    with pytest.raises(ValueError, match=r"\['single_blocks\.0\.linear3'\] match no linear"):
        LoRASet(model, preset("style", 2, patterns=[r"double_blocks\.\d+\.img_attn\.qkv", "single_blocks.0.linear3"]))
    with pytest.raises(ValueError, match=r"'\*bad' is not a valid regular expression"):
        preset("style", 2, patterns=["*bad"])
    # a pattern whose linears an earlier pattern took is not a typo
    lora = LoRASet(model, preset("style", 2, patterns=[r"double_blocks\..*", r"double_blocks\.0\.img_mlp\.0"]))
    assert lora.names() == LoRASet(model, preset("style", 2, patterns=[r"double_blocks\..*"])).names()


# ----- trainer --------------------------------------------------------------------------------------


def _samples(n=2, fill=None):
    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g) if fill is None else torch.full((1, 128, 2, 2), fill),
                        torch.randn(1, 4, 96, generator=g)) for _ in range(n)]


def _trainer(cfg, samples=None, rank=2, alpha=None, **kw):
    model = tiny_transformer().float()
    return Trainer(model, LoRASet(model, preset("style", rank, alpha)), samples or _samples(), cfg, **kw)


def test_a_nan_loss_stops_before_it_reaches_the_lora():
    tr = _trainer(TrainConfig(steps=3, learning_rate=1e-2), _samples(1, float("nan")))
    before = [p.detach().clone() for p in tr.lora.parameters()]
    with pytest.raises(FloatingPointError, match="at step 1; the LoRA keeps the weights of step 0"):
        tr.train()
    tr.close()
    assert tr.step == 0 and all(torch.equal(a, b) for a, b in zip(before, tr.lora.parameters()))


@pytest.mark.parametrize(("change", "named"), [
    ({"learning_rate": 3e-2}, "learning_rate 0.01 -> 0.03"),
    ({"batch_size": 2}, "global_batch_size 1 -> 2"),
    ({"alpha": 8.0}, "lora_targets"),
    ({"identity": {"dataset_hash": "other"}}, "dataset_hash 'abc' -> 'other'"),
])
def test_resume_refuses_a_checkpoint_of_other_settings(tmp_path, change, named):
    first = _trainer(TrainConfig(steps=4, learning_rate=1e-2, checkpoint_every=2), output_dir=tmp_path,
                     run_identity={"dataset_hash": "abc"})
    first.train(until=2)
    first.close()
    cfg = {"steps": 4, "learning_rate": 1e-2, "checkpoint_every": 2}
    cfg.update({k: v for k, v in change.items() if k in ("learning_rate", "batch_size")})
    second = _trainer(TrainConfig(**cfg), alpha=change.get("alpha"), run_identity=change.get("identity", {"dataset_hash": "abc"}))
    with pytest.raises(ValueError, match="trained with other settings than this run") as err:
        second.resume(tmp_path / "checkpoint-2")
    second.close()
    assert named in str(err.value) and second.step == 0
    same = _trainer(TrainConfig(steps=4, learning_rate=1e-2), run_identity={"dataset_hash": "abc"})
    same.resume(tmp_path / "checkpoint-2")  # the same settings (more steps, no checkpoints) resume
    same.close()
    assert same.step == 2


def test_resume_refuses_a_checkpoint_past_the_last_step(tmp_path):
    first = _trainer(TrainConfig(steps=3, learning_rate=1e-2, checkpoint_every=3), output_dir=tmp_path)
    first.train()
    first.close()
    second = _trainer(TrainConfig(steps=2, learning_rate=1e-2))
    with pytest.raises(ValueError, match="at step 3, past this run's 2 steps; resume with steps 3 or more"):
        second.resume(tmp_path / "checkpoint-3")
    second.close()


# ----- CLI ----------------------------------------------------------------------------------------


def test_cli_refuses_unknown_and_wrong_toml_options(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    common = ["--dataset", str(tmp_path / "nowhere"), "--transformer", "flux-2-klein-base-4b.safetensors",
              "--vae", "v.safetensors", "--text-encoder", "t.safetensors", "--output", str(tmp_path / "o.safetensors")]
    toml.write_text("learning_rate = 0.5\nstep = 10\n")  # misspelt: lr, steps
    assert run_train(_args(str(toml), *common)) == 2
    err = capsys.readouterr().err
    assert f"{toml}: unknown option(s) learning_rate, step (did you mean steps?)" in err and "lr" in err
    toml.write_text('steps = "ten"\n')
    assert run_train(_args(str(toml), *common)) == 2
    assert "option steps: expected an integer, got 'ten'" in capsys.readouterr().err
    toml.write_text("steps = [\n")
    assert run_train(_args(str(toml), *common)) == 2
    assert f"{toml}: not valid TOML" in capsys.readouterr().err


def test_cli_toml_on_python_3_10(tmp_path, monkeypatch, capsys):
    """Without the standard library's tomllib (Python 3.10) the config is read with tomli, its
    origin; without either, one line says what to install."""
    import sys

    import tomllib
    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "d"\ntransformer = "t"\nvae = "v"\ntext_encoder = "e"\noutput = "o.safetensors"\n'
                    "steps = 7\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "tomli", tomllib)  # the same API, as tomli has
    assert train_cli._job(train_cli._options(_args(str(toml)))).config.steps == 7
    monkeypatch.setitem(sys.modules, "tomli", None)
    assert run_train(_args(str(toml))) == 2
    assert f"{toml}: reading a TOML config on Python 3.10 needs the tomli package" in capsys.readouterr().err


def test_cli_toml_string_for_a_repeatable_option_is_one_item(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "d"\ntransformer = "t"\nvae = "v"\ntext_encoder = "e"\noutput = "o.safetensors"\n'
                    'sample_prompts = "a cat"\ntargets = "double_blocks\\\\..*"\n')
    job = train_cli._job(train_cli._options(_args(str(toml))))
    assert job.config.sample_prompts == ("a cat",) and job.targets == (r"double_blocks\..*",)


@pytest.mark.parametrize("flags", [("--rank", "0"), ("--resolution", "-32"), ("--targets", "*bad")])
def test_cli_refuses_bad_lora_settings_before_any_encoding(tmp_path, capsys, flags):
    paths, data = tiny_training_files(tmp_path)
    out = tmp_path / "o.safetensors"
    assert run_train(_args("--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
                           "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", "1",
                           "--device", "cpu", *flags)) == 2
    assert "error:" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "o.safetensors.cache").exists()  # nothing was encoded


def test_cli_resume_auto_refuses_a_checkpoint_of_other_images(tmp_path, capsys):
    paths, data = tiny_training_files(tmp_path)

    def run(steps):
        return run_train(_args(
            "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
            "--transformer", str(paths["klein_base_4b"]), "--output", str(tmp_path / "o.safetensors"),
            "--steps", str(steps), "--resolution", "32", "--rank", "2", "--device", "cpu", "--lr", "1e-2",
            "--checkpoint-every", "1", "--resume", "auto"))

    assert run(1) == 0
    Image.new("RGB", (32, 32), (1, 200, 3)).save(data / "0.png")  # the same name, other pixels
    capsys.readouterr()
    assert run(2) == 2
    err = capsys.readouterr().err
    assert "checkpoint-1" in err and "dataset_hash" in err and "resuming would mix two runs" in err


# ----- node ---------------------------------------------------------------------------------------


def test_node_fingerprint_of_a_jsonl_dataset_follows_its_images(comfy_pack, tmp_path):
    train = importlib.import_module(f"{comfy_pack.pack.__name__}.train")
    Image.new("RGB", (32, 32), (1, 2, 3)).save(tmp_path / "a.png")
    Image.new("RGB", (32, 32), (1, 2, 3)).save(tmp_path / "r.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"image": "a.png", "caption": "c", "references": ["r.png"]}) + "\n")
    before = train.dataset_fingerprint(str(rows))
    for name in ("a.png", "r.png"):  # an edited target, then an edited reference: each a new fingerprint
        Image.new("RGB", (48, 32), (200, 2, 3)).save(tmp_path / name)
        st = os.stat(rows)
        os.utime(rows, ns=(st.st_atime_ns, st.st_mtime_ns))  # the JSONL itself unchanged
        now = train.dataset_fingerprint(str(rows))
        assert now != before
        before = now
