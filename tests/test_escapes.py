"""Tests for planted bugs that once escaped the suite (issue #33 and the review after it), each written
from outside the code under test: expected values come from the spec (SPEC.md, copied
here as literals) or from diffusers / PEFT, never from klein_core's own constants or functions. The
bugs themselves are mutants in tests/mutants/catalog.py.

1. The KV reference cache must key on the pictures' content, not only on their ids (sizes): a second
   picture of the same size must not be served the first one's keys and values. Also its other key
   parts (dtype, timestep), the hit path, and the owner check of the BoundedCache under it. The prompt
   cache's encoder identity likewise (dtype, quantisation), with a control query that hits.
2. The schedule's mu around the 4300-token boundary, against diffusers' own ``compute_empirical_mu``
   (1024x1056 = 4224 tokens is a real size between the old pinned points 4096 and 5000).
3. rsLoRA (PEFT ``use_rslora``: scale alpha / sqrt(r)) against diffusers + PEFT.
4. The transformer's norm eps (LayerNorm / QK-RMSNorm) on activations small enough for eps to matter.

(The text encoder's output layers are pinned in tests/test_text_encoder.py, whose transformers
reference now writes (9, 18, 27) itself.)
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from extras import require
from PIL import Image
from safetensors.torch import save_file
from tiny_reference import CTX, tiny_diffusers_transformer
from torch import nn

from klein_core.files.loaders import load_text_encoder, load_transformer
from klein_core.lora.apply import apply_loras
from klein_core.lora.read import load_lora
from klein_core.pipeline.bounded_cache import BoundedCache
from klein_core.pipeline.engine import generate
from klein_core.pipeline.prompts import DiskPromptCache, PromptCache, encode_prompts, encoder_identity
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.pipeline.sampling import (
    compute_empirical_mu,
    get_schedule,
    position_ids,
    reference_tokens,
    text_position_ids,
)
from klein_core.testing.tiny import build_tiny_components, tiny_text_encoder, tiny_transformer

diffusers = require("diffusers")
require("peft")
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu as diffusers_mu  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

# ---------------------------------------------------------------------------------------------
# 1. The KV reference cache: content, not just ids


def _latents(seed: int, h: int = 4, w: int = 3) -> torch.Tensor:
    return torch.randn(1, 128, h, w, generator=torch.Generator().manual_seed(seed))


def _same(a, b) -> bool:
    pairs = zip(a.double + a.single, b.double + b.single)
    return all(torch.equal(x, y) for pa, pb in pairs for x, y in zip(pa, pb))


def test_kv_cache_serves_a_new_picture_of_the_same_size_its_own_keys():
    model = tiny_transformer()
    first, second = reference_tokens([_latents(1)]), reference_tokens([_latents(2)])
    assert torch.equal(first.ids, second.ids) and not torch.equal(first.tokens, second.tokens)
    cache = ReferenceKVCache()
    stale = cache.get(model, first)
    got = cache.get(model, second)
    fresh = model.reference_kv(second.tokens, second.ids)
    assert not _same(got, stale), "the cache served the previous picture's keys/values for a new picture"
    assert _same(got, fresh)
    # and the hit path still works: the same picture again is served from the cache, equal to fresh
    again = cache.get(model, reference_tokens([_latents(2)]))
    assert cache.hits == 1 and _same(again, fresh)


def test_kv_cache_keys_on_dtype_and_timestep():
    model = tiny_transformer()
    refs = reference_tokens([_latents(3)])
    cache = ReferenceKVCache(max_entries=4)
    at_zero = cache.get(model, refs)
    later = cache.get(model, refs, timestep=0.5)
    assert not _same(later, at_zero)
    assert _same(later, model.reference_kv(refs.tokens, refs.ids, timestep=0.5))
    model.to(torch.bfloat16)  # the same object, now another dtype: its fp32 entries are not its keys
    low = cache.get(model, refs)
    assert low.double[0][0].dtype == torch.bfloat16
    assert _same(low, model.reference_kv(refs.tokens, refs.ids))
    assert cache.misses == 3 and cache.hits == 0


def test_bounded_cache_serves_an_entry_only_to_its_owner():
    """Both caches above build on BoundedCache: an entry made for one object is never served to
    another one alive under the same key (in-memory prompt entries are keyed by ``id(encoder)``)."""

    class Owner:
        pass

    first, second = Owner(), Owner()
    cache: BoundedCache[str] = BoundedCache(4, 1 << 20, lambda v: 1)
    with cache._lock:
        cache._store("k", first, "made for the first")
        assert cache._lookup("k", second) is None
        assert cache._lookup("k", None) is None
        assert cache._lookup("k", first) == "made for the first"
        cache._store("shared", None, "no owner")
        assert cache._lookup("shared", second) == "no owner"


def test_prompt_cache_identity_keys_on_dtype_and_quantisation(tmp_path):
    """The same encoder file loaded in another dtype (or quantised) gives other embeddings: the disk
    cache must miss for it, where the very same query in the stored dtype hits (so the miss is the
    dtype's doing, not the prompt's, the options' or the padded length's)."""
    path = tmp_path / "qwen_3_4b.safetensors"
    save_file({"model." + k: v.contiguous() for k, v in tiny_text_encoder().state_dict().items()}, str(path))
    disk = tmp_path / "prompt_cache"
    stored = PromptCache(disk=DiskPromptCache(disk)).encode(load_text_encoder(path), ["a cat"])
    assert stored.dtype == torch.float32
    fp32, bf16 = encoder_identity(path, torch.float32, "cpu"), encoder_identity(path, torch.bfloat16, "cpu")
    q8 = encoder_identity(path, torch.float32, "cpu", quantize="q8")
    assert len({fp32, bf16, q8}) == 3
    restarted = PromptCache(disk=DiskPromptCache(disk))
    assert restarted.cached(fp32, ["a cat"]) is not None  # the control: this query hits
    assert restarted.cached(bf16, ["a cat"]) is None and restarted.cached(q8, ["a cat"]) is None
    low = load_text_encoder(path, dtype=torch.bfloat16)
    got = restarted.encode(low, ["a cat"])  # its own identity: encoded anew, in bf16
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, encode_prompts(low, ["a cat"], cache=None))


def _picture(seed: int, w: int = 64, h: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_kv_generation_with_another_picture_of_the_same_size_equals_a_fresh_run():
    """Two edits in a row with the default cache, the second from another picture of the same
    size: the second result equals a run without any cache, and differs from the first."""
    tr, _, vae = build_tiny_components()
    emb = torch.randn(1, 8, tr.config.context_dim, generator=torch.Generator().manual_seed(4))
    kw = dict(prompt_embeds=emb, width=64, height=64, steps=2, seed=11, output="latent", ref_mode="kv")
    cache = ReferenceKVCache()
    first = generate(tr, None, vae, references=[_picture(1)], kv_cache=cache, **kw)
    second = generate(tr, None, vae, references=[_picture(2)], kv_cache=cache, **kw)
    fresh = generate(tr, None, vae, references=[_picture(2)], kv_cache=None, **kw)
    assert torch.equal(second.latents, fresh.latents)
    assert not torch.equal(second.latents, first.latents)


# ---------------------------------------------------------------------------------------------
# 2. The schedule's mu, against diffusers' function (and the spec's formula written out here)


def _spec_mu(seq: int, steps: int) -> float:
    """SPEC §4.1, step 3, with the spec's constants."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq > 4300:
        return a2 * seq + b2
    m200, m10 = a2 * seq + b2, a1 * seq + b1
    a = (m200 - m10) / 190
    return a * steps + (m200 - 200 * a)


# Around both sides of the 4300-token boundary, the old pinned points, and common sizes.
SEQ_LENS = (1, 256, 512, 1024, 4096, 4097, 4224, 4250, 4299, 4300, 4301, 4320, 4352, 5000, 8192, 16384)


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 28, 50])
def test_empirical_mu_equals_diffusers(steps):
    for seq in SEQ_LENS:
        assert compute_empirical_mu(seq, steps) == pytest.approx(diffusers_mu(seq, steps), abs=1e-12), seq
        assert compute_empirical_mu(seq, steps) == pytest.approx(_spec_mu(seq, steps), abs=1e-9), seq


def test_mu_at_1024x1056_is_on_the_step_dependent_side():
    seq = (1056 // 16) * (1024 // 16)
    assert seq == 4224  # below 4300: mu still depends on the step count
    assert compute_empirical_mu(seq, 4) == pytest.approx(diffusers_mu(seq, 4), abs=1e-12)
    assert compute_empirical_mu(seq, 4) != pytest.approx(compute_empirical_mu(seq, 50), abs=1e-3)


@pytest.mark.parametrize("size,steps", [((1024, 1056), 4), ((1056, 1024), 50), ((1024, 1088), 4),
                                        ((1024, 1072), 8)])
def test_schedule_at_sizes_near_the_boundary_equals_diffusers_scheduler(size, steps):
    """What the diffusers Klein pipeline does for this size: mu from its own function, sigmas from
    its scheduler (dynamic shifting, exponential), compared with klein_core's schedule bit for bit."""
    w, h = size
    seq = (h // 16) * (w // 16)
    sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=diffusers_mu(seq, steps))
    assert torch.equal(get_schedule(steps, seq), sched.sigmas)


# ---------------------------------------------------------------------------------------------
# 3. rsLoRA against diffusers + PEFT


def test_rslora_scale_matches_diffusers_and_peft(tmp_path, parity):
    dm = tiny_diffusers_transformer(0)
    dsd = {k: v.contiguous() for k, v in dm.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    img, txt = torch.randn(2, ids.shape[0], 8, generator=g), torch.randn(2, 5, CTX, generator=g)
    t = torch.tensor([0.8, 0.3])
    lora_dm = copy.deepcopy(dm)
    linears = [n for n, m in lora_dm.named_modules() if isinstance(m, nn.Linear)]
    # rank 4 (scale 8/sqrt(4) = 4, not 8/4 = 2), and a rank pattern (8/sqrt(2)) for one module
    cfg = LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=linears, init_lora_weights=False,
                     rank_pattern={"^transformer_blocks.0.attn.to_out.0": 2})
    lora_dm.add_adapter(cfg)
    with torch.no_grad():
        for n, p in lora_dm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    layer = lora_dm.transformer_blocks[0].attn.to_out[0]
    assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(2))  # PEFT's own rsLoRA scale
    assert lora_dm.transformer_blocks[1].attn.to_q.scaling["default"] == pytest.approx(8 / math.sqrt(4))
    with torch.no_grad():
        ref = lora_dm(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids,
                      txt_ids=text_position_ids(5), return_dict=False)[0]
    diffusers.Flux2KleinPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(lora_dm),
        transformer_lora_adapter_metadata=cfg.to_dict())
    lora = load_lora(tmp_path / "pytorch_lora_weights.safetensors")
    model = load_transformer(dsd)
    with torch.no_grad():
        plain = model(img=img, img_ids=ids, txt=txt, txt_ids=text_position_ids(5), timesteps=t)
        apply_loras(model, [(lora, 1.0)])
        out = model(img=img, img_ids=ids, txt=txt, txt_ids=text_position_ids(5), timesteps=t)
    assert (ref - plain).abs().max().item() > 0.05  # the LoRA matters
    diff = parity("LoRA fp32, rsLoRA (use_rslora) vs diffusers+PEFT", (out - ref).abs().max().item())
    assert diff <= 1e-4, f"rsLoRA: max abs diff {diff:.3e}"


# ---------------------------------------------------------------------------------------------
# 4. The norm eps: inputs small enough that eps matters (random inputs of unit scale hide a wrong eps
#    below the parity tolerance of tests/test_transformer.py). The reference is diffusers' model.


def test_transformer_norm_eps_matches_diffusers_on_tiny_activations(parity):
    dm = tiny_diffusers_transformer(0)
    model = load_transformer({k: v.contiguous() for k, v in dm.state_dict().items()})
    g = torch.Generator().manual_seed(2)
    ids = position_ids(3, 4)
    # hidden states of RMS ~1e-3: LayerNorm's eps (1e-6) is of the order of their variance
    img, txt = torch.randn(1, 12, 8, generator=g) * 2e-3, torch.randn(1, 5, CTX, generator=g) * 2e-3
    t = torch.tensor([0.6])
    with torch.no_grad():
        ref = dm(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids,
                 txt_ids=text_position_ids(5), return_dict=False)[0]
        out = model(img=img, img_ids=ids, txt=txt, txt_ids=text_position_ids(5), timesteps=t)
    diff = parity("transformer fp32 on activations of RMS ~1e-3 (norm eps) vs diffusers",
                  (out - ref).abs().max().item())
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item()), diff
