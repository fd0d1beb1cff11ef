"""Pipeline behaviour: references, ids, seeds, cancel, prompt cache, size rules."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

import klein_core as kc
from klein_core.pipeline.images import prepare_reference_image, reference_size
from klein_core.pipeline.prompts import encode_prompts
from klein_core.pipeline.request import resolve_size
from klein_core.pipeline.sampling import make_noise, pack, reference_tokens
from klein_core.testing import build_tiny_components


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


def _img(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


# --- reference preprocessing -------------------------------------------------------------------

@pytest.mark.parametrize(
    "size,expected",
    [
        ((1024, 1024), (1024, 1024)),  # exactly 1 MP: untouched
        ((1000, 700), (992, 688)),  # below 1 MP: crop only
        ((2048, 1536), (1168, 880)),  # 3 MP -> scale sqrt(1/3): int(1182.4)=1182, int(886.8)=886 -> /16
        ((4000, 500), (2896, 352)),  # 8:1, scaled to 1 MP first
        ((64, 64), (64, 64)),
        ((100, 77), (96, 64)),
    ],
)
def test_reference_sizes(size, expected):
    assert reference_size(*size) == expected
    t = prepare_reference_image(_img(*size))
    assert t.shape == (1, 3, expected[1], expected[0])
    assert t.dtype == torch.float32 and -1.0 <= t.min().item() and t.max().item() <= 1.0


def test_reference_is_centre_crop_of_lanczos_resize():
    img = _img(1500, 900, seed=3)
    t = prepare_reference_image(img)
    w, h = int(1500 * (1048576 / 1350000) ** 0.5), int(900 * (1048576 / 1350000) ** 0.5)
    ref = img.resize((w, h), Image.Resampling.LANCZOS)
    tw, th = w // 16 * 16, h // 16 * 16
    left, top = (w - tw) // 2, (h - th) // 2
    ref = np.asarray(ref.crop((left, top, left + tw, top + th)), dtype=np.float32) / 255 * 2 - 1
    assert np.array_equal(t[0].permute(1, 2, 0).numpy(), ref)


@pytest.mark.parametrize("mode", ["L", "RGBA", "I;16"])
def test_reference_modes_become_rgb(mode):
    t = prepare_reference_image(_img(80, 64, mode))
    assert t.shape == (1, 3, 64, 80)
    if mode == "L":
        assert torch.equal(t[0, 0], t[0, 1]) and torch.equal(t[0, 1], t[0, 2])
    if mode == "I;16":  # 16-bit is rescaled, not clipped to white
        assert t.max().item() > 0.9 and t.min().item() < -0.9 and t.std().item() > 0.3


@pytest.mark.parametrize("kind", ["RGB 1 MP", "RGB over 1 MP", "RGB cropped", "every level", "L", "RGBA", "P",
                                  "I;16", "F"])
def test_reference_pixels_from_levels_are_the_float_preprocessings_bits(kind):
    """reference_pixels (the encoder's: on a GPU, 8-bit levels copied there and mapped to floats by a
    table; run here on the CPU through _pixels_from_levels) gives prepare_reference_image's values bit
    for bit and its strides (the VAE's convolutions see the same layout); high-bit pictures take the
    float path itself. tests/gpu checks the same on CUDA."""
    from klein_core.pipeline.images import _fitted_reference, _pixels_from_levels, reference_pixels

    img = {"RGB 1 MP": lambda: _img(1024, 1024, seed=1), "RGB over 1 MP": lambda: _img(1500, 900, seed=3),
           "RGB cropped": lambda: _img(100, 77, seed=4), "L": lambda: _img(80, 64, "L"),
           "every level": lambda: Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3) * 7),
           "RGBA": lambda: _img(96, 64, "RGBA", seed=5), "P": lambda: _img(64, 80, seed=6).convert("P"),
           "I;16": lambda: _img(80, 64, "I;16"),
           "F": lambda: Image.fromarray(np.random.default_rng(7).random((64, 96), dtype=np.float32), "F")}[kind]()
    want = prepare_reference_image(img)
    fitted, peak = _fitted_reference(img, 16)
    got = reference_pixels(img, 16, "cpu") if peak is not None else _pixels_from_levels(fitted, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)
    if kind in ("RGB 1 MP", "every level"):  # and what numpy makes of the 8 bits, float32 throughout
        assert np.array_equal(got[0].permute(1, 2, 0).numpy(), np.asarray(img, dtype=np.float32) / 255 * 2 - 1)
    if kind == "every level":
        assert got.unique().numel() == 256
    assert torch.equal(reference_pixels(img), want)  # the CPU when no device is given


def test_reference_rejects_bad_images():
    with pytest.raises(ValueError, match="at least 64"):
        prepare_reference_image(_img(63, 200))
    with pytest.raises(ValueError, match="aspect ratio"):
        prepare_reference_image(_img(900, 100))
    with pytest.raises(TypeError, match="PIL"):
        prepare_reference_image(torch.zeros(3, 64, 64))


def test_reference_tokens_ids_and_order():
    lat = [torch.randn(1, 128, 2, 3), torch.randn(1, 128, 4, 1)]
    refs = reference_tokens(lat)
    assert refs.tokens.shape == (1, 10, 128) and refs.ids.shape == (10, 4)
    assert refs.ids[:6, 0].tolist() == [10] * 6 and refs.ids[6:, 0].tolist() == [20] * 4
    assert refs.ids[6:, 1].tolist() == [0, 1, 2, 3] and refs.ids[:, 3].abs().sum() == 0
    assert torch.equal(refs.tokens[0, :6], pack(lat[0])[0])


# --- seeds and noise ---------------------------------------------------------------------------

def test_noise_matches_comfyui_random_noise():
    # ComfyUI RandomNoise: torch.randn(shape, generator=torch.manual_seed(seed), device="cpu")
    g = torch.Generator().manual_seed(1234)
    assert torch.equal(make_noise(1234, 2, 128, 4, 6), torch.randn((2, 128, 4, 6), generator=g))
    assert make_noise(2**64 - 1, 1, 4, 2, 2).shape == (1, 4, 2, 2)  # ComfyUI's largest seed
    with pytest.raises(ValueError, match="2\\^64"):
        make_noise(2**64, 1, 4, 2, 2)
    with pytest.raises(ValueError):
        make_noise(-1, 1, 4, 2, 2)


def test_seed_reproducible_across_runs_and_batches(tiny):
    tr, te, vae = tiny
    kw = dict(prompt="a fox", width=64, height=80, steps=2, output="latent")
    a = kc.generate(tr, te, vae, seed=5, **kw).latents
    b = kc.generate(tr, te, vae, seed=5, **kw).latents
    c = kc.generate(tr, te, vae, seed=6, **kw).latents
    batch = kc.generate(tr, te, vae, seed=5, batch_size=3, **kw).latents
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert torch.allclose(batch[0], a[0], atol=1e-5)  # item 0 of a batch = the single image
    assert not torch.allclose(batch[1], batch[2])  # batch items differ


def test_multiple_prompts_times_batch(tiny):
    tr, te, vae = tiny
    res = kc.generate(tr, te, vae, prompt=["a", "b"], batch_size=2, width=64, height=64, steps=1, output="latent")
    assert res.latents.shape == (4, 128, 4, 4)


# --- cancel, callback, cache -------------------------------------------------------------------

def test_callback_each_step_and_cancel(tiny):
    tr, te, vae = tiny
    seen = []
    kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=3, output="latent",
                callback=lambda s, n, lat: seen.append((s, n, tuple(lat.shape))))
    assert seen == [(1, 3, (1, 128, 4, 4)), (2, 3, (1, 128, 4, 4)), (3, 3, (1, 128, 4, 4))]
    with pytest.raises(kc.GenerationCancelled, match="after step 2 of 4"):
        kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=4, callback=lambda s, n, lat: s < 2)
    # the models are untouched: a normal run afterwards equals a fresh one
    a = kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=2, seed=1, output="latent").latents
    b = kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=2, seed=1, output="latent").latents
    assert torch.equal(a, b)


def test_callback_exception_propagates(tiny):
    tr, te, vae = tiny

    class Interrupted(Exception):
        pass

    def cb(s, n, lat):
        raise Interrupted

    with pytest.raises(Interrupted):
        kc.generate(tr, te, vae, prompt="x", width=64, height=64, steps=2, callback=cb)


def test_prompt_cache_hit_skips_encoder(tiny, monkeypatch):
    tr, te, vae = tiny
    cache = kc.PromptCache(max_entries=2)
    calls = []
    real = type(te).encode

    def counting(self, ids, mask):
        calls.append(ids.shape[0])
        return real(self, ids, mask)

    monkeypatch.setattr(type(te), "encode", counting)
    kw = dict(width=64, height=64, steps=1, output="latent", cache=cache)
    a = kc.generate(tr, te, vae, prompt="same prompt", seed=1, **kw)
    b = kc.generate(tr, te, vae, prompt="same prompt", seed=2, **kw)  # new seed: no re-encode
    assert calls == [1] and cache.hits == 1 and cache.misses == 1
    kc.generate(tr, te, vae, prompt=["same prompt", "other"], **kw)  # only the new one is encoded
    assert calls == [1, 1]
    kc.generate(tr, te, vae, prompt="third", **kw)  # bounded: oldest entry evicted
    assert len(cache) == 2
    assert not torch.equal(a.latents, b.latents)
    # a different encoder object never gets another encoder's embeddings
    other = build_tiny_components(seed=1)[1]
    e1 = cache.encode(te, ["third"])
    e2 = cache.encode(other, ["third"])
    assert not torch.allclose(e1, e2)


def test_cached_embeddings_equal_fresh(tiny):
    _, te, _ = tiny
    cache = kc.PromptCache()
    fresh = encode_prompts(te, ["héllo wörld", "猫"], cache=None)
    cache.encode(te, ["猫"])
    assert torch.equal(cache.encode(te, ["héllo wörld", "猫"]), fresh)


# --- sizes, defaults, guidance -----------------------------------------------------------------

def test_size_rules(caplog):
    assert resolve_size(None, None, None) == (1024, 1024)
    assert resolve_size(None, None, (768, 512)) == (768, 512)
    assert resolve_size(800, None, (768, 512)) == (800, 512)
    with caplog.at_level(logging.WARNING):
        assert resolve_size(1000, 1001, None) == (992, 992)
    assert "not a multiple of 16" in caplog.text
    with pytest.raises(ValueError, match="too small"):
        resolve_size(48, 512, None)
    with pytest.raises(ValueError, match="4 megapixels"):
        resolve_size(2048, 2064, None)
    assert resolve_size(2048, 2048, None) == (2048, 2048)
    with pytest.raises(TypeError):
        resolve_size(512.0, 512, None)


def test_output_size_follows_first_reference(tiny):
    tr, te, vae = tiny
    res = kc.generate(tr, te, vae, prompt="edit", references=[_img(96, 64), _img(64, 128)], steps=1)
    assert (res.width, res.height) == (96, 64) and res.images[0].size == (96, 64)
    assert res.reference_sizes == [(96, 64), (64, 128)]


def test_defaults_and_bad_arguments(tiny, caplog):
    tr, te, vae = tiny
    kw = dict(prompt="x", width=64, height=64, output="latent")
    assert kc.generate(tr, te, vae, **kw).steps == 4
    base = kc.generate(tr, te, vae, kind="base", steps=1, **kw)
    assert base.guidance == 4.0
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, vae, guidance=3.0, negative_prompt="bad", steps=1, **kw)
    assert "guidance 3.00 is ignored" in caplog.text and "negative prompt is not used" in caplog.text
    for bad in (dict(steps=0), dict(steps=2.5), dict(guidance=float("nan")), dict(guidance=-1.0),
                dict(batch_size=0)):
        with pytest.raises(ValueError):
            kc.generate(tr, te, vae, **kw, **bad)


def test_many_references_warn(tiny, caplog):
    tr, te, vae = tiny
    lat = [torch.zeros(1, 128, 4, 4)] * 5
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, vae, prompt="x", reference_latents=lat, steps=1, output="latent")
    assert "5 references" in caplog.text


def test_mismatched_encoder_refused_before_compute(tiny):
    from klein_core.testing import TINY_9B, tiny_text_encoder

    tr, _, vae = tiny
    with pytest.raises(ValueError, match="does not fit"):
        kc.generate(tr, tiny_text_encoder(TINY_9B), vae, prompt="x")


def test_to_pil_rounds_like_numpy_half_to_even():
    """Images are 8-bit roundings of the [0, 1] pixels, written here as numpy's formula (float32
    product, round half to even), including values exactly halfway between two levels."""
    import numpy as np

    from klein_core.pipeline.images import to_pil

    g = torch.Generator().manual_seed(0)
    px = torch.rand(2, 3, 17, 23, generator=g)
    halves = (torch.arange(0, 255, dtype=torch.float32) + 0.5) / 255  # k + 0.5 levels, in float32
    px[0, 0, 0, : halves.numel() // 16] = halves[: halves.numel() // 16]
    px[1, 2, :, 0] = torch.tensor([0.0, 1.0, 0.5, 1 / 255, 254.5 / 255] + [0.25] * 12)
    expected = (px.permute(0, 2, 3, 1).numpy() * np.float32(255)).round().astype(np.uint8)
    images = to_pil(px)
    assert [im.size for im in images] == [(23, 17)] * 2 and images[0].mode == "RGB"
    for im, ref in zip(images, expected):
        assert np.array_equal(np.asarray(im), ref)
    assert to_pil(px[:1].to(torch.bfloat16))[0].size == (23, 17)  # any float dtype
