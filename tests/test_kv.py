"""Klein 9B-KV: reference keys/values computed once, vs diffusers' Flux2KleinKVPipeline (0.42.1),
their reuse across runs, and the "timestep zero" reference mode vs a reference built from diffusers'
own blocks. Tiny random components, fp32, written to files and loaded through klein_core."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from extras import require
from test_pipeline_parity import CTX, LATENT_CH, _embeds, _image, components  # noqa: F401 (fixture)
from test_pipeline_parity import _run_reference as _reference

import klein_core as kc
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.pipeline.sampling import make_noise, pack, position_ids, reference_tokens, text_position_ids

diffusers = require("diffusers")
TOL = 2e-5  # about twice the largest measured (5.4e-6 KV, 4.6e-6 timestep zero)


def _kv_pipe(tr, vae):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    return diffusers.Flux2KleinKVPipeline(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None,
                                          transformer=tr, is_distilled=True)


@pytest.mark.parametrize("n_refs,size,batch", [(1, (96, 64), 1), (3, (64, 80), 2)])
def test_kv_mode_matches_diffusers(components, parity, n_refs, size, batch):
    tr, vae, ours_tr, ours_vae = components
    emb = _embeds(20 + n_refs)
    refs = [_image(80, 64, 1), _image(64, 96, 2), _image(72, 72, 3)][:n_refs]
    w, h = size
    noise = make_noise(5, batch, 4 * LATENT_CH, h // 4, w // 4)
    ref = _reference(_kv_pipe(tr, vae), image=refs, prompt_embeds=emb, width=w, height=h, num_inference_steps=3,
                     latents=noise, num_images_per_prompt=batch)
    res = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, references=refs, width=w, height=h, steps=3,
                      seed=5, batch_size=batch, output="latent", ref_mode="kv", kv_cache=None)
    diff = parity(f"KV mode fp32, {n_refs} reference(s), {w}x{h}, batch {batch} vs Flux2KleinKVPipeline",
                  (pack(res.latents) - ref).abs().max().item())
    assert diff <= TOL, diff
    joint = kc.generate(ours_tr, None, ours_vae, prompt_embeds=emb, references=refs, width=w, height=h, steps=3,
                        seed=5, batch_size=batch, output="latent")
    assert (joint.latents - res.latents).abs().max() > 1e-3  # KV mode is really another computation


def test_reference_kv_depends_only_on_the_references(components):
    """What the reference pass stores does not depend on the prompt, noise, step or batch: computed
    alone it equals what the joint first step (diffusers' "extract" pass) stores."""
    tr, _, ours_tr, _ = components
    lat = torch.randn(1, 4 * LATENT_CH, 6, 5, generator=torch.Generator().manual_seed(1))
    refs = reference_tokens([lat])
    kv = ours_tr.reference_kv(refs.tokens, refs.ids)
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor,
        Flux2KVParallelSelfAttnProcessor,
    )

    for block in tr.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in tr.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    for seed in (0, 1):  # two different prompts and noises: the same stored K/V
        g = torch.Generator().manual_seed(seed)
        img = torch.randn(2, 12, 4 * LATENT_CH, generator=g)
        txt = torch.randn(2, 7, CTX, generator=g)
        with torch.no_grad():
            _, cache = tr(hidden_states=torch.cat([refs.tokens.expand(2, -1, -1), img], 1),
                          encoder_hidden_states=txt, timestep=torch.full((2,), 0.7 - 0.3 * seed),
                          img_ids=torch.cat([refs.ids, position_ids(3, 4)])[None],
                          txt_ids=text_position_ids(7)[None], return_dict=False, kv_cache_mode="extract",
                          num_ref_tokens=refs.tokens.shape[1])
        for (k, v), layer in zip(kv.double + kv.single, cache.double_block_caches + cache.single_block_caches):
            # diffusers keeps [B, N, H, D]; ours [1, H, N, D]
            assert (layer.k_ref - k.transpose(1, 2)).abs().max() < 1e-5
            assert (layer.v_ref - v.transpose(1, 2)).abs().max() < 1e-5


def test_reference_kv_reuse_gives_the_same_latents_and_saves_the_pass(components, parity):
    _, _, ours_tr, ours_vae = components
    refs = [_image(128, 128, 4), _image(96, 128, 5)]
    cache = ReferenceKVCache()
    kw = dict(references=refs, width=64, height=64, steps=2, output="latent", ref_mode="kv")
    calls = []
    real = type(ours_tr).reference_kv

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    type(ours_tr).reference_kv = counting
    try:
        t0 = time.perf_counter()
        first = kc.generate(ours_tr, None, ours_vae, prompt_embeds=_embeds(30), seed=1, kv_cache=cache, **kw)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        second = kc.generate(ours_tr, None, ours_vae, prompt_embeds=_embeds(31), seed=2, kv_cache=cache, **kw)
        t_second = time.perf_counter() - t0
        assert len(calls) == 1 and cache.hits == 1 and cache.misses == 1  # the second run skipped the pass
        fresh = kc.generate(ours_tr, None, ours_vae, prompt_embeds=_embeds(31), seed=2, kv_cache=None, **kw)
        assert len(calls) == 2
    finally:
        type(ours_tr).reference_kv = real
    assert torch.equal(second.latents, fresh.latents)  # reuse = no reuse, bit for bit
    assert not torch.equal(first.latents, second.latents)
    parity("KV reuse: latents with stored reference K/V vs computed anew (max abs)",
           (second.latents - fresh.latents).abs().max().item())
    parity("KV reuse: CPU tiny-model run time, second run / first run (ratio, not a diff)", t_second / t_first)
    # other references are another entry; the cache keeps one by default
    kc.generate(ours_tr, None, ours_vae, prompt_embeds=_embeds(31), seed=2, kv_cache=cache,
                **{**kw, "references": refs[:1]})
    assert cache.misses == 2 and len(cache) == 1


def test_kv_cache_lets_a_freed_models_entries_go():
    """A model released by its owner takes its cached reference keys/values with it (they live on
    the GPU: gigabytes at 9B), at once, not at the next store."""
    from klein_core.testing import tiny_transformer

    cache = ReferenceKVCache()
    model = tiny_transformer()
    refs = reference_tokens([torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(0))])
    cache.get(model, refs)
    assert len(cache) == 1 and cache.nbytes() > 0
    del model
    gc.collect()
    assert len(cache) == 0 and cache.nbytes() == 0


def test_bounded_cache_order_and_owners():
    from klein_core.pipeline.bounded_cache import BoundedCache

    class Owner:
        pass

    cache: BoundedCache[int] = BoundedCache(2, 1 << 30, lambda v: 1)
    first, second = Owner(), Owner()
    with cache._lock:
        cache._store("a", None, 1)
        cache._store("b", None, 2)
        cache._store("a", None, 3)  # written again: now the newest
        cache._store("c", None, 4)  # so "b" is the one dropped
        assert list(cache._data) == ["a", "c"]
        cache._store("k", first, 5)
        cache._store("k", second, 6)  # the same key for a new owner
    del first
    gc.collect()
    with cache._lock:  # the old owner's death must not remove the newer entry under its key
        assert cache._lookup("k", second) == 6
    del second
    gc.collect()
    assert "k" not in cache._data


def test_loras_on_the_model_bypass_the_kv_cache(components):
    _, _, ours_tr, _ = components
    refs = reference_tokens([torch.randn(1, 4 * LATENT_CH, 4, 4)])
    cache = ReferenceKVCache()
    cache.get(ours_tr, refs)
    name = "double_blocks.0.img_attn.qkv"
    w = ours_tr.state_dict()[name + ".weight"]
    lora = kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(2, w.shape[1]),
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(w.shape[0], 2)})
    with kc.apply_loras(ours_tr, lora):
        patched = cache.get(ours_tr, refs)
    plain = cache.get(ours_tr, refs)
    assert not torch.equal(patched.double[0][0], plain.double[0][0])


def test_timestep_zero_mode_matches_a_reference_built_from_diffusers_blocks(components, parity):
    """ComfyUI's "index_timestep_zero": references stay in the joint sequence (full attention) but
    are modulated as at timestep 0. The reference: diffusers' own modules and modulation blending."""
    from diffusers.models.transformers import transformer_flux2 as tf

    tr, _, ours_tr, _ = components
    for block in tr.transformer_blocks:
        block.attn.set_processor(tf.Flux2AttnProcessor())
    for block in tr.single_transformer_blocks:
        block.attn.set_processor(tf.Flux2ParallelSelfAttnProcessor())
    g = torch.Generator().manual_seed(3)
    img = torch.randn(2, 12, 4 * LATENT_CH, generator=g)
    ref = torch.randn(1, 10, 4 * LATENT_CH, generator=g)
    txt = torch.randn(2, 7, CTX, generator=g)
    t = torch.tensor([0.8, 0.3])
    img_ids = position_ids(3, 4)
    ref_ids = position_ids(2, 5, t=10)
    with torch.no_grad():
        # diffusers' layout for blended modulation is [ref, img]
        n_ref, n_img, n_txt = 10, 12, 7
        temb = tr.time_guidance_embed(t * 1000, None)
        temb0 = tr.time_guidance_embed(torch.zeros(2), None)
        mod_img = tf._blend_double_block_mods(tr.double_stream_modulation_img(temb),
                                              tr.double_stream_modulation_img(temb0), n_ref, n_ref + n_img)
        mod_txt = tr.double_stream_modulation_txt(temb)
        mod_single = tf._blend_single_block_mods(tr.single_stream_modulation(temb),
                                                 tr.single_stream_modulation(temb0), n_txt, n_ref, n_txt + n_ref + n_img)
        x = tr.x_embedder(torch.cat([ref.expand(2, -1, -1), img], 1))
        c = tr.context_embedder(txt)
        ids = torch.cat([ref_ids, img_ids])
        rot_i, rot_t = tr.pos_embed(ids), tr.pos_embed(text_position_ids(n_txt))
        rot = (torch.cat([rot_t[0], rot_i[0]]), torch.cat([rot_t[1], rot_i[1]]))
        for block in tr.transformer_blocks:
            c, x = block(hidden_states=x, encoder_hidden_states=c, temb_mod_img=mod_img, temb_mod_txt=mod_txt,
                         image_rotary_emb=rot)
        hs = torch.cat([c, x], 1)
        for block in tr.single_transformer_blocks:
            hs = block(hidden_states=hs, encoder_hidden_states=None, temb_mod=mod_single, image_rotary_emb=rot)
        expected = tr.proj_out(tr.norm_out(hs[:, n_txt + n_ref:], temb))
        ours = ours_tr(img=torch.cat([img, ref.expand(2, -1, -1)], 1), img_ids=torch.cat([img_ids, ref_ids]),
                       txt=txt, txt_ids=text_position_ids(n_txt), timesteps=t, zero_time_tokens=n_ref)[:, :n_img]
        joint = ours_tr(img=torch.cat([img, ref.expand(2, -1, -1)], 1), img_ids=torch.cat([img_ids, ref_ids]),
                        txt=txt, txt_ids=text_position_ids(n_txt), timesteps=t)[:, :n_img]
    diff = parity("timestep-zero reference mode fp32 vs diffusers blocks with blended modulation",
                  (ours - expected).abs().max().item())
    assert diff <= TOL, diff
    assert (joint - ours).abs().max() > 1e-3  # the mode changes the output
