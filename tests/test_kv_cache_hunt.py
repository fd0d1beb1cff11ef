"""Bug hunt, second round: Klein 9B-KV reference keys/values kept across runs (ReferenceKVCache) under
the engine's memory placements, KV mode with CFG and batches, and the opt-in step cache combined with
references, two-pass CFG, batches and the KV cache. Tiny random models on the CPU; the meta device
stands in for a GPU where a placement only copies weights to a device other than their home.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_step_cache import _smooth_in_time  # trained-like timestep response: the step cache skips on it

import klein_core as kc
from klein_core.accel import disable_step_cache, enable_step_cache
from klein_core.memory.placement import StagePlacer
from klein_core.pipeline.reference_kv import ReferenceKVCache, weights_state
from klein_core.pipeline.sampling import denoise, get_schedule, reference_tokens
from klein_core.testing import tiny_transformer


def _refs(seed: int = 1, h: int = 4, w: int = 4):
    return reference_tokens([torch.randn(1, 128, h, w, generator=torch.Generator().manual_seed(seed))])


def _emb(model, seed: int, length: int = 8, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, model.config.context_dim, generator=torch.Generator().manual_seed(seed))


# --- the KV cache under the engine's memory placements ---------------------------------------------

@pytest.mark.parametrize("placement", ["staged", "blocks"])
def test_kv_cache_serves_the_next_edit_when_the_transformer_is_staged_or_streamed(placement):
    """Was a bug: the reference key/value cache never hit when the transformer does not live on the
    compute device, i.e. whenever the memory plan is not "resident" (memory "swap"/"blocks", and
    "auto" on a card too small to keep the weights: weights_home() then keeps them on the CPU). Input:
    the same reference three times, each run in its own transformer stage as Engine.denoise runs it,
    the stage placed by klein_core's StagePlacer on a device other than the weights' home (meta stands
    in for the GPU). Seen: 0 hits, 3 misses for both placements; each run paid the reference pass
    again, and the cache kept a dead entry (on the device: 2 GiB per 1 MP reference on 9B-KV).
    docs/kv.md promises that a second edit of the same pictures with another prompt or seed skips the
    reference pass, "also in ComfyUI" (whose 9B-KV fp8 on a 12 GB card runs "auto -> blocks",
    docs/speed.md). Cause: the key was weights_state(model) inside the stage, i.e. the storages of the
    per-stage device copies, new every run. Now the engine takes the token of the weights where they
    live before the stage and passes it (``weights=``)."""
    model, refs = tiny_transformer(seed=0), _refs()
    # A first stage rewraps the home parameters once (their version counters, bumped when the tiny
    # model was filled in place, start again; a model read from a file has them at 0 already).
    with StagePlacer("meta", {"transformer": model}, {"transformer": placement}).stage("transformer"):
        pass
    cache = ReferenceKVCache(max_entries=1)
    for _ in range(3):
        placer = StagePlacer("meta", {"transformer": model}, {"transformer": placement})
        home = weights_state(model)  # as Engine.denoise takes it, before the stage
        with placer.stage("transformer") as placed:
            assert placed is model and model.device.type == "meta"  # really ran on the stand-in device
            cache.get(placed, refs, weights=home)
        assert model.device.type == "cpu"  # the weights went home after the stage
    assert (cache.hits, cache.misses) == (2, 1), (
        f"{placement}: the same references in three runs gave {cache.hits} hits and {cache.misses} misses")


def test_the_engine_keys_the_kv_cache_on_the_weights_home_not_the_stage_copies(monkeypatch):
    """The engine's side of the test above: each transformer stage gives the model new tensors (as a
    device copy does), and three edits of the same reference still make one reference pass, each
    result equal to a run without the cache."""
    model = tiny_transformer(seed=0)
    real_stage = kc.Engine._stage

    @contextlib.contextmanager
    def copying_stage(self, component, plan):
        with real_stage(self, component, plan) as placed:
            if component != "transformer":
                yield placed
                return
            homes = {n: p.data for n, p in placed.named_parameters()}
            for p in placed.parameters():
                p.data = p.data.clone()  # what a stage on a GPU gives: new storages every run
            try:
                yield placed
            finally:
                for n, p in placed.named_parameters():
                    p.data = homes[n]

    lat = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(1))
    kw = {"reference_latents": [lat], "width": 64, "height": 64, "steps": 2, "kind": "kv", "output": "latent", "cache": None}
    plain = [kc.generate(model, None, None, kv_cache=None, prompt_embeds=_emb(model, 10 + i), seed=i, **kw).latents
             for i in range(3)]
    monkeypatch.setattr(kc.Engine, "_stage", copying_stage)
    cache = ReferenceKVCache(max_entries=1)
    for i in range(3):
        got = kc.generate(model, None, None, kv_cache=cache, prompt_embeds=_emb(model, 10 + i), seed=i, **kw).latents
        assert torch.equal(got, plain[i])
    assert (cache.hits, cache.misses) == (2, 1)


def test_kv_cache_hits_through_the_engine_when_the_transformer_is_resident():
    """The control for the test above, through generate(): the transformer on its compute device
    (the CPU), the same reference latents in three edits with other prompts, seeds and batch sizes:
    one reference pass, then two hits, each result equal to a run without the cache."""
    model = tiny_transformer(seed=0)
    lat = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(1))
    cache = ReferenceKVCache(max_entries=1)
    kw = {"reference_latents": [lat], "width": 64, "height": 64, "steps": 2, "kind": "kv", "output": "latent", "cache": None}
    for i in range(3):
        run = dict(prompt_embeds=_emb(model, 10 + i), seed=i, batch_size=1 + i % 2, **kw)
        got = kc.generate(model, None, None, kv_cache=cache, **run).latents
        assert torch.equal(got, kc.generate(model, None, None, kv_cache=None, **run).latents)
    assert (cache.hits, cache.misses) == (2, 1)


# --- KV mode with CFG and batches ------------------------------------------------------------------

@pytest.mark.parametrize("neg_length", [9, 5], ids=["batched-cfg", "two-pass-cfg"])
def test_kv_mode_with_cfg_gives_each_image_of_a_batch_its_own_row(neg_length):
    """KV mode on a base model (CFG): the stored reference keys/values are [1, ...] and joined to
    every sequence of the batch (2 images x [pos; neg] in one forward, or two forwards when the
    negative is shorter). Each image must equal that image's run alone. Measured: 1.5e-6 (batched
    CFG), 2.1e-6 (two passes): batching rounding only."""
    model = tiny_transformer(seed=0)
    g = torch.Generator().manual_seed(0)
    refs = reference_tokens([torch.randn(1, 128, 4, 6, generator=g), torch.randn(1, 128, 2, 2, generator=g)])
    noise = torch.randn(2, 128, 4, 4, generator=g)
    txt = torch.randn(2, 9, model.config.context_dim, generator=g)
    neg = torch.randn(2, neg_length, model.config.context_dim, generator=g)
    sig = get_schedule(3, 16)
    kw = {"guidance": 3.0, "refs": refs, "ref_mode": "kv"}
    with torch.no_grad():
        both = denoise(model, noise, txt, sig, neg_txt=neg, **kw)
        rows = torch.cat([denoise(model, noise[i:i + 1], txt[i:i + 1], sig, neg_txt=neg[i:i + 1], **kw)
                          for i in range(2)])
        joint = denoise(model, noise, txt, sig, neg_txt=neg, guidance=3.0, refs=refs, ref_mode="joint")
    assert (both - rows).abs().max().item() < 2e-5
    assert (both - joint).abs().max().item() > 1e-3  # KV mode really ran (not the joint sequence)


# --- the step cache with references, two-pass CFG and batches --------------------------------------

@pytest.mark.parametrize("ref_mode", ["timestep_zero", "kv"])
def test_step_cache_threshold_zero_is_exact_with_references_two_pass_cfg_and_a_batch(ref_mode):
    """threshold 0 never skips, so it must give the uncached bytes also where the existing tests do
    not look: two references, a batch of 2, CFG as two forwards (a shorter negative), one state
    per pass; and a huge threshold still keeps warmup / last-step pattern per pass."""
    model = _smooth_in_time(tiny_transformer(seed=0))
    g = torch.Generator().manual_seed(0)
    refs = reference_tokens([torch.randn(1, 128, 4, 6, generator=g), torch.randn(1, 128, 2, 2, generator=g)])
    noise = torch.randn(2, 128, 6, 6, generator=g)
    txt = torch.randn(2, 9, model.config.context_dim, generator=g)
    neg = torch.randn(2, 5, model.config.context_dim, generator=g)
    sig = get_schedule(6, 36)
    kw = {"neg_txt": neg, "guidance": 3.0, "refs": refs, "ref_mode": ref_mode}
    with torch.no_grad():
        exact = denoise(model, noise, txt, sig, **kw)
        cache = enable_step_cache(model, threshold=0.0)
        assert torch.equal(denoise(model, noise, txt, sig, **kw), exact)
        assert cache.last_run.patterns == ("CCCCCC", "CCCCCC")
        cache = enable_step_cache(model, threshold=1e9, warmup=2)
        skipped = denoise(model, noise, txt, sig, **kw)
    st = cache.last_run
    assert st.patterns == ("CCSSSC", "CCSSSC") and (st.computed, st.skipped, st.forwards) == (6, 6, 12)
    assert not torch.equal(skipped, exact)


def test_step_cache_and_kv_cache_second_edit_equals_a_fresh_model():
    """Base model, KV mode, CFG as two forwards, step cache on (warmup 0, so a stale residual would
    be used at once): a second edit of the same reference with another prompt, negative, seed and
    batch size takes the keys/values from the cache and no step-cache state from the first edit. It
    must equal that edit run first on a fresh copy of the model (no KV cache), with the same skip
    pattern. Measured: equal, patterns ('CSSSSCSCCCCC',) * 2."""
    model = _smooth_in_time(tiny_transformer(seed=0))
    fresh = copy.deepcopy(model)
    lat = torch.randn(1, 128, 4, 6, generator=torch.Generator().manual_seed(1))
    kw = {"reference_latents": [lat], "width": 64, "height": 64, "steps": 12, "kind": "base", "ref_mode": "kv",
              "output": "latent", "cache": None}
    kv_cache = ReferenceKVCache()
    cache = enable_step_cache(model, threshold=0.3, warmup=0)
    kc.generate(model, None, None, prompt_embeds=_emb(model, 1), negative_embeds=_emb(model, 2, 5), seed=1,
                kv_cache=kv_cache, **kw)
    second = dict(prompt_embeds=_emb(model, 3), negative_embeds=_emb(model, 4, 5), seed=2, batch_size=2, **kw)
    got = kc.generate(model, None, None, kv_cache=kv_cache, **second).latents
    assert (kv_cache.hits, kv_cache.misses) == (1, 1)
    alone = enable_step_cache(fresh, threshold=0.3, warmup=0)
    want = kc.generate(fresh, None, None, kv_cache=None, **second).latents
    assert torch.equal(got, want)
    assert cache.last_run == alone.last_run and cache.last_run.passes == 2 and cache.last_run.skipped > 0
    disable_step_cache(model)
    exact = kc.generate(model, None, None, kv_cache=kv_cache, **second).latents
    assert kv_cache.hits == 2 and not torch.equal(got, exact)  # the step cache did approximate
