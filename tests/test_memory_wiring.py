import torch
from PIL import Image
import numpy as np
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
    assert (tiled.latents - base.latents).abs().mean() < 0.1  # the reference was encoded in tiles too
    assert (tiled.pixels - base.pixels).abs().mean() < 0.15

def test_loaders_quantize(tmp_path):
    paths = demo.write_tiny_model_files(tmp_path)
    tr = klein_core.load_transformer(paths["klein_4b"], quantize="fp8")
    te = klein_core.load_text_encoder(paths["qwen_4b"], quantize="fp8")
    assert fp8_layers(tr) and fp8_layers(te)
    vae = klein_core.load_vae(paths["vae"])
    out = klein_core.generate(tr, te, vae, prompt="x", steps=1, width=64, height=64, cache=None, memory="auto", device="cpu")
    assert torch.isfinite(out.pixels).all()
