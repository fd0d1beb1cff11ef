"""Bug hunt: the opt-in step cache (klein_core.accel.step_cache) beyond tests/test_step_cache.py and the
step-cache part of tests/test_kv_cache_hunt.py: the rising-timestep safety net for callers that do
not call ``start_run`` (docs/DESIGN.md), the cut schedule of image to image and inpainting, and a
run that fails inside the transformer. Tiny random models on the CPU, each test well under a second.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from test_step_cache import _smooth_in_time  # trained-like timestep response: the step cache skips on it

import klein_core as kc
from klein_core.accel import disable_step_cache, enable_step_cache
from klein_core.pipeline.sampling import denoise, get_schedule, position_ids, text_position_ids
from klein_core.testing import tiny_transformer, tiny_vae

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: threads only contend


@pytest.fixture
def model() -> kc.Flux2Transformer:
    return _smooth_in_time(tiny_transformer(seed=0))


def _direct_inputs(model: kc.Flux2Transformer, seed: int = 4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One image of 4x4 tokens and a 6-token prompt, as a direct caller (its own sampler) passes them."""
    g = torch.Generator().manual_seed(seed)
    txt = torch.randn(1, 6, model.config.context_dim, generator=g)
    img = torch.randn(1, 16, 128, generator=g)
    return img, {"img_ids": position_ids(4, 4), "txt": txt, "txt_ids": text_position_ids(6)}


def _forwards(model: kc.Flux2Transformer, img: torch.Tensor, kw: dict, times) -> list[torch.Tensor]:
    """A direct caller's run without ``start_run``: one forward per timestep, the input moving with it."""
    with torch.no_grad():
        return [model(img=img + t, timesteps=torch.tensor([t]), **kw) for t in times]


# --- the rising-timestep safety net -----------------------------------------------------------------

RUN_B = (1.0, 0.9, 0.8)


@pytest.mark.parametrize("first_run,cap", [((0.5,), None), ((0.9, 0.8, 0.7), 1)],
                         ids=["first-run-shorter-than-warmup", "skip-cap-reached"])
def test_a_rising_timestep_starts_the_pass_afresh_whatever_the_pass_may_do(model, first_run, cap):
    """Was a bug: docs/DESIGN.md promises "A forward whose timestep is above its pass's previous one starts
    that pass afresh, as a safety net for callers that forget start_run" (the module docstring's
    direct callers). Input: threshold 1e9 (every forward that may skip does), warmup 2, direct forwards
    without start_run: a first run (one forward at t=0.5; or, with max_consecutive_skips=1, three
    forwards 0.9, 0.8, 0.7 ending on a skip), then a second run at t = 1.0, 0.9, 0.8 with the same
    shapes. Expected: the second run equals that run on a fresh copy of the model with the same
    settings (pattern "CCS": its own warmup of 2 full forwards). Seen: the pass is not started afresh
    (patterns "CCSS" / "CCSCSC", the two runs merged) and the second run's forward at t=0.9 skips,
    inside what should be its warmup, reusing the residual of the forward before: its output differs
    from the fresh run's. Cause: the timestep is compared only inside ``if self._candidate(state)``
    (step_cache.py ``run``), so a forward that cannot skip (pass still in its warmup by count, or its
    skip cap reached) never looks at the timestep, and the next one is taken as part of the old run."""
    fresh = copy.deepcopy(model)
    img, kw = _direct_inputs(model)
    cache = enable_step_cache(model, threshold=1e9, warmup=2, max_consecutive_skips=cap)
    _forwards(model, img, kw, first_run)
    got = _forwards(model, img, kw, RUN_B)
    alone = enable_step_cache(fresh, threshold=1e9, warmup=2, max_consecutive_skips=cap)
    want = _forwards(fresh, img, kw, RUN_B)
    assert alone.last_run.patterns == ("CCS",)  # the oracle: a fresh pass honours its warmup
    same = [torch.equal(a, b) for a, b in zip(got, want)]
    assert all(same), (f"second run's forwards equal to a fresh run's: {same}; patterns "
                       f"{cache.last_run.patterns} (fresh {alone.last_run.patterns})")
    assert cache.last_run.patterns == alone.last_run.patterns


def test_direct_forwards_after_a_denoise_run_start_a_fresh_pass(model):
    """Was a bug: the same safety net after a run of the library's own sampler. Input: step cache threshold
    1e9, warmup 1; ``denoise`` runs 5 steps (pattern "CSSSC"), then a direct caller runs forwards of the
    same shapes at t = 1.0, 0.9, 0.8, 0.7 without start_run. Expected (docs/DESIGN.md: a forward whose
    timestep is above its pass's previous one starts that pass afresh): the direct run equals the same
    forwards on a fresh copy of the model, pattern "CSSS" (3 skipped). Seen: the pass is never started
    afresh and never skips again: pattern "CSSSCCCCC", every direct forward runs every block (outputs
    differ from the fresh run's from the second forward on), and ``last_run`` merges the two runs
    under ``steps=5``. Cause (step_cache.py ``run``): at the denoise run's last step the pass released
    its tensors, ``prev_t`` included, so the rise from ~0.2 to 1.0 cannot be seen; ``_candidate`` is
    False while ``residual`` is None, and because the pass's pattern is already ``>= self._steps`` (a
    count left from the earlier run's start_run) each forward releases the residual again. Fix: treat
    a forward on a pass that has finished its ``_steps`` (or whose timestep rose, checked before
    ``_candidate``) as the start of a new pass."""
    fresh = copy.deepcopy(model)
    img, kw = _direct_inputs(model)
    noise = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(5))
    cache = enable_step_cache(model, threshold=1e9, warmup=1)
    with torch.no_grad():
        denoise(model, noise, kw["txt"], get_schedule(5, 16))
    assert cache.last_run.patterns == ("CSSSC",)
    times = (1.0, 0.9, 0.8, 0.7)
    got = _forwards(model, img, kw, times)
    alone = enable_step_cache(fresh, threshold=1e9, warmup=1)
    want = _forwards(fresh, img, kw, times)
    assert alone.last_run.patterns == ("CSSS",)
    same = [torch.equal(a, b) for a, b in zip(got, want)]
    assert all(same), (f"direct forwards equal to a fresh run's: {same}; pattern {cache.last_run.patterns} "
                       f"(fresh {alone.last_run.patterns})")


# --- image to image and inpainting: the cut schedule -----------------------------------------------

def test_image_to_image_and_inpaint_through_generate_follow_the_cut_schedule():
    """Pinned: through kc.generate the step cache is told the steps that really run. Image to image at
    strength 0.6 of 10 steps runs 6: threshold 0 gives the uncached bytes, a huge threshold the
    pattern "CCSSSC" (warmup 2, the cut schedule's own last step computed, not step 10's); inpainting
    (mask, strength 1) runs all 10: "CCSSSSSSSC". The init image also joins as a reference, so the
    measure and the stored residual cover the noisy tokens plus a reference."""
    tr, vae = _smooth_in_time(tiny_transformer(seed=0)), tiny_vae()
    emb = torch.randn(1, 8, tr.config.context_dim, generator=torch.Generator().manual_seed(2))
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(64, 64, 3) * 255).astype(np.uint8))
    mask = Image.fromarray(np.where(np.arange(64)[None, :] >= 32, 255, 0).repeat(64, 0).astype(np.uint8))
    for extra, pattern in (({"strength": 0.6}, "CCSSSC"), ({"mask": mask}, "CCSSSSSSSC")):
        kw = dict(prompt_embeds=emb, width=64, height=64, steps=10, seed=3, output="latent", cache=None,
                  image=image, **extra)
        disable_step_cache(tr)
        exact = kc.generate(tr, None, vae, **kw).latents
        cache = enable_step_cache(tr, threshold=0.0)
        assert torch.equal(kc.generate(tr, None, vae, **kw).latents, exact)
        assert cache.last_run.patterns == ("C" * len(pattern),) and cache.last_run.steps == len(pattern)
        cache = enable_step_cache(tr, threshold=1e9)
        approx = kc.generate(tr, None, vae, **kw).latents
        assert cache.last_run.patterns == (pattern,)
        assert not torch.equal(approx, exact)


# --- a run that fails inside the transformer ---------------------------------------------------------

class _Boom(Exception):
    pass


def test_a_run_failing_inside_a_full_forward_leaves_nothing_for_the_next(model):
    """Pinned: a run that fails inside the transformer, after block 0 of a full forward (the pass has
    taken the new block-0 residual, not yet the later blocks' one), leaves no stored tensors and no
    state: the next run (another noise and prompt, the same shapes; warmup 0, where stale state would
    be used at once) equals that run on a fresh copy of the model, pattern and all."""
    fresh = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    d = model.config.context_dim
    runs = [(torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 6, d, generator=g)) for _ in range(2)]
    sig = get_schedule(8, 16)
    cache = enable_step_cache(model, threshold=0.3, warmup=0)
    calls = []

    def fail_late(module, args, output):
        calls.append(1)
        if len(calls) == 5:  # the fifth full forward
            raise _Boom

    hook = model.single_blocks[0].register_forward_hook(fail_late)
    with torch.no_grad(), pytest.raises(_Boom):
        denoise(model, *runs[0], sig)
    hook.remove()
    assert "S" in cache.last_run.patterns[0]  # it had skipped before failing
    held = [n for s in cache._passes.values() for n, v in vars(s).items() if isinstance(v, torch.Tensor)]
    assert held == []
    with torch.no_grad():
        got = denoise(model, *runs[1], sig)
        alone = enable_step_cache(fresh, threshold=0.3, warmup=0)
        want = denoise(fresh, *runs[1], sig)
    assert torch.equal(got, want) and cache.last_run == alone.last_run and alone.last_run.skipped > 0


def test_enable_and_disable_are_idempotent(model):
    """Pinned: disabling a model without a step cache is a no-op; enabling twice leaves only the second
    cache (its settings, fresh counters), and a run then equals one with a single enable; disabling
    twice gives the plain bytes."""
    g = torch.Generator().manual_seed(8)
    noise, txt = torch.randn(1, 128, 4, 4, generator=g), torch.randn(1, 6, model.config.context_dim, generator=g)
    sig = get_schedule(6, 16)
    disable_step_cache(model)
    with torch.no_grad():
        plain = denoise(model, noise, txt, sig)
        first = enable_step_cache(model, threshold=1e9, warmup=1)
        denoise(model, noise, txt, sig)
        second = enable_step_cache(model, threshold=1e9, warmup=3)
        assert model.step_cache is second and first is not second
        assert second.last_run.forwards == 0
        approx = denoise(model, noise, txt, sig)
        assert second.last_run.patterns == ("CCCSSC",) and first.last_run.patterns == ("CSSSSC",)
        once = copy.deepcopy(model)
        enable_step_cache(once, threshold=1e9, warmup=3)
        assert torch.equal(denoise(once, noise, txt, sig), approx)
        disable_step_cache(model)
        disable_step_cache(model)
        assert model.step_cache is None and torch.equal(denoise(model, noise, txt, sig), plain)
