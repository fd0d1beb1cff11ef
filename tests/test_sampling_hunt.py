"""Regressions found by a hunt through the sampling settings: the step cache's stored tensors after
a run, the negative prompt embeddings' count, and the size rules for given noise.

Each check is on what the code holds or refuses, not on numbers: the schedule, CFG, seeds and the
image-to-image cut were compared with diffusers and matched (see the parity tests)."""

from __future__ import annotations

import pytest
import torch

import klein_core as kc
import klein_core.pipeline.engine as engine_module
from klein_core.accel import enable_step_cache
from klein_core.errors import GenerationCancelled
from klein_core.pipeline.sampling import denoise, get_schedule
from klein_core.testing import build_tiny_components, tiny_transformer


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


class _Sampled(Exception):
    """Raised instead of sampling: the request got past every check."""


@pytest.fixture
def no_sampling(monkeypatch):
    def refuse(*args, **kw):
        raise _Sampled

    monkeypatch.setattr(engine_module, "denoise", refuse)


def _held(cache) -> list[str]:
    """The tensors the step cache still holds, by pass field name."""
    return [name for state in cache._passes.values() for name, v in vars(state).items()
            if isinstance(v, torch.Tensor)]


# --- the step cache keeps no device tensors once a run is over -------------------------------------

def test_step_cache_releases_its_residuals_when_a_run_ends():
    model = tiny_transformer()
    cache = enable_step_cache(model, threshold=0.0)
    g = torch.Generator().manual_seed(0)
    d = model.config.context_dim
    noise, txt, neg = torch.randn(2, 128, 4, 4, generator=g), torch.randn(2, 6, d, generator=g), torch.randn(2, 6, d)
    with torch.no_grad():
        denoise(model, noise, txt, get_schedule(3, 16), neg_txt=neg, guidance=4.0)
    assert _held(cache) == []
    assert cache.last_run.patterns == ("CCC",)  # the counters stay

    with torch.no_grad(), pytest.raises(GenerationCancelled):
        denoise(model, noise, txt, get_schedule(3, 16), callback=lambda step, total, x: False)
    assert _held(cache) == []
    assert cache.last_run.patterns == ("C",)


def test_step_cache_released_after_a_failing_callback():
    model = tiny_transformer()
    cache = enable_step_cache(model, threshold=0.0)
    noise, txt = torch.randn(1, 128, 4, 4), torch.randn(1, 6, model.config.context_dim)

    def boom(step, total, x):
        raise KeyError("host failed")

    with torch.no_grad(), pytest.raises(KeyError):
        denoise(model, noise, txt, get_schedule(4, 16), callback=boom)
    assert _held(cache) == []


# --- negative prompt embeddings: one, or one per prompt, checked before sampling --------------------

def test_negative_embedding_count_refused_before_sampling(tiny, no_sampling):
    tr, _, _ = tiny
    d = tr.config.context_dim
    engine = kc.Engine(tr, kind="base", prompt_cache=None)
    bad = kc.Conditioning(torch.zeros(2, 5, d), torch.zeros(3, 5, d))
    with pytest.raises(ValueError, match=r"3 negative prompt embeddings for 2 prompt\(s\)"):
        engine.denoise(bad, settings=kc.Settings(64, 64, 1, 4.0, batch_size=2))
    bad = kc.Conditioning(torch.zeros(1, 5, d), torch.zeros(2, 5, d))
    with pytest.raises(ValueError, match=r"2 negative prompt embeddings for 1 prompt\(s\)"):
        engine.denoise(bad, settings=kc.Settings(64, 64, 1, 4.0, batch_size=2))
    for n_neg in (1, 2):  # the two pairings that are meant: these reach the sampler
        with pytest.raises(_Sampled):
            engine.denoise(kc.Conditioning(torch.zeros(2, 5, d), torch.zeros(n_neg, 5, d)),
                           settings=kc.Settings(64, 64, 1, 4.0, batch_size=2))


# --- given noise sets the size, so the size rules apply to it ---------------------------------------

@pytest.mark.parametrize(("grid", "message"), [
    ((1, 1), r"the given noise \(16x16 px\) is too small"),
    ((2, 300), r"the given noise \(4800x32 px\) is too small"),
    ((129, 128), "2048x2064 is 4.2 megapixels"),
])
def test_given_noise_follows_the_size_rules(tiny, no_sampling, grid, message):
    tr, _, _ = tiny
    engine = kc.Engine(tr, prompt_cache=None)
    cond = kc.Conditioning(torch.zeros(1, 5, tr.config.context_dim))
    noise = torch.zeros(1, tr.config.in_channels, *grid)
    with pytest.raises(ValueError, match=message):
        engine.denoise(cond, settings=kc.Settings(steps=1), noise=noise)


def test_given_noise_within_the_rules_still_runs(tiny, no_sampling):
    tr, _, _ = tiny
    engine = kc.Engine(tr, prompt_cache=None)
    cond = kc.Conditioning(torch.zeros(1, 5, tr.config.context_dim))
    for grid in ((4, 4), (128, 128), (4, 256)):  # 64x64, 2048x2048 (4 MP exactly), 4096x64
        with pytest.raises(_Sampled):
            engine.denoise(cond, settings=kc.Settings(steps=1), noise=torch.zeros(1, tr.config.in_channels, *grid))


def test_given_noise_sets_the_size_and_a_conflicting_one_is_refused():
    """Settings(512, 512) with noise on a 4x4 grid made a 64x64 image while the run (and the memory
    plan) said 512x512; the noise's grid is the size, as an init image's is, and a different
    width/height is refused."""
    import klein_core as kc
    from klein_core.testing.tiny import build_tiny_components

    tr, te, vae = build_tiny_components()
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    cond = engine.encode_prompts(["x"])
    noise = torch.zeros(1, 128, 4, 6)
    with pytest.raises(ValueError, match=r"comes from the given noise \(96x64\); got width/height 512x512"):
        engine.check_inputs(cond, (), kc.Settings(512, 512), noise=noise)
    assert (engine.check_inputs(cond, (), kc.Settings(), noise=noise).width,
            engine.check_inputs(cond, (), kc.Settings(), noise=noise).height) == (96, 64)
    request = kc.GenerationRequest("x", noise=noise)
    assert (engine.memory_request(request).width, engine.memory_request(request).height) == (96, 64)


def test_a_strength_that_skips_no_step_is_said(tiny, caplog):
    """Was silent: diffusers' rule skips ``int(steps x (1 - strength))`` steps, so at 4 steps any
    strength above 0.75 skips none and sampling starts from pure noise, as at 1. With the image not
    joining as a reference it is then not used at all: a warning naming 0.75; as a reference (the
    default, and diffusers' default 0.8) a note in the log; 0.75 skips one step and says nothing."""
    from PIL import Image
    tr, te, vae = tiny
    picture = Image.new("RGB", (64, 64), (200, 40, 40))

    def said(strength: float, as_reference: bool) -> list[tuple[int, str]]:
        caplog.clear()
        with caplog.at_level("INFO", logger="klein_core.pipeline.engine"):
            kc.generate(tr, te, vae, prompt="x", image=picture, strength=strength, steps=4, seed=1,
                        image_as_reference=as_reference)
        return [(r.levelno, r.getMessage()) for r in caplog.records if "skips no step" in r.getMessage()]

    [(level, text)] = said(0.8, False)
    assert level == 30 and "Use 0.75 or less" in text and "the image is not used" in text, text
    [(level, text)] = said(0.8, True)
    assert level == 20 and "joins as a reference only" in text, text
    assert said(0.75, False) == [] and said(1.0, False) == []


def test_at_one_step_the_advice_is_more_steps(tiny, caplog):
    """At 1 step every strength below 1 skips no step; the advice is more steps, not "Use 0 or less"."""
    from PIL import Image
    tr, te, vae = tiny
    with caplog.at_level("INFO", logger="klein_core.pipeline.engine"):
        kc.generate(tr, te, vae, prompt="x", image=Image.new("RGB", (64, 64), (9, 90, 200)), strength=0.5, steps=1,
                    seed=1, image_as_reference=False)
    [text] = [r.getMessage() for r in caplog.records if "skips no step" in r.getMessage()]
    assert "Use more steps to start from the image" in text and "Use 0" not in text, text
