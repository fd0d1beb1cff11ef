"""Options that need an image, and the inpaint helpers' sizes and boxes: refused up front, naming the
culprit, and the library usable afterwards (issue #28)."""

from __future__ import annotations

import pytest
from PIL import Image

import klein_core as kc
from klein_core import cli
from klein_core.pipeline.inpaint import MAX_CANVAS_PIXELS, outpaint, stitch
from klein_core.testing import build_tiny_components


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


@pytest.mark.parametrize("option", [dict(feather=4), dict(image_as_reference=False), dict(composite=False),
                                    dict(mask_crop_padding=8)])
def test_image_options_without_an_image_are_refused(tiny, option):
    tr, te, vae = tiny
    kw = dict(prompt="x", width=64, height=64, steps=1, output="latent")
    with pytest.raises(ValueError, match=rf"{next(iter(option))} needs an image to start from \(image=\)"):
        kc.generate(tr, te, vae, **kw, **option)
    assert kc.generate(tr, te, vae, **kw).latents.shape[-1] == 4  # still usable


@pytest.mark.parametrize("flags", [["--feather", "8"], ["--no-composite"]])
def test_cli_image_flags_without_an_image_are_refused(flags, capsys):
    assert cli.main(["generate", "--demo", "--out", "unused.png", *flags]) == 2
    assert f"{flags[0]} needs --image" in capsys.readouterr().err


def test_outpaint_refuses_a_huge_canvas_up_front():
    img = Image.new("RGB", (64, 48))
    with pytest.raises(ValueError, match=r"outpaint would make a 1099511627840x48 canvas"):
        outpaint(img, right=2**40)
    side = int(MAX_CANVAS_PIXELS**0.5)
    with pytest.raises(ValueError, match="at most 256 megapixels"):
        outpaint(img, right=side, bottom=side)
    canvas, mask = outpaint(img, right=16)
    assert canvas.size == mask.size == (80, 48)


@pytest.mark.parametrize("box", [(10, 10, 5, 20), (10, 10, 20, 10), (-1, 0, 8, 8), (0, 0, 65, 8), (0, 0, 8),
                                 ("a", 0, 8, 8), (0.5, 0, 8, 8)])
def test_stitch_names_a_bad_box(box):
    original, generated = Image.new("RGB", (64, 48)), Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="stitch: box"):
        stitch(original, generated, box, None)
    assert stitch(original, generated, (0, 0, 16, 16), None).size == (64, 48)
