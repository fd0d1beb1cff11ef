"""ComfyUI's own LoRA loading (``comfy.sd.load_lora_for_models``, what LoraLoaderModelOnly runs) on the
bridged MODEL (Klein Model to MODEL) of models whose block weights are not plain floats, in the real
ComfyUI 0.3.75 host, on tiny random weights:

* GGUF blocks (here Q4_0, Klein Model Loader ``weight_dtype`` q4) and NVFP4: ComfyUI found no
  ``.weight`` key for their layers, logged ``lora key not loaded`` for every key and sampled without
  the LoRA. Now the patches are applied to the dequantised weight at each call;
* float8 with the blocks streamed (``memory_mode`` blocks): the re-quantised weight was read under
  its old scale once streaming had replaced the Parameter, a LoRA distorted beyond its own effect.
"""

from __future__ import annotations

import importlib
import logging
import os

import pytest
import torch
from test_native_hunt import _comfy_delta, _comfy_lora, _layer, _loaded, _lora_file
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

from klein_core.memory.placement import module_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYER = "double_blocks.0.img_attn.qkv"


def _streamed(h, dtype: str):
    with torch.inference_mode():
        return h.pack.KleinModelLoader.execute(M4B, VAE, dtype, "auto", "blocks").args[0]


def _sampled_like_klein_lora_loader(h, model, path, parity, what: str) -> None:
    """ComfyUI's LoRA on the bridged MODEL samples as Klein LoRA Loader -> Klein Model to MODEL (the
    LoRA as branches on the same packed weights), and the plain bridged MODEL is unchanged after."""
    import klein_core as kc

    lora_mod = importlib.import_module(f"{PACK}.lora")
    pos = _native_cond(h, _encode(h).positive)
    plain = _core(h, _bridge(h, model), pos)
    ours = _core(h, _bridge(h, lora_mod.patch_model(model, kc.load_lora(path), 1.0)), pos)
    theirs = _core(h, _comfy_lora(_bridge(h, model), path), pos)
    effect = _diff(plain, ours)
    assert effect > 1e-2
    rel = parity(f"ComfyUI LoRA on the bridged {what} MODEL vs Klein LoRA Loader, / the LoRA's effect (bf16)",
                 _diff(theirs, ours) / effect)
    # bf16 rounding of a merged weight against a branch: 0.097-0.100 here, 0.099 on the plain bf16
    # model, where ComfyUI's own merge runs (measured); without the LoRA applied it is 1.0
    assert rel < 0.15, rel
    assert torch.equal(_core(h, _bridge(h, model), pos), plain)


def test_comfyui_lora_on_a_gguf_model_is_applied_per_call(host, tmp_path, caplog, parity):  # noqa: F811
    """Every key of the LoRA loads; while patched, the layer stands for its dequantised weight plus the
    delta ComfyUI adds on the fp32 model; its packed bytes never change; unpatched it is itself again.
    The placeholder that gives ComfyUI the key holds no values (the MODEL's size is the packed bytes)."""
    from klein_core.quant.ggml import GGMLLinear

    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    delta = _comfy_delta(host, path)
    q4 = _loaded(host, "q4")
    original = q4.ref.get().get_submodule(LAYER)
    assert isinstance(original, GGMLLinear)
    packed = original.qweight.clone()
    w0 = original.dequantized(torch.float32)
    bridged = _bridge(host, q4)
    placeholders = sum(1 for m in bridged.model.diffusion_model.modules() if isinstance(m, GGMLLinear))
    assert placeholders > 0
    size = host.mm.module_size(bridged.model.diffusion_model)  # what ComfyUI counts for the MODEL
    assert size - module_bytes(q4.ref.get()) == placeholders  # one byte each
    with caplog.at_level(logging.WARNING):
        patched = _comfy_lora(bridged, path)
    assert "not loaded" not in caplog.text, caplog.text
    # current ComfyUI's lazy copy for saving asks for the patched weight alone, patching nothing
    key = f"diffusion_model.{LAYER}.weight"
    saved = patched.patch_weight_to_device(key, torch.device("cpu"), return_weight=True)
    assert saved.dtype == torch.bfloat16  # the compute dtype
    assert ((saved.float() - w0 - delta).norm() / delta.norm()).item() < 6e-3  # bf16: 2.9e-3 measured
    assert _layer(patched)._klein_live_patches is None
    patched.patch_model()
    try:
        layer = _layer(patched)
        rel = parity("GGUF Q4_0 layer under ComfyUI's LoRA: (weight - dequantised) vs ComfyUI's fp32 delta (rel)",
                     ((layer.klein_weight(torch.float32) - w0 - delta).norm() / delta.norm()).item())
        assert rel < 1e-5, rel  # before the fix the layer had no patch at all: 1.0
        x = torch.randn(3, w0.shape[1])
        assert torch.allclose(layer(x), x @ (w0 + delta).T, atol=1e-5)
    finally:
        patched.unpatch_model()
    layer = _layer(patched)
    assert torch.equal(layer.klein_weight(torch.float32), w0)
    assert torch.equal(original.qweight, packed) and torch.equal(layer.qweight, packed)


def test_comfyui_lora_on_a_gguf_model_samples_like_klein_lora_loader(host, tmp_path, parity):  # noqa: F811
    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    _sampled_like_klein_lora_loader(host, _loaded(host, "q4"), path, parity, "GGUF Q4_0")


def test_comfyui_lora_on_an_nvfp4_model_samples_like_klein_lora_loader(host, tmp_path, parity):  # noqa: F811
    pytest.importorskip("comfy_kitchen")
    import folder_paths
    from test_nvfp4 import _nvfp4_file

    from klein_core.quant.nvfp4 import NVFP4Linear
    from klein_core.testing import tiny_transformer

    folder = folder_paths.get_folder_paths("diffusion_models")[0]
    name = "flux-2-klein-4b-nvfp4-lora-test.safetensors"
    _nvfp4_file(f"{folder}/{name}", tiny_transformer().float(), "comfy_quant")
    folder_paths.filename_list_cache.clear()
    try:
        with torch.inference_mode():
            model = host.pack.KleinModelLoader.execute(name, VAE, "bf16", "auto").args[0]
        assert isinstance(model.ref.get().get_submodule(LAYER), NVFP4Linear)
        path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
        _sampled_like_klein_lora_loader(host, model, path, parity, "NVFP4")
    finally:
        importlib.import_module(f"{PACK}.cache").release_all("nvfp4 lora test done")
        os.remove(f"{folder}/{name}")
        folder_paths.filename_list_cache.clear()


@pytest.mark.parametrize("dtype", ["fp8", "q4"])
def test_comfyui_lora_on_streamed_blocks_equals_the_whole_model(host, tmp_path, dtype, parity):  # noqa: F811
    """memory_mode blocks streams each block to the compute device every step (a new Parameter for
    every weight): the LoRA must come along. fp8 was off by more than the LoRA's own effect (the
    patched float8 values read under their old scale); its streamed and whole runs are now equal."""
    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    pos = _native_cond(host, _encode(host).positive)
    whole_model, streamed_model = _loaded(host, dtype), _streamed(host, dtype)
    plain = _core(host, _bridge(host, whole_model), pos)
    whole = _core(host, _comfy_lora(_bridge(host, whole_model), path), pos)
    streamed = _core(host, _comfy_lora(_bridge(host, streamed_model), path), pos)
    assert _diff(plain, whole) > 1e-2
    diff = parity(f"ComfyUI LoRA on the bridged {dtype} MODEL, memory_mode blocks vs whole", _diff(streamed, whole))
    assert diff <= 1e-6, diff
    assert torch.equal(_core(host, _bridge(host, streamed_model), pos), plain)


def test_comfyuis_other_weight_paths_on_a_packed_layer(host, tmp_path):  # noqa: F811
    """ComfyUI's own patching of one weight (what its hooks and model merging run: convert_weight,
    its merge, set_weight) on a packed layer gives it the merged weight densely until unpatched."""
    import comfy.model_patcher

    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    delta = _comfy_delta(host, path)
    patched = _comfy_lora(_bridge(host, _loaded(host, "q4")), path)
    layer = _layer(patched)
    w0 = layer.dequantized(torch.float32)
    key = f"diffusion_model.{LAYER}.weight"
    comfy.model_patcher.ModelPatcher.patch_weight_to_device(patched, key, device_to=torch.device("cpu"))
    try:
        dense = layer.klein_weight(torch.float32)
        assert ((dense - w0 - delta).norm() / delta.norm()).item() < 6e-3  # stored in bf16: 2.9e-3 measured
        x = torch.randn(3, w0.shape[1])
        assert torch.allclose(layer(x), x @ dense.T, atol=1e-5)  # the forward runs on that weight
    finally:
        patched.unpatch_model()
    assert torch.equal(_layer(patched).klein_weight(torch.float32), w0)


@pytest.mark.parametrize("dtype", ["fp8", "q4"])
def test_comfyui_lora_on_a_compiled_bridged_model(host, tmp_path, dtype, parity):  # noqa: F811
    """TorchCompileModel's wrapper (dynamo; its eager backend here, so the compiled run gives eager's
    bits): a graph traced without the LoRA must not serve the patched model. It did: on GGUF the LoRA
    was not applied at all, on fp8 the re-quantised weights were read under their old scale. The layers
    keep their patch state in attributes that dynamo guards on."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    path = _lora_file(host, tmp_path, _loaded(host, "fp32").ref.get())
    pos = _native_cond(host, _encode(host).positive)
    model = _loaded(host, dtype)
    plain = _core(host, _bridge(host, model), pos)
    lora = _core(host, _comfy_lora(_bridge(host, model), path), pos)
    assert _diff(plain, lora) > 1e-2
    compiled = _bridge(host, model).clone()
    set_torch_compile_wrapper(model=compiled, backend="eager")
    assert _diff(_core(host, compiled, pos), plain) <= 1e-6
    diff = parity(f"ComfyUI LoRA on the compiled bridged {dtype} MODEL vs eager (dynamo, eager backend)",
                  _diff(_core(host, _comfy_lora(compiled, path), pos), lora))
    assert diff <= 1e-6, diff
    assert _diff(_core(host, compiled, pos), plain) <= 1e-6  # unpatched again
