"""Klein Model to MODEL with ComfyUI's own LoRA loading on a model whose block weights are float8
(Klein Model Loader ``weight_dtype`` fp8), in the real ComfyUI 0.3.75 host, on tiny random weights.

An FP8Linear stores ``weight`` as float8 values scaled by ``weight_scale``. ComfyUI's weight patching
(``comfy.sd.load_lora_for_models``, what LoraLoaderModelOnly runs) used to add the LoRA's deltas to
the raw float8 values, so the LoRA landed scaled by ``weight_scale``: next to no effect, no warning.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_native_model import (  # noqa: F401
    M4B,
    PACK,
    VAE,
    _bridge,
    _core,
    _diff,
    _encode,
    _native_cond,
    host,
)
from train_files import nonzero_lora

from klein_core.quant.fp8 import FP8Linear, dequantize

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loaded(h, dtype: str):
    with torch.inference_mode():
        return h.pack.KleinModelLoader.execute(M4B, VAE, dtype, "auto").args[0]


def _lora_file(h, tmp_path, transformer):
    """A rank-2 LoRA over every block Linear, saved in ComfyUI names, its up matrices made non-zero."""
    from klein_core.train.adapters import preset
    from klein_core.train.save import save_lora

    lora = nonzero_lora(transformer, preset("full", rank=2))
    return save_lora(tmp_path / "hunt_lora.safetensors", lora, fmt="comfyui")


def _comfy_lora(patcher, path):
    import comfy.sd
    from safetensors.torch import load_file

    patched, _ = comfy.sd.load_lora_for_models(patcher, None, load_file(str(path)), 1.0, 0)
    return patched


def _layer(patcher, name="double_blocks.0.img_attn.qkv"):
    return patcher.model.diffusion_model.get_submodule(name)


def _comfy_delta(h, path, name="double_blocks.0.img_attn.qkv") -> torch.Tensor:
    """The delta ComfyUI's LoRA patching adds to ``name``'s weight on the fp32 model."""
    ref = _comfy_lora(_bridge(h, _loaded(h, "fp32")), path)
    before = _layer(ref, name).weight.detach().float().clone()
    ref.patch_model()
    try:
        return _layer(ref, name).weight.detach().float() - before
    finally:
        ref.unpatch_model()


def test_comfyui_lora_on_an_fp8_model_patches_the_weight_it_stands_for(host, tmp_path):  # noqa: F811
    """After ComfyUI patches the bridged fp8 MODEL, the layer stands for its weight plus the LoRA's
    delta (the delta ComfyUI applies to the fp32 model, within fp8 rounding); unpatching gives the
    original weight and scale back, and the pack's transformer never changes."""
    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    delta = _comfy_delta(host, path)
    assert delta.abs().max() > 1e-2  # the LoRA touches this layer

    fp8 = _loaded(host, "fp8")
    original = fp8.ref.get().get_submodule("double_blocks.0.img_attn.qkv")
    assert isinstance(original, FP8Linear)
    saved = (original.weight.detach().clone(), original.weight_scale.detach().clone())
    w0 = dequantize(*saved)
    patched = _comfy_lora(_bridge(host, fp8), path)
    patched.patch_model()
    try:
        layer = _layer(patched)
        got = dequantize(layer.weight, layer.weight_scale)
        rel = ((got - (w0 + delta)).norm() / delta.norm()).item()
        assert rel < 0.1, rel  # before the fix: ~1 (the delta was scaled by weight_scale)
    finally:
        patched.unpatch_model()
    layer = _layer(patched)
    assert torch.equal(dequantize(layer.weight, layer.weight_scale), w0)
    assert torch.equal(original.weight.view(torch.uint8), saved[0].view(torch.uint8))
    assert torch.equal(original.weight_scale, saved[1])


def test_comfyui_lora_on_an_fp8_model_samples_like_klein_lora_loader(host, tmp_path):  # noqa: F811
    """Sampled through SamplerCustomAdvanced: ComfyUI's LoRA loading on the bridged fp8 MODEL gives the
    latents of Klein LoRA Loader -> Klein Model to MODEL (up to fp8 re-quantisation, far below the
    LoRA's own effect); the plain bridged MODEL is unchanged afterwards."""
    import klein_core as kc

    lora_mod = importlib.import_module(f"{PACK}.lora")
    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    fp8 = _loaded(host, "fp8")
    pos = _native_cond(host, _encode(host).positive)
    plain = _core(host, _bridge(host, fp8), pos)
    ours = _core(host, _bridge(host, lora_mod.patch_model(fp8, kc.load_lora(path), 1.0)), pos)
    theirs = _core(host, _comfy_lora(_bridge(host, fp8), path), pos)
    effect = _diff(plain, ours)
    assert effect > 1e-2
    assert _diff(theirs, ours) < 0.3 * effect, (_diff(theirs, ours), effect)  # before the fix: ~0.95 * effect
    assert torch.equal(_core(host, _bridge(host, fp8), pos), plain)
