"""Training data: folder and JSONL scanning, the errors for bad input, buckets, and the caches
keyed by content hash and model identity."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from klein_core.testing import write_tiny_model_files
from klein_core.train.data import (
    MAX_SEQUENCE_TOKENS,
    DatasetError,
    Encoders,
    bucket_size,
    build_samples,
    require_base_model,
    scan_dataset,
)


def _img(path, w=48, h=32, color=(200, 10, 10)):
    Image.new("RGB", (w, h), color).save(path)
    return path


def _folder(tmp_path, n=3):
    for i in range(n):
        _img(tmp_path / f"im{i}.png", color=(i * 40, 20, 30))
        (tmp_path / f"im{i}.txt").write_text(f"caption {i}\n")
    return tmp_path


def test_folder_with_captions(tmp_path):
    scan = scan_dataset(_folder(tmp_path))
    assert [(i.image.name, i.caption) for i in scan.items] == [("im0.png", "caption 0"), ("im1.png", "caption 1"),
                                                               ("im2.png", "caption 2")]
    assert scan.skipped == {}


def test_empty_folder_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="holds no images"):
        scan_dataset(tmp_path)


def test_images_without_caption_are_named(tmp_path):
    _folder(tmp_path)
    _img(tmp_path / "lonely.jpg")
    _img(tmp_path / "alone.png")
    with pytest.raises(DatasetError, match=r"2 image\(s\) have no caption file: alone.png, lonely.jpg"):
        scan_dataset(tmp_path)


def test_unreadable_image_is_skipped_and_reported(tmp_path, caplog):
    _folder(tmp_path)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "broken.txt").write_text("x")
    with caplog.at_level("WARNING"):
        scan = scan_dataset(tmp_path)
    assert len(scan.items) == 3 and list(scan.skipped) == [str(tmp_path / "broken.png")]
    assert "unreadable image" in scan.skipped[str(tmp_path / "broken.png")]
    assert "broken.png" in caplog.text


def test_distilled_base_is_refused(tmp_path):
    paths = write_tiny_model_files(tmp_path)
    with pytest.raises(DatasetError, match="distilled Klein model; LoRAs are trained on the base model"):
        require_base_model(paths["klein_4b"])
    require_base_model(paths["klein_base_4b"])  # accepted: returns without error


def test_bucket_keeps_aspect_and_area():
    assert bucket_size(1024, 1024) == (1024, 1024)
    w, h = bucket_size(1920, 1080)
    assert (w % 16, h % 16) == (0, 0) and w * h <= 1024 * 1024 and abs(w / h - 16 / 9) < 0.03


def _encoders(calls, identity="vae-A"):
    def image(px):
        calls.append("image")
        return px[:, :1, ::16, ::16].repeat(1, 4, 1, 1)

    def text(caption):
        calls.append("text")
        return torch.full((1, 3, 6), float(len(caption)))
    return Encoders(image, text, identity, "te-A")


def test_edit_pairs_and_caches(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _img(data / "t.png", 64, 32)
    _img(data / "r1.png", 32, 32, (0, 255, 0))
    _img(data / "r2.png", 32, 48, (0, 0, 255))
    (data / "pairs.jsonl").write_text(json.dumps({"image": "t.png", "instruction": "make it red",
                                                  "references": ["r1.png", "r2.png"]}) + "\n")
    scan = scan_dataset(data / "pairs.jsonl")
    calls: list[str] = []
    samples = build_samples(scan, _encoders(calls), tmp_path / "cache", area=64 * 32, reference_area=32 * 32)
    assert calls == ["image", "image", "image", "text"]
    s = samples[0]
    assert s.latents.shape == (1, 4, 2, 4) and [r.shape for r in s.references] == [(1, 4, 2, 2), (1, 4, 2, 1)]  # 32x48 -> 16x32 px
    calls.clear()
    again = build_samples(scan, _encoders(calls), tmp_path / "cache", area=64 * 32, reference_area=32 * 32)
    assert calls == [] and torch.equal(again[0].latents, s.latents)  # everything from the cache
    _img(data / "r1.png", 32, 32, (9, 9, 9))  # content changed: that entry is rebuilt
    build_samples(scan, _encoders(calls), tmp_path / "cache", area=64 * 32, reference_area=32 * 32)
    assert calls == ["image"]
    calls.clear()
    build_samples(scan, _encoders(calls, identity="vae-B"), tmp_path / "cache", area=64 * 32, reference_area=32 * 32)
    assert calls == ["image", "image", "image"]  # another VAE: every latent rebuilt, prompts kept
    calls.clear()
    for f in (tmp_path / "cache" / "prompts").iterdir():
        f.write_bytes(b"garbage")  # a corrupt entry is rebuilt
    build_samples(scan, _encoders(calls, identity="vae-B"), tmp_path / "cache", area=64 * 32, reference_area=32 * 32)
    assert calls == ["text"]


def test_too_many_references_refused_up_front(tmp_path):
    _img(tmp_path / "t.png", 1024, 1024)
    for i in range(3):
        _img(tmp_path / f"r{i}.png", 1024, 1024)
    (tmp_path / "p.jsonl").write_text(json.dumps({"image": "t.png", "caption": "c",
                                                  "references": ["r0.png", "r1.png", "r2.png"]}))
    calls: list[str] = []
    with pytest.raises(DatasetError, match=r"3 reference\(s\) make 16896 tokens with the target and text, over the 10000-token limit"):
        build_samples(scan_dataset(tmp_path / "p.jsonl"), _encoders(calls), tmp_path / "c", token_limit=10_000)
    assert calls == []  # refused before anything was encoded
    assert MAX_SEQUENCE_TOKENS == 52_000
