"""klein_core.accel.step_cache: the opt-in first-block step cache, on the CPU with tiny random models.

The cache is approximate, so every test that lets it skip compares against the exact run and
asserts both that it skipped and how far the latents moved (relative L2, recorded in the parity
table). The figures measured when these bounds were set are in comments next to each bound.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

import klein_core as kc
from klein_core.accel import (
    StepCacheSettings,
    disable_step_cache,
    enable_fast_paths,
    enable_step_cache,
    relative_l2,
)
from klein_core.accel import step_cache as sc
from klein_core.memory.placement import BlockOffloader
from klein_core.pipeline.sampling import (
    denoise,
    get_schedule,
    position_ids,
    reference_tokens,
    text_position_ids,
)
from klein_core.testing import tiny_text_encoder, tiny_transformer, tiny_vae

STEPS = 30
GUIDANCE = 4.0


def _smooth_in_time(model: kc.Flux2Transformer) -> kc.Flux2Transformer:
    """Zero the time embedder's inputs from the sinusoid channels faster than 1/100 rad per unit of
    ``t * 1000``.

    Between two steps of a 30-step schedule the fastest of those channels turn by tens of radians;
    a random time embedder passes them on, so the modulation jumps at every step: block 0's
    residual then changes by about 100% per step (measured 0.67-1.66 on the stock tiny model) and
    no sane threshold skips anything. Trained models respond smoothly to the timestep; with these
    channels off the tiny model's per-step change starts near 2% and grows to about 40% at the end
    of the schedule, like the curves published for first-block caches on FLUX.1.
    """
    half = model.time_in.in_layer.weight.shape[1] // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
    fast = torch.cat([freqs > 0.01, freqs > 0.01])
    with torch.no_grad():
        model.time_in.in_layer.weight[:, fast] = 0
    return model


@pytest.fixture
def model() -> kc.Flux2Transformer:
    return _smooth_in_time(tiny_transformer())


def _inputs(model: kc.Flux2Transformer, seed: int = 1, length: int = 12, neg_length: int = 12,
            grid: tuple[int, int] = (8, 8)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = model.config.context_dim
    return dict(noise=torch.randn(1, 128, *grid, generator=g), txt=torch.randn(1, length, d, generator=g),
                neg_txt=torch.randn(1, neg_length, d, generator=g))


@pytest.fixture(scope="module")
def exact() -> torch.Tensor:
    """The uncached run of the default inputs (every test's ``model`` has the same weights)."""
    model = _smooth_in_time(tiny_transformer())
    return _run(model, _inputs(model))


def _run(model, inputs: dict[str, torch.Tensor], steps: int = STEPS, **kw) -> torch.Tensor:
    sigmas = get_schedule(steps, inputs["noise"].shape[-1] * inputs["noise"].shape[-2])
    with torch.no_grad():
        return denoise(model, inputs["noise"], inputs["txt"], sigmas, neg_txt=inputs["neg_txt"],
                       guidance=GUIDANCE, **kw)


# --- exactness when it cannot skip -----------------------------------------------------------------

def test_threshold_zero_is_bit_identical_to_the_plain_run(model, exact):
    inputs = _inputs(model)
    cache = enable_step_cache(model, threshold=0.0)
    assert model.step_cache is cache
    out = _run(model, inputs)
    assert torch.equal(out, exact)
    st = cache.last_run
    assert (st.steps, st.computed, st.skipped, st.patterns) == (STEPS, STEPS, 0, ("C" * STEPS,))


def test_forward_is_unchanged_with_the_cache_off(model):
    # The block loop moved into BlockStack.run: the plain forward must still be the same computation.
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    kw = dict(img=torch.randn(2, ids.shape[0], 128, generator=g), img_ids=ids,
              txt=torch.randn(2, 5, model.config.context_dim, generator=g), txt_ids=text_position_ids(5),
              timesteps=torch.tensor([0.7, 0.4]))
    with torch.no_grad():
        x = model.img_in(kw["img"])
        c = model.txt_in(kw["txt"])
        vec = model._time_vector(kw["timesteps"], 2, x.device)
        cos, sin = model.rope(kw["txt_ids"], ids)
        mod_img, mod_txt = model.double_stream_modulation_img(vec), model.double_stream_modulation_txt(vec)
        x, c = model.double_blocks[0](x, c, cos, sin, mod_img, mod_txt)
        h = torch.cat([c, x], dim=1)
        for block in model.single_blocks:
            h = block(h, cos, sin, model.single_stream_modulation(vec))
        by_hand = model.final_layer(h[:, c.shape[1]:], vec)
        assert torch.equal(model(**kw), by_hand)
        enable_step_cache(model, threshold=0.0)
        assert torch.equal(model(**kw), by_hand)


# --- approximation: skips, and the error they cost ------------------------------------------------

# (threshold, at least this many of the 30 forwards skipped, relative-L2 bound). Measured on this
# fixture: 0.05 -> 5 skipped, rel L2 4.7e-6; 0.1 -> 9, 1.5e-5; 0.3 -> 20, 1.19e-4. Error bounds
# ~2.5x the measured figures; the skip counts leave room for a decision flipped by rounding.
ACCURACY = [(0.05, 3, 1.2e-5), (0.1, 7, 4e-5), (0.3, 16, 3e-4)]


def test_positive_thresholds_skip_and_stay_close(model, exact, parity):
    inputs = _inputs(model)
    skipped = []
    for threshold, min_skipped, bound in ACCURACY:
        cache = enable_step_cache(model, threshold=threshold)
        out = _run(model, inputs)
        st = cache.last_run
        name = f"step cache t2i CFG {STEPS} steps, threshold {threshold}: rel L2 ({st.skipped} skipped)"
        err = parity(name, relative_l2(out, exact))
        assert st.passes == 1  # batched CFG [pos; neg]: one decision for both halves
        assert st.skipped >= min_skipped and st.computed + st.skipped == STEPS
        pattern = st.patterns[0]
        assert pattern.startswith("CC") and pattern.endswith("C")  # warmup 2 and the last step run everything
        assert len(st.changes[0]) == STEPS - 3 and all(d > 0 for d in st.changes[0])
        assert 0 < err < bound
        skipped.append(st.skipped)
    assert skipped == sorted(set(skipped))  # a larger threshold skips more


def test_warmup_last_step_and_skip_cap_shape_the_pattern(model):
    inputs = _inputs(model)
    cache = enable_step_cache(model, threshold=1e9, warmup=3)  # every forward that may skip does
    _run(model, inputs, steps=10)
    assert cache.last_run.patterns == ("CCC" + "S" * 6 + "C",)
    cache = enable_step_cache(model, threshold=1e9, warmup=1, max_consecutive_skips=2)
    _run(model, inputs, steps=10)
    assert cache.last_run.patterns == ("CSSCSSCSSC",)


# --- state: one per pass, none across runs --------------------------------------------------------

def test_no_state_leaks_into_the_next_run(model):
    """A second run with another prompt and noise equals that run done first on a fresh model, even
    with warmup 0 (where a stale residual would be used at once)."""
    fresh = copy.deepcopy(model)
    first, second = _inputs(model, seed=1), _inputs(model, seed=2)
    exact = _run(fresh, second)
    enable_step_cache(model, threshold=0.3, warmup=0)
    _run(model, first)
    after = _run(model, second)
    cache = enable_step_cache(fresh, threshold=0.3, warmup=0)
    alone = _run(fresh, second)
    assert torch.equal(after, alone)
    assert model.step_cache.last_run == cache.last_run and cache.last_run.skipped > 0
    assert relative_l2(after, exact) > 0  # it did approximate


def test_a_new_run_without_start_run_starts_afresh(model):
    """Direct callers that skip start_run: a rising timestep starts the pass afresh (full forward)."""
    g = torch.Generator().manual_seed(4)
    ids, txt_ids = position_ids(4, 4), text_position_ids(6)
    kw = dict(img_ids=ids, txt=torch.randn(1, 6, model.config.context_dim, generator=g), txt_ids=txt_ids)
    img = torch.randn(1, 16, 128, generator=g)
    cache = enable_step_cache(model, threshold=1e9, warmup=0)
    with torch.no_grad():
        for t in (0.9, 0.8, 0.7):
            model(img=img + t, timesteps=torch.tensor([t]), **kw)
        assert cache.last_run.patterns == ("CSS",)
        out = model(img=img, timesteps=torch.tensor([1.0]), **kw)  # back up: another run
        assert cache.last_run.patterns == ("C",)
        disable_step_cache(model)
        assert torch.equal(out, model(img=img, timesteps=torch.tensor([1.0]), **kw))


class _Router:
    """Sends each forward to one of two copies of a model by its text length, so each copy's own
    cache sees exactly one CFG pass: the oracle for per-pass state in one cache."""

    def __init__(self, models: dict[int, kc.Flux2Transformer]) -> None:
        self.models = models
        self.any = next(iter(models.values()))
        self.step_cache = self  # denoise starts the run here; both copies' caches start it

    def start_run(self, steps: int, noisy_tokens: int) -> None:
        for m in self.models.values():
            m.step_cache.start_run(steps, noisy_tokens)

    device = property(lambda self: self.any.device)
    dtype = property(lambda self: self.any.dtype)

    def rope(self, txt_ids, img_ids):
        return self.any.rope(txt_ids, img_ids)

    def __call__(self, **kw):
        return self.models[kw["txt"].shape[1]](**kw)


def test_cfg_with_two_forwards_keeps_one_state_per_pass(model, parity):
    inputs = _inputs(model, length=12, neg_length=7)  # different lengths: two forwards per step
    pos_model, neg_model = copy.deepcopy(model), copy.deepcopy(model)
    exact = _run(model, inputs)
    cache = enable_step_cache(model, threshold=0.3)
    out = _run(model, inputs)
    st = cache.last_run
    assert st.passes == 2 and all(p.count("S") > 0 for p in st.patterns)
    enable_step_cache(pos_model, threshold=0.3)
    enable_step_cache(neg_model, threshold=0.3)
    routed = _run(_Router({12: pos_model, 7: neg_model}), inputs)
    assert torch.equal(out, routed)
    assert st.patterns == tuple(m.step_cache.last_run.patterns[0] for m in (pos_model, neg_model))
    name = f"step cache CFG two forwards, threshold 0.3: rel L2 ({st.skipped} of {st.forwards} skipped)"
    err = parity(name, relative_l2(out, exact))
    assert 0 < err < 3e-4  # measured 1.13e-4 (40 of 60 forwards skipped)


def test_logs_one_line_per_run(model, caplog):
    inputs = _inputs(model, length=12, neg_length=7)
    enable_step_cache(model, threshold=0.3)
    with caplog.at_level(logging.INFO, logger=sc.__name__):
        _run(model, inputs, steps=12)
        _run(model, inputs, steps=12)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step cache:")]
    st = model.step_cache.last_run
    assert len(lines) == 2
    assert lines[1].startswith(f"step cache: {st.skipped} of 24 forwards skipped") and "2 passes" in lines[1]


# --- on/off and the other switches ----------------------------------------------------------------

def test_disable_restores_the_plain_path(model, exact):
    inputs = _inputs(model)
    enable_step_cache(model, threshold=0.3)
    assert not torch.equal(_run(model, inputs), exact)
    disable_step_cache(model)
    assert model.step_cache is None
    assert torch.equal(_run(model, inputs), exact)


def test_composes_with_fast_paths(model):
    inputs = _inputs(model)
    cached = copy.deepcopy(model)
    cache = enable_step_cache(cached, threshold=0.3)
    ref = _run(cached, inputs)
    ref_patterns = cache.last_run.patterns
    enable_fast_paths(model)  # the plain path on the CPU
    enable_step_cache(model, threshold=0.3)
    assert torch.equal(_run(model, inputs), ref)
    # In the other order, and with each block compiled (eager backend: traced by dynamo, no codegen):
    # the cache survives enable_fast_paths and decides in eager code between the compiled blocks.
    enable_fast_paths(model, compile=True, compile_backend="eager")
    assert model.step_cache is not None
    torch.testing.assert_close(_run(model, inputs), ref, rtol=1e-6, atol=1e-6)
    assert model.step_cache.last_run.patterns == ref_patterns
    assert all("forward" in b.__dict__ for b in [*model.double_blocks, *model.single_blocks])


def test_composes_with_block_streaming(model):
    """Skipped forwards run block 0 only: the streamer's prefetch of block 1 must not pile up."""
    inputs = _inputs(model)
    cached = copy.deepcopy(model)
    cache = enable_step_cache(cached, threshold=0.3)
    ref = _run(cached, inputs)
    enable_step_cache(model, threshold=0.3)
    with BlockOffloader(model, "cpu", prefetch=1) as streamer:  # CPU-to-CPU copies, same code path
        out = _run(model, inputs)
    assert torch.equal(out, ref) and model.step_cache.last_run.patterns == cache.last_run.patterns
    assert cache.last_run.skipped > 0 and streamer.stats.max_resident <= 2


# --- references ---------------------------------------------------------------------------------

# Measured (20 steps, 10 of 20 skipped): joint 1.00e-4, timestep_zero 1.00e-4, kv 1.00e-4.
@pytest.mark.parametrize("ref_mode,bound", [("joint", 2.5e-4), ("timestep_zero", 2.5e-4), ("kv", 2.5e-4)])
def test_reference_modes(model, parity, ref_mode, bound):
    inputs = _inputs(model, grid=(6, 6))
    refs = reference_tokens([torch.randn(1, 128, 4, 6, generator=torch.Generator().manual_seed(9))])
    kw = dict(steps=20, refs=refs, ref_mode=ref_mode)
    exact = _run(model, inputs, **kw)
    cache = enable_step_cache(model, threshold=0.0)
    assert torch.equal(_run(model, inputs, **kw), exact)
    cache = enable_step_cache(model, threshold=0.3)
    out = _run(model, inputs, **kw)
    st = cache.last_run
    err = parity(f"step cache refs {ref_mode}, threshold 0.3: rel L2 ({st.skipped} skipped)",
                 relative_l2(out, exact))
    assert st.skipped > 0 and 0 < err < bound


# --- the engine path and the API ----------------------------------------------------------------

def test_through_generate_with_a_base_model(parity):
    tr, te, vae = _smooth_in_time(tiny_transformer()), tiny_text_encoder(), tiny_vae()
    kw = dict(prompt="a fox", negative_prompt="", width=64, height=64, steps=20, kind="base", seed=3,
              output="latent", cache=None)
    exact = kc.generate(tr, te, vae, **kw).latents
    cache = enable_step_cache(tr, threshold=0.3)
    out = kc.generate(tr, te, vae, **kw).latents
    st = cache.last_run
    assert (st.steps, st.passes, st.forwards) == (20, 1, 20) and st.skipped > 0
    err = parity(f"step cache generate() base 20 steps, threshold 0.3: rel L2 ({st.skipped} skipped)",
                 relative_l2(out, exact))
    assert 0 < err < 4.5e-4  # measured 1.79e-4 (11 of 20 skipped)


def test_settings_are_checked():
    for bad in (-0.1, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="threshold"):
            StepCacheSettings(threshold=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup"):
        StepCacheSettings(warmup=-1)
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        StepCacheSettings(max_consecutive_skips=0)
    with pytest.raises(TypeError, match="Flux2Transformer"):
        enable_step_cache(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    assert StepCacheSettings() == StepCacheSettings(sc.DEFAULT_THRESHOLD, sc.DEFAULT_WARMUP, None)


def test_relative_l2():
    exact = torch.tensor([3.0, 4.0])
    assert relative_l2(exact, exact) == 0.0
    assert relative_l2(torch.tensor([3.0, 4.5]), exact) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="shapes"):
        relative_l2(torch.zeros(3), exact)
