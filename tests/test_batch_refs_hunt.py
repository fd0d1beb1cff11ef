"""Bug hunt: batches and multi-reference editing (engine, reference preparation, KV mode, the
Reference Stacker and the Klein Sampler's batch_size / references / size).

Tiny random components on the CPU in fp32 (the nodes: ComfyUI 0.3.75's modules, bf16 files)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image
from test_nodes import _as_loadimage, _encode, _load, _random_image, _sample, _stack, comfy  # noqa: F401
from test_pipeline_parity import LATENT_CH, _embeds, _image, _pipe, _run_reference, components  # noqa: F401

import klein_core as kc
import klein_core.pipeline.engine as engine_mod
from klein_core.pipeline.images import prepare_reference_image
from klein_core.pipeline.inputs import InitLatents
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.pipeline.sampling import make_noise, pack
from klein_core.testing import build_tiny_components

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXT = 96  # the tiny transformer's context width (3 x 32)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


def _img(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _emb(n: int, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, length, TEXT, generator=torch.Generator().manual_seed(seed))


def _lat(h: int, w: int, seed: int, b: int = 1) -> torch.Tensor:
    return torch.randn(b, 128, h, w, generator=torch.Generator().manual_seed(seed))


# ----- batches: image i of P prompts x batch_size = that prompt with that noise row, run alone -----


@pytest.mark.parametrize("mode", ["joint", "timestep_zero", "kv"])
def test_each_image_of_prompts_times_batch_equals_its_prompt_and_noise_row_alone(tiny, mode):
    """2 prompts x batch_size 2 with two references of other sizes and shapes: 4 images, in the
    order [p1, p1, p2, p2]; image i equals prompt i // 2 run alone from row i of the seed's noise
    (drawn together, as documented), in every reference mode. Measured: 7.2e-7 max abs."""
    tr, _, vae = tiny
    emb = _emb(2)
    refs = [_img(96, 64, 1), _img(64, 80, 2)]
    batch = kc.generate(tr, None, vae, prompt_embeds=emb, references=refs, steps=2, seed=3, batch_size=2,
                        output="latent", ref_mode=mode, kv_cache=None)
    assert batch.latents.shape == (4, 128, 4, 6) and (batch.width, batch.height) == (96, 64)
    noise = torch.randn((4, 128, 4, 6), generator=torch.Generator().manual_seed(3))  # ComfyUI's RandomNoise
    alone = [kc.generate(tr, None, vae, prompt_embeds=emb[i // 2:i // 2 + 1], references=refs, steps=2,
                         noise=noise[i:i + 1], output="latent", ref_mode=mode, kv_cache=None).latents[0]
             for i in range(4)]
    for i in range(4):
        assert (batch.latents[i] - alone[i]).abs().max() < 1e-5, i
    assert (alone[0] - alone[2]).abs().max() > 1e-2  # the prompts really differ


@pytest.mark.parametrize("mode", ["joint", "kv"])
@pytest.mark.parametrize("neg_shape", [(1, 20), (2, 16)], ids=["one-longer-negative", "one-per-prompt"])
def test_cfg_batch_pairs_each_image_with_its_prompts_negative(tiny, mode, neg_shape):
    """Base model, guidance 3, 2 prompts x batch_size 2 with references: one negative for all (of
    another length: a second forward) or one per prompt; image i equals its prompt and that prompt's
    negative run alone from the same noise row. Measured: 2.3e-6 max abs."""
    tr, _, vae = tiny
    engine = kc.Engine(tr, None, vae, kind="base", prompt_cache=None, kv_cache=None)
    emb, neg = _emb(2), _emb(neg_shape[0], neg_shape[1], seed=1)
    refs = [_lat(3, 3, 2), _lat(2, 5, 3)]
    settings = kc.Settings(width=64, height=80, steps=2, guidance=3.0, seed=3, batch_size=2)
    batch, run = engine.denoise(kc.Conditioning(emb, neg), refs, settings, ref_mode=mode)
    assert run.cfg and batch.shape == (4, 128, 5, 4)
    noise = make_noise(3, 4, 128, 5, 4)
    for i in range(4):
        p = i // 2
        n = neg if neg.shape[0] == 1 else neg[p:p + 1]
        one, _ = engine.denoise(kc.Conditioning(emb[p:p + 1], n), refs, kc.Settings(steps=2, guidance=3.0),
                                noise=noise[i:i + 1], ref_mode=mode)
        assert (one[0] - batch[i]).abs().max() < 1e-5, i
    plain, _ = engine.denoise(kc.Conditioning(emb), refs, kc.Settings(width=64, height=80, steps=2, guidance=1.0,
                                                                      seed=3, batch_size=2), ref_mode=mode)
    assert (plain - batch).abs().max() > 1e-2  # CFG really ran


@pytest.mark.parametrize("as_reference", [False, True])
@pytest.mark.parametrize("mode", ["joint", "kv"])
def test_one_init_image_seeds_every_image_of_a_batch(tiny, as_reference, mode):
    """Image-to-image with one init latent and batch_size 3 (the "batch size ignores the input image"
    complaint): every image starts from that image with its own noise row, equal to a single run
    from that row; with as_reference the image also joins every item's references."""
    tr, _, vae = tiny
    engine = kc.Engine(tr, None, vae, prompt_cache=None, kv_cache=None)
    init = InitLatents(_lat(4, 5, 1), 0.5, None, as_reference=as_reference)
    cond, refs = kc.Conditioning(_emb(1)), [_lat(3, 3, 2)]
    batch, _ = engine.denoise(cond, refs, kc.Settings(steps=4, seed=3, batch_size=3), init=init, ref_mode=mode)
    noise = make_noise(3, 3, 128, 4, 5)
    for i in range(3):
        one, _ = engine.denoise(cond, refs, kc.Settings(steps=4), init=init, noise=noise[i:i + 1], ref_mode=mode)
        assert (one[0] - batch[i]).abs().max() < 1e-5, i
    from_noise, _ = engine.denoise(cond, refs, kc.Settings(width=80, height=64, steps=4, seed=3, batch_size=3),
                                   ref_mode=mode)
    assert (from_noise - batch).abs().max() > 0.5  # the image was used


def test_prompts_times_batch_with_four_references_matches_diffusers(components, parity):  # noqa: F811
    """The diffusers report "seven prompts plus an image produced 28 images": 2 prompts x
    num_images_per_prompt 2 with four references of four shapes give 4 images in both pipelines, the
    size of reference 1, and the same latents (measured 4.1e-6 max abs, fp32)."""
    require("diffusers")
    tr, vae, ours_tr, ours_vae = components
    emb = torch.cat([_embeds(11), _embeds(12)])
    refs = [_image(96, 64, 1), _image(64, 112, 2), _image(72, 72, 3), _image(128, 64, 4)]
    noise = make_noise(5, 4, 4 * LATENT_CH, 64 // 4, 96 // 4)
    ref = _run_reference(_pipe(tr, vae, True), image=refs, prompt_embeds=emb, num_inference_steps=2,
                         guidance_scale=1.0, latents=noise, num_images_per_prompt=2)
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, references=refs, steps=2, seed=5, batch_size=2,
                      output="latent")
    assert ref.shape[0] == res.latents.shape[0] == 4
    assert (res.width, res.height) == (96, 64)
    assert res.reference_sizes == [(96, 64), (64, 112), (72, 72), (128, 64)]
    diff = parity("pipeline fp32, 4 references, 2 prompts x batch 2", (pack(res.latents) - ref).abs().max().item())
    assert diff <= 1e-4, diff


def test_reference_token_layout_with_an_init_image_and_three_references(tiny, monkeypatch):
    """The sequence a run builds: the init image first (t = 10), then references 1..3 (t = 20, 30, 40),
    each with its own row-major (h, w) grid from 0 and l = 0, and one copy of the reference tokens
    for the whole batch (shared, not repeated per image)."""
    tr, _, vae = tiny
    seen = []
    real = engine_mod.reference_tokens
    monkeypatch.setattr(engine_mod, "reference_tokens", lambda lats: seen.append(real(lats)) or seen[-1])
    refs = [_lat(2, 3, 1), _lat(4, 1, 2), _lat(1, 4, 3)]
    init = InitLatents(_lat(4, 4, 4), 0.5, None, as_reference=True)
    kc.Engine(tr, None, vae, prompt_cache=None).denoise(kc.Conditioning(_emb(2)), refs,
                                                        kc.Settings(steps=2, batch_size=3), init=init)
    (toks,) = seen
    assert toks.tokens.shape == (1, 16 + 6 + 4 + 4, 128)  # batch 1: shared by the 6 images
    assert toks.sizes == ((4, 4), (2, 3), (4, 1), (1, 4))
    ids = toks.ids.tolist()
    expected = []
    for t, (h, w) in zip((10, 20, 30, 40), toks.sizes):
        expected += [[t, y, x, 0] for y in range(h) for x in range(w)]
    assert ids == expected
    order = [init.latents, *refs]
    assert torch.equal(toks.tokens[0], torch.cat([lat.flatten(2)[0].T for lat in order]))


# ----- KV mode -------------------------------------------------------------------------------------


def test_kv_mode_without_references_is_the_joint_run(tiny):
    """A 9B-KV run with no references has nothing to store: it must be the plain distilled run,
    bit for bit (kind "kv" vs "distilled", same seed)."""
    tr, _, vae = tiny
    kw = {"prompt_embeds": _emb(2), "width": 64, "height": 80, "steps": 3, "seed": 4, "batch_size": 2, "output": "latent"}
    kv = kc.generate(tr, None, vae, kind="kv", **kw)
    joint = kc.generate(tr, None, vae, kind="distilled", **kw)
    assert (kv.steps, kv.guidance) == (3, 1.0)
    assert torch.equal(kv.latents, joint.latents)


def test_kv_cache_is_keyed_by_the_reference_content_and_order(tiny):
    """A different reference picture of the same shape, or the same two references swapped, must
    not be served the stored keys/values; the same references (another prompt, seed and batch size)
    are, with the latents a fresh reference pass gives."""
    tr, _, vae = tiny
    cache = ReferenceKVCache(max_entries=1)
    a, b = _img(64, 64, 1), _img(64, 64, 2)

    def run(refs, kv_cache, seed=1, batch=1, prompt_seed=0):
        return kc.generate(tr, None, vae, prompt_embeds=_emb(1, seed=prompt_seed), references=refs, steps=2,
                           seed=seed, batch_size=batch, kind="kv", kv_cache=kv_cache, output="latent").latents

    first = run([a, b], cache)
    assert (cache.hits, cache.misses) == (0, 1)
    other = run([a, a], cache)  # same shapes, other picture
    assert (cache.hits, cache.misses) == (0, 2)
    assert torch.equal(other, run([a, a], None))
    swapped = run([b, a], cache)
    assert (cache.hits, cache.misses) == (0, 3)
    assert torch.equal(swapped, run([b, a], None)) and not torch.equal(swapped, first)
    again = run([b, a], cache, seed=9, batch=3, prompt_seed=5)  # another edit of the same pictures
    assert (cache.hits, cache.misses) == (1, 3)
    assert torch.equal(again, run([b, a], None, seed=9, batch=3, prompt_seed=5))


# ----- reference preparation ---------------------------------------------------------------------


def _lanczos_then_rgb_expected(rgb: Image.Image) -> torch.Tensor:
    """What the docstring promises for a picture over 1 MP whose RGB pixels are ``rgb``: LANCZOS to
    at most 1 MP (sides int(side * sqrt(1 MP / area))), centre crop to multiples of 16, [-1, 1]."""
    w, h = rgb.size
    s = math.sqrt(1024 * 1024 / (w * h))
    w2, h2 = int(w * s), int(h * s)
    small = rgb.resize((w2, h2), Image.Resampling.LANCZOS)
    tw, th = w2 // 16 * 16, h2 // 16 * 16
    left, top = (w2 - tw) // 2, (h2 - th) // 2
    arr = np.asarray(small.crop((left, top, left + tw, top + th)), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1)[None] * 2 - 1


def _large_picture() -> Image.Image:
    """1100x1000 (over 1 MP): a smooth gradient with fine horizontal stripes, white on its left half."""
    x = np.linspace(0, 255, 1100)[None, :].repeat(1000, 0)
    y = np.linspace(0, 255, 1000)[:, None].repeat(1100, 1)
    rgb = np.stack([x, y, (x + y) / 2], -1)
    rgb[::2] = 255 - rgb[::2]
    rgb[:, :550] = 255
    return Image.fromarray(rgb.astype(np.uint8))


@pytest.mark.parametrize("mode", ["RGBA", "PA", "P"])
def test_a_large_reference_with_alpha_or_a_palette_is_scaled_as_its_rgb_pixels(mode):
    """Was a bug: ``prepare_reference_image`` resizes a picture over 1 MP *before* converting it to RGB
    (images.py: ``image.resize(..., LANCZOS)`` then ``_to_rgb_array``), so PIL's mode rules replace the
    documented "LANCZOS down-scaling ... RGBA (alpha dropped)": RGBA is resized premultiplied, so a
    transparent area comes out black (the same picture at 1000x1000, not resized, keeps its white);
    a palette (P) picture is resized with NEAREST (PIL forces it), aliasing fine detail; a PA picture
    loses its palette and comes out all black. The user sees a reference unlike the picture, only
    when it is over 1 MP. Expected: the picture's RGB pixels, LANCZOS-scaled (as BFL converts to RGB
    first). diffusers' Flux2KleinPipeline shares this order (resize, then convert)."""
    rgb = _large_picture()
    if mode == "RGBA":
        alpha = np.full((1000, 1100), 255, np.uint8)
        alpha[:, :550] = 0  # transparent left half; its stored colour is white
        picture = Image.fromarray(np.dstack([np.asarray(rgb), alpha]), "RGBA")
    elif mode == "P":
        picture = rgb.quantize(256)
        rgb = picture.convert("RGB")
    else:
        picture = rgb.quantize(256).convert("PA")
        rgb = picture.convert("RGB")
    got = prepare_reference_image(picture)
    want = _lanczos_then_rgb_expected(rgb)
    assert torch.equal(prepare_reference_image(rgb), want)  # the RGB picture itself: as documented
    assert got.shape == want.shape == (1, 3, 976, 1072)
    err = (got - want).abs()
    assert err.max().item() <= 2 / 255 + 1e-6, f"{mode}: max {err.max().item():.3f}, mean {err.mean().item():.3f}"


def test_reference_latent_too_small_error_gives_its_size_in_pixels(tiny):
    """Was a bug: a reference latent that is too small to set the output size is named with its latent
    grid as if it were pixels: a [1, 128, 3, 2] latent (32x48 px) is reported as "reference latent 1
    (2x3 px) ... (32x48)", contradicting itself. Cause: ``vae_io.size_source`` reads a tensor's last
    two dims as pixels, and engine.memory_request / Engine.check_inputs pass it latents. Expected: the
    pixel size (32x48 px)."""
    tr, _, vae = tiny
    lat = _lat(3, 2, 1)
    with pytest.raises(ValueError, match="too small") as gen:
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), reference_latents=[lat], steps=1, output="latent")
    with pytest.raises(ValueError, match="too small") as den:
        kc.Engine(tr, None, vae, prompt_cache=None).denoise(kc.Conditioning(_emb(1)), [lat], kc.Settings(steps=1))
    for exc in (gen.value, den.value):
        assert "(32x48 px)" in str(exc) and "(2x3 px)" not in str(exc), str(exc)


@pytest.mark.parametrize("bad,problem", [
    (torch.zeros(1, 3, 72, 64), "multiples of 16"),
    (torch.zeros(1, 4, 64, 64), "3"),
])
def test_a_bad_tensor_reference_is_refused_naming_which_reference(tiny, bad, problem):
    """Was a bug: a prepared-tensor reference that is not [1, 3, H, W] with H and W multiples of 16 is
    refused by the VAE ("VAE encode needs height and width that are multiples of 16, got 72x64" /
    "VAE encode expects pixels [B, 3, H, W], got [1, 4, 64, 64]") without saying which of the
    references it is: with several, the user cannot tell. PIL references get "reference N: ...";
    vae_io.encode_references passes tensors to the VAE unchecked. Expected: "reference 2" in the
    message."""
    tr, _, vae = tiny
    with pytest.raises(ValueError, match=problem) as err:
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), references=[_img(64, 64, 1), bad], steps=1,
                    output="latent")
    assert "reference 2" in str(err.value), str(err.value)


def test_a_tiny_pil_reference_is_refused_naming_it_and_the_limit(tiny):
    """A picture under 64 px a side among several references: refused before any compute, naming the
    reference's number, its size and the limit."""
    tr, _, vae = tiny
    with pytest.raises(ValueError, match=r"reference 3: reference image is 40x200; both sides must be at least 64"):
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), references=[_img(64, 64, 1), _img(80, 64, 2),
                                                                      _img(40, 200, 3)], steps=1, output="latent")


# ----- the nodes ----------------------------------------------------------------------------------


def _execute_sampler(comfy, model, cond, **kw):  # noqa: F811
    kw = {"width": 0, "height": 0, "steps": 2, "guidance": 0.0, "seed": 7, "batch_size": 1, **kw}
    with torch.inference_mode():
        return comfy.pack.KleinSampler.execute(model, cond, **kw)


def test_sampler_batch_size_with_one_latent_starts_every_image_from_it(comfy):  # noqa: F811
    """Klein Sampler, a latent of one image, batch_size 3, a stacked reference: 3 images of the
    latent's size; image 1 is the batch_size 1 image (noise drawn together from the seed), the
    others differ from it, and all start from the latent (a pure-noise batch is far away)."""
    model, vae = _load(comfy)
    refs, _ = _stack(comfy, _as_loadimage(_random_image(96, 64, seed=1)), vae)
    cond = _encode(comfy)
    latent = {"samples": _lat(5, 4, 2) * 0.5}
    kw = {"references": refs, "latent": latent, "denoise": 0.5, "steps": 4}
    three = _execute_sampler(comfy, model, cond, batch_size=3, **kw).args[0]["samples"]
    one = _execute_sampler(comfy, model, cond, batch_size=1, **kw).args[0]["samples"]
    assert three.shape == (3, 128, 5, 4)
    assert torch.equal(three[0], one[0])
    assert (three[1] - three[0]).abs().max() > 1e-2 and (three[2] - three[1]).abs().max() > 1e-2
    noise_only = _execute_sampler(comfy, model, cond, batch_size=3, references=refs, width=64, height=80,
                                  steps=4).args[0]["samples"]
    assert ((three - latent["samples"]).abs().mean() < (noise_only - latent["samples"]).abs().mean())


def test_sampler_latent_batch_as_reference_tells_the_user_it_only_seeds_the_noise(comfy):  # noqa: F811
    """A latent of 2 images with latent_as_reference on (the default) and batch_size 2: the images
    seed the noise but cannot join as references (one sequence of references serves the batch);
    the node says so in its warnings rather than dropping the option silently. A batch of 3 for
    batch_size 2 is refused naming latent, batch_size and the fix."""
    model, _ = _load(comfy)
    cond = _encode(comfy)
    out = _execute_sampler(comfy, model, cond, batch_size=2, latent={"samples": _lat(4, 4, 3, b=2)}, denoise=0.5)
    assert out.args[0]["samples"].shape == (2, 128, 4, 4)
    assert any("only seed the noise" in w for w in out.ui["warnings"]), out.ui
    with pytest.raises(ValueError, match=r"Klein Sampler: latent holds 3 images but batch_size is 2: set batch_size"):
        _execute_sampler(comfy, model, cond, batch_size=2, latent={"samples": _lat(4, 4, 3, b=3)})


def test_stacker_and_sampler_warn_past_four_references(comfy):  # noqa: F811
    """Five references: the Reference Stacker's sizes list all five in order and its warnings say
    Klein is published for 4; the sampler, with the latent joining as a further reference, warns too."""
    model, vae = _load(comfy)
    frames = torch.stack([_as_loadimage(_random_image(64, 64, seed=s))[0] for s in range(4)])
    refs, _ = _stack(comfy, frames, vae)
    with torch.inference_mode():
        out = comfy.pack.KleinReferenceStacker.execute(_as_loadimage(_random_image(80, 64, seed=9)), vae, refs)
    _, text = out.args
    assert text.splitlines() == [f"ref {i}: 64x64 (from 64x64)" for i in range(1, 5)] + ["ref 5: 80x64 (from 80x64)"]
    assert any("5 references" in w and "at most 4" in w for w in out.ui["warnings"]), out.ui
    sampled = _execute_sampler(comfy, model, _encode(comfy), references=refs, latent={"samples": _lat(4, 4, 1)},
                               denoise=0.5)
    assert any("5 references" in w for w in sampled.ui["warnings"]), sampled.ui


def test_an_inherited_size_over_4_megapixels_names_the_reference_it_came_from(tiny):
    """Was a bug: width/height unset, reference latent 1 of 3008x2000 px (a 6 MP picture encoded
    beforehand, e.g. through ComfyUI's VAE Encode + ReferenceLatent): refused as "Output size
    3008x2000 is 6.0 megapixels" although the user gave no output size; resolve_size's docstring
    says a side taken from an image that is refused names that image, but only sides that are too
    small do (_check_inherited); too large ones fall through to check_size's "Output size". Expected:
    the message names reference latent 1 and says to give width and height."""
    tr, _, vae = tiny
    big = torch.zeros(1, 128, 125, 188)
    with pytest.raises(ValueError, match="megapixels") as err:
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), reference_latents=[big], steps=1, output="latent")
    assert "reference latent 1" in str(err.value), str(err.value)
    # with the size given the same reference passes every check (the reference itself has no 4 MP
    # limit); checked without running: a step over its 23,500 tokens took 8 s on the CPU
    run = kc.Engine(tr, None, vae, prompt_cache=None).check_inputs(kc.Conditioning(_emb(1)), [big],
                                                                   kc.Settings(64, 64, 1))
    assert (run.width, run.height, run.steps) == (64, 64, 1)


def test_an_oversized_output_with_one_side_given_is_named_as_the_output_size(tiny):
    """Review of the fix above: with the width given and only the height taken from reference 1, an
    output over 4 MP is the width's doing; it is named "Output size", not the reference."""
    tr, _, vae = tiny
    with pytest.raises(ValueError) as err:
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), reference_latents=[_lat(64, 64, 1)], width=8192,
                    steps=1, output="latent")
    assert str(err.value).startswith("Output size 8192x1024") and "reference" not in str(err.value), str(err.value)


@pytest.mark.parametrize("grid", [(2, 2), (125, 188)], ids=["32x32px", "3008x2000px"])
def test_sampler_refusing_reference_1s_size_does_not_tell_to_set_width_height_to_0(comfy, grid):  # noqa: F811
    """Was a bug: Klein Sampler, width and height 0, the first reference (a ReferenceLatent on the
    conditioning) too small (32x32 px) or over 4 MP (3008x2000 px) to be the output size: the node
    appends "Set both to 0 to use the first reference's size" to every size refusal (sampler.py,
    ``except ValueError`` around ``resolve``), so the user, whose width and height are already 0 and
    whose reference 1 is the problem, is told to do what they did; for the large one the message
    does not even name reference 1 ("Output size 3008x2000 is 6.0 megapixels"). Expected: name
    reference 1 and say to set width and height (or use a smaller/larger reference)."""
    model, _ = _load(comfy)
    cond = _encode(comfy)
    native = [[cond.positive, {"reference_latents": [torch.zeros(1, 128, *grid)]}]]
    with pytest.raises(ValueError, match="Klein Sampler: width/height") as err:
        _sample(comfy, model, native, width=0, height=0, steps=1)
    message = str(err.value)
    assert "reference 1" in message, message
    assert "Set both to 0" not in message, message


def test_a_reference_path_over_pils_pixel_limit_is_refused_naming_the_reference(tiny, tmp_path, monkeypatch):
    """Was a bug: a reference given as a path to a picture over PIL's decompression-bomb limit (178.9 MP by
    default; simulated here by lowering ``Image.MAX_IMAGE_PIXELS`` to 1000 for a 100x100 file) escapes
    as PIL's own ``DecompressionBombError`` ("Image size (10000 pixels) exceeds limit ...") with no
    reference number: ``request.as_reference`` turns OSError / ValueError into "reference N: cannot
    open ..." but DecompressionBombError is neither (the CLI catches it, the Python API does not).
    Expected: a ValueError naming reference 2."""
    tr, _, vae = tiny
    path = tmp_path / "huge.png"
    _img(100, 100, 1).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError) as err:
        kc.generate(tr, None, vae, prompt_embeds=_emb(1), references=[_img(64, 64, 2), str(path)], steps=1,
                    output="latent")
    assert "reference 2" in str(err.value), str(err.value)
