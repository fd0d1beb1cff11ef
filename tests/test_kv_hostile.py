"""The reference key/value cache (Klein 9B-KV) under weights changed behind its back, and its bounds
checked at construction (issue #28): a changed model is never served its old keys/values, the fresh
ones equal a recompute, and the cache stays bounded and usable."""

from __future__ import annotations

import pytest
import torch

import klein_core as kc
from klein_core.pipeline.bounded_cache import BoundedCache
from klein_core.pipeline.reference_kv import ReferenceKVCache, weights_state
from klein_core.pipeline.sampling import reference_tokens
from klein_core.testing import tiny_transformer


def _refs(seed: int = 0):
    return reference_tokens([torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(seed))])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a.double + a.single, b.double + b.single) for x, y in zip(pa, pb))


def _fresh_and_not_stale(cache, model, refs, stale):
    got = cache.get(model, refs)
    assert _same(got, model.reference_kv(refs.tokens, refs.ids)), "not what the model computes now"
    assert not _same(got, stale), "the cache served the keys/values of the previous weights"
    return got


def test_load_state_dict_in_place_is_not_served_the_old_keys():
    model, refs = tiny_transformer(seed=0), _refs()
    cache = ReferenceKVCache(max_entries=4)
    stale = cache.get(model, refs)
    model.load_state_dict(tiny_transformer(seed=1).state_dict())  # copy_ into the same tensors
    _fresh_and_not_stale(cache, model, refs, stale)
    assert (cache.hits, cache.misses) == (0, 2)
    assert len(cache) == 1  # the old weights' entry is dropped at once, not kept to the bound
    again = cache.get(model, refs)  # and the new weights' entry is served
    assert cache.hits == 1 and _same(again, model.reference_kv(refs.tokens, refs.ids))


def test_assigned_weights_and_a_single_in_place_edit_miss():
    model, refs = tiny_transformer(seed=0), _refs()
    cache = ReferenceKVCache(max_entries=4)
    stale = cache.get(model, refs)
    model.load_state_dict(tiny_transformer(seed=2).state_dict(), assign=True)  # new tensors
    stale = _fresh_and_not_stale(cache, model, refs, stale)
    # one weight patched in place, as another tool merging a LoRA would: its version counter moves
    w = model.double_blocks[0].img_attn.qkv.weight
    with torch.no_grad():
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    _fresh_and_not_stale(cache, model, refs, stale)
    assert cache.misses == 3 and cache.hits == 0


def test_a_new_storage_is_another_state_even_with_the_same_values():
    model = tiny_transformer(seed=0)
    before = weights_state(model)
    assert weights_state(model) == before  # cheap and stable while nothing changes
    p = model.double_blocks[0].img_attn.qkv.weight
    p.data = p.data.clone()  # `.data =` does not move the version counter; the storage is new
    assert weights_state(model) != before


def _lora_for(model):
    name = "double_blocks.0.img_attn.qkv"
    w = model.state_dict()[name + ".weight"]
    g = torch.Generator().manual_seed(4)
    return kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(2, w.shape[1], generator=g),
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(w.shape[0], 2, generator=g)})


@pytest.mark.parametrize("mode", ["merge", "branch"])
def test_applying_and_removing_a_lora_never_serves_the_other_weights(mode):
    model, refs = tiny_transformer(seed=0), _refs()
    cache = ReferenceKVCache(max_entries=4)
    plain = cache.get(model, refs)
    with kc.apply_loras(model, _lora_for(model), mode=mode):
        patched = _fresh_and_not_stale(cache, model, refs, plain)
    # removed: the model is bit for bit the plain one again, so the plain keys/values are right
    back = _fresh_and_not_stale(cache, model, refs, patched)
    assert _same(back, plain)


def test_inference_tensors_are_still_cached():
    """ComfyUI runs nodes under torch.inference_mode: tensors without version counters must not
    make the cache useless, and new tensors still miss."""
    refs = _refs()
    with torch.inference_mode():
        model = tiny_transformer(seed=0)
        cache = ReferenceKVCache()
        first = cache.get(model, refs)
        assert cache.get(model, refs) is first and cache.hits == 1
        model.load_state_dict(tiny_transformer(seed=1).state_dict(), assign=True)
        _fresh_and_not_stale(cache, model, refs, first)
    assert cache.misses == 2


BAD = [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError), (None, TypeError)]


@pytest.mark.parametrize("arg", ["max_entries", "max_bytes"])
@pytest.mark.parametrize("value,error", BAD)
def test_cache_bounds_are_checked_at_construction(arg, value, error):
    with pytest.raises(error, match=rf"{arg} must be a whole number >= 1, got {value!r}"):
        ReferenceKVCache(**{arg: value})
    with pytest.raises(error, match=rf"{arg} must be a whole number >= 1, got {value!r}"):
        BoundedCache(**{"max_entries": 2, "max_bytes": 1 << 20, arg: value}, size=lambda v: 1)
    cache = ReferenceKVCache(**{arg: 3 if arg == "max_entries" else 1 << 30})  # a valid bound works
    model, refs = tiny_transformer(seed=0), _refs()
    assert _same(cache.get(model, refs), model.reference_kv(refs.tokens, refs.ids)) and len(cache) == 1
