import numpy as np
import torch
from PIL import Image

import klein_core
from klein_core import testing as demo
from klein_core.memory.planner import MemoryPlan
from klein_core.quant.fp8 import fp8_layers


def test_generate_memory_modes_equal():
    tr, te, vae = demo.build_tiny_components()
    img = Image.fromarray((np.random.default_rng(0).random((96, 128, 3)) * 255).astype(np.uint8))
    kw = dict(prompt="a cat", references=[img], steps=2, seed=1, cache=None)
    base = klein_core.generate(tr, te, vae, **kw)
    for mode in ("auto", "resident", "swap", "blocks", "minimum"):
        got = klein_core.generate(tr, te, vae, memory=mode, device="cpu", **kw)
        assert torch.equal(got.latents, base.latents), mode
        assert torch.equal(got.pixels, base.pixels), mode
    plan = MemoryPlan({"text_encoder": "staged", "transformer": "blocks", "vae": "staged"}, vae_tile=4, name="test")
    tiled = klein_core.generate(tr, te, vae, memory=plan, device="cpu", **kw)
    # The tiles really ran (the reference was encoded in tiles too, so the latents move a little)
    # and stay close: measured mean |d| 1.2e-4 (latents) and 0.083 (pixels; another seed: 0.17).
    assert not torch.equal(tiled.latents, base.latents) and not torch.equal(tiled.pixels, base.pixels)
    assert (tiled.latents - base.latents).abs().mean() < 3e-4
    assert (tiled.pixels - base.pixels).abs().mean() < 0.12

def test_loaders_quantize(tmp_path):
    paths = demo.write_tiny_model_files(tmp_path)
    tr = klein_core.load_transformer(paths["klein_4b"], quantize="fp8")
    te = klein_core.load_text_encoder(paths["qwen_4b"], quantize="fp8")
    assert fp8_layers(tr) and fp8_layers(te)
    vae = klein_core.load_vae(paths["vae"])
    out = klein_core.generate(tr, te, vae, prompt="x", steps=1, width=64, height=64, cache=None, memory="auto", device="cpu")
    assert torch.isfinite(out.pixels).all()


def test_module_tensors_walks_each_submodule_once_as_modules_does():
    """The planner's and the stages' walk (a stack, not ``module.modules()``) visits the same tensors:
    each submodule once, also one registered under two names, and every float8 or meta tensor."""
    from klein_core.memory.placement import module_bytes, module_tensors, tensor_devices

    tr, te, vae = demo.build_tiny_components()
    shared = torch.nn.Linear(3, 3)
    twice = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    twice.register_buffer("scale", torch.ones(2, dtype=torch.float8_e4m3fn))
    twice.register_buffer("absent", None)
    with torch.device("meta"):
        twice.add_module("on_meta", torch.nn.Linear(2, 2))
    for module in (tr, te, vae, twice):
        expected = [t for m in module.modules() for t in (*m._parameters.values(), *m._buffers.values())
                    if t is not None]
        got = list(module_tensors(module))
        assert sorted(map(id, got)) == sorted(map(id, expected))
        assert module_bytes(module) == sum(t.numel() * t.element_size() for t in expected)
    assert tensor_devices(twice) == {torch.device("cpu"), torch.device("meta")}
    assert tensor_devices(tr) == {torch.device("cpu")}


def test_a_pinned_vae_tile_decodes_in_those_tiles_and_the_result_says_which():
    """generate(vae_tile=16) decodes a 32x32-latent image in tiles of 16 (equal to tiling.decode with
    that tile), and encodes its reference in tiles too; the result names the tile per image. Auto on the
    CPU and None decode whole (the same pixels); an image no larger than the tile is decoded whole and
    recorded as such. A bad value is refused before anything runs."""
    import pytest

    from klein_core.memory import tiling

    tr, te, vae = demo.build_tiny_components()
    kw = dict(prompt="a fox", width=512, height=512, steps=2, seed=3, cache=None)
    auto = klein_core.generate(tr, te, vae, **kw)
    whole = klein_core.generate(tr, te, vae, vae_tile=None, **kw)
    pinned = klein_core.generate(tr, te, vae, vae_tile=16, **kw)
    assert auto.decode_tiles == whole.decode_tiles == [None] and torch.equal(auto.pixels, whole.pixels)
    assert pinned.decode_tiles == [16] and torch.equal(pinned.latents, auto.latents)
    expected = ((tiling.decode(vae, auto.latents, 16).float() + 1) / 2).clamp(0, 1)
    assert torch.equal(pinned.pixels, expected)
    assert (pinned.pixels - auto.pixels).abs().max() > 0.01  # tiling is not exact: it really ran
    assert klein_core.generate(tr, te, vae, vae_tile=16, batch_size=2, **kw).decode_tiles == [16, 16]

    img = Image.fromarray((np.random.default_rng(0).random((512, 512, 3)) * 255).astype(np.uint8))
    edit = dict(prompt="a fox", references=[img], steps=2, seed=3, cache=None)
    assert not torch.equal(klein_core.generate(tr, te, vae, vae_tile=16, **edit).latents,
                           klein_core.generate(tr, te, vae, **edit).latents)  # the reference encoded in tiles

    small = klein_core.generate(tr, te, vae, vae_tile=64, **{**kw, "width": 256, "height": 256})
    assert small.decode_tiles == [None]  # 16x16 latents fit one tile of 64: decoded whole, exactly
    with pytest.raises(ValueError, match="vae_tile must be"):
        klein_core.generate(tr, te, vae, vae_tile=48, **kw)


def test_a_decode_that_runs_out_of_memory_records_the_smaller_tiles_it_retried_in(monkeypatch, caplog):
    """Pinned whole (vae_tile=None), the decode of 32x32 latents runs out of memory whole: it retries in
    tiles of 16 with a warning, and decode_tiles says 16, the tiles that made the pixels. Sides of 64
    and 32 are not tried: they tile nothing at this size (they were the same whole decode again,
    tests/test_vae_hunt.py)."""
    import klein_core.pipeline.engine as engine_mod

    tr, te, vae = demo.build_tiny_components()
    kw = dict(prompt="a fox", width=512, height=512, steps=2, seed=3, cache=None)
    tiled = klein_core.generate(tr, te, vae, vae_tile=16, **kw)
    real, tried = engine_mod.decode_to_pixels, []

    def short_of_memory(vae_, latents, *, tile=None, **k):
        tried.append(tile)
        if tile != 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(vae_, latents, tile=tile, **k)

    monkeypatch.setattr(engine_mod, "decode_to_pixels", short_of_memory)
    with caplog.at_level("WARNING"):
        got = klein_core.generate(tr, te, vae, vae_tile=None, **kw)
    assert tried == [None, 16] and got.decode_tiles == [16]
    assert torch.equal(got.pixels, tiled.pixels)
    assert sum("retrying in tiles of" in r.getMessage() for r in caplog.records) == 1
