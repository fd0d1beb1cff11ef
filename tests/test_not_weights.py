"""A file that holds no weights (an image, a web page, a Git LFS pointer, a text file) is named for
what it is by every loader, and not told to "download it again"; a truncated safetensors still is."""

from __future__ import annotations

import io
import struct

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import klein_core as kc
from klein_core.errors import WeightFormatError
from klein_core.files.identify import probe


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 30)).save(buf, fmt)
    return buf.getvalue()


NOT_WEIGHTS = {  # file content -> the words the message must use
    "jpeg": (lambda: _image("JPEG"), "a JPEG image"),
    "png": (lambda: _image("PNG"), "a PNG image"),
    "webp": (lambda: _image("WEBP"), "a WebP image"),
    "gif": (lambda: _image("GIF"), "a GIF image"),
    "pdf": (lambda: b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< >>\nendobj\n", "a PDF document"),
    "text": (lambda: b"these are my notes about Klein\nsecond line\n", 'a text file (it begins "these are my notes'),
    "json": (lambda: b'{\n  "_class_name": "Flux2Transformer2DModel"\n}\n', "a JSON text file"),
}
LOADERS = {  # component name in messages -> loader
    "transformer": kc.load_transformer,
    "text encoder": kc.load_text_encoder,
    "VAE": kc.load_vae,
    "LoRA": kc.load_lora,
}


@pytest.mark.parametrize("suffix", [".safetensors", ".jpg", ".gguf"])
@pytest.mark.parametrize("content", sorted(NOT_WEIGHTS))
def test_every_loader_says_what_the_file_is(tmp_path, content, suffix):
    make, what = NOT_WEIGHTS[content]
    path = tmp_path / f"model{suffix}"
    path.write_bytes(make())
    for component, load in LOADERS.items():
        with pytest.raises(WeightFormatError) as exc:
            load(path)
        msg = str(exc.value)
        assert str(path) in msg and what in msg, msg
        assert "not a safetensors or GGUF file" in msg and f"The {component} must be a" in msg, msg
        assert ".safetensors" in msg.split("must be", 1)[1], msg  # and what is expected instead
        assert "download it again" not in msg.lower() and "truncated" not in msg, msg


def test_web_page_and_lfs_pointer_get_their_own_advice(tmp_path):
    page = tmp_path / "flux-2-klein-4b.safetensors"
    page.write_bytes(b"<!DOCTYPE html>\n<html><head><title>Access restricted</title></head></html>\n")
    with pytest.raises(WeightFormatError, match="this is an HTML page") as exc:
        kc.load_transformer(page)
    assert "web page" in str(exc.value) and str(page) in str(exc.value)
    pointer = tmp_path / "flux2-vae.safetensors"
    pointer.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 336213556\n")
    with pytest.raises(WeightFormatError, match="this is a Git LFS pointer") as exc:
        kc.load_vae(pointer)
    assert "git lfs pull" in str(exc.value)


def test_truncated_safetensors_is_still_told_to_download_again(tmp_path):
    """Cut anywhere, even inside the header or after 9 bytes, a real file stays "truncated"."""
    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.randn(64, 64), "b": torch.zeros(64)}, whole)
    raw = whole.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut in (9, 40, 8 + n // 2, len(raw) - 100):
        part = tmp_path / f"cut{cut}.safetensors"
        part.write_bytes(raw[:cut])
        with pytest.raises(WeightFormatError) as exc:
            kc.load_transformer(part)
        msg = str(exc.value)
        assert "Download it again" in msg and "truncated" in msg and "not a safetensors or GGUF" not in msg, msg


def test_first_byte_like_a_pickle_still_reads_as_safetensors(tmp_path):
    """About one real header in 32 starts with 0x80 (a pickle's first byte), as flux-2-klein-4b-fp8's
    does: cut short, it is still a truncated safetensors, not "a Python pickle"."""
    path = tmp_path / "t.safetensors"
    key = "k" * (0x0380 - 60)  # a header of 0x380 bytes: the file starts 80 03, like pickle protocol 3
    save_file({key: torch.zeros(4)}, path)
    raw = path.read_bytes()
    assert raw[0] == 0x80 and raw[1] == 0x03 and raw[8:9] == b"{"
    path.write_bytes(raw[:200])
    with pytest.raises(WeightFormatError, match="Download it again"):
        kc.load_transformer(path)


def test_probe_names_what_the_file_is(tmp_path):
    path = tmp_path / "photo.safetensors"
    path.write_bytes(_image("JPEG"))
    info = probe(path)
    assert info.kind == "unknown" and info.description.startswith("a JPEG image")
