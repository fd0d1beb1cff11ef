"""The inpainting helpers: crop region, fill resize, outpaint canvas, feathering, composite and the
crop-and-stitch round trip; the diffusers parts compared with diffusers' own image processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image, ImageDraw

from klein_core.pipeline import inpaint

diffusers = require("diffusers")


def _processor():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    return Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)


def _image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _mask(w: int, h: int, box) -> Image.Image:
    m = Image.new("L", (w, h), 0)
    ImageDraw.Draw(m).rectangle(box, fill=255)
    return m


@pytest.mark.parametrize("seed", range(40))
def test_crop_region_equals_diffusers(seed):
    rng = np.random.default_rng(seed)
    w, h = int(rng.integers(32, 300)), int(rng.integers(32, 300))
    x1, y1 = int(rng.integers(0, w - 2)), int(rng.integers(0, h - 2))
    box = (x1, y1, int(rng.integers(x1, w)), int(rng.integers(y1, h)))
    mask = _mask(w, h, box)
    pw, ph, pad = int(rng.integers(64, 1024)), int(rng.integers(64, 1024)), int(rng.integers(0, 40))
    assert inpaint.crop_region(mask, pw, ph, pad) == _processor().get_crop_region(mask, pw, ph, pad=pad)


@pytest.mark.parametrize("size,target", [((50, 30), (64, 64)), ((30, 50), (64, 48)), ((64, 48), (128, 96)),
                                         ((33, 77), (96, 32))])
def test_fill_resize_equals_diffusers(size, target):
    img = _image(*size, 3)
    ours = inpaint._resize_fill(img, *target)
    theirs = _processor()._resize_and_fill(img, *target)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("steps,strength", [(4, 1.0), (4, 0.6), (5, 0.6), (50, 0.35), (4, 0.01), (28, 0.999)])
def test_steps_to_run_equals_diffusers_get_timesteps(steps, strength):
    from types import SimpleNamespace

    from diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint import Flux2KleinInpaintPipeline

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    _, theirs = Flux2KleinInpaintPipeline.get_timesteps(SimpleNamespace(scheduler=scheduler), steps, strength, "cpu")
    assert inpaint.steps_to_run(steps, strength) == theirs >= 1


def test_processing_size():
    assert inpaint.processing_size(1024, 1024) == (1024, 1024)
    assert inpaint.processing_size(1000, 700) == (992, 688)  # resized, not cropped
    assert inpaint.processing_size(2048, 1536) == (1168, 880)


def test_masks_in_every_form_are_the_same():
    pil = _mask(40, 30, (5, 5, 20, 25))
    arr = np.asarray(pil, dtype=np.float32) / 255
    for form in (pil, pil.convert("RGB"), torch.from_numpy(arr), torch.from_numpy(arr)[None], arr[None, None]):
        assert np.array_equal(inpaint.mask_array(form), arr)
    with pytest.raises(ValueError, match="0..1"):
        inpaint.mask_array(torch.full((4, 4), 2.0))
    with pytest.raises(ValueError, match="one \\[H, W\\] mask"):
        inpaint.mask_array(torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="empty"):
        inpaint.crop_region(Image.new("L", (8, 8)), 8, 8)


def test_feather_never_touches_unmasked_pixels_and_ramps_inside():
    m = torch.zeros(64, 64)
    m[16:48, 16:48] = 1
    f = inpaint.feather_mask(m, 8)
    assert torch.equal(f[m == 0], torch.zeros_like(f[m == 0]))
    assert f[32, 32] == pytest.approx(1.0, abs=1e-4) and 0 < f[16, 32] < 0.5 < f[24, 32]
    assert torch.equal(inpaint.feather_mask(m, 0), m)


def test_composite_is_exact_outside_the_mask():
    a, b = _image(50, 40, 1), _image(50, 40, 2)
    mask = _mask(50, 40, (10, 10, 30, 30))
    out = np.asarray(inpaint.composite(a, b, mask, feather=4))
    keep = np.asarray(mask) == 0
    assert np.array_equal(out[keep], np.asarray(a)[keep])
    assert np.array_equal(out[20, 20], np.asarray(b)[20, 20])  # deep inside: the generated pixel
    t = torch.rand(2, 40, 50, 3, dtype=torch.float64)
    g = torch.rand(2, 40, 50, 3)
    mt = torch.from_numpy(np.asarray(mask) / 255.0)
    res = inpaint.composite_pixels(t, g, mt)
    assert torch.equal(res[:, mt == 0], t[:, mt == 0]) and res.dtype == torch.float64


def test_outpaint_canvas_and_mask():
    img = _image(64, 48, 4)
    canvas, mask = inpaint.outpaint(img, left=16, right=32, bottom=8, feather=6)
    assert canvas.size == (112, 56) and mask.size == (112, 56)
    c, m = np.asarray(canvas), np.asarray(mask)
    assert np.array_equal(c[0:48, 16:80], np.asarray(img))  # the image itself is untouched
    assert (m[:, :16] == 255).all() and (m[:, 80:] == 255).all() and (m[48:] == 255).all()
    assert m[20, 40] == 0 and m[20, 16] == 255 and 0 < m[20, 18] < 255 and m[20, 16 + 6] == 0  # 6 px feather
    assert m[0, 40] == 0  # the top did not grow: no feather there
    with pytest.raises(ValueError, match="at least one side"):
        inpaint.outpaint(img)


def test_crop_for_inpaint_and_stitch_round_trip():
    img = _image(900, 600, 5)
    mask = _mask(900, 600, (600, 400, 640, 430))
    crop, crop_mask, box = inpaint.crop_for_inpaint(img, mask, padding=20, megapixels=0.25)
    x1, y1, x2, y2 = box
    assert x1 <= 580 and x2 >= 661 and y1 <= 380 and y2 >= 451
    assert crop.width % 16 == 0 and crop.height % 16 == 0 and crop.size == crop_mask.size
    assert abs(crop.width * crop.height - 0.25 * 2**20) < 0.1 * 2**20
    generated = _image(*crop.size, 6)
    out = inpaint.stitch(img, generated, box, mask)
    keep = np.asarray(mask) == 0
    assert out.size == img.size and np.array_equal(np.asarray(out)[keep], np.asarray(img)[keep])
    assert not np.array_equal(np.asarray(out)[~keep], np.asarray(img)[~keep])
    # without the composite, the whole crop box is replaced
    pasted = np.asarray(inpaint.stitch(img, generated, box, mask, keep_unmasked=False))
    assert not np.array_equal(pasted[y1:y2, x1:x2], np.asarray(img)[y1:y2, x1:x2])
    assert np.array_equal(pasted[:y1], np.asarray(img)[:y1])
