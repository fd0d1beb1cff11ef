"""Image-to-image and inpainting vs diffusers' Flux2KleinInpaintPipeline (0.42.1) on tiny random
components written to files and loaded through klein_core's loaders; fp32, final packed latents.

Both draw the noise from a CPU generator seeded alike (diffusers' ``latents=`` argument would skip
its own noising of the image, so the generator path is compared).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image, ImageDraw
from test_pipeline_parity import CTX, LATENT_CH, _embeds, _image, components  # noqa: F401 (fixture)

import klein_core as kc
from klein_core.pipeline.sampling import pack

diffusers = require("diffusers")
TOL = 2e-5  # about twice the largest measured (1.0e-5, base CFG inpaint)


def _pipe(tr, vae, distilled: bool):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    return diffusers.Flux2KleinInpaintPipeline(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None,
                                               transformer=tr, is_distilled=distilled)


def _reference(pipe, seed: int, **kw) -> tuple[torch.Tensor, list[Image.Image]]:
    captured = {}

    def grab(p, i, t, kwargs):
        captured["latents"] = kwargs["latents"].clone()
        return {}

    with torch.no_grad():
        out = pipe(generator=torch.Generator().manual_seed(seed), callback_on_step_end=grab, **kw)
    return captured["latents"], out.images


def _mask(w: int, h: int, box: tuple[int, int, int, int]) -> Image.Image:
    m = Image.new("L", (w, h), 0)
    ImageDraw.Draw(m).rectangle(box, fill=255)
    return m


def _diff(res: kc.GenerationResult, ref: torch.Tensor) -> float:
    return (pack(res.latents) - ref).abs().max().item()


def test_image_to_image_at_strength_0_6(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb, image = _embeds(11), _image(96, 64, 1)
    white = Image.new("L", image.size, 255)  # diffusers' pipeline needs a mask: all white = image-to-image
    ref, _ = _reference(_pipe(tr, vae, True), 5, image=image, mask_image=white, strength=0.6,
                        num_inference_steps=5, guidance_scale=1.0, prompt_embeds=emb, output_type="latent")
    steps_seen = []
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, strength=0.6, steps=5, seed=5,
                      output="latent", callback=lambda s, n, x: steps_seen.append((s, n)))
    assert steps_seen[-1] == (3, 3)  # int(5 * 0.6) = 3 of the 5 steps run
    diff = parity("inpaint pipeline fp32, image-to-image strength 0.6", _diff(res, ref))
    assert diff <= TOL, diff
    # strength changes the result, and 1.0 starts from pure noise (the image only as a reference)
    full = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, strength=1.0, steps=5, seed=5,
                       output="latent")
    assert (full.latents - res.latents).abs().max() > 1e-2


@pytest.mark.parametrize("with_reference", [False, True])
def test_inpaint_without_and_with_a_reference(components, parity, with_reference):
    tr, vae, ours_tr, ours_vae = components
    emb, image = _embeds(12), _image(80, 112, 2)  # non-square
    mask = _mask(80, 112, (10, 20, 50, 70))
    extra = {"image_reference": _image(64, 72, 3)} if with_reference else {}
    ref, _ = _reference(_pipe(tr, vae, True), 9, image=image, mask_image=mask, strength=0.9,
                        num_inference_steps=4, guidance_scale=1.0, prompt_embeds=emb, output_type="latent",
                        num_images_per_prompt=2, **extra)
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=mask, strength=0.9, steps=4,
                      seed=9, batch_size=2, output="latent",
                      references=[extra["image_reference"]] if with_reference else [])
    name = "with a reference image" if with_reference else "without a reference"
    diff = parity(f"inpaint pipeline fp32, inpaint {name}, batch 2, 80x112", _diff(res, ref))
    assert diff <= TOL, diff
    assert res.latents.shape == (2, 4 * LATENT_CH, 28, 20)


def test_inpaint_base_model_with_cfg(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb, neg, image = _embeds(13), _embeds(14), _image(64, 64, 4)
    mask = _mask(64, 64, (0, 0, 31, 63))
    ref, _ = _reference(_pipe(tr, vae, False), 2, image=image, mask_image=mask, strength=1.0,
                        num_inference_steps=4, guidance_scale=3.0, prompt_embeds=emb, negative_prompt_embeds=neg,
                        output_type="latent")
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, negative_embeds=neg, image=image, mask=mask,
                      steps=4, guidance=3.0, seed=2, kind="base", output="latent")
    diff = parity("inpaint pipeline fp32, base model CFG 3", _diff(res, ref))
    assert diff <= TOL, diff


def test_padding_mask_crop(components, parity):
    tr, vae, ours_tr, ours_vae = components
    emb, image = _embeds(15), _image(128, 96, 5)
    mask = _mask(128, 96, (70, 50, 90, 66))
    ref, ref_images = _reference(_pipe(tr, vae, True), 4, image=image, mask_image=mask, padding_mask_crop=6,
                                 num_inference_steps=3, guidance_scale=1.0, prompt_embeds=emb, strength=1.0,
                                 output_type="pil")  # diffusers allows only PIL output with a crop
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=mask, mask_crop_padding=6,
                      strength=1.0, steps=3, seed=4, output="latent")
    diff = parity("inpaint pipeline fp32, padding_mask_crop 6", _diff(res, ref))
    assert diff <= TOL, diff
    # the crop is generated at the image's size, then stitched back: only masked pixels change
    full = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=mask, mask_crop_padding=6,
                       strength=1.0, steps=3, seed=4)
    out = np.asarray(full.images[0])
    keep = np.asarray(mask) == 0
    assert full.images[0].size == image.size
    assert np.array_equal(out[keep], np.asarray(image)[keep])
    assert not np.array_equal(out[~keep], np.asarray(image)[~keep])


def test_composite_keeps_unmasked_pixels_exactly_and_can_be_switched_off(components):
    tr, vae, ours_tr, ours_vae = components
    emb, image = _embeds(16), _image(72, 66, 6)  # not a multiple of 4: generated at 72x64, output 72x66
    mask = _mask(72, 66, (20, 10, 60, 40))
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=mask, steps=2, seed=1)
    out, src, keep = np.asarray(res.images[0]), np.asarray(image), np.asarray(mask) == 0
    assert res.images[0].size == (72, 66) and (res.width, res.height) == (72, 66)
    assert np.array_equal(out[keep], src[keep])
    raw = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=mask, steps=2, seed=1,
                      composite=False)
    assert raw.images[0].size == (72, 64)  # the generated picture as diffusers returns it
    assert not np.array_equal(np.asarray(raw.images[0])[:64][keep[:64]], src[:64][keep[:64]])


def test_bad_inputs_are_named(components):
    tr, vae, ours_tr, ours_vae = components
    emb, image = _embeds(17), _image(64, 64, 7)
    for strength in (0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="strength"):
            kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, strength=strength)
    steps_seen = []  # a small strength still runs one step (diffusers' rule: int() of what is skipped)
    kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, strength=0.1, steps=4, output="latent",
                callback=lambda s, n, x: steps_seen.append(n))
    assert steps_seen == [1]
    with pytest.raises(ValueError, match="mask is empty"):
        kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask=Image.new("L", (64, 64)))
    with pytest.raises(ValueError, match="needs? an image"):
        kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, mask=Image.new("L", (64, 64), 255))
    with pytest.raises(ValueError, match="output size comes from the init image"):
        kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, width=96, height=96)
    with pytest.raises(ValueError, match="crop_padding needs a mask"):
        kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, image=image, mask_crop_padding=8)
