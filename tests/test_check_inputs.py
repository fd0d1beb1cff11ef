"""Inputs are checked once, where a request enters the engine (inputs.check_denoise_inputs, through
Engine.check_inputs), before any compute; the sampler and the transformer trust what passed."""

from __future__ import annotations

import logging

import pytest
import torch

import klein_core as kc
import klein_core.pipeline.engine as engine_module
import klein_core.pipeline.inputs as inputs_module
from klein_core.models.variants import TextWidthMismatch
from klein_core.pipeline.inputs import InitLatents
from klein_core.testing import build_tiny_components

IGNORED = "negative prompt is not used"


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


@pytest.fixture
def counted(monkeypatch):
    """Counts Engine.check_inputs and text-width checks, and the sampler runs that started."""
    counts = {"check_inputs": 0, "text_width": 0, "sampled": 0}
    real_check, real_width, real_denoise = kc.Engine.check_inputs, inputs_module.check_text_width, engine_module.denoise

    def check_inputs(self, *args, **kw):
        counts["check_inputs"] += 1
        return real_check(self, *args, **kw)

    def check_text_width(*args, **kw):
        counts["text_width"] += 1
        return real_width(*args, **kw)

    def denoise(*args, **kw):
        counts["sampled"] += 1
        return real_denoise(*args, **kw)

    monkeypatch.setattr(kc.Engine, "check_inputs", check_inputs)
    monkeypatch.setattr(inputs_module, "check_text_width", check_text_width)
    monkeypatch.setattr(engine_module, "denoise", denoise)
    return counts


def _ignored(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if IGNORED in r.getMessage()]


@pytest.mark.parametrize("steps", [1, 3])
def test_one_check_per_run_however_many_steps(tiny, counted, steps):
    tr, te, _ = tiny
    embeds = kc.Engine(tr, te, prompt_cache=None).encode_prompts(["x"])
    counted["text_width"] = 0  # Engine(tr, te) checked the pair of models (check_compatible)
    res = kc.generate(tr, prompt_embeds=embeds.positive, width=64, height=64, steps=steps, output="latent")
    assert res.steps == steps
    assert counted == {"check_inputs": 1, "text_width": 1, "sampled": 1}


def test_the_transformer_does_not_recheck_the_text_width(tiny):
    """A direct call still gets a plain shape error for embeddings of the wrong width."""
    import klein_core.models.transformer as transformer_module

    assert not hasattr(transformer_module, "check_text_width")
    tr, _, _ = tiny
    ctx = tr.config.context_dim
    with pytest.raises(ValueError, match=rf"txt must be \[B, L, {ctx}\]"):
        tr(img=torch.zeros(1, 4, tr.config.in_channels), img_ids=torch.zeros(4, 4),
           txt=torch.zeros(1, 2, ctx + 1), txt_ids=torch.zeros(2, 4), timesteps=torch.ones(1))


@pytest.mark.parametrize("how", ["text", "embeds"])
def test_unused_negative_prompt_is_told_once_per_run(tiny, caplog, how):
    tr, te, _ = tiny
    kw = dict(prompt="x", width=64, height=64, steps=1, output="latent", negative_prompt="blurry")
    if how == "embeds":
        embeds = kc.Engine(tr, te, prompt_cache=None).encode_prompts(["x"], "blurry")
        kw.update(prompt_embeds=embeds.positive, negative_embeds=embeds.negative)
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, **kw)
    assert _ignored(caplog) == ["the negative prompt is not used: distilled Klein models run without CFG (for a "
                                "base model: model_kind base on the loader node, --base in the CLI, "
                                "kind='base' in Python)"]


def test_a_blank_negative_prompt_is_no_negative_prompt(tiny, caplog):
    """Whitespace only is nothing written (as the encoder node counts it): no notice."""
    tr, te, _ = tiny
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, prompt="x", negative_prompt=" \n\t", width=64, height=64, steps=1, output="latent")
    assert not _ignored(caplog)


def test_negative_prompt_unused_by_a_base_model_at_guidance_1(tiny, caplog):
    tr, te, _ = tiny
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, prompt="x", negative_prompt="blurry", kind="base", guidance=1.0, width=64,
                    height=64, steps=1, output="latent")
    assert _ignored(caplog) == ["the negative prompt is not used: guidance 1 is not above 1"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kc.generate(tr, te, prompt="x", negative_prompt="blurry", kind="base", guidance=2.0, width=64,
                    height=64, steps=1, output="latent")
    assert not _ignored(caplog)


def test_mismatched_embeddings_refused_once_before_compute(tiny, counted):
    tr, _, _ = tiny
    ctx = tr.config.context_dim
    with pytest.raises(TextWidthMismatch, match=rf"The prompt embedding \(text width {ctx + 3}\) does not fit"):
        kc.Engine(tr, prompt_cache=None).denoise(kc.Conditioning(torch.zeros(1, 5, ctx + 3)),
                                                 settings=kc.Settings(64, 64, 1))
    assert counted == {"check_inputs": 1, "text_width": 1, "sampled": 0}


def _inpaint_inputs(tr):
    ctx, ch = tr.config.context_dim, tr.config.in_channels
    return kc.Conditioning(torch.zeros(1, 5, ctx)), torch.zeros(1, ch, 4, 4)


@pytest.mark.parametrize(("mask", "message"), [
    (torch.ones(1, 1, 3, 4), r"the inpaint mask \[1, 1, 3, 4\] must be \[1 or 1, 1, h, w\] on the latent grid"),
    (torch.ones(1, 2, 4, 4), "the inpaint mask"),
    (torch.full((1, 1, 4, 4), float("nan")), "the inpaint mask"),
    (torch.ones(3, 1, 4, 4), r"the inpaint mask \[3, 1, 4, 4\] must be \[1 or 1, 1, h, w\]"),
])
def test_bad_mask_refused_before_compute(tiny, counted, mask, message):
    tr, _, _ = tiny
    cond, latents = _inpaint_inputs(tr)
    with pytest.raises(ValueError, match=message):
        kc.Engine(tr, prompt_cache=None).denoise(cond, settings=kc.Settings(steps=2), init=InitLatents(latents, 1.0,
                                                                                                        mask))
    assert counted["check_inputs"] == 1 and counted["sampled"] == 0


def test_good_mask_runs_with_one_check(tiny, counted):
    tr, _, _ = tiny
    cond, latents = _inpaint_inputs(tr)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, :] = 1
    out, _ = kc.Engine(tr, prompt_cache=None).denoise(cond, settings=kc.Settings(steps=2),
                                                      init=InitLatents(latents, 1.0, mask))
    assert counted == {"check_inputs": 1, "text_width": 1, "sampled": 1}
    assert torch.equal(out[..., 2:, :].float(), latents[..., 2:, :].to(out.dtype).float())
