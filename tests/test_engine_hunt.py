"""Regressions found by a hunt through the engine's inputs: ``--out`` checked before generating,
16-bit / float pictures read at their own levels, and masks that would repaint nothing refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import klein_core as kc
from klein_core import cli
from klein_core.pipeline.images import prepare_reference_image
from klein_core.pipeline.inpaint import crop_for_inpaint, outpaint, prepare_inpaint, stitch
from klein_core.pipeline.prompts import encode_prompts
from klein_core.testing import build_tiny_components


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components()


# ----- --out ------------------------------------------------------------------------------------------


def test_cli_out_without_an_extension_writes_a_png(tmp_path, capsys):
    """A name without an extension used to fail after the whole generation ("unknown file extension")."""
    out = tmp_path / "picture"
    assert cli.main(["--demo", "--width", "64", "--height", "64", "--steps", "1", "--out", str(out), "-q"]) == 0
    written = tmp_path / "picture.png"
    img = Image.open(written)
    assert img.format == "PNG" and img.size == (64, 64)
    assert json.loads(img.text["parameters"])["width"] == 64
    assert str(written) in capsys.readouterr().out


@pytest.mark.parametrize("case", ["folder", "extension", "parent_is_file"])
def test_cli_bad_out_is_refused_before_generating(case, tmp_path, monkeypatch, capsys):
    """A folder, an extension PIL cannot write or a path under a file used to be found only when the
    finished images were saved (a traceback, or an error after the whole run)."""
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "file.png").write_bytes(b"x")
    out = {"folder": tmp_path / "folder.png", "extension": tmp_path / "x.notanimage",
           "parent_is_file": tmp_path / "file.png" / "x.png"}[case]
    ran = []
    monkeypatch.setattr(cli, "generate", lambda *a, **k: ran.append(1))
    assert cli.main(["--demo", "--width", "64", "--height", "64", "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert not ran
    assert err.startswith("error: --out ") and str(out) in err and err.count("\n") == 1
    assert (tmp_path / "file.png").read_bytes() == b"x"


def test_cli_out_naming_a_folder_that_does_not_exist_yet_is_refused(tmp_path, monkeypatch, capsys):
    """``--out outdir/`` (a trailing separator: a folder) wrote the file ``outdir.png`` beside it, since
    ``Path`` drops the separator; it is refused before anything runs, the folder not made."""
    ran = []
    monkeypatch.setattr(cli, "generate", lambda *a, **k: ran.append(1))
    assert cli.main(["--demo", "--out", f"{tmp_path / 'outdir'}/", "-q"]) == 2 and not ran
    assert "is a folder; give a file name such as" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ----- 16-bit, 32-bit and float pictures ----------------------------------------------------------------


def _edge(dtype, low, high, size=(1000, 1200)):
    """A picture with a sharp vertical edge: ``low`` on the left half, ``high`` on the right."""
    h, w = size
    a = np.full((h, w), low, dtype)
    a[:, w // 2:] = high
    return Image.fromarray(a)


@pytest.mark.parametrize("mode", ["F", "I"])
def test_large_high_bit_reference_keeps_its_levels(mode):
    """Over 1 MP the picture is resized first; LANCZOS overshoot at the edge used to make a 0..1 float
    picture read as 0..255 (almost black), or a 0..255 32-bit one as 0..65535."""
    img = _edge(np.float32, 0.2, 1.0) if mode == "F" else _edge(np.int32, 51, 255)
    assert img.mode == mode and img.width * img.height > 1024 * 1024
    px = prepare_reference_image(img)
    left, right = float(px[0, :, :, :20].mean()), float(px[0, :, :, -20:].mean())
    assert left == pytest.approx(0.2 * 2 - 1, abs=0.01)
    assert right == pytest.approx(1.0, abs=0.01)


def test_inpaint_with_a_16_bit_picture_keeps_its_unmasked_pixels(tiny):
    """Unmasked pixels must be the original's; a 16-bit picture's came back white (convert("RGB") clips)."""
    tr, te, vae = tiny
    a = np.full((128, 128), 20000, np.uint16)
    a[:, 64:] = 40000
    picture = Image.fromarray(a)
    assert picture.mode.startswith("I;16")
    mask = Image.new("L", (128, 128), 0)
    mask.paste(255, (0, 0, 32, 32))
    result = kc.generate(tr, te, vae, prompt="x", image=picture, mask=mask, steps=1, seed=1)
    out = np.asarray(result.images[0])
    expected_left, expected_right = round(20000 / 65535 * 255), round(40000 / 65535 * 255)
    assert (out[32:, :64] == expected_left).all() and (out[32:, 64:] == expected_right).all()


def test_outpaint_crop_and_stitch_keep_a_16_bit_pictures_levels():
    a = np.full((96, 96), 30000, np.uint16)
    picture = Image.fromarray(a)
    level = round(30000 / 65535 * 255)
    canvas, _ = outpaint(picture, right=32)
    assert np.asarray(canvas)[:, :96].max() == level and np.asarray(canvas)[:, :96].min() == level
    mask = Image.new("L", (96, 96), 0)
    mask.paste(255, (40, 40, 56, 56))
    crop, _, box = crop_for_inpaint(picture, mask, padding=8, megapixels=0.0625)
    assert abs(int(np.asarray(crop).astype(int).mean()) - level) <= 1
    stitched = stitch(picture, Image.new("RGB", crop.size, (0, 0, 0)), box, None, keep_unmasked=False)
    assert np.asarray(stitched)[0, 0].tolist() == [level] * 3  # outside the box: the picture's own level


# ----- masks that would repaint nothing -------------------------------------------------------------------


def test_a_mask_below_half_everywhere_is_refused():
    """The sampler binarises at 0.5; a faint mask used to run and silently repaint nothing."""
    picture = Image.new("RGB", (128, 128), (90, 120, 150))
    with pytest.raises(ValueError, match="binarised at 0.5.*100/255"):
        prepare_inpaint(picture, Image.new("L", (128, 128), 100))


def test_a_mask_lost_when_fitted_to_the_processing_size_is_refused():
    """A one-pixel mask on a 2048x2048 picture vanishes when the picture is scaled to 1 MP."""
    picture = Image.new("RGB", (2048, 2048), (90, 120, 150))
    dot = Image.new("L", (2048, 2048), 0)
    dot.putpixel((1000, 1000), 255)
    with pytest.raises(ValueError, match="binarised at 0.5 for the 1024x1024"):
        prepare_inpaint(picture, dot)
    dot.paste(255, (1000, 1000, 1008, 1008))  # large enough to survive: accepted
    assert prepare_inpaint(picture, dot).mask.any()


# ----- paths and sizes that the OS or a float cannot take ----------------------------------------------


def test_a_path_with_a_nul_byte_is_one_line_naming_the_flag(tmp_path):
    """os.stat raises ValueError for an embedded NUL byte: before, it escaped as a traceback (and
    stopped a whole Ray batch job, whose rows read references through open_image)."""
    with pytest.raises(cli.CLIError, match=r"--ref '.*bad\\x00\.png': not a usable file path"):
        cli.open_image("--ref", tmp_path / "bad\x00.png")


def test_an_absurd_size_is_refused_not_an_overflow():
    """The size message computed megapixels as a float: a side of 10**308 raised OverflowError."""
    from klein_core.pipeline.request import check_size

    with pytest.raises(ValueError, match=r"is \d{300,}\.\d megapixels"):
        check_size(10**308, 64)
    with pytest.raises(ValueError, match=r"is 16\.8 megapixels"):  # 16.777216: the usual rounding kept
        check_size(4096, 4096)


def test_an_engine_over_the_text_encoder_alone_takes_its_device():
    """``Engine(text_encoder=te)`` (no transformer, no VAE) takes the encoder's device, as it takes
    the transformer's; it used to fail with an AttributeError on ``device``."""
    _, te, _ = build_tiny_components()
    engine = kc.Engine(text_encoder=te, prompt_cache=None)
    assert engine.device == te.embed_tokens.weight.device == te.device
    direct = encode_prompts(te, ["a red fox"], cache=None)  # the pipeline function, no engine
    assert torch.equal(engine.encode_prompts(["a red fox"]).positive, direct)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_channels_last_is_the_image_layout_of_the_same_pixels(batch):
    """``Engine.decode(channels_last=True)`` gives ComfyUI's IMAGE ``[B, H, W, 3]``: the same pixels as
    the default ``[B, 3, H, W]``, laid out before the copy to the host (the VAE Decode node's path)."""
    tr, te, vae = build_tiny_components()
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    latents = torch.randn(batch, vae.config.latent_channels, 4, 6, generator=torch.Generator().manual_seed(3))
    nchw = engine.decode(latents)
    nhwc = engine.decode(latents, channels_last=True)
    assert nhwc.shape == (batch, nchw.shape[2], nchw.shape[3], 3) and nhwc.is_contiguous()
    assert torch.equal(nhwc, nchw.permute(0, 2, 3, 1)) and nhwc.dtype == torch.float32
