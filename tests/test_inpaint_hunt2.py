"""Image to image, inpainting and outpainting from Python and the command line, second hunt: the
crop-and-stitch geometry at the picture's borders, the by-hand helpers (crop_for_inpaint / stitch /
composite) fed what their documented partner accepts, pictures in palette / alpha modes, the log's
advice on strength, and numbers the CLI checks only after loading the models.

Tests whose docstring begins "Was a bug:" failed on the code before their fix;
the others pin documented behaviour no earlier test covered."""

from __future__ import annotations

import io
import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageOps

import klein_core as kc
from klein_core import cli
from klein_core.pipeline import inpaint
from klein_core.pipeline.images import prepare_reference_image
from klein_core.testing import build_tiny_components, write_tiny_model_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


def _noise_picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _rect_mask(size: tuple[int, int], box) -> Image.Image:
    m = Image.new("L", size, 0)
    ImageDraw.Draw(m).rectangle(box, fill=255)
    return m


def _as_picture(pixels: torch.Tensor) -> Image.Image:
    """``[1, 3, H, W]`` in [-1, 1] (prepare_inpaint's pixels) as the 8-bit picture they hold."""
    a = ((pixels[0].permute(1, 2, 0).numpy() + 1) / 2 * 255).round().clip(0, 255).astype(np.uint8)
    return Image.fromarray(a)


def _exif_photo(w: int, h: int, orientation: int, seed: int) -> Image.Image:
    """A JPEG stored ``w x h`` whose EXIF orientation turns it a quarter (5-8), read back."""
    raw = _noise_picture(w, h, seed)
    exif = raw.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    raw.save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    photo = Image.open(buf)
    photo.load()
    return photo


# ----- crop and stitch: the painted crop must land where it was cut from ------------------------------


def _dark_columns(row: np.ndarray) -> list[int]:
    """x of each left edge of a dark stripe on a light row."""
    dark = row < 100
    return [int(x) for x in np.flatnonzero(dark[1:] & ~dark[:-1]) + 1]


def _striped(w: int, h: int, xs: tuple[int, ...], width: int) -> Image.Image:
    """A light ``w x h`` picture with dark vertical stripes ``width`` px wide starting at ``xs``."""
    a = np.full((h, w, 3), 220, np.uint8)
    for x in xs:
        a[:, x:x + width] = 0
    return Image.fromarray(a)


def _in_place(found: list[int], expected: list[int]) -> bool:
    """The stripes found where expected, to 1 px (resampling and the box's int() rounding)."""
    return len(found) == len(expected) and all(abs(f - e) <= 1 for f, e in zip(found, expected))


@pytest.mark.parametrize("padding", [150, 5000])
def test_crop_box_clipped_by_the_border_stitches_the_crop_back_in_place(padding):
    """Was a bug: with ``mask_crop_padding`` reaching the picture's border, the crop box is clipped there and
    no longer has the processing size's aspect ratio; prepare_inpaint fits it with diffusers'
    _resize_and_fill (centred, the sides filled with stretched edge pixels), but stitch resizes the
    WHOLE generated picture, fill bands included, into the box. The painted content comes back
    squeezed and shifted: a 400x300 picture (processing 400x288), a tall mask, padding 150 or 5000 (box
    = the whole picture): if the model returned its input exactly, stitching it back moves a stripe at
    x=20 to x=27 and one at x=370 to x=363 (7 px) — in the result the repainted area no longer
    lines up with the kept pixels around it. The generation itself is diffusers' (the fill is right);
    the stitch (engine.py's call of ``stitch`` with ``prepared.box``) should crop the fill bands
    (the centred ``src_w x src_h`` of _resize_fill) out of the generated picture before resizing it
    into the box."""
    w, h = 400, 300
    picture = _striped(w, h, (20, 200, 370), 6)
    mask = _rect_mask((w, h), (180, 40, 230, 260))
    prepared = inpaint.prepare_inpaint(picture, mask, crop_padding=padding)
    assert prepared.box == (0, 0, w, h) and prepared.size == (400, 288)
    # the model "paints" exactly what it was given: the stitched picture should be the original again
    same = _as_picture(prepared.pixels)
    back = inpaint.stitch(prepared.original, same, prepared.box, prepared.original_mask, keep_unmasked=False,
                          fitted=True)  # as the engine stitches prepare_inpaint's crops
    assert back.size == picture.size
    found = _dark_columns(np.asarray(back)[h // 2, :, 0])
    assert _in_place(found, [20, 200, 370]), found


def test_a_crop_for_inpaint_crop_stitches_back_in_place_however_its_sides_were_rounded():
    """crop_for_inpaint stretches its box to sides rounded down to multiples of 16, so the crop's aspect
    is not quite the box's; stitch (without ``fitted``) puts the whole crop back, stretched, not the
    region an aspect-keeping fit would have (a review found the fitted geometry applied here: the
    content came back shifted by several px near the box's sides)."""
    w, h = 600, 420
    picture = _striped(w, h, (160, 300, 440), 4)
    mask = _rect_mask((w, h), (153, 108, 447, 312))
    crop, _, box = inpaint.crop_for_inpaint(picture, mask, padding=3, megapixels=0.0625)
    bw, bh = box[2] - box[0], box[3] - box[1]
    assert abs(crop.width / crop.height - bw / bh) > 1e-3  # the rounding changed the aspect
    back = inpaint.stitch(picture, crop, box, mask, keep_unmasked=False)
    found = _dark_columns(np.asarray(back)[h // 2, :, 0])
    assert _in_place(found, [160, 300, 440]), found


def test_crop_box_inside_the_picture_stitches_back_in_place():
    """Pin: a crop box that is not clipped (the usual small mask) comes back where it was cut from (to
    1 px: its int()-rounded aspect leaves a 1 px fill band), and the pixels outside the box are
    untouched."""
    w, h = 400, 300
    picture = _striped(w, h, (150, 200, 250), 6)
    mask = _rect_mask((w, h), (180, 120, 230, 170))
    prepared = inpaint.prepare_inpaint(picture, mask, crop_padding=40)
    x1, y1, x2, y2 = prepared.box
    assert 0 < x1 and x2 < w and 0 < y1 and y2 < h
    back = inpaint.stitch(prepared.original, _as_picture(prepared.pixels), prepared.box, prepared.original_mask,
                          keep_unmasked=False, fitted=True)
    found = _dark_columns(np.asarray(back)[h // 2, :, 0])
    assert _in_place(found, [150, 200, 250]), found
    outside = np.ones((h, w), bool)
    outside[y1:y2, x1:x2] = False
    assert np.array_equal(np.asarray(back)[outside], np.asarray(picture)[outside])


def test_crop_region_with_padding_beyond_the_picture_equals_diffusers():
    """Pin (diffusers-equal, documented): padding larger than the picture and masks on its corners and
    edges give diffusers' crop region (tests/test_inpaint.py draws paddings of 0..40 only)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    proc = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)
    w, h = 301, 187
    pw, ph = inpaint.processing_size(w, h)
    for box in ((0, 0, 5, 5), (296, 182, 300, 186), (0, 90, 300, 95), (150, 0, 152, 186), (0, 0, 300, 186)):
        mask = _rect_mask((w, h), box)
        for pad in (0, 17, 200, 5000):
            assert inpaint.crop_region(mask, pw, ph, pad) == proc.get_crop_region(mask, pw, ph, pad=pad), (box, pad)


# ----- the by-hand helpers: stitch / composite fed what crop_for_inpaint takes ------------------------------


def test_stitch_puts_an_exif_rotated_photo_back_upright():
    """Was a bug: crop_for_inpaint (and outpaint, and generate) turn a photo upright by its EXIF orientation,
    so the box it returns is in upright coordinates; stitch and composite do not, so the documented
    crop-and-stitch by hand, ``stitch(photo, painted, box, mask)`` with the same photo, pastes the crop
    into the sideways stored pixels and squeezes the upright mask onto them: a phone photo stored
    300x200 with orientation 6 (upright 200x300) comes back 300x200, sideways, with the painted patch in
    the wrong place and unmasked pixels changed. Cause: ``stitch`` / ``composite`` in inpaint.py use
    ``original`` as given; fix: ``ImageOps.exif_transpose(original)`` first, as crop_for_inpaint does."""
    photo = _exif_photo(300, 200, 6, seed=1)
    upright = np.asarray(ImageOps.exif_transpose(photo).convert("RGB"))
    assert upright.shape[:2] == (300, 200)
    mask = _rect_mask((200, 300), (50, 100, 90, 140))
    crop, _, box = inpaint.crop_for_inpaint(photo, mask, padding=8, megapixels=0.0625)
    out = inpaint.stitch(photo, Image.new("RGB", crop.size, (255, 0, 255)), box, mask)
    assert out.size == (200, 300)
    o, keep = np.asarray(out), np.asarray(mask) == 0
    assert np.array_equal(o[keep], upright[keep])
    assert (o[120, 70] == (255, 0, 255)).all()  # inside the mask: the painted patch


def _mask_forms(size: tuple[int, int], box) -> dict[str, object]:
    m8 = _rect_mask(size, box)
    levels = np.asarray(m8, np.float32) / 255
    black = Image.new("L", size, 0)
    return {
        "float_F_0_to_1": Image.fromarray(levels, "F"),
        "alpha_only_RGBA": Image.merge("RGBA", [black, black, black, Image.fromarray(255 - np.asarray(m8))]),
        "tensor": torch.from_numpy(levels),
    }


@pytest.mark.parametrize("form", ["float_F_0_to_1", "alpha_only_RGBA", "tensor"])
def test_stitch_reads_the_mask_as_crop_for_inpaint_does(form, caplog):
    """Was a bug: crop_for_inpaint reads its mask with mask_image (a mode-F 0..1 mask at its scale, an RGBA
    mask whose alpha alone varies from alpha as ComfyUI does, a [H, W] tensor), but stitch / composite
    read the same mask with plain ``mask.convert("L")``: a mode-F 0..1 mask becomes 0/1 out of 255 and
    an alpha-only mask a uniform black, so the painted area is thrown away (the pixel inside a
    60x60 masked square stays the original's [201, 127, 48] instead of the painted [255, 0, 255]), and
    a tensor mask fails with torch's "requested resize to (300, 200)x1" RuntimeError. Cause:
    ``composite`` in inpaint.py; fix: read ``mask`` with ``mask_image`` (and accept MaskInput)."""
    picture = _noise_picture(300, 200, 0)
    box = (100, 60, 160, 120)
    mask = _mask_forms(picture.size, box)[form]
    crop, crop_mask, cbox = inpaint.crop_for_inpaint(picture, mask, padding=8, megapixels=0.0625)
    assert np.asarray(crop_mask).max() == 255  # crop_for_inpaint read it right
    out = np.asarray(inpaint.stitch(picture, Image.new("RGB", crop.size, (255, 0, 255)), cbox, mask))
    keep = np.asarray(_rect_mask(picture.size, box)) == 0
    assert np.array_equal(out[keep], np.asarray(picture)[keep])
    assert (out[61:120, 101:160] == (255, 0, 255)).all()


def test_a_mask_of_another_size_changes_no_pixel_well_outside_it():
    """Was a bug: a mask of another size than the picture is resized to it (InitImage: "resized to the
    image") with LANCZOS, whose negative lobes ring: a 50x50 mask with a 20x20 white square (x 40..119
    once scaled to 200 px), on a 200x200 black picture painted white, changes 992 pixels 5 to 9 px
    outside the square (more than one mask pixel, 4 px, away) by up to 9 levels (a row reads
    0 4 8 5 0 0 0 0 23 89 | 166 ... at x = 30..40). Pixels the mask leaves black however it is scaled
    are no longer "the original's, bit for bit": a faint halo around the repainted area. Cause:
    ``composite`` in inpaint.py resizes the mask with LANCZOS; fix: BILINEAR (no negative lobes: the
    same row reads 0 ... 0 32 96 | 159 ..., nothing changes beyond 2 px)."""
    orig = Image.new("RGB", (200, 200), (0, 0, 0))
    painted = Image.new("RGB", (200, 200), (255, 255, 255))
    mask = _rect_mask((50, 50), (10, 10, 29, 29))  # 40..119 at 200 px
    out = np.asarray(inpaint.composite(orig, painted, mask))[..., 0]
    far = np.ones((200, 200), bool)
    far[40 - 5:120 + 5, 40 - 5:120 + 5] = False  # more than 4 px (one 50-px mask pixel) outside the square
    assert out[far].max() == 0, f"{(out[far] > 0).sum()} pixels changed, up to {out[far].max()}/255"
    assert (out[40:120, 40:120][4:-4, 4:-4] == 255).all()


# ----- pictures in other modes: prepared as their RGB pixels ---------------------------------------------


def test_palette_picture_is_prepared_as_its_rgb_pixels():
    """Was a bug: a palette (mode P) picture whose size is not a multiple of 16 is resized by Pillow with
    NEAREST whatever LANCZOS is asked (Pillow's rule for P), so the sampler starts from an aliased
    picture: a 300x300 P picture of thin stripes and the same pixels as RGB are prepared up to 204/255
    apart. prepare_reference_image converts such pictures to RGB first for exactly this reason;
    prepare_inpaint (its ``image.resize`` / ``_resized``) does not. Fix: convert non-RGB/L 8-bit modes to
    RGB before resizing."""
    a = np.zeros((300, 300), np.uint8)
    a[:, ::3] = 1
    a[::5, :] = 2
    pal = Image.fromarray(a, "L").convert("P")
    pal.putpalette([0, 0, 0, 255, 255, 255, 255, 0, 0] + [0] * 759)
    mask = _rect_mask(pal.size, (10, 10, 60, 60))
    got = inpaint.prepare_inpaint(pal, mask).pixels
    want = inpaint.prepare_inpaint(pal.convert("RGB"), mask).pixels
    assert (got - want).abs().max().item() * 127.5 <= 1


@pytest.mark.parametrize("side", [500, 1100])
def test_transparent_pixels_of_an_rgba_picture_do_not_turn_black_when_resized(side):
    """Was a bug: an RGBA picture's alpha leaks into what is painted, depending on its size: the composite
    keeps the raw RGB of transparent pixels (alpha dropped), and a 512x512 picture is prepared with them
    too, but a 500x500 (or > 1 MP) one is resized by Pillow with premultiplied alpha, so its transparent
    half reaches the sampler as black [0, 0, 0] instead of its red [200, 0, 0] (as the reference path
    and the result's own kept pixels have it). The repainted area then matches black surroundings that
    the result does not show. Cause: prepare_inpaint resizes RGBA as given; fix: convert to RGB first,
    as prepare_reference_image does."""
    a = np.zeros((side, side, 4), np.uint8)
    a[..., 0] = 200
    a[..., 3] = 255
    a[:, : side // 2, 3] = 0  # left half transparent, its colour still red
    rgba = Image.fromarray(a, "RGBA")
    mask = _rect_mask(rgba.size, (side - 100, 10, side - 50, 60))
    ref = (prepare_reference_image(rgba)[0, :, 40, 5] + 1) * 127.5
    assert ref.round().tolist() == [200, 0, 0]  # the reference path: alpha dropped
    px = (inpaint.prepare_inpaint(rgba, mask).pixels[0, :, 40, 5] + 1) * 127.5
    assert px.round().tolist() == [200, 0, 0]


# ----- the engine: composite at odd sizes, EXIF, feather, batch -----------------------------------------


def test_inpaint_of_an_exif_photo_at_an_odd_size_keeps_unmasked_pixels_and_feathers_only_inside(tiny):
    """Pin: generate with an EXIF-rotated photo of odd size (stored 211x147, upright 147x211, generated at
    144x208), a soft (grey-edged) mask and feather 6, batch 2: both results are upright at the exact
    original size, every pixel under a black mask is the photo's bit for bit, and well inside the mask
    (beyond the feather band) each pixel is the uncomposited result resized, untouched by the blend.
    The same seed gives the same pictures."""
    tr, te, vae = tiny
    photo = _exif_photo(211, 147, 6, seed=2)
    upright = np.asarray(ImageOps.exif_transpose(photo).convert("RGB"))
    mask = Image.new("L", (147, 211), 0)
    ImageDraw.Draw(mask).ellipse((20, 40, 120, 170), fill=255)
    mask = mask.filter(ImageFilter.GaussianBlur(3))
    kw = {"prompt": "x", "image": photo, "mask": mask, "steps": 2, "seed": 11, "batch_size": 2}
    res = kc.generate(tr, te, vae, feather=6, **kw)
    raw = kc.generate(tr, te, vae, composite=False, **kw)
    assert [im.size for im in res.images] == [(147, 211)] * 2 and (res.width, res.height) == (147, 211)
    assert [im.size for im in raw.images] == [(144, 208)] * 2
    keep = np.asarray(mask) == 0
    deep = np.asarray(mask.filter(ImageFilter.MinFilter(31))) == 255  # >= 15 px inside the full-white core
    assert deep.sum() > 1000
    for out, gen in zip(res.images, raw.images):
        o = np.asarray(out)
        assert np.array_equal(o[keep], upright[keep])
        assert np.array_equal(o[deep], np.asarray(gen.resize((147, 211), Image.Resampling.LANCZOS))[deep])
    assert not np.array_equal(np.asarray(res.images[0])[deep], np.asarray(res.images[1])[deep])
    again = kc.generate(tr, te, vae, feather=6, **kw)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(res.images, again.images))


def test_asymmetric_outpaint_fills_with_edge_pixels_and_keeps_the_picture(tiny):
    """Pin (docs: the canvas grown with the picture's edge pixels, a mask of the new area): zero on some
    sides, feather ramping only into the sides that grew; generating on it returns the canvas's exact
    size with every pixel of the picture not under the mask unchanged."""
    tr, te, vae = tiny
    img = _noise_picture(70, 66, 3)
    a = np.asarray(img)
    canvas, mask = inpaint.outpaint(img, left=0, top=5, right=37, bottom=0, feather=3)
    c, m = np.asarray(canvas), np.asarray(mask)
    assert canvas.size == mask.size == (107, 71)
    assert np.array_equal(c[5:, :70], a)
    assert np.array_equal(c[5:, 70:], np.repeat(a[:, -1:], 37, axis=1))  # the right edge column stretched
    assert np.array_equal(c[:5, :70], np.repeat(a[:1], 5, axis=0))  # the top row stretched
    assert (m[:5] == 255).all() and (m[:, 70:] == 255).all()
    assert (m[5 + 3:, :70 - 3] == 0).all() and m[-1, 0] == 0  # left and bottom did not grow: no ramp there
    assert 0 < m[40, 68] < 255 and m[40, 69] == 255  # the ramp into the picture on the right
    res = kc.generate(tr, te, vae, prompt="x", image=canvas, mask=mask, steps=1, seed=2)
    out = np.asarray(res.images[0])
    assert res.images[0].size == (107, 71)
    assert np.array_equal(out[m == 0], c[m == 0]) and (out[m == 255] != c[m == 255]).any()


# ----- strength: the runs the docs and the log promise -----------------------------------------------------


def _steps_run(tr, te, vae, steps: int, strength: float, **kw) -> int:
    seen = []
    kc.generate(tr, te, vae, prompt="x", image=_noise_picture(64, 64, 4), steps=steps, strength=strength, seed=1,
                output="latent", callback=lambda i, total, lat: seen.append(total), **kw)
    return seen[0]


def test_strength_edges_run_the_documented_number_of_steps(tiny):
    """Pin (docs: 4 steps at 0.6 run 3, any strength above 0.75 runs all 4; strength 0.01 still runs one
    step); with a mask and without."""
    tr, te, vae = tiny
    mask = _rect_mask((64, 64), (10, 10, 40, 40))
    for strength, runs in ((0.01, 1), (0.6, 3), (0.75, 3), (0.76, 4), (1.0, 4)):
        assert _steps_run(tr, te, vae, 4, strength) == runs, strength
        assert _steps_run(tr, te, vae, 4, strength, mask=mask) == runs, strength


def test_strength_diffusers_rule_at_float_edges():
    """Pin: the steps run follow diffusers' get_timesteps also where floats round (10 steps at 0.8 run 8,
    not the 9 that ``int(steps * (1 - strength))`` = int(1.9999999999999996) = 1 skipped would give)."""
    from types import SimpleNamespace

    import diffusers
    from diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint import Flux2KleinInpaintPipeline

    for steps, strength in ((10, 0.8), (5, 0.8), (10, 0.9), (25, 0.68), (3, 0.9), (7, 0.857143)):
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(steps)
        _, theirs = Flux2KleinInpaintPipeline.get_timesteps(SimpleNamespace(scheduler=scheduler), steps, strength,
                                                            "cpu")
        assert inpaint.steps_to_run(steps, strength) == theirs, (steps, strength)
    assert inpaint.steps_to_run(10, 0.8) == 8


@pytest.mark.parametrize("steps", [3, 7])
def test_the_strength_the_log_advises_does_skip_a_step(tiny, caplog, steps):
    """Was a bug: when a strength skips no step the engine says "Use %g or less, or more steps, to start from
    the image" with (steps - 1) / steps printed by %g, which rounds UP: at 3 steps it advises 0.666667
    and at 7 steps 0.857143, and each of those still skips no step (3 x 0.666667 = 2.000001, so
    int(3 - 2.000001) = 0 are skipped): the user who follows the advice gets all steps from pure noise
    and the same warning again. Cause: engine.py's denoise warning; fix: print a value rounded down
    (e.g. math.floor((steps - 1) / steps * 1e6) / 1e6)."""
    tr, te, vae = tiny
    with caplog.at_level(logging.INFO, logger="klein_core"):
        assert _steps_run(tr, te, vae, steps, 0.99, image_as_reference=False) == steps
    advice = re.search(r"Use ([0-9.e-]+) or less", caplog.text)
    assert advice, caplog.text
    advised = float(advice.group(1))
    assert _steps_run(tr, te, vae, steps, advised, image_as_reference=False) == steps - 1, advised


# ----- the command line -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    write_tiny_model_files(d)
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (80, 72, 3), np.uint8)).save(d / "img.png")
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 40, 3), np.uint8)).save(d / "small.png")
    m = np.zeros((80, 72), np.uint8)
    m[20:50, 20:50] = 255
    Image.fromarray(m).save(d / "mask.png")
    return d


@pytest.mark.parametrize("flags,message", [
    (["--mask", "{d}/mask.png", "--feather", "-2"], "feather must be a whole number of pixels >= 0"),
    (["--mask", "{d}/mask.png", "--crop-padding", "-3"], "crop_padding must be a whole number of pixels >= 0"),
    (["--crop-padding", "8"], "crop_padding needs a mask"),
])
def test_cli_refuses_bad_inpaint_numbers_before_loading_the_models(model_dir, monkeypatch, capsys, flags, message):
    """Was a bug: _check_request promises "Every number checked before anything loads (a wrong size must not
    wait for 16 GB of weights)", but --feather -2, --crop-padding -3 and --crop-padding without --mask
    are only refused by the engine (InitImage / prepare_inpaint), after the transformer, text encoder
    and VAE have loaded: with real models, tens of seconds and 16 GB for a one-line error. Cause:
    cli._check_request checks --strength and --outpaint but not --feather / --crop-padding; fix: check
    them there (>= 0, --crop-padding needs --mask)."""
    from klein_core.files import loaders

    def refuse(*a, **k):
        raise AssertionError("the transformer was loaded before the flags were checked")

    monkeypatch.setattr(loaders, "load_transformer", refuse)
    args = ["--models-dir", str(model_dir), "--prompt", "x", "--image", str(model_dir / "img.png"), "--steps", "1",
            "--out", str(model_dir / "never.png"), "-q", *(f.format(d=model_dir) for f in flags)]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_outpaint_parameters_fed_back_reproduce_the_batch(model_dir, tmp_path):
    """Pin: an outpaint with feather and a batch of 2 at an odd size: the PNG records the canvas size, the
    resolved strength and every inpaint flag, and the command rebuilt from those parameters alone
    writes the same pixels."""
    import json

    out = tmp_path / "a.png"
    base = ["--models-dir", str(model_dir), "-q"]
    assert cli.main([*base, "--prompt", "sky", "--image", str(model_dir / "img.png"), "--outpaint", "0,9,23,0",
                     "--feather", "4", "--steps", "2", "--seed", "13", "--batch", "2", "--out", str(out)]) == 0
    files = [tmp_path / "a_00.png", tmp_path / "a_01.png"]
    p = json.loads(Image.open(files[1]).text["parameters"])
    assert (p["width"], p["height"], p["strength"], p["outpaint"], p["feather"], p["composite"], p["batch_index"]) \
        == (95, 89, 1.0, "0,9,23,0", 4, True, 1)
    again = tmp_path / "b.png"
    argv = [*base, "--prompt", p["prompt"], "--image", p["image"], "--outpaint", p["outpaint"], "--feather",
            str(p["feather"]), "--strength", str(p["strength"]), "--steps", str(p["steps"]), "--seed", str(p["seed"]),
            "--batch", str(p["batch"]), "--out", str(again)]
    if p["crop_padding"] is not None:
        argv += ["--crop-padding", str(p["crop_padding"])]
    if not p["composite"]:
        argv.append("--no-composite")
    assert cli.main(argv) == 0
    for i, f in enumerate(files):
        first, second = np.asarray(Image.open(f).convert("RGB")), np.asarray(Image.open(tmp_path / f"b_{i:02d}.png"))
        assert first.shape == (89, 95, 3) and np.array_equal(first, second)
    picture = np.asarray(Image.open(model_dir / "img.png").convert("RGB"))
    assert np.array_equal(np.asarray(Image.open(files[0]))[9 + 4:, :72 - 4], picture[4:, :68])
