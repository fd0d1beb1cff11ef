"""Image sizes, aspect ratios and tensor shapes at the edges (hunt).

What is probed: output sizes that are not multiples of 16, tiny and extremely elongated ones, the
64 px / 4 megapixel limits and who is named when a size taken from an image breaks them (a
reference, an init image, given noise, the Klein Sampler's latent); reference images of odd sizes,
modes and batches (Python API and Klein Reference Stacker); masks and latents handed between nodes
with other sizes or batches; empty batches (B = 0) and empty images (a side of 0) through the
engine's VAE stages and every node that takes an IMAGE, MASK or LATENT; tiled VAE decoding at
sizes that are not a multiple of the tile; and what ``GenerationResult`` says the size of an
inpainted result is.

Sub-areas probed without a defect found (not repeated here; covered elsewhere or working): the
size rules of ``resolve_size`` (test_pipeline), the 8:1 reference limit and the 1-megapixel
reference scaling (test_pipeline, test_batch_refs_hunt), grey / RGBA / 16-bit references
(test_engine_hunt, test_nodes), tiled decode and encode at sizes that are not a multiple of the
tile (test_vae_hunt), FLUX.1 / SD / 32-channel / 5-D latents refused by Flux2 VAE Decode by name,
batch / serve widths given as strings, floats or odd numbers (test_serve_hunt, test_ray_hunt2), and
a Klein Sampler mask of another size than its latent, which is resized to it (as ComfyUI's own
samplers resize a noise mask; Klein Inpaint Crop, which cuts by the mask, refuses one).

Each ``Was a bug:`` test failed on the code it was written against because of the defect it names (fixed since); each
``Pinned:`` test holds behaviour that already works and is not tested elsewhere. Tiny random
models on the CPU (the nodes: ComfyUI 0.3.75's modules, bf16 files).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from test_nodes import _load, _sample, _stack, comfy  # noqa: F401

import klein_core as kc
from klein_core.testing import build_tiny_components

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXT = 96  # the tiny transformer's context width (3 x 32)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


def _emb(n: int = 1, length: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, length, TEXT, generator=torch.Generator().manual_seed(seed))


def _native_cond() -> list:
    """A native CONDITIONING of the tiny model's text width (as CLIPTextEncode gives): the sampler
    node takes it without the text encoder being loaded."""
    return [[_emb(), {}]]


def _img(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ----- a size taken from an image the output must follow -------------------------------------------


@pytest.mark.parametrize("source", ["init image", "given noise"])
def test_a_too_small_size_source_that_fixes_the_output_size_is_not_told_to_give_width_and_height(tiny, source):
    """Was a bug: request.py ``_check_inherited`` ends every "too small to set the output size" refusal with
    "Use a larger image, or give width and height explicitly", also when the size comes from an init
    image (``kc.generate(image=...)``) or from given noise, whose size the output must keep: a
    64x20000 picture (1.3 MP, scaled to 1 MP it is 48 px wide) or noise on a 64x3 latent grid (48 px
    high) is refused with that advice, and a user who follows it and gives width and height is
    refused again, by inputs.py ``check_denoise_inputs``: "the output size comes from the init
    image (48x18096); got width/height 64x1024: leave them unset (0 in ComfyUI)", and for the noise
    "Output size 1024x48 is too small" (the noise's own size, whatever width and height say).
    Expected: the advice fits the source (a larger image / larger noise), never width and height,
    which these sources do not take."""
    tr, _, vae = tiny
    if source == "init image":
        kw = {"image": Image.new("RGB", (64, 20000), (90, 120, 150)), "strength": 0.5}
    else:
        kw = {"noise": torch.randn(1, 128, 3, 64, generator=torch.Generator().manual_seed(1))}
    with pytest.raises(ValueError, match="too small to set the output size") as err:
        kc.generate(tr, None, vae, prompt_embeds=_emb(), steps=1, output="latent", cache=None, **kw)
    assert "give width and height" not in str(err.value), str(err.value)


@pytest.mark.parametrize("grid", [(3, 64), (125, 188)], ids=["1024x48px", "3008x2000px"])
def test_sampler_refusing_the_latents_size_does_not_tell_to_give_width_and_height(comfy, grid):  # noqa: F811
    """Was a bug: Klein Sampler, width and height 0 (as they must be with a latent), a ``latent`` (Flux2 VAE
    Encode of a 1024x48 strip, or of a 3008x2000 photo with size 'crop to 16') too small or over 4 MP
    to be the output size: the refusal (sampler.py ``execute`` -> request.py ``_check_inherited``)
    says "Use a larger image, or give width and height explicitly" / "Give width and height
    explicitly (e.g. 2048x2048 at most), or use a smaller image", but the same node refuses width
    and height with a latent: "width/height: the output takes the size of latent (...); set both
    to 0". The user is sent in a circle. Expected: name the latent and say what works (a larger /
    smaller image, or 'fit 1 megapixel' on Flux2 VAE Encode), never width and height."""
    model, _ = _load(comfy)
    latent = {"samples": torch.zeros(1, 128, *grid)}
    with pytest.raises(ValueError, match=r"Klein Sampler: width/height: latent \(") as err:
        _sample(comfy, model, _native_cond(), width=0, height=0, latent=latent, denoise=0.5, steps=1)
    assert "width and height explicitly" not in str(err.value), str(err.value)
    # (review) Flux2 VAE Encode's 'fit 1 megapixel' only scales down: named for a latent too large only
    assert ("fit 1 megapixel" in str(err.value)) == (grid == (125, 188)), str(err.value)


# ----- empty batches and empty images -----------------------------------------------------------------


def test_sampler_empty_latent_batch_is_not_told_to_set_batch_size_to_0(comfy):  # noqa: F811
    """Was a bug: Klein Sampler with a ``latent`` of 0 images (``[0, 128, 4, 4]``, an empty batch from an
    upstream node): sampler.py ``check_batches`` answers "latent holds 0 images but batch_size is 1:
    set batch_size to 0 (one output image from each), or give a latent of one image"; batch_size
    cannot be 0 (its widget's minimum is 1). Expected: the latent named as an empty batch, with no
    impossible fix (check ``b == 0`` before the batch_size advice)."""
    model, _ = _load(comfy)
    with pytest.raises(ValueError, match=r"Klein Sampler: latent") as err:
        _sample(comfy, model, _native_cond(), width=0, height=0, latent={"samples": torch.zeros(0, 128, 4, 4)},
                denoise=0.5, steps=1)
    assert "batch_size to 0" not in str(err.value), str(err.value)


def test_reference_stacker_refuses_an_empty_image_batch(comfy):  # noqa: F811
    """Was a bug: Klein Reference Stacker given an IMAGE of 0 frames (``[0, 64, 64, 3]``) returns the stack
    unchanged and an empty ``sizes`` text, without a word (references.py ``execute``:
    ``frames_to_pil`` gives no frame and ``encode_references([])`` returns []): the edit then runs
    without the reference the user connected, at 1024x1024 instead of the reference's size.
    Expected: a ValueError naming the node and its ``image`` input (an empty batch holds no
    reference), as for any other unusable frame."""
    _, vae = _load(comfy)
    with pytest.raises(ValueError, match=r"Klein Reference Stacker: .*image"):
        _stack(comfy, torch.rand(0, 64, 64, 3), vae)


@pytest.mark.parametrize("empty", ["image", "mask"])
def test_inpaint_crop_refuses_an_empty_image_or_mask_batch(comfy, empty):  # noqa: F811
    """Was a bug: Klein Inpaint Crop (nodes/inpaint.py ``execute`` / ``_one_mask``) takes one frame and
    refuses more ("the image has N frames; crop-and-stitch takes one"), but not 0: an ``image`` of
    0 frames passes and gives an empty crop and a stitch over an empty original, which Klein Inpaint
    Stitch then fails on with torch's "The expanded size of the tensor (1) must match the existing
    size (0)"; a ``mask`` of 0 frames (``[0, 64, 64]``) fails with a bare ``IndexError: index 0 is
    out of bounds for dimension 0 with size 0``. Expected: a ValueError naming the node and the
    empty input (check ``image.shape[0] != 1`` and ``mask.shape[0] >= 1``)."""
    image = torch.rand(0 if empty == "image" else 1, 64, 64, 3)
    mask = torch.ones(0, 64, 64) if empty == "mask" else torch.ones(1, 64, 64)
    with pytest.raises(ValueError, match=rf"Klein Inpaint Crop: .*{empty}"):
        comfy.pack.KleinInpaintCrop.execute(image, mask)


@pytest.mark.parametrize("stage", ["decode", "encode_pixels"])
def test_an_empty_image_is_refused_by_name_like_an_empty_batch(tiny, stage):
    """Was a bug: Engine.decode of latents with a side of 0 (``[1, 128, 0, 4]``) and Engine.encode_pixels
    of pixels with a side of 0 (``[1, 3, 0, 64]``) escape as torch's own ``RuntimeError: Calculated
    padded input size per channel: ... Kernel size can't be greater than actual input size`` from
    inside the VAE, naming nothing. engine.py ``_decode`` / ``encode_pixels`` refuse an empty
    *batch* by name ("the latents to decode must be [B, 128, h, w] with B >= 1") and the tiled path
    refuses an empty image ("decode_tiled: latents must be a non-empty tensor"), but the whole-image
    path checks only ``shape[0]``. Expected: a ValueError naming the latents / pixels (check
    ``0 in shape``)."""
    tr, _, vae = tiny
    engine = kc.Engine(tr, None, vae, prompt_cache=None, vae_tile=None)
    if stage == "decode":
        call, what = (lambda: engine.decode(torch.zeros(1, 128, 0, 4))), "latents to decode"
    else:
        call, what = (lambda: engine.encode_pixels(torch.zeros(1, 3, 0, 64))), "pixels to encode"
    with pytest.raises(ValueError, match=what):
        call()


# ----- what the result says its size is ------------------------------------------------------------


def test_an_inpainted_results_pixels_have_the_size_of_its_images(tiny):
    """Was a bug: ``kc.generate(image=<100x70 picture>, mask=...)`` returns ``images`` at the original
    100x70 (docs/inpaint.md: "with a mask and composite, returned at the exact original size") and
    ``width, height = 100, 70``, but ``pixels`` stays the raw generation at the 96x64 processing size
    ``[1, 3, 64, 96]``, before the composite (engine.py ``Engine.generate`` replaces ``images`` and
    the size with the stitched ones and leaves ``pixels``). Everywhere else ``pixels`` is the float
    form of ``images`` (test_transfer); here a user taking ``pixels`` gets another picture, of
    another size, whose unmasked pixels are not the original's. Expected: ``pixels`` of the
    returned images (``[B, 3, height, width]``), or None with the reason documented."""
    tr, _, vae = tiny
    mask = np.zeros((70, 100), np.uint8)
    mask[10:40, 10:40] = 255
    result = kc.generate(tr, None, vae, prompt_embeds=_emb(), steps=1, cache=None, image=_img(100, 70, 3),
                         mask=Image.fromarray(mask))
    assert result.images[0].size == (100, 70) and (result.width, result.height) == (100, 70)
    assert tuple(result.pixels.shape) == (1, 3, 70, 100), (
        f"pixels {list(result.pixels.shape)} for a {result.width}x{result.height} result")


# ----- pinned -----------------------------------------------------------------------------------------


def test_pinned_an_elongated_size_not_a_multiple_of_16_comes_out_exactly_as_rounded_and_tiled(tiny, caplog):
    """Pinned: width 64 (the smallest side) and height 1030 (16:1, not a multiple of 16) with the VAE
    tile pinned at 16 latent positions: one warning "Size 64x1030 is not a multiple of 16; using
    64x1024", the result, its image and its latents are exactly 64x1024 / [1, 128, 64, 4], and the
    decode ran in tiles of 16 (a latent taller than one tile but narrower than it)."""
    tr, _, vae = tiny
    with caplog.at_level(logging.WARNING, logger="klein_core"):
        result = kc.generate(tr, None, vae, prompt_embeds=_emb(), width=64, height=1030, steps=1, cache=None,
                             vae_tile=16)
    warned = [r.getMessage() for r in caplog.records if "not a multiple of 16" in r.getMessage()]
    assert warned == ["Size 64x1030 is not a multiple of 16; using 64x1024"]
    assert (result.width, result.height) == (64, 1024) and result.images[0].size == (64, 1024)
    assert tuple(result.latents.shape) == (1, 128, 64, 4) and tuple(result.pixels.shape) == (1, 3, 1024, 64)
    assert result.decode_tiles == [16]
