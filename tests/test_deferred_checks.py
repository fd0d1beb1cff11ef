"""A run's finiteness checks wait on the device and are read once (klein_core.checks.Checks).

On CUDA, ``generate`` queues each check as a flag on the device and reads them all when the images
come to the host, so the host never waits between stages. Here the CPU stands in for the device
(``DEFERRED_DEVICES`` patched to include it): the same errors must come out, naming where the NaN
entered, the images must not change, the prompt cache must keep only what proved finite, and the
one read must come after the last decode. Stage methods called alone still check at once. That no
wait is left on a real GPU is checked in tests/gpu (``set_sync_debug_mode``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import klein_core as kc
from klein_core import checks as checks_module
from klein_core.checks import Checks
from klein_core.pipeline.engine import Engine, StageClock
from klein_core.pipeline.prompts import PromptCache
from klein_core.testing import build_tiny_components

NAN = float("nan")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_components(seed=0)


@pytest.fixture
def deferred(monkeypatch):
    """The CPU's checks are queued like a GPU's."""
    monkeypatch.setattr(checks_module, "DEFERRED_DEVICES", ("cuda", "cpu"))


def _run(tr, te, vae, **kw):
    args = {"prompt": "a fox on a hill", "width": 64, "height": 64, "steps": 2, "seed": 3, "cache": None}
    return kc.generate(tr, te, vae, **{**args, **kw})


def _poisoned(module: nn.Module, name: str) -> nn.Module:
    bad = copy.deepcopy(module)
    t = dict(bad.named_parameters())[name]
    with torch.no_grad():
        t.view(-1)[t.numel() // 2] = NAN
    bad.source = f"poisoned_{name}.safetensors"
    return bad


# -- Checks on its own ---------------------------------------------------------------------------

def test_checks_wait_until_resolved_and_name_the_first_failure(deferred):
    checks = Checks(defer=True)
    module = nn.Linear(2, 2)
    checks.require_finite(torch.ones(3), "the good input")
    checks.check_output(torch.tensor([1.0, NAN]), "The first stage", module, "a numeric cause")
    checks.require_finite(torch.tensor([NAN]), "the later input")  # carries the NaN on: not the cause
    assert checks.pending == 3  # nothing raised yet
    with pytest.raises(FloatingPointError, match="The first stage produced NaN/Inf .*a numeric cause"):
        checks.resolve()
    assert checks.pending == 0
    checks.resolve()  # empty: nothing left to raise


def test_a_deferred_output_check_names_the_corrupt_weight(deferred):
    module = _poisoned(nn.Linear(4, 4), "weight")
    checks = Checks(defer=True)
    checks.check_output(module(torch.ones(1, 4)), "The stage", module, "unused")
    with pytest.raises(kc.NonFiniteWeights, match=r"tensor 'weight' of poisoned_weight\.safetensors"):
        checks.resolve()


def test_resolve_reads_every_flag_in_one_copy(deferred, monkeypatch):
    copies = []
    real = checks_module.to_host
    monkeypatch.setattr(checks_module, "to_host", lambda *t: copies.append(len(t)) or real(*t))
    checks = Checks(defer=True)
    for i in range(5):
        checks.require_finite(torch.full((8,), float(i)), f"input {i}")
    checks.require_finite(torch.ones(2, dtype=torch.float8_e4m3fn), "a float8 tensor")
    checks.require_finite(torch.ones(2, dtype=torch.int64), "an integer tensor")  # always finite: not queued
    assert checks.pending == 6
    checks.resolve()
    assert copies == [1]  # one stacked tensor for the one device


def test_when_finite_acts_only_on_finite_tensors_and_in_order(deferred):
    done = []
    checks = Checks(defer=True)
    checks.when_finite(torch.ones(2), lambda: done.append("first"))
    checks.when_finite(torch.tensor([NAN]), lambda: done.append("never"))
    checks.require_finite(torch.tensor([float("inf")]), "the input")
    checks.when_finite(torch.ones(2), lambda: done.append("after the failure"))
    assert done == []
    with pytest.raises(ValueError, match="the input contains NaN or infinite values"):
        checks.resolve()
    assert done == ["first"]


def test_settle_keeps_what_proved_finite_and_only_logs_a_failed_check(deferred, caplog):
    done = []
    checks = Checks(defer=True)
    checks.when_finite(torch.ones(2), lambda: done.append("before"))
    checks.require_finite(torch.tensor([NAN]), "the first bad input")
    checks.require_finite(torch.tensor([NAN]), "the second bad input")
    checks.when_finite(torch.tensor([NAN]), lambda: done.append("never"))
    checks.when_finite(torch.ones(2), lambda: done.append("after"))
    with caplog.at_level("WARNING", logger="klein_core.checks"):
        checks.settle()  # raises nothing: another error is on its way
    assert done == ["before", "after"]  # each action on its own tensor's flag, past the failed check
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "the first bad input contains NaN" in warnings[0]
    assert checks.pending == 0


def test_settle_empties_the_queue_when_the_device_cannot_be_read(deferred, monkeypatch):
    def broken(*tensors):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(checks_module, "to_host", broken)
    done = []
    checks = Checks(defer=True)
    checks.when_finite(torch.ones(2), lambda: done.append(1))
    checks.settle()
    assert done == [] and checks.pending == 0


def test_checks_as_a_block_resolve_at_its_end_or_settle_on_an_error(deferred):
    done = []
    with pytest.raises(ValueError, match="the input contains NaN"):
        with Checks(defer=True) as checks:
            checks.require_finite(torch.tensor([NAN]), "the input")
    with pytest.raises(KeyError, match="unrelated"):  # the block's own error, not the check's
        with Checks(defer=True) as checks:
            checks.require_finite(torch.tensor([NAN]), "the input")
            checks.when_finite(torch.ones(1), lambda: done.append(1))
            raise KeyError("unrelated")
    assert done == [1] and checks.pending == 0


def test_checks_that_do_not_defer_raise_at_once(deferred):
    with pytest.raises(ValueError, match="the input contains NaN"):
        Checks().require_finite(torch.tensor([NAN]), "the input")
    done = []
    Checks().when_finite(torch.ones(1), lambda: done.append(1))
    assert done == [1]


def test_host_tensors_are_checked_at_once_by_default():
    """Without the patch the CPU is not deferred: a GPU run's host tensors (given noise) are refused
    before anything runs."""
    with pytest.raises(ValueError, match="the noise"):
        Checks(defer=True).require_finite(torch.tensor([NAN]), "the noise")


# -- generate --------------------------------------------------------------------------------------

def test_a_deferred_run_gives_the_same_images_and_reads_once_after_the_decode(tiny, deferred, monkeypatch):
    kw = {"references": [torch.zeros(1, 3, 64, 64)], "prompt": ["a fox", "a hare"]}
    with monkeypatch.context() as m:  # the reference: every check read at once
        m.setattr(checks_module, "DEFERRED_DEVICES", ("cuda",))
        reference = _run(*tiny, **kw)
    order = []
    real_resolve, real_decode = Checks.resolve, Engine._decode_one

    def resolve(self):
        if self.pending:
            order.append(("resolve", self.pending))
        return real_resolve(self)

    def decode_one(self, *a, **kw):
        order.append("decode")
        return real_decode(self, *a, **kw)

    def at_once(*_a, **_kw):
        raise AssertionError("a check was read at once inside generate")

    monkeypatch.setattr(Checks, "resolve", resolve)
    monkeypatch.setattr(Engine, "_decode_one", decode_one)
    monkeypatch.setattr(checks_module, "require_finite", at_once)
    monkeypatch.setattr(checks_module, "check_output", at_once)
    res = _run(*tiny, **kw)
    assert torch.equal(res.pixels, reference.pixels) and torch.equal(res.latents, reference.latents)
    assert order[:-1] == ["decode", "decode"] and order[-1][0] == "resolve"
    # per prompt group: the text output; the conditioning; the reference pixels (finite, and in
    # [-1, 1]), its latents and the reference latents again as an input; the sampler's output; the
    # latents to decode; two images
    assert order[-1][1] == 10
    assert list(res.timings) == ["text", "references", "denoise", "decode"]
    assert all(v >= 0 for v in res.timings.values())
    monkeypatch.undo()  # and the library is as usable as before
    again = _run(*tiny, **kw)
    assert torch.equal(again.pixels, reference.pixels)


@pytest.mark.parametrize("component,name", [
    ("text_encoder", "layers.0.self_attn.q_proj.weight"),
    ("transformer", "single_blocks.1.linear2.weight"),
    ("vae", "decoder.conv_in.weight"),
    ("vae", "encoder.conv_out.weight"),
])
def test_corrupt_weights_are_named_when_the_checks_wait(tiny, deferred, component, name):
    models = dict(zip(("transformer", "text_encoder", "vae"), tiny, strict=True))
    models[component] = _poisoned(models[component], name)
    with pytest.raises(kc.NonFiniteWeights) as err:
        _run(models["transformer"], models["text_encoder"], models["vae"], references=[torch.zeros(1, 3, 64, 64)])
    assert f"'{name}'" in str(err.value) and f"poisoned_{name}.safetensors" in str(err.value)


@pytest.mark.parametrize("kw,words", [
    ({"noise": torch.full((1, 128, 4, 4), NAN)}, "the given noise"),
    ({"prompt_embeds": torch.full((1, 512, 96), NAN)}, "the prompt embeddings"),
    ({"reference_latents": [torch.full((1, 128, 4, 4), NAN)]}, "reference latent 1"),
    ({"references": [torch.full((1, 3, 64, 64), NAN)]}, "reference 1"),
])
def test_bad_inputs_are_named_when_the_checks_wait(tiny, deferred, kw, words):
    with pytest.raises(ValueError, match=f"{words} contains NaN or infinite values"):
        _run(*tiny, **kw)


def test_an_overflow_is_named_when_the_checks_wait(tiny, deferred):
    tr = copy.deepcopy(tiny[0])
    with torch.no_grad():
        tr.final_layer.linear.weight.mul_(3e38)
    with pytest.raises(FloatingPointError, match="The sampler produced NaN/Inf"):
        _run(tr, tiny[1], tiny[2], output="latent")


def test_the_prompt_cache_keeps_only_what_proved_finite(tiny, deferred):
    tr, te, vae = tiny
    cache = PromptCache()
    bad_te = _poisoned(te, "layers.0.self_attn.q_proj.weight")
    with pytest.raises(kc.NonFiniteWeights):
        _run(tr, bad_te, vae, cache=cache)
    assert len(cache) == 0
    # a finite embedding is kept even when a later stage fails
    bad_vae = _poisoned(vae, "decoder.conv_in.weight")
    with pytest.raises(kc.NonFiniteWeights, match="decoder.conv_in.weight"):
        _run(tr, te, bad_vae, cache=cache)
    hits = cache.hits
    _run(tr, te, vae, cache=cache, output="latent")
    assert cache.hits == hits + 1


def test_a_cancelled_run_keeps_the_prompts_it_encoded(tiny, deferred):
    """A cancel (or an out-of-memory error) after the text stage: the next run with the same prompt
    finds its embeddings cached (with an offloaded text encoder, encoding again costs a reload)."""
    tr, te, vae = tiny
    cache = PromptCache()

    def cancel(step, total, latents):
        return False

    with pytest.raises(kc.GenerationCancelled):
        _run(tr, te, vae, cache=cache, callback=cancel)
    assert len(cache) == 1
    misses = cache.misses
    _run(tr, te, vae, cache=cache, output="latent")
    assert cache.misses == misses
    # and a prompt whose embedding is not finite is still never kept
    bad_te = _poisoned(te, "layers.0.self_attn.q_proj.weight")
    with pytest.raises(kc.GenerationCancelled):
        _run(tr, bad_te, vae, cache=cache, callback=cancel, prompt="another prompt")
    assert len(cache) == 1


def test_a_stage_method_alone_checks_before_it_computes(tiny, deferred, monkeypatch):
    tr, te, vae = tiny
    engine = Engine(tr, te, vae)
    decoded = []
    monkeypatch.setattr(Engine, "_decode_one", lambda *a, **kw: decoded.append(1))
    with pytest.raises(ValueError, match="the latents to decode contains NaN"):
        engine.decode(torch.full((1, 128, 4, 4), NAN))
    assert decoded == []


def test_the_stage_clock_on_the_host_keeps_the_order():
    clock = StageClock(torch.device("cpu"))
    for name in ("b", "a", "c"):
        with clock.stage(name):
            torch.ones(4).sum()
    out = clock.read()
    assert list(out) == ["b", "a", "c"] and all(v >= 0 for v in out.values())
