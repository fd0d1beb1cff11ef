"""Reference path regressions (bug hunt): the KV cache's memory while it replaces an entry, its key
under other block ops, and reference latents that sit on different devices."""

from __future__ import annotations

import torch

from klein_core.models.block_ops import PLAIN_OPS, BlockOps
from klein_core.pipeline.reference_kv import ReferenceKVCache
from klein_core.pipeline.sampling import reference_tokens
from klein_core.testing import tiny_transformer


def _refs(seed: int, h: int = 4, w: int = 4):
    return reference_tokens([torch.randn(1, 128, h, w, generator=torch.Generator().manual_seed(seed))])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a.double + a.single, b.double + b.single) for x, y in zip(pa, pb))


def _held_during_reference_pass(model, cache, refs) -> tuple[int, int]:
    """(entries, bytes) the cache holds while ``cache.get`` runs the model's reference pass."""
    seen = []
    real = type(model).reference_kv

    def spy(self, *args, **kw):
        seen.append((len(cache), cache.nbytes()))
        return real(self, *args, **kw)

    type(model).reference_kv = spy
    try:
        kv = cache.get(model, refs)
    finally:
        type(model).reference_kv = real
    assert len(seen) == 1, "expected exactly one reference pass (a miss)"
    assert _same(kv, model.reference_kv(refs.tokens, refs.ids))
    return seen[0]


def test_a_replaced_kv_entry_is_freed_before_the_new_reference_pass():
    """With one entry (ComfyUI's cache), another edit's keys/values replace the old ones: the old
    ones must be gone while the new ones are computed, or the device holds both (the memory planner
    counts one set: 2 GiB per 1 MP reference on 9B-KV)."""
    model = tiny_transformer(seed=0)
    cache = ReferenceKVCache(max_entries=1)
    cache.get(model, _refs(1))
    assert len(cache) == 1 and cache.nbytes() > 0
    assert _held_during_reference_pass(model, cache, _refs(2)) == (0, 0)
    assert len(cache) == 1 and cache.misses == 2


def test_a_byte_bound_frees_only_what_the_new_entry_pushes_out():
    model = tiny_transformer(seed=0)
    one = model.reference_kv(_refs(1).tokens, _refs(1).ids).nbytes()
    cache = ReferenceKVCache(max_entries=8, max_bytes=2 * one)  # room for two same-sized entries
    cache.get(model, _refs(1))
    cache.get(model, _refs(2))
    assert len(cache) == 2
    assert _held_during_reference_pass(model, cache, _refs(3)) == (1, one)  # the oldest went first, only it
    before = cache.hits
    cache.get(model, _refs(2))  # the newer one was kept and is served
    assert cache.hits == before + 1


def test_other_block_ops_on_the_same_model_are_not_served_the_old_keys():
    """A model switched to other kernels (another speed on the same object) computes other
    keys/values; the cache must not serve the ones made under the previous ops."""

    class RoundedAttention(BlockOps):  # a lower-precision attention kernel, as a fast path may be
        def attention(self, q, k, v):
            return super().attention(q.to(torch.bfloat16).float(), k.to(torch.bfloat16).float(), v)

    model, refs = tiny_transformer(seed=0), _refs(1)
    cache = ReferenceKVCache(max_entries=4)
    plain = cache.get(model, refs)
    model.ops = RoundedAttention()
    try:
        fresh = model.reference_kv(refs.tokens, refs.ids)
        assert not _same(fresh, plain)  # the ops really change the keys/values
        served = cache.get(model, refs)
        assert _same(served, fresh) and cache.hits == 0
        assert cache.get(model, refs) is served and cache.hits == 1  # and those are reused
    finally:
        model.ops = PLAIN_OPS
    assert cache.get(model, refs) is plain  # back on the plain ops: their entry is still right


def test_reference_latents_on_different_devices_are_gathered():
    """Latents given by the caller (host) and references the engine encoded (device) join one
    sequence; the meta device stands in for a GPU here."""
    a = torch.empty(1, 128, 2, 3, device="meta")
    b = torch.randn(1, 128, 4, 2)
    refs = reference_tokens([a, b])
    assert refs.tokens.shape == (1, 2 * 3 + 4 * 2, 128) and refs.tokens.device == a.device
    assert refs.sizes == ((2, 3), (4, 2))
    expected_t = torch.tensor([10] * 6 + [20] * 8)
    assert torch.equal(refs.ids[:, 0], expected_t)
    assert torch.equal(refs.ids[6:, 1:3], torch.tensor([[h, w] for h in range(4) for w in range(2)]))
