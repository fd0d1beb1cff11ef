"""Klein Inpaint Crop / Stitch and Flux2 VAE Encode on inputs found to break them: a grey (1- or
2-channel) IMAGE, a mask smaller than the feather, a picture too elongated for "fit 1 megapixel".

Nodes' ``execute`` are called directly in ComfyUI 0.3.75's modules (``--cpu``), as in test_nodes.py.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch
from test_nodes import _load, comfy  # noqa: F401 (fixtures)

from klein_core.pipeline.inpaint import composite_pixels, feather_mask


def _inpaint():
    return sys.modules["klein_pack_nodes.inpaint"]


def _crop_and_stitch(image, mask, feather, padding=8, megapixels=0.0625, seed=0):
    mod = _inpaint()
    with torch.inference_mode():
        crop, crop_mask, info = mod.KleinInpaintCrop.execute(image, mask, padding, megapixels).args
        painted = torch.rand(1, *crop.shape[1:3], 3, generator=torch.Generator().manual_seed(seed))
        (out,) = mod.KleinInpaintStitch.execute(info, painted, feather, True).args
    return crop, crop_mask, info, out


@pytest.mark.parametrize("channels", [1, 2])
def test_grey_image_crops_to_rgb_and_stitches_keeping_unmasked_pixels(comfy, channels):  # noqa: F811
    h, w = 90, 110
    image = torch.rand(1, h, w, channels, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, h, w)
    mask[:, 30:50, 40:70] = 1
    crop, crop_mask, _, out = _crop_and_stitch(image, mask, 4)
    # The crop is RGB like every other IMAGE the pack makes (grey repeated), for Flux2 VAE Encode or
    # ComfyUI's own VAEEncode.
    assert crop.shape[-1] == 3 and crop.dtype == torch.float32 and crop.shape[1:3] == crop_mask.shape[1:]
    assert torch.equal(crop[..., 0], crop[..., 2])
    grey = image[0, ..., :1].expand(h, w, 3)
    keep = mask[0] == 0
    assert out.shape == (1, h, w, 3)
    assert torch.equal(out[0][keep], grey[keep])  # bit for bit
    assert not torch.equal(out[0][~keep], grey[~keep])  # the painted crop went in


def test_default_feather_never_erases_a_small_mask_and_keeps_a_wide_ones(comfy, caplog):  # noqa: F811
    h, w = 200, 240
    image = torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(2))
    # a 4 px and a 6 px spot, a 5 px stroke: feather 8 alone keeps none of them
    for x1, y1, x2, y2 in [(100, 100, 104, 104), (100, 100, 106, 106), (40, 120, 200, 125)]:
        mask = torch.zeros(1, h, w)
        mask[:, y1:y2, x1:x2] = 1
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _, _, _, out = _crop_and_stitch(image, mask, 8, padding=32, megapixels=1.0)
        keep = mask[0] == 0
        assert torch.equal(out[0][keep], image[0][keep])
        changed = (out[0] != image[0]).any(-1)[~keep]
        assert changed.float().mean() > 0.5, f"{(x1, y1, x2, y2)}: only {int(changed.sum())} of " \
                                             f"{changed.numel()} masked pixels changed"
        assert any("feather 8 would erase part of the mask" in r.getMessage() for r in caplog.records)
    # a mask wider than the feather, and a long soft ramp (Pad Image for Outpainting's feathering 60 on
    # the right), keep the feather asked for, with no warning
    wide = torch.zeros(1, h, w)
    wide[:, 60:140, 60:180] = 1
    ramp = torch.ones(1, h, w)
    d = (160 - torch.arange(160)).float()
    ramp[:, :, :160] = torch.where(d < 60, ((60 - d) / 60) ** 2, torch.zeros(()))
    mod = _inpaint()
    for mask in (wide, ramp):
        caplog.clear()
        with caplog.at_level(logging.WARNING), torch.inference_mode():
            crop, _, info = mod.KleinInpaintCrop.execute(image, mask, 8, 0.0625).args
            painted = torch.rand(1, *crop.shape[1:], generator=torch.Generator().manual_seed(4))
            (out,) = mod.KleinInpaintStitch.execute(info, painted, 8, True).args
            (pasted,) = mod.KleinInpaintStitch.execute(info, painted, 0, False).args
        assert torch.equal(out, composite_pixels(image, pasted, feather_mask(mask[0], 8)))
        assert not any("would erase" in r.getMessage() for r in caplog.records)


def test_fit_one_megapixel_refuses_a_too_elongated_image_by_name(comfy):  # noqa: F811
    _, vae = _load(comfy)
    pixels = torch.rand(1, 16, 70000, 3)  # 1.1 MP: scaled to 1 MP its height rounds down to 0
    with torch.inference_mode(), pytest.raises(ValueError, match=r"Flux2 VAE Encode: a 70000x16 image scaled to "
                                                                 r"1 megapixel has a side under 16 pixels"):
        comfy.pack.KleinVAEEncode.execute(pixels, vae, "fit 1 megapixel")


def test_the_core_composite_keeps_a_small_spot_a_feather_would_erase():
    """The Python API / CLI composite (``feather=``, ``--feather``) lowers the feather the same way:
    a 6x6 spot at feather 8 was kept entirely as the original."""
    from PIL import Image

    from klein_core.pipeline.inpaint import composite

    original = Image.new("RGB", (64, 64), (0, 0, 0))
    generated = Image.new("RGB", (64, 64), (255, 255, 255))
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (30, 30, 36, 36))
    out = np.asarray(composite(original, generated, mask, feather=8))
    assert out[30:36, 30:36].max() > 0  # part of the spot is painted
    assert out[:30].max() == 0 and out[36:].max() == 0  # unmasked pixels stay the original's
