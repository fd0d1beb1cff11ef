"""Component placement and block offload: outputs identical to resident, bounded residency.

On this CPU-only machine the offload code runs its real path with CPU-to-CPU copies (no streams):
the tests check that every block runs on a fresh copy of its weights, that at most
``prefetch + 1`` blocks hold device copies at once, and that outputs are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from klein_core import testing as demo
from klein_core.memory.placement import BlockOffloader, module_bytes, offload_blocks, on_device, pin_memory_
from klein_core.pipeline.sampling import denoise, get_schedule, make_noise, position_ids, text_position_ids
from klein_core.quant.fp8 import quantize_model_


def _inputs(cfg, batch=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    return dict(
        img=torch.randn(batch, ids.shape[0], cfg.in_channels, generator=g), img_ids=ids,
        txt=torch.randn(batch, 5, cfg.context_dim, generator=g), txt_ids=text_position_ids(5),
        timesteps=torch.tensor([1.0, 0.5]),
    )


def _tiny(depth=2, depth_single=3, fp8=False):
    model = demo.tiny_transformer(demo.TinySpec(depth=depth, depth_single=depth_single), seed=4)
    if fp8:
        quantize_model_(model)
    return model


class _Probe:
    """Checks, as each block starts, that it runs on a device copy and counts the copies alive."""

    def __init__(self, off: BlockOffloader) -> None:
        self.off = off
        self.homes = [[s.home.data_ptr() for s in slots] for slots in off._slots]
        self.on_copy = []
        for i, b in enumerate(off.blocks):
            b.register_forward_pre_hook(self._hook(i))  # runs after the offloader's own pre-hook

    def _hook(self, i):
        def hook(module, args):
            live = [(s.owner._parameters if s.is_param else s.owner._buffers)[s.name].data_ptr()
                    for s in self.off._slots[i]]
            self.on_copy.append(all(a != b for a, b in zip(live, self.homes[i])))
        return hook


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("fp8", [False, True])
def test_block_offload_equals_resident(prefetch, fp8):
    model = _tiny(fp8=fp8)
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = model(**inputs)
    n = len(model.double_blocks) + len(model.single_blocks)
    off = BlockOffloader(model, "cpu", prefetch=prefetch).attach()
    probe = _Probe(off)
    with torch.no_grad():
        first = model(**inputs)
        second = model(**inputs)  # the wrap-around prefetch feeds the next forward
    assert torch.equal(first, want) and torch.equal(second, want)
    assert probe.on_copy == [True] * (2 * n)
    assert off.stats.max_resident == prefetch + 1
    # every block twice, plus the first blocks of a next forward, already prefetched
    assert off.stats.loads == 2 * n + prefetch
    sizes = [module_bytes(b) for b in off.blocks]
    assert off.stats.bytes_copied == 2 * sum(sizes) + sum(sizes[:prefetch])
    off.detach()
    assert off.stats.resident == 0
    # only the probe's hooks are left
    assert all(len(b._forward_pre_hooks) == 1 and not b._forward_hooks for b in off.blocks)
    with torch.no_grad():
        assert torch.equal(model(**inputs), want)


def test_offload_through_the_sampler_and_text_encoder():
    model = _tiny()
    cfg = model.config
    noise = make_noise(3, 1, cfg.in_channels, 4, 4)
    txt = torch.randn(1, 6, cfg.context_dim, generator=torch.Generator().manual_seed(1))
    sig = get_schedule(3, 16)
    with torch.no_grad():
        want = denoise(model, noise, txt, sig)
    with offload_blocks(model, "cpu") as off:
        got = denoise(model, noise, txt, sig)
    assert torch.equal(got, want) and off.stats.max_resident <= 2
    te = demo.tiny_text_encoder(seed=2)
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ref = te.encode(ids, mask)
    with BlockOffloader(te, "cpu", prefetch=1) as off:
        assert torch.equal(te.encode(ids, mask), ref)
        assert off.stats.max_resident == 2 and off.stats.loads == len(te.layers) + 1  # + next prefetch


def test_on_device_restores_the_original_tensors():
    vae = demo.tiny_vae(seed=1)
    before = {k: v.data_ptr() for k, v in vae.state_dict().items()}
    x = torch.randn(1, 3, 32, 32) * 0.5
    want = vae.encode(x)
    seen = []
    with on_device(vae, "cpu") as m:  # already there: nothing moves
        seen.append(m.encoder.conv_in.weight.data_ptr() == before["encoder.conv_in.weight"])
    assert seen == [True]
    with pytest.raises(RuntimeError, match="boom"):
        with on_device(vae, "meta"):
            assert vae.encoder.conv_in.weight.is_meta
            raise RuntimeError("boom")
    assert {k: v.data_ptr() for k, v in vae.state_dict().items()} == before
    assert torch.equal(vae.encode(x), want)
    pin_memory_(vae)  # no CUDA here: stays on the CPU, still exact
    assert torch.equal(vae.encode(x), want)


def test_offloader_refuses_models_without_blocks():
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        BlockOffloader(torch.nn.Linear(2, 2), "cpu")
    with pytest.raises(ValueError, match="prefetch"):
        BlockOffloader(_tiny(), "cpu", prefetch=-1)


@pytest.mark.parametrize("placement", ["resident", "staged", "blocks"])
def test_stage_placer_runs_each_placement(placement):
    from klein_core.memory.placement import StagePlacer

    model = _tiny()
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = model(**inputs)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    placer = StagePlacer("cpu", {"transformer": model}, {"transformer": placement})
    with placer.stage("transformer") as m, torch.no_grad():
        got = m(**inputs)
    assert torch.equal(got, want)
    # Staged and streamed models are left as they were found (their CPU tensors).
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert not any(b._forward_pre_hooks for b in model.double_blocks)
    with pytest.raises(ValueError, match="unknown placements"):
        StagePlacer("cpu", {"transformer": model}, {"transformer": "swap"})


@pytest.mark.parametrize("placement", ["staged", "blocks"])
def test_fp8_weights_are_not_copied_to_a_device_without_float8(placement, monkeypatch):
    """A model kept in CPU memory with fp8 layers, staged or streamed onto a device without float8
    (Apple's MPS; "meta" stands in, its answer patched): refused before any copy, naming the fix,
    instead of torch's dtype error from inside the copy. A bf16 model goes as before."""
    from klein_core.memory import placement as placement_mod

    monkeypatch.setattr(placement_mod, "holds_float8", lambda device: torch.device(device).type != "meta")
    model = demo.tiny_transformer()
    plain = placement_mod.StagePlacer("meta", {"transformer": model}, {"transformer": placement})
    with plain.stage("transformer"):
        pass
    quantize_model_(model)
    placer = placement_mod.StagePlacer("meta", {"transformer": model}, {"transformer": placement})
    refused = (r"the transformer holds fp8 weights, which meta cannot hold; load it with "
               r"quantize=klein_core.files.loaders.quantize_for\(path, 'transformer', 'meta'\)")
    with pytest.raises(ValueError, match=refused), placer.stage("transformer"):
        pass
    assert all(t.device.type == "cpu" for t in model.state_dict().values())  # nothing moved
