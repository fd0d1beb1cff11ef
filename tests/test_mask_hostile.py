"""Inpaint masks and input pictures that are easy to misread (issue #28): float / 16-bit / alpha-only
PIL masks read at their real scale, tensor masks out of 0..1 refused where they enter, and
unreadable --image / --mask / --ref files refused by the CLI in one line naming the flag and path."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from test_nodes import comfy  # noqa: F401 (fixture)

from klein_core import cli
from klein_core.pipeline.inpaint import (
    InitImage,
    comfy_mask_to_latents,
    crop_for_inpaint,
    crop_region,
    mask_array,
    mask_image,
    prepare_inpaint,
)

H, W = 80, 96
RAMP = np.tile(np.linspace(0, 1, W, dtype=np.float32), (H, 1))  # 0 (keep) on the left .. 1 (repaint) right


def _photo() -> Image.Image:
    return Image.new("RGB", (W, H), (30, 120, 200))


def _as_l(levels: np.ndarray) -> Image.Image:
    return Image.fromarray(np.round(levels * 255).astype(np.uint8), "L")


# ----- PIL masks at their real scale -----------------------------------------------------------------


@pytest.mark.parametrize("name,mask,levels", [
    ("F 0..1", Image.fromarray(RAMP, "F"), RAMP),
    ("F 0..255", Image.fromarray(RAMP * 255, "F"), RAMP),
    ("I;16", Image.fromarray(np.round(RAMP * 65535).astype(np.uint16)), RAMP),
    ("I 0..65535", Image.fromarray(np.round(RAMP * 65535).astype(np.int32)), RAMP),
    ("I 0..255", Image.fromarray(np.round(RAMP * 255).astype(np.int32)), RAMP),
    ("I 0/1", Image.fromarray((RAMP >= 0.5).astype(np.int32)), (RAMP >= 0.5).astype(np.float32)),
])
def test_float_and_wide_pil_masks_are_read_at_their_scale(name, mask, levels):
    assert mask.mode == name.split()[0]
    got = mask_array(mask)
    assert np.abs(got - levels).max() <= 1 / 255, f"{name}: misread (max {got.max():g})"
    # the whole preparation agrees with the same mask given as an ordinary 8-bit one
    want = prepare_inpaint(_photo(), _as_l(levels))
    prepared = prepare_inpaint(_photo(), mask)
    assert torch.equal(prepared.mask, want.mask) and prepared.mask.sum() > 0
    assert np.array_equal(np.asarray(prepared.original_mask), np.asarray(want.original_mask))


@pytest.mark.parametrize("values,found", [(RAMP * 300, "0..300"), (RAMP - 0.5, "-0.5..0.5"),
                                          (np.where(RAMP > 0.5, np.nan, RAMP), "NaN")])
def test_float_pil_masks_out_of_range_are_refused(values, found):
    mask = Image.fromarray(values.astype(np.float32), "F")
    for prepare in (mask_array, mask_image, lambda m: prepare_inpaint(_photo(), m)):
        with pytest.raises(ValueError, match=rf"mask \(a mode F image\) must hold values within 0\.\.1 .*got {found}"):
            prepare(mask)
    assert prepare_inpaint(_photo(), Image.fromarray(RAMP, "F")).mask.any()  # still usable


def test_int_pil_mask_beyond_16_bits_is_refused():
    with pytest.raises(ValueError, match=r"mask \(a mode I image\) must hold values within 0\.\.65535; got 0\.\.70000"):
        mask_array(Image.fromarray(np.round(RAMP * 70000).astype(np.int32)))


def test_alpha_only_rgba_mask_is_read_from_alpha_as_comfyui_does(caplog):
    alpha = np.round((1 - RAMP) * 255).astype(np.uint8)  # transparent on the right = repaint there
    rgba = np.dstack([np.full((H, W, 3), 255, np.uint8), alpha])
    mask = Image.fromarray(rgba, "RGBA")
    assert np.asarray(mask.convert("L")).min() == 255  # what convert("L") (diffusers) would see: all repaint
    with caplog.at_level(logging.WARNING, logger="klein_core.pipeline.inpaint"):
        got = mask_array(mask)
    assert np.abs(got - RAMP).max() <= 1 / 255
    assert "only its alpha varies" in caplog.text and "transparent = repaint" in caplog.text
    assert torch.equal(prepare_inpaint(_photo(), mask).mask, prepare_inpaint(_photo(), _as_l(RAMP)).mask)
    # a mask whose colour carries the signal is converted as before, alpha or not, without a warning
    caplog.clear()
    coloured = Image.fromarray(np.dstack([np.repeat(np.asarray(_as_l(RAMP))[..., None], 3, 2), alpha]), "RGBA")
    with caplog.at_level(logging.WARNING, logger="klein_core.pipeline.inpaint"):
        assert np.array_equal(np.asarray(mask_image(coloured)), np.asarray(coloured.convert("L")))
    assert caplog.text == ""


def test_a_mask_mode_without_a_grey_conversion_is_named():
    with pytest.raises(ValueError, match="mask: a mode LAB image cannot be read as a grey mask"):
        mask_array(Image.new("LAB", (W, H)))


# ----- tensor / array masks out of 0..1 --------------------------------------------------------------


def _bad(kind: str) -> torch.Tensor:
    m = torch.from_numpy(RAMP.copy())
    if kind == "5.0":
        m[:, -4:] = 5.0
    elif kind == "negative":
        m[0, 0] = -0.25
    else:
        m[3, 3] = float("nan")
    return m


BAD = [("5.0", "0..5"), ("negative", "-0.25..1"), ("nan", "NaN")]


@pytest.mark.parametrize("kind,found", BAD)
def test_tensor_masks_out_of_range_are_refused_where_they_enter(kind, found):
    m = _bad(kind)
    msg = rf"mask values must be finite and within 0\.\.1 \(1 = repaint, 0 = keep\); got {found}"
    entries = {
        "mask_array": lambda: mask_array(m), "mask_image": lambda: mask_image(m),
        "array": lambda: mask_array(m.numpy()), "prepare_inpaint": lambda: prepare_inpaint(_photo(), m),
        "crop_region": lambda: crop_region(m, W, H), "crop_for_inpaint": lambda: crop_for_inpaint(_photo(), m),
        "InitImage": lambda: InitImage(_photo(), m), "comfy_mask_to_latents": lambda: comfy_mask_to_latents(m, H // 16, W // 16),
    }
    for name, enter in entries.items():
        with pytest.raises(ValueError, match=msg):
            enter()
            pytest.fail(f"{name} took a mask with {kind} values")
    ok = torch.from_numpy(RAMP.copy())
    assert prepare_inpaint(_photo(), ok).mask.any() and comfy_mask_to_latents(ok, H // 16, W // 16).any()


@pytest.mark.parametrize("kind,found", BAD)
def test_crop_node_refuses_a_mask_out_of_range(comfy, kind, found):  # noqa: F811
    mod = sys.modules["klein_pack_nodes.inpaint"]
    image = torch.rand(1, H, W, 3)
    with pytest.raises(ValueError, match=rf"Klein Inpaint Crop: the mask's values must lie within 0\.\.1 .*got "
                                         rf"{'NaN/inf' if found == 'NaN' else found}"):
        mod.KleinInpaintCrop.execute(image, _bad(kind)[None], 8, 0.0625)
    mask = torch.zeros(1, H, W)
    mask[:, 10:20, 30:40] = 1
    with torch.inference_mode():
        crop, crop_mask, _ = mod.KleinInpaintCrop.execute(image, mask, 8, 0.0625).args
    assert crop.shape[1:3] == crop_mask.shape[1:]
    assert crop_mask.max() == 1


# ----- unreadable pictures on the command line ---------------------------------------------------------


def _bad_file(tmp_path, kind: str):
    path = tmp_path / f"{kind}.png"
    if kind == "missing":
        return path, "no such file"
    if kind == "folder":
        path.mkdir()
        return path, "is a folder, not an image file"
    if kind == "truncated":
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path)
        path.write_bytes(path.read_bytes()[:2000])
        return path, "the image is damaged or truncated"
    if kind == "not_an_image":
        path.write_text("these are not pixels\n" * 20)
        return path, "not an image file"
    if kind == "fifo":
        os.mkfifo(path)  # opening it would wait for a writer forever
        return path, "not a regular file"
    raise AssertionError(kind)


KINDS = ["missing", "folder", "truncated", "not_an_image"] + (["fifo"] if hasattr(os, "mkfifo") else [])


@pytest.mark.parametrize("flag", ["--image", "--mask", "--ref"])
@pytest.mark.parametrize("kind", KINDS)
def test_cli_refuses_an_unreadable_picture_in_one_line(tmp_path, capsys, flag, kind):
    good = tmp_path / "good.png"
    _photo().save(good)
    path, reason = _bad_file(tmp_path, kind)
    extra = {"--image": ["--image", str(path)], "--mask": ["--image", str(good), "--mask", str(path)],
             "--ref": ["--ref", str(path)]}[flag]
    assert cli.main(["--demo", "--out", str(tmp_path / "out.png"), "-q", *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag} {path}: {reason}" + err[len(f"error: {flag} {path}: {reason}"):]
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("pixels", [1100, 4096])  # over the limit (PIL warns) and over twice it (PIL raises)
def test_cli_refuses_a_decompression_bomb(tmp_path, capsys, monkeypatch, pixels):
    side = int(pixels**0.5)
    Image.new("L", (side, pixels // side)).save(tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert cli.main(["--demo", "--out", str(tmp_path / "o.png"), "-q", "--ref", str(tmp_path / "bomb.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --ref {tmp_path / 'bomb.png'}: too large to read safely (")
    assert "exceeds limit of" in err and err.count("\n") == 1


def test_cli_reads_a_good_picture_after_bad_ones(tmp_path, capsys):
    _bad_file(tmp_path, "truncated")
    assert cli.main(["--demo", "--out", str(tmp_path / "o.png"), "-q", "--image", str(tmp_path / "truncated.png")]) == 2
    Image.new("RGB", (W, H), (20, 140, 60)).save(tmp_path / "photo.png")
    mask = Image.fromarray((RAMP >= 0.5).astype(np.float32), "F")  # the right half
    mask.save(tmp_path / "mask.tiff")  # a float mask file, 0..1
    assert cli.main(["--demo", "--image", str(tmp_path / "photo.png"), "--mask", str(tmp_path / "mask.tiff"),
                     "--out", str(tmp_path / "ok.png"), "-q"]) == 0
    out = np.asarray(Image.open(tmp_path / "ok.png"))
    assert out.shape == (H, W, 3)
    assert (out[:, :40] == (20, 140, 60)).all()  # left of the mask: the original, exactly
    # under the mask: painted anew (read as 0..255 it would blend in at 1/255 and change next to nothing)
    assert np.abs(out[:, 60:].astype(np.float32) - (20, 140, 60)).mean() > 10
